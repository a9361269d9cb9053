#!/usr/bin/env bash
# Memorisation check after the CPU recipe moved to blocks of 7 (2026-12-04): a DSpark draft trained 300 steps on the
# 8 prepared conversations of tests/fixtures/memorise8.prepared.jsonl, evaluated on their own prompts in float32
# (outputs must equal target-only), beside prompt lookup and the draft with lookup in front, one eval run per recipe:
# the demo's settings (blocks of 3, 3 drafts per step, trees of 3: the 2026-12-03 check again) and the cpu recipe's
# (blocks of 7 at 32 anchors, the whole block per step, trees of 4).
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=${D:-runs/memorise8-2026-12-04}
mkdir -p $D
P=tests/fixtures/memorise8.prepared.jsonl
.venv/bin/python -c "
import json
rows=[json.loads(l) for l in open('$P')]
open('$D/prompts.jsonl','w').write(''.join(json.dumps({'turns':[r['messages'][0]['content']]})+'\n' for r in rows))"
.venv/bin/deepspec cache --recipe demo --input $P --output-dir "$D/cache"
for R in demo cpu; do
  .venv/bin/deepspec train --recipe $R --cache-dir "$D/cache" --output-dir "$D/train-$R" --max-steps 300 --heldout-every 0
  .venv/bin/deepspec eval --recipe $R --draft $D/train-$R --output-dir $D/eval-float32-$R --benchmarks gsm8k \
      --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8 --num-prompts-per-benchmark gsm8k=8 --dtype float32 \
      --baselines ngram
done
