"""What answer regeneration (``deepspec prepare``, local backend) costs, with and without the few-row path.

Regenerates the answers to the first ``--num-prompts`` gsm8k *train* problems (the demo's training
prompts, read from the local benchmarks folder) in batches of ``--batch-size``, greedy, at most
``--max-new-tokens`` each, through :class:`deepspec.data.backends.LocalBackend` with
``few_row_linear="off"`` (``F.linear``) and ``"on"`` (:mod:`deepspec.target.few_row_linear` over at
most :data:`deepspec.data.backends.BATCH_FEW_ROW_MAX_ROWS` rows), interleaved: every round runs both
once, in one process (these machines are shared and noisy; only the side-by-side ratio counts).
Prints generated tokens per second per path and round, the median ratio, and whether the two paths
generated the same ids.

Writes ``prepare_bench.json`` and ``prepare_bench.png`` under ``--output-dir``.

    python bench/prepare.py                          # 32 prompts x 128 tokens, 2 rounds
    python bench/prepare.py --num-prompts 64 --batch-size 64 --rounds 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.data.backends import GenerationParams, LocalBackend, TurnRequest  # noqa: E402
from deepspec.device import check_dtype_name, dtype_name, resolve_dtype  # noqa: E402
from deepspec.target.decoding import SamplingParams  # noqa: E402
from deepspec.utils import atomic_write_json, pyplot, save_png  # noqa: E402

PATHS = ("off", "on")


def regenerate(backend: LocalBackend, requests: list) -> tuple[float, list[list[int]]]:
    """Seconds to answer ``requests`` and the generated ids, in request order."""
    ids: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    backend.generate(requests, lambda i, result: ids.__setitem__(i, list(result.token_ids)))
    return time.perf_counter() - t0, [ids[i] for i in range(len(requests))]


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rounds = range(1, len(results["tok_per_s"]["off"]) + 1)
    for p, label in (("off", "F.linear"), ("on", f"few-row (<= {results['few_row_max_rows']} rows)")):
        ax.plot(list(rounds), results["tok_per_s"][p], "o-", label=label)
    ax.set_xlabel("round (both paths once per round, interleaved)")
    ax.set_ylabel("generated tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{results['target']}, {results['dtype']}, {results['num_prompts']} prompts in batches of "
                 f"{results['batch_size']}, {results['max_new_tokens']} tokens", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default", help="target (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", help="auto | float32 | bfloat16")
    p.add_argument("--num-prompts", type=int, default=32, help="gsm8k train problems regenerated per round")
    p.add_argument("--batch-size", type=int, default=32, help="prompts generated at once (prepare's --batch-size)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    p.add_argument("--output-dir", default="runs/bench-prepare")
    args = p.parse_args(argv)
    try:
        check_dtype_name(args.dtype, "--dtype")
    except ValueError as exc:
        p.error(str(exc))
    for name in ("num_prompts", "batch_size", "max_new_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")

    from deepspec.eval.benchmarks import training_conversations
    from deepspec.target.load import load_target

    try:
        conversations = training_conversations("gsm8k")[:args.num_prompts]
    except FileNotFoundError as exc:
        p.error(f"{exc} (bench/prepare.py reads gsm8k's train split, as the demo does)")
    dtype = resolve_dtype(args.dtype, "cpu")
    model, tokenizer = load_target(args.target, dtype=dtype)
    generation = GenerationParams(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=0.0))
    requests = [TurnRequest(key=c["id"], messages=c["messages"][:1], generation=generation) for c in conversations]
    backends = {path: LocalBackend(model, tokenizer, batch_size=args.batch_size, few_row_linear=path)
                for path in PATHS}
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    tokens: dict[str, list[int]] = {path: [] for path in PATHS}
    outputs: dict[str, list[list[int]]] = {}
    print(f"{args.target} in {dtype_name(dtype)} ({torch.get_num_threads()} threads): {len(requests)} gsm8k train "
          f"prompts, batches of {args.batch_size}, {args.max_new_tokens} greedy tokens at most")
    for r in range(args.rounds):
        for path in PATHS:
            dt, ids = regenerate(backends[path], requests)
            outputs.setdefault(path, ids)
            seconds[path].append(dt)
            tokens[path].append(sum(map(len, ids)))
            print(f"round {r + 1} {path:>3}: {dt:7.1f} s, {tokens[path][-1] / dt:6.1f} tok/s", flush=True)
    same = sum(a == b for a, b in zip(outputs["off"], outputs["on"]))
    ratio = statistics.median(on / off for on, off in zip(seconds["on"], seconds["off"]))
    results = {
        "target": args.target, "dtype": dtype_name(dtype), "threads": torch.get_num_threads(),
        "num_prompts": len(requests), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
        "few_row_max_rows": backends["on"].few_row_rows, "seconds": seconds,
        "tok_per_s": {path: [t / s for t, s in zip(tokens[path], seconds[path])] for path in PATHS},
        "time_ratio_on_over_off": ratio, "answers_identical": same, "answers": len(requests),
    }
    print(f"few-row / F.linear time (median over rounds): {ratio:.2f}; identical answers {same} / {len(requests)}")
    out = Path(args.output_dir)
    atomic_write_json(out / "prepare_bench.json", results)
    plot(results, out / "prepare_bench.png")
    print(f"wrote {out / 'prepare_bench.json'} and {out / 'prepare_bench.png'}")
    return results


if __name__ == "__main__":
    main()
