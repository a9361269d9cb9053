#!/usr/bin/env bash
# Memorisation check after the Gemma family rules, soft-capping and the DFlash block layouts: the demo
# recipe's DSpark draft (DeepSpec's layout, Qwen3-style layers) trained 300 steps on the 8 prepared
# conversations of tests/fixtures/memorise8.prepared.jsonl, evaluated greedily on their own prompts, with
# the n-gram baseline and target-only interleaved per prompt in the same eval run.
set -euo pipefail
D=${D:-runs/memorise8-final}
P=tests/fixtures/memorise8.prepared.jsonl
mkdir -p "$D"
.venv/bin/python - "$P" "$D/prompts.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
with open(sys.argv[2], "w") as out:
    for row in rows:
        out.write(json.dumps({"turns": [row["messages"][0]["content"]]}) + "\n")
PY
.venv/bin/deepspec cache --recipe demo --input $P --output-dir "$D/cache"
.venv/bin/deepspec train --recipe demo --cache-dir "$D/cache" --output-dir "$D/train" --max-steps 300 --heldout-every 0
.venv/bin/deepspec eval --recipe demo --draft "$D/train" --output-dir "$D/eval" --benchmarks gsm8k \
    --benchmark-files gsm8k="$D/prompts.jsonl" --num-prompts 8
