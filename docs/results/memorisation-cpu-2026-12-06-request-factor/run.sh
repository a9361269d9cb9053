#!/usr/bin/env bash
# Memorisation check after the scheduler moved to one request factor, scored tree nodes, cut-whole trees as plain
# steps and the verifying step's bookkeeping in its cost: a DSpark draft trained 300 steps with the demo's settings on the 8 prepared conversations of
# tests/fixtures/memorise8.prepared.jsonl, evaluated greedily in float32 on their own prompts (outputs must equal
# target-only) with the schedule fixed and auto, beside prompt lookup and the draft with lookup in front.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=${D:-runs/memorise8-request-factor}
mkdir -p $D
P=tests/fixtures/memorise8.prepared.jsonl
.venv/bin/python -c "
import json
rows=[json.loads(l) for l in open('$P')]
open('$D/prompts.jsonl','w').write(''.join(json.dumps({'turns':[r['messages'][0]['content']]})+'\n' for r in rows))"
.venv/bin/deepspec cache --recipe demo --input $P --output-dir "$D/cache"
.venv/bin/deepspec train --recipe demo --cache-dir "$D/cache" --output-dir "$D/train-demo" --max-steps 300 --heldout-every 0
for S in fixed auto; do
  .venv/bin/deepspec eval --recipe demo --draft $D/train-demo --output-dir $D/eval-float32-$S --schedule $S \
      --benchmarks gsm8k --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8 --num-prompts-per-benchmark gsm8k=8 \
      --dtype float32 --baselines ngram
done
