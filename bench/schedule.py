"""Step scheduler benchmark: ``schedule="auto"`` beside fixed chains and fixed trees, per prompt set.

One process, one target, one draft; for every prompt set (``--prompts NAME=FILE`` JSONL with ``turns``, or a
benchmark name loaded with ``deepspec.eval.benchmarks.load_benchmark``) the methods run interleaved per prompt,
in ABBA order (the order reversed on every other prompt), after one untimed warm-up each, greedily, each
``--timing-repeats`` times from the same state with the fastest run kept (``deepspec.eval.run.run_fastest``, the
rule ``deepspec eval`` times by), with fresh engines per prompt set (so the scheduler's running acceptance starts
from its prior on every set; its cost curve is measured once and cached on disk):

- ``target-only``: the engine with ``NullProposer`` (the speedup baseline);
- ``chain-fixed`` / ``chain-auto``: the draft proposing chains of its K, verified whole / scheduled;
- ``tree<W>-fixed`` / ``tree<W>-auto`` (``--tree-width W``, default 3; 0 drops them): draft trees of W nodes
  per slot, verified whole / scheduled;
- ``chain-auto-whole``, for a draft that drafts serially (Eagle3): scheduled, but drafting its whole K on every
  call instead of the depth the scheduler planned.

Printed per set and method: speedup (target-only time per output token / the method's, pooled), the median
of the per-prompt speedups, tau (committed tokens per verify step), the per-step breakdown (propose, verify,
overhead and the scheduler's own ms), the share of plain steps and the mean draft tokens verified per step,
the share of outputs equal to target-only's, and tau and speedup over only the prompts on which every method's
output equals target-only's (``sh.``, :func:`shared_text_figures`: in bfloat16 an output that parts at a near-tie
goes on through other text, whose tau differs, so only those prompts compare the methods on the same tokens).
Writes ``schedule_bench.json`` and ``schedule_bench.png`` (speedup bars) under ``--output-dir``.

    python bench/schedule.py --draft runs/demo/train --prompts gsm8k mt-bench --num-prompts 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspec.algorithms.protocol import NullProposer  # noqa: E402
from deepspec.algorithms.registry import algorithm_for_model, load_draft  # noqa: E402
from deepspec.checkpoints import draft_folder  # noqa: E402
from deepspec.data.chat import render_prompt  # noqa: E402
from deepspec.decoding.engine import GenerationResult, SpeculativeEngine  # noqa: E402
from deepspec.device import dtype_name, resolve_dtype  # noqa: E402
from deepspec.eval.benchmarks import load_benchmark  # noqa: E402
from deepspec.eval.metrics import schedule_stats, step_timing_stats  # noqa: E402
from deepspec.eval.run import eos_token_ids_of, run_fastest  # noqa: E402
from deepspec.target.load import EMBEDDED_DEFAULT, open_target  # noqa: E402
from deepspec.utils import atomic_write_json, pyplot, save_png  # noqa: E402


class Loaded(NamedTuple):
    """A target and a trained draft, ready for engines: the target model and tokenizer, the draft (cast to the
    target's dtype, in eval mode), its algorithm, the target's EOS ids, the layers the draft reads and the target's
    position limit."""

    model: Any
    tokenizer: Any
    draft: Any
    algorithm: Any
    eos: list[int]
    layers: list[int]
    max_positions: int


def open_target_and_draft(draft: str, target: str = EMBEDDED_DEFAULT, dtype: str = "auto") -> Loaded:
    """Load ``target`` on the CPU in ``dtype`` (``deepspec.device.resolve_dtype``'s names) and the draft trained for
    it (a ``deepspec train`` run folder or checkpoint). Raises ValueError / FileNotFoundError for a bad dtype, a
    missing draft (named before the target loads) or a draft trained for another target."""
    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    folder = draft_folder(draft)
    loaded = open_target(target, dtype=torch_dtype, device="cpu")  # fingerprinted as loaded, then cast
    model, tokenizer = loaded.model, loaded.tokenizer
    _, model_draft = load_draft(folder, target_model=model, target_fingerprint=loaded.fingerprint)
    model_draft = model_draft.to(torch_dtype).eval()
    return Loaded(model, tokenizer, model_draft, algorithm_for_model(model_draft), eos_token_ids_of(model, tokenizer),
                  list(model_draft.config.target_layer_ids), int(model.config.max_position_embeddings))


def prompt_sets(specs: list[str], tokenizer, num_prompts: int) -> dict[str, list[list[int]]]:
    """``{set name: prompt ids}``: ``NAME=FILE`` (a JSONL of ``{"turns": [...]}``) or a benchmark name."""
    sets = {}
    for spec in specs:
        if "=" in spec:
            name, path = spec.split("=", 1)
            rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
            messages = [[{"role": "user", "content": r["turns"][0]}] for r in rows[:num_prompts]]
        else:
            name = spec
            messages = [p.messages for p in load_benchmark(spec, max_samples=num_prompts)]
        sets[name] = [render_prompt(tokenizer, m) for m in messages]
    return sets


def shared_text_figures(runs: dict[str, list[GenerationResult]]) -> dict[str, dict[str, float | int | None]]:
    """Each method's tau and speedup over only the prompts on which every method's output equals target-only's.

    ``runs``: method name -> one result per prompt, in the same prompt order, ``"target-only"`` among them. In
    bfloat16 a method's output parts from target-only's at near-ties and goes on through other text, whose tau
    differs; over the prompts all methods share, the methods decode the same tokens, so their tau and speedup
    differ by what they verify and what it costs alone. Returns, per method, ``num_shared`` (the prompts kept),
    ``tau_shared`` (committed tokens per verify step) and ``speedup_shared`` (target-only time per output token
    over the method's, pooled), both None where no prompt is shared."""
    base = runs["target-only"]
    shared = [i for i in range(len(base)) if all(rs[i].output_ids == base[i].output_ids for rs in runs.values())]
    per_token = {n: sum(rs[i].total_time_s for i in shared) / max(sum(rs[i].num_new_tokens for i in shared), 1)
                 for n, rs in runs.items()}
    figures: dict[str, dict[str, float | int | None]] = {}
    for name, rs in runs.items():
        steps = [s for i in shared for s in rs[i].steps]
        figures[name] = {
            "num_shared": len(shared),
            "tau_shared": sum(s.num_committed for s in steps) / len(steps) if steps else None,
            "speedup_shared": per_token["target-only"] / per_token[name] if shared else None,
        }
    return figures


def plot(results: dict[str, dict], path: Path) -> None:
    """Speedup over target-only per prompt set (groups) and method (bars), with the 1.0 line."""
    plt = pyplot()
    sets = list(results)
    methods = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(sets), 3.6))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ax.bar([i + j * width for i in range(len(sets))], [results[s][m]["speedup"] for s in sets], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets)
    ax.set_ylabel("speedup over target-only")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)


class WholeChain:
    """A serial drafter with its ``drafts_serially`` hidden: it drafts its whole K whenever it is called."""

    drafts_serially = False

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--draft", required=True, help="a trained draft (deepspec train run folder or checkpoint)")
    p.add_argument("--target", default=EMBEDDED_DEFAULT, help="the target the draft was trained for")
    p.add_argument("--prompts", nargs="+", default=["gsm8k", "mt-bench"], help="benchmark names or NAME=FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64, help="output tokens per prompt")
    p.add_argument("--tree-width", type=int, default=3,
                   help="nodes per slot of the tree rows (0 drops them; chains are always run)")
    p.add_argument("--few-row-linear", choices=("on", "off"), default="on",
                   help="the few-row linear path (float32 only; off in bfloat16)")
    p.add_argument("--dtype", default="float32",
                   help="float32 | bfloat16 | auto (deepspec.device.resolve_dtype; deepspec eval's default is auto)")
    p.add_argument("--timing-repeats", type=int, default=2,
                   help="runs of every (prompt, method), each from the same state, the fastest kept (as deepspec eval)")
    p.add_argument("--output-dir", default="runs/schedule-bench", help="where schedule_bench.json and .png go")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.timing_repeats < 1:
        p.error("--num-prompts, --max-new-tokens and --timing-repeats: expected integers >= 1")
    if args.tree_width < 0:
        p.error(f"--tree-width: expected an integer >= 0 (0: chains only), got {args.tree_width}")
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        p.error(str(exc))


def run(args: argparse.Namespace) -> dict:
    """The benchmark of :func:`main`'s parsed arguments (the module docstring); returns the record it writes.
    Raises ValueError / FileNotFoundError for a bad dtype, draft, target or prompt set."""
    loaded = open_target_and_draft(args.draft, args.target, args.dtype)
    dtype = next(loaded.model.parameters()).dtype
    model, tokenizer, draft, algorithm = loaded.model, loaded.tokenizer, loaded.draft, loaded.algorithm
    eos, layers, max_pos = loaded.eos, loaded.layers, loaded.max_positions
    few_row = args.few_row_linear == "on" and dtype == torch.float32

    def engines() -> dict[str, SpeculativeEngine]:
        made = {"target-only": SpeculativeEngine(model, layers, NullProposer(), eos, few_row_linear=few_row)}
        widths = [1] + ([args.tree_width] if args.tree_width >= 2 else [])
        for w in widths:
            label = "chain" if w == 1 else f"tree{w}"
            for schedule in ("fixed", "auto"):
                proposer = algorithm.proposer(draft, max_positions=max_pos, tree_width=w)
                made[f"{label}-{schedule}"] = SpeculativeEngine(model, layers, proposer, eos, few_row_linear=few_row,
                                                                schedule=schedule)
                if schedule == "auto" and getattr(proposer, "drafts_serially", False):
                    whole = WholeChain(algorithm.proposer(draft, max_positions=max_pos, tree_width=w))
                    made[f"{label}-auto-whole"] = SpeculativeEngine(model, layers, whole, eos, few_row_linear=few_row,
                                                                    schedule="auto")
        return made

    results: dict[str, dict] = {}
    for set_name, prompts in prompt_sets(args.prompts, tokenizer, args.num_prompts).items():
        made = engines()
        for engine in made.values():  # warm-up (and the scheduler's cost curve), untimed
            engine.generate(prompts[0], max_new_tokens=8)
        runs: dict[str, list] = {name: [] for name in made}
        for i, prompt in enumerate(prompts):
            order = list(made.items())

            def run_once(name: str, engine: SpeculativeEngine) -> tuple[float, GenerationResult]:
                result = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
                return result.total_time_s, result

            abba = order if i % 2 == 0 else order[::-1]  # a drift weighs on every method alike
            for name, result in run_fastest(abba, run_once, args.timing_repeats).items():
                runs[name].append(result)
        base = runs["target-only"]
        per_token = {n: sum(r.total_time_s for r in rs) / sum(r.num_new_tokens for r in rs) for n, rs in runs.items()}
        rows = {}
        for name, rs in runs.items():
            steps = [s for r in rs for s in r.steps]
            per_prompt = [(b.total_time_s / b.num_new_tokens) / (r.total_time_s / r.num_new_tokens)
                          for b, r in zip(base, rs)]
            rows[name] = {
                "speedup": per_token["target-only"] / per_token[name],
                "speedup_median": statistics.median(per_prompt),
                "tau": sum(s.num_committed for s in steps) / len(steps),
                "mean_nodes_verified": sum(s.num_nodes_verified for s in steps) / len(steps),
                "identical": sum(r.output_ids == b.output_ids for r, b in zip(rs, base)) / len(rs),
                **vars(step_timing_stats(steps)),
                **schedule_stats(steps),
            }
        for name, figures in shared_text_figures(runs).items():
            rows[name].update(figures)
        results[set_name] = rows
        print(f"\n{set_name} ({len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy, {dtype_name(dtype)}, "
              f"fastest of {args.timing_repeats})")
        print(f"{'method':17} {'speedup':>8} {'median':>7} {'tau':>5} {'nodes':>6} {'plain':>6} {'propose':>8} "
              f"{'verify':>7} {'overhead':>8} {'sched':>6} identical {'sh.tau':>6} {'sh.speedup':>10}")
        shown = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        for name, r in rows.items():
            print(f"{name:17} {r['speedup']:8.2f} {r['speedup_median']:7.2f} {r['tau']:5.2f} "
                  f"{r['mean_nodes_verified']:6.2f} {r['frac_plain_steps']:6.2f} {r['propose_ms_per_step']:8.2f} "
                  f"{r['verify_ms_per_step']:7.2f} {r['overhead_ms_per_step']:8.2f} {r['schedule_ms_per_step']:6.3f} "
                  f"{r['identical']:9.2f} {shown(r['tau_shared']):>6} {shown(r['speedup_shared']):>10}")
        print(f"sh.: over the {rows['target-only']['num_shared']} of {len(prompts)} prompts on which every method's "
              "output equals target-only's")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "dtype": dtype_name(dtype), "threads": torch.get_num_threads(),
              "date": time.strftime("%Y-%m-%d"),
              "results": results}
    atomic_write_json(out / "schedule_bench.json", record)
    plot(results, out / "schedule_bench.png")
    return record


if __name__ == "__main__":
    main()
