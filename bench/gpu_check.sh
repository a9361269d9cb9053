#!/usr/bin/env bash
# The prepared GPU check (issue 13): run on a machine with CUDA from the repository root, e.g. through
# the device tool: `bash bench/gpu_check.sh` (about 5-8 minutes on one H200, compiles included).
# Writes under $OUT (the device tool's folder that comes back; default runs/gpu-check):
#   env.txt             torch / transformers / GPU
#   tests_gpu.txt       pytest -m gpu tests/gpu -s (flex vs dense figures, bf16 divergences, the pipeline)
#   train_bench_qwen3_4b.{json,png}, bench_train.txt   bench/train.py --qwen3-4b (step time, peak memory, MFU)
#   decode/decode_bench.{json,png}, bench_decode.txt   bench/decode.py --qwen3-4b --compile on: the compiled and
#                       eager target-only baselines against generate(), and a block-8 speculative step against a
#                       one-token step (issue 13's decoding goals). Its prompts come from gsm8k: copy
#                       ../shared/benchmarks/gsm8k into runs/gpu-benchmarks/ first and carry runs/gpu-benchmarks
#                       (the device machine gets the checkout only); without it this step is skipped.
# Needs no data or model outside the checkout (random targets, the Qwen3 tokenizer from tests/fixtures), but
# Python packages beside torch and transformers: pytest (the tests), tensorboard and matplotlib (train's
# logs and plots, the bench's PNG), safetensors, tokenizers, tqdm. env.txt lists those the machine lacks;
# the steps that need them are then skipped with a line saying so.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu-check}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'bf16', torch.cuda.is_bf16_supported())"
  python3 -c "import importlib.util as u; m = [n for n in ('pytest', 'tensorboard', 'matplotlib', 'safetensors', \
'tokenizers', 'tqdm') if u.find_spec(n) is None]; print('missing:', ' '.join(m) or 'none')"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
missing=$(sed -n 's/^missing: //p' "$out/env.txt")
status=0
if [[ " $missing " == *" pytest "* ]]; then
  echo "tests/gpu skipped: pytest is not installed here" | tee "$out/tests_gpu.txt"
  status=1
else
  timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$out/tests_gpu.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
timeout "${BENCH_TIMEOUT:-200}" python3 bench/train.py --qwen3-4b --repeats 5 --output-dir "$out" 2>&1 \
  | tee "$out/bench_train.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ -d runs/gpu-benchmarks/gsm8k ]; then
  timeout "${DECODE_TIMEOUT:-240}" python3 bench/decode.py --qwen3-4b --draft untrained --compile on --temperatures 0 \
    --baselines none --benchmarks gsm8k --num-prompts 2 --max-new-tokens 128 --repeats 2 \
    --benchmarks-dir runs/gpu-benchmarks --output-dir "$out/decode" 2>&1 | tee "$out/bench_decode.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "bench/decode.py --qwen3-4b skipped: no runs/gpu-benchmarks/gsm8k (copy ../shared/benchmarks/gsm8k there and carry it)" \
    | tee "$out/bench_decode.txt"
fi
exit $status
