# Memorisation check after the per-step K record and the corpus lookup (2026-12-03): the demo recipe's DSpark draft,
# 300 steps on the 8 prepared conversations of tests/fixtures/memorise8.prepared.jsonl, evaluated on their own prompts
# in float32 (outputs must equal target-only) beside prompt lookup, the draft with lookup in front, and the lookup
# backed by the same 8 answers as its corpus (which holds the very answers: it shows the corpus path decodes
# losslessly, not a held-out gain).
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=${D:-runs/memorise8-2026-12-03}
mkdir -p $D
P=tests/fixtures/memorise8.prepared.jsonl
.venv/bin/python -c "
import json
rows=[json.loads(l) for l in open('$P')]
open('$D/prompts.jsonl','w').write(''.join(json.dumps({'turns':[r['messages'][0]['content']]})+'\n' for r in rows))"
.venv/bin/deepspec cache --recipe demo --input $P --output-dir "$D/cache"
.venv/bin/deepspec train --recipe demo --cache-dir "$D/cache" --output-dir "$D/train" --max-steps 300 --heldout-every 0
.venv/bin/deepspec eval --recipe demo --draft $D/train --output-dir $D/eval-float32 --benchmarks gsm8k \
    --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8 --dtype float32 --baselines ngram ngram+corpus \
    --lookup-corpus $P
