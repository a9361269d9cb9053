# Memorisation check after --dtype auto on the training side (2026-12-02): the demo recipe's DSpark draft (its cache
# and training now follow --dtype auto: bf16 on a CPU with AMX), 300 steps on the 8 prepared conversations (answers
# the float32 target generated), evaluated on their own prompts in float32 and in the recipe's dtype (auto).
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=${D:-runs/memorise8-s10}
mkdir -p $D
P=tests/fixtures/memorise8.prepared.jsonl
.venv/bin/python -c "
import json,sys
rows=[json.loads(l) for l in open('$P')]
open('$D/prompts.jsonl','w').write(''.join(json.dumps({'turns':[r['messages'][0]['content']]})+'\n' for r in rows))"
.venv/bin/deepspec cache --recipe demo --input $P --output-dir "$D/cache"
.venv/bin/deepspec train --recipe demo --cache-dir "$D/cache" --output-dir "$D/train" --max-steps 300 --heldout-every 0
for dtype in float32 auto; do
  .venv/bin/deepspec eval --recipe demo --draft $D/train --output-dir $D/eval-$dtype --benchmarks gsm8k \
      --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8 --dtype $dtype --baselines ngram
done
