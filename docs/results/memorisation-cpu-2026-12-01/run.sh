# Memorisation check (train and inference agree): the demo recipe's DSpark draft trained on 8 prepared
# conversations (tests/fixtures/memorise8.prepared.jsonl: ShareGPT prompts answered by the embedded target),
# then evaluated on those same 8 prompts, greedy, 3 drafts per step, with the n-gram baseline beside it.
set -e
cd "$(dirname "$0")/../../.."
D=${D:-runs/memorise8}
P=tests/fixtures/memorise8.prepared.jsonl
.venv/bin/python - "$P" "$D/prompts.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
with open(sys.argv[2], "w") as out:
    for row in rows:
        out.write(json.dumps({"turns": [row["messages"][0]["content"]]}) + "\n")
PY
.venv/bin/deepspec cache --recipe demo --input $P --output-dir $D/cache
.venv/bin/deepspec train --recipe demo --cache-dir $D/cache --output-dir $D/train --max-steps 300 --heldout-every 0
.venv/bin/deepspec eval --recipe demo --draft $D/train --output-dir $D/eval --benchmarks gsm8k \
    --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8
