#!/usr/bin/env bash
# Memorisation check (the quick test that training and inference agree): a DSpark draft trained 300 steps with the
# demo's settings on the 8 prepared conversations of tests/fixtures/memorise8.prepared.jsonl, then evaluated greedily
# in float32 on their own prompts (every output must equal target-only's) with the schedule fixed and auto, beside
# prompt lookup and the draft with lookup in front. tau should be high (about 3.4-3.8 with blocks of 3).
#
#   bash bench/memorise.sh [OUTPUT_DIR]      # default runs/memorise8; needs `make install` (.venv)
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-runs/memorise8}
P=tests/fixtures/memorise8.prepared.jsonl
mkdir -p "$D"
.venv/bin/python -c "
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
open(sys.argv[2], 'w').write(''.join(json.dumps({'turns': [r['messages'][0]['content']]}) + '\n' for r in rows))
" "$P" "$D/prompts.jsonl"
.venv/bin/deepspec cache --recipe demo --input "$P" --output-dir "$D/cache"
.venv/bin/deepspec train --recipe demo --cache-dir "$D/cache" --output-dir "$D/train-demo" --max-steps 300 --heldout-every 0
for S in fixed auto; do
  .venv/bin/deepspec eval --recipe demo --draft "$D/train-demo" --output-dir "$D/eval-float32-$S" --schedule "$S" \
      --benchmarks gsm8k --benchmark-files "gsm8k=$D/prompts.jsonl" --num-prompts 8 --num-prompts-per-benchmark gsm8k=8 \
      --dtype float32 --baselines ngram
done
