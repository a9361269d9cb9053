#!/usr/bin/env bash
# Memorisation check after the training settings moved out of train/loop.py and the engine gained its step
# scheduler (default fixed, so eval is unchanged): a DSpark
# draft trained 300 steps on the 8 prepared conversations of tests/fixtures/memorise8.prepared.jsonl with the demo's
# and the cpu recipe's settings, evaluated greedily in float32 on their own prompts (outputs must equal target-only),
# beside prompt lookup and the draft with lookup in front. Then the demo-settings draft once more as chains on the
# compiled path (--compile: static caches, the target's steps and the draft's proposals compiled), whose tau must
# equal the eager chains' and whose outputs must equal target-only.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=${D:-runs/memorise8-schedule}
mkdir -p $D
P=tests/fixtures/memorise8.prepared.jsonl
.venv/bin/python -c "
import json
rows=[json.loads(l) for l in open('$P')]
open('$D/prompts.jsonl','w').write(''.join(json.dumps({'turns':[r['messages'][0]['content']]})+'\n' for r in rows))"
.venv/bin/deepspec cache --recipe demo --input $P --output-dir "$D/cache"
EVAL=(--benchmarks gsm8k --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8 --num-prompts-per-benchmark gsm8k=8
      --dtype float32 --baselines ngram)
for R in demo cpu; do
  .venv/bin/deepspec train --recipe $R --cache-dir "$D/cache" --output-dir "$D/train-$R" --max-steps 300 --heldout-every 0
  .venv/bin/deepspec eval --recipe $R --draft $D/train-$R --output-dir $D/eval-float32-$R "${EVAL[@]}"
done
for C in false true; do  # chains, eager and compiled, in one script run
  .venv/bin/deepspec eval --recipe demo --draft $D/train-demo --output-dir $D/eval-float32-demo-chains-compile-$C \
      "${EVAL[@]}" --tree-width 0 --compile $C --few-row-linear off
done
