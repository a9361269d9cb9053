"""An Eagle3 draft's context flush over a long prompt, side by side in one process: `commit_rows` on an empty cache
(SDPA's causal kernel, no mask) against the same layer under the dense [T, T] causal mask it took before.

    python docs/results/schedule-prior-cpu-2026-12-07/flush.py --draft runs/recipe/train-eagle3 --positions 2341

Run from the repository root (bfloat16 where the CPU has bf16 units). Prints the fastest of 5 runs of each, in ms.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path.cwd()), str(Path.cwd() / "bench")]
from schedule import open_target_and_draft  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--draft", required=True)
p.add_argument("--positions", type=int, default=2341)
args = p.parse_args()

d = open_target_and_draft(args.draft).draft
dtype = d.fc.weight.dtype
T = args.positions
feats = torch.randn(T, d.fc.weight.shape[1], dtype=dtype)
ids = torch.randint(0, d.config.vocab_size, (T,))


def dense_mask_commit() -> None:
    hid = d.fc(feats).unsqueeze(0)
    emb = d.embed(ids.view(1, T)).to(hid.dtype)
    cos, sin = d.rotary_emb(hid, torch.arange(T).unsqueeze(0))
    d.midlayer(emb, hid, cos, sin, None, None, torch.ones(T, T, dtype=torch.bool).tril())


def fastest_ms(fn, n: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


with torch.no_grad():
    causal = fastest_ms(lambda: d.commit_rows(d.new_cache(), ids, feats))
    dense = fastest_ms(dense_mask_commit)
print(f"{dtype}, {torch.get_num_threads()} threads, {T} positions: causal kernel {causal:.1f} ms, "
      f"dense mask {dense:.1f} ms ({dense / causal:.2f}x)")
