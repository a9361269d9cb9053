# Memorisation check after the compiled target path (2026-12-02): the demo recipe's DSpark draft, 300 steps on
# the 8 prepared conversations, evaluated in float32 on their own prompts with the eager and the compiled engine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=${D:-runs/memorise8-s9}
mkdir -p $D
P=tests/fixtures/memorise8.prepared.jsonl
.venv/bin/python -c "
import json,sys
rows=[json.loads(l) for l in open('$P')]
open('$D/prompts.jsonl','w').write(''.join(json.dumps({'turns':[r['messages'][0]['content']]})+'\n' for r in rows))"
.venv/bin/deepspec cache --recipe demo --input $P --output-dir "$D/cache"
.venv/bin/deepspec train --recipe demo --cache-dir "$D/cache" --output-dir "$D/train" --max-steps 300 --heldout-every 0
.venv/bin/deepspec eval --recipe demo --draft $D/train --output-dir $D/eval-fp32 --benchmarks gsm8k \
    --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8 --dtype float32
.venv/bin/deepspec eval --recipe demo --draft $D/train --output-dir $D/eval-fp32-compiled --benchmarks gsm8k \
    --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8 --dtype float32 --compile
