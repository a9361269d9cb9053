"""What a verify forward costs against a one-token forward, with and without the few-row linear path.

One target forward over ``n`` new tokens at ``--context`` tokens of KV cache (the engine's call:
:func:`deepspec.target.capture.target_forward` with logits, then the KV cache cropped back), for
``n`` in ``--num-tokens``, with ``F.linear`` (``off``) and with
:func:`deepspec.target.few_row_linear.few_row_linear` (``on``). Measured interleaved (every round runs
each (path, n) once, in one process), ``--rounds`` rounds after two warm-up rounds; the median is
printed. A verify step of a draft that proposes ``N`` tokens is the ``n = N + 1`` column; the
``ratio`` columns divide by the ``off`` one-token forward (the target-only step both paths share),
so they are the break-even tau of a proposer that costs nothing (the n-gram baseline, nearly).

Writes ``verify_cost.json`` and ``verify_cost.png`` under ``--output-dir``.

    python bench/verify_cost.py                        # embedded SmolLM2-135M, float32, context 300
    python bench/verify_cost.py --dtype bfloat16 --num-tokens 1,4,8
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.device import check_dtype_name, dtype_name, resolve_device, resolve_dtype  # noqa: E402
from deepspec.target.capture import target_forward  # noqa: E402
from deepspec.target.few_row_linear import few_row_linear  # noqa: E402
from deepspec.utils import atomic_write_json, pyplot, save_png  # noqa: E402

PATHS = ("off", "on")


@torch.inference_mode()
def measure(model, *, context: int, num_tokens: list[int], rounds: int, seed: int) -> dict[str, dict[int, float]]:
    """Median seconds of a forward over ``n`` new tokens after ``context`` cached ones, per path and n."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    cache = DynamicCache()
    prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    target_forward(model, prompt, [], past_key_values=cache, use_cache=True)
    times: dict[str, dict[int, list[float]]] = {p: {n: [] for n in num_tokens} for p in PATHS}
    for r in range(rounds + 2):
        for path in PATHS:
            with few_row_linear(model) if path == "on" else contextlib.nullcontext():
                for n in num_tokens:
                    ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
                    pos = torch.arange(context, context + n, device=device).unsqueeze(0)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    target_forward(model, ids, [], position_ids_BT=pos, past_key_values=cache, use_cache=True,
                                   compute_logits=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if r >= 2:
                        times[path][n].append(time.perf_counter() - t0)
                    cache.crop(-n)
    return {p: {n: statistics.median(v) for n, v in by_n.items()} for p, by_n in times.items()}


def plot(results: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for p, label in (("off", "F.linear"), ("on", "few-row (W @ x^T)^T")):
        ns = sorted(int(n) for n in results["ms"][p])
        ax.plot(ns, [results["ratio"][p][str(n)] for n in ns], "o-", label=label)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xlabel("new tokens in the forward (a verify over N drafts: N + 1)")
    ax.set_ylabel("forward time / one-token forward (F.linear)")
    ax.set_title(f"{results['target']}, {results['dtype']}, context {results['context']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default", help="target (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", help="auto | float32 | bfloat16")
    p.add_argument("--device", default="auto",
                   help="auto (cuda:LOCAL_RANK when CUDA is available, else cpu) | cpu | cuda | cuda:N")
    p.add_argument("--context", type=int, default=300, help="tokens already in the KV cache")
    p.add_argument("--num-tokens", default="1,2,3,4,6,8,12,16", help="comma-separated new-token counts")
    p.add_argument("--rounds", type=int, default=15, help="timed interleaved rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--output-dir", default="runs/bench-verify-cost")
    args = p.parse_args(argv)
    try:
        check_dtype_name(args.dtype, "--dtype")
    except ValueError as exc:
        p.error(str(exc))
    try:
        num_tokens = sorted({int(n) for n in args.num_tokens.split(",") if n})
    except ValueError:
        p.error(f"--num-tokens: expected comma-separated integers, got {args.num_tokens!r}")
    if not num_tokens or num_tokens[0] < 1 or 1 not in num_tokens:
        p.error(f"--num-tokens: expected integers >= 1 including 1 (the one-token step), got {args.num_tokens!r}")
    if args.context < 1 or args.rounds < 1:
        p.error("--context and --rounds must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from deepspec.target.load import load_target

    try:
        device = resolve_device(args.device, "--device")
    except ValueError as exc:
        p.error(str(exc))
    dtype = resolve_dtype(args.dtype, device)
    model, _ = load_target(args.target, dtype=dtype)
    model.to(device).eval()
    if args.context + max(num_tokens) > model.config.max_position_embeddings:
        p.error(f"--context {args.context} + {max(num_tokens)} tokens exceed the target's max_position_embeddings")
    med = measure(model, context=args.context, num_tokens=num_tokens, rounds=args.rounds, seed=args.seed)
    one = med["off"][1]
    results = {
        "target": args.target, "device": str(device), "dtype": dtype_name(dtype),
        "threads": torch.get_num_threads(), "context": args.context, "rounds": args.rounds,
        "ms": {pa: {str(n): 1e3 * t for n, t in by_n.items()} for pa, by_n in med.items()},
        "ratio": {pa: {str(n): t / one for n, t in by_n.items()} for pa, by_n in med.items()},
    }
    print(f"{args.target} on {device} in {dtype_name(dtype)} ({torch.get_num_threads()} threads), context "
          f"{args.context}, median of {args.rounds} interleaved rounds; ratio = forward / one-token forward "
          "(F.linear)")
    print(f"{'new tokens':>10}{'F.linear ms':>13}{'ratio':>7}{'few-row ms':>12}{'ratio':>7}{'few-row / F.linear':>20}")
    for n in num_tokens:
        off, on = med["off"][n], med["on"][n]
        print(f"{n:>10}{1e3 * off:>13.1f}{off / one:>7.2f}{1e3 * on:>12.1f}{on / one:>7.2f}{on / off:>20.2f}")
    out = Path(args.output_dir)
    atomic_write_json(out / "verify_cost.json", results)
    plot(results, out / "verify_cost.png")
    print(f"wrote {out / 'verify_cost.json'} and {out / 'verify_cost.png'}")
    return results


if __name__ == "__main__":
    main()
