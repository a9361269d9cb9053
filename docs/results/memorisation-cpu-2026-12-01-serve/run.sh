# Memorisation check after Eagle3's chain-rows TTT forward and the engine's on_tokens callback: the demo
# recipe's DSpark and Eagle3 drafts trained for 300 steps on the 8 prepared conversations of
# tests/fixtures/memorise8.prepared.jsonl, then evaluated together, greedily, on those same 8 prompts (one eval
# run: both drafts, the n-gram baseline and target-only interleaved per prompt).
set -e
cd "$(dirname "$0")/../../.."
D=${D:-runs/memorise8-serve}
P=tests/fixtures/memorise8.prepared.jsonl
mkdir -p $D
.venv/bin/python - "$P" "$D/prompts.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
with open(sys.argv[2], "w") as out:
    for row in rows:
        out.write(json.dumps({"turns": [row["messages"][0]["content"]]}) + "\n")
PY
.venv/bin/deepspec cache --recipe demo --input $P --output-dir $D/cache
.venv/bin/deepspec train --recipe demo --cache-dir $D/cache --output-dir $D/train --max-steps 300 --heldout-every 0
.venv/bin/deepspec train --recipe demo --algorithm eagle3 --cache-dir $D/cache --output-dir $D/train-eagle3 \
    --max-steps 300 --heldout-every 0
.venv/bin/deepspec eval --recipe demo --draft $D/train $D/train-eagle3 --output-dir $D/eval --benchmarks gsm8k \
    --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8
