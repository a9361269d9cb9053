"""Answer regeneration in bfloat16 with and without the contiguous output-layer input (2026-12-02).

Regenerates the first 64 gsm8k train problems (the demo's prompts), greedy, at most 128 tokens, through
``LocalBackend`` in bfloat16: "before" with ``deepspec.target.decoding._contiguous_output_layer_input``
replaced by a no-op (the code before the fix), "after" as shipped, at prepare's default batch of 32,
and "after" at batches of 64 and 128. Every round runs each setting once, interleaved, in one process.
Writes ``measure.json`` and ``measure.png`` beside this file.

    .venv/bin/python docs/results/prepare-bf16-cpu-2026-12-02/measure.py
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

import deepspec.target.decoding as decoding  # noqa: E402
from deepspec.data.backends import GenerationParams, LocalBackend, TurnRequest  # noqa: E402
from deepspec.eval.benchmarks import training_conversations  # noqa: E402
from deepspec.target.decoding import SamplingParams  # noqa: E402
from deepspec.target.load import load_target  # noqa: E402
from deepspec.utils import pyplot, save_png  # noqa: E402

SETTINGS = (("before", 32), ("after", 32), ("after", 64), ("after", 128))
ROUNDS = 2
shipped = decoding._contiguous_output_layer_input


def run(model, tok, requests, fixed: bool, batch: int) -> tuple[float, list[list[int]]]:
    decoding._contiguous_output_layer_input = shipped if fixed else (lambda m: contextlib.nullcontext())
    ids: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    LocalBackend(model, tok, batch_size=batch).generate(requests, lambda i, r: ids.__setitem__(i, list(r.token_ids)))
    return time.perf_counter() - t0, [ids[i] for i in range(len(requests))]


def main() -> None:
    model, tok = load_target(dtype=torch.bfloat16)
    gen = GenerationParams(max_new_tokens=128, sampling=SamplingParams(temperature=0.0))
    requests = [TurnRequest(key=c["id"], messages=c["messages"][:1], generation=gen)
                for c in training_conversations("gsm8k")[:64]]
    res: dict[str, dict] = {f"{w} b{b}": {"seconds": [], "tok_per_s": []} for w, b in SETTINGS}
    outputs = {}
    for r in range(ROUNDS):
        for w, b in SETTINGS:
            dt, ids = run(model, tok, requests, w == "after", b)
            key = f"{w} b{b}"
            outputs.setdefault(key, ids)
            n = sum(map(len, ids))
            res[key]["seconds"].append(dt)
            res[key]["tok_per_s"].append(n / dt)
            print(f"round {r + 1} {key:>10}: {dt:6.1f} s  {n / dt:6.1f} tok/s  ({n} tokens)", flush=True)
    base = res["before b32"]["seconds"]
    for key, v in res.items():
        v["time_ratio_to_before_b32"] = statistics.median(s / b for s, b in zip(v["seconds"], base))
        v["answers_identical_to_before_b32"] = sum(a == b for a, b in zip(outputs[key], outputs["before b32"]))
        print(f"{key:>10}: time / before b32 {v['time_ratio_to_before_b32']:.2f}, identical answers "
              f"{v['answers_identical_to_before_b32']} / {len(requests)}")
    out = {"host": "2-core Intel Xeon, AMX-BF16", "torch": torch.__version__, "threads": torch.get_num_threads(),
           "num_prompts": len(requests), "max_new_tokens": 128, "dtype": "bfloat16", "rounds": ROUNDS, "settings": res}
    (HERE / "measure.json").write_text(json.dumps(out, indent=1) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    keys = list(res)
    ax.bar(keys, [statistics.median(res[k]["tok_per_s"]) for k in keys])
    ax.set_ylabel("generated tokens / s (median of rounds)")
    ax.set_title("deepspec prepare, local backend, SmolLM2-135M bf16, 64 gsm8k x 128 tokens", fontsize=9)
    fig.tight_layout()
    save_png(fig, HERE / "measure.png")


if __name__ == "__main__":
    main()
