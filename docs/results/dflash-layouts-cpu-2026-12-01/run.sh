#!/usr/bin/env bash
# DFlash in both block layouts on the memorisation set (the 8 prepared conversations of
# tests/fixtures/memorise8.prepared.jsonl, evaluated on their own prompts): does the z-lab layout
# (--sample-from-anchor false) train and decode as its DeepSpec-layout twin does, on the same cache,
# steps and block (K = 4, 3 drafts per step for both)? VLLM_DRAFT: optionally, the DFlash draft the
# vllm test trained (its train/ folder), decoded here on the same prompts as vLLM served it.
set -euo pipefail
D=${D:-runs/dflash-layouts}
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
for layout in true false; do
    time .venv/bin/deepspec train --recipe demo --algorithm dflash --block-size 4 --sample-from-anchor $layout \
        --cache-dir "$D/cache" --output-dir "$D/train-anchor-$layout" --max-steps 300 --heldout-every 0
done
.venv/bin/deepspec eval --recipe demo --draft "$D/train-anchor-true" "$D/train-anchor-false" ${VLLM_DRAFT:-} \
    --output-dir "$D/eval" --benchmarks gsm8k --benchmark-files gsm8k="$D/prompts.jsonl" --num-prompts 8
