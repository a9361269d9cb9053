"""Verify forwards with and without the grouped-query attention swap, side by side, by context length.

One process, one target (the embedded one unless ``--target``), on the CPU in ``--dtype``. At each context length
(``--contexts``) a cache of that many tokens is built once; then, in interleaved rounds (``--rounds``, after
``--warmup`` untimed ones), the target runs a one-token step, a chain verify of each length in ``--verify-lengths``
(the anchor and its drafts: the causal mask offset by the cache) and a draft tree of the same size (every node a
child of the anchor: a tree mask), each under transformers' stock ``sdpa`` attention and under
:class:`deepspec.target.gqa_attention.GroupedQueryVerify` (the key/value heads not repeated), the cache cropped
back after every forward. The median of each is kept. Printed per context: ms of each forward, the verify's cost in
one-token steps, and the swap's time as a fraction of stock's. Writes ``verify_attention.json`` and
``verify_attention.png`` (the verify's cost in one-token steps against context, both kernels) under
``--output-dir``.

    python bench/verify_attention.py --dtype bfloat16 --output-dir runs/verify-attention
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspec.decoding.engine import crop_kv_cache, tree_attention_mask  # noqa: E402
from deepspec.device import dtype_name, resolve_dtype  # noqa: E402
from deepspec.target.gqa_attention import GroupedQueryVerify  # noqa: E402
from deepspec.target.load import EMBEDDED_DEFAULT, open_target  # noqa: E402
from deepspec.utils import atomic_write_json, pyplot, save_png  # noqa: E402


def forwards(lengths: list[int]) -> dict[str, tuple[int, list[int] | None]]:
    """``{name: (tokens fed, tree parents or None)}``: one token, a chain and a one-level tree per length."""
    made: dict[str, tuple[int, list[int] | None]] = {"1": (1, None)}
    for n in lengths:
        made[f"chain{n}"] = (n, None)
        made[f"tree{n}"] = (n, [0] * (n - 1))  # the anchor's n - 1 children
    return made


def run(args: argparse.Namespace) -> dict:
    """The benchmark of :func:`main`'s arguments (the module docstring); returns the record it writes. Raises
    ValueError for a context longer than the target allows and for a target the swap does not apply to."""
    torch_dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    model = open_target(args.target, dtype=torch_dtype, device="cpu").model
    gqa = GroupedQueryVerify(model)
    if not gqa.applies:
        raise ValueError("the target has no grouped-query sdpa attention on the CPU: nothing to compare.")
    longest = max(args.contexts) + max(args.verify_lengths)
    if longest > int(model.config.max_position_embeddings):
        raise ValueError(f"--contexts: {longest} positions exceed the target's {model.config.max_position_embeddings}.")
    ids = torch.randint(100, int(model.config.vocab_size), (1, longest), generator=torch.Generator().manual_seed(0))
    from transformers import DynamicCache

    results: dict[str, dict[str, dict[str, float]]] = {}
    with torch.inference_mode():
        for context in args.contexts:
            cache = model(ids[:, :context], past_key_values=DynamicCache(), use_cache=True).past_key_values
            kinds = forwards(args.verify_lengths)

            def once(n: int, parents: list[int] | None, swapped: bool) -> float:
                kwargs = {}
                if parents is not None:
                    kwargs = {"attention_mask": tree_attention_mask(parents, context, "cpu"),
                              "position_ids": torch.tensor([[context] + [context + 1] * (n - 1)])}
                start = time.perf_counter()
                with gqa() if swapped else contextlib.nullcontext():
                    model(ids[:, context:context + n], past_key_values=cache, use_cache=True, **kwargs)
                seconds = time.perf_counter() - start
                crop_kv_cache(cache, context)
                return seconds

            samples: dict[tuple[str, bool], list[float]] = {(k, s): [] for k in kinds for s in (False, True)}
            for r in range(args.warmup + args.rounds):
                order = list(samples) if r % 2 == 0 else list(samples)[::-1]
                for name, swapped in order:
                    seconds = once(*kinds[name], swapped)
                    if r >= args.warmup:
                        samples[(name, swapped)].append(seconds)
            ms = {f"{k}{'_gqa' if s else ''}": statistics.median(v) * 1e3 for (k, s), v in samples.items()}
            results[str(context)] = ms
            print(f"context {context}: " + ", ".join(
                f"{k} {ms[k]:.2f} / {ms[k + '_gqa']:.2f} ms ({ms[k + '_gqa'] / ms[k]:.3f})" for k in kinds), flush=True)
    print("(each: stock sdpa / grouped-query swap, ms, median; the swap over stock in brackets)")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "dtype": dtype_name(torch_dtype), "threads": torch.get_num_threads(),
              "date": time.strftime("%Y-%m-%d"), "ms": results}
    atomic_write_json(out / "verify_attention.json", record)
    plot(results, args.verify_lengths, out / "verify_attention.png")
    return record


def plot(results: dict[str, dict[str, float]], lengths: list[int], path: Path) -> None:
    """A verify's cost in one-token steps against context length, stock sdpa (dashed) and the swap (solid)."""
    plt = pyplot()
    contexts = [int(c) for c in results]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for n in lengths:
        for kind in ("chain", "tree"):
            for suffix, style in (("", "--"), ("_gqa", "-")):
                ax.plot(contexts, [results[str(c)][f"{kind}{n}{suffix}"] / results[str(c)]["1"] for c in contexts],
                        style, marker="o", label=f"{kind} of {n}{' (swap)' if suffix else ' (sdpa)'}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("verify / one-token step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_DEFAULT, help="the target (a folder, GGUF or hub id)")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or auto")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512, 1024], help="context lengths, tokens")
    p.add_argument("--verify-lengths", type=int, nargs="+", default=[4, 8], help="tokens fed per verify (>= 2)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (medians kept)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--output-dir", default="runs/verify-attention")
    args = p.parse_args(argv)
    if min(args.verify_lengths) < 2 or min(args.contexts) < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--verify-lengths >= 2, --contexts >= 1, --rounds >= 1 and --warmup >= 0")
    try:
        return run(args)
    except ValueError as exc:
        p.error(str(exc))


if __name__ == "__main__":
    main()
