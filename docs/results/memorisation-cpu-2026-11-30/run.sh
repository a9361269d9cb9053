set -e
cd /work/main
D=/work/exp/mem
.venv/bin/deepspec cache --input $D/p8.jsonl --output-dir $D/cache --max-seq-len 384 --storage-dtype float32
.venv/bin/deepspec train --cache-dir $D/cache --output-dir $D/train --max-steps 300 --batch-size 2 --num-anchors 16 --markov-rank 64 --draft-vocab-size 8192 --lr 3e-3
.venv/bin/deepspec eval --draft $D/train --output-dir $D/eval --benchmarks gsm8k --benchmark-files gsm8k=$D/prompts.jsonl --num-prompts 8 --max-new-tokens 48 --compare-hf-generate false
