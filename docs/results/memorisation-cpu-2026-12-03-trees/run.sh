# Memorisation check after draft trees (2026-12-03): the demo recipe's DSpark draft, 300 steps on the 8 prepared
# conversations of tests/fixtures/memorise8.prepared.jsonl, evaluated on their own prompts in float32 (outputs must
# equal target-only), once with chains and once with --tree-width 3 (DSpark trees of 3 nodes per slot, the lookup's
# match verified beside them), each beside prompt lookup and the draft with lookup in front.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=${D:-runs/memorise8-2026-12-03-trees}
mkdir -p $D
P=tests/fixtures/memorise8.prepared.jsonl
.venv/bin/python -c "
import json
rows=[json.loads(l) for l in open('$P')]
open('$D/prompts.jsonl','w').write(''.join(json.dumps({'turns':[r['messages'][0]['content']]})+'\n' for r in rows))"
.venv/bin/deepspec cache --recipe demo --input $P --output-dir "$D/cache"
.venv/bin/deepspec train --recipe demo --cache-dir "$D/cache" --output-dir "$D/train" --max-steps 300 --heldout-every 0
for W in 0 3; do
  .venv/bin/deepspec eval --recipe demo --draft $D/train --output-dir $D/eval-float32-tree$W --benchmarks gsm8k \
      --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8 --dtype float32 --baselines ngram --tree-width $W
done
