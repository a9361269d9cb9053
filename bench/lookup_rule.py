"""Prompt lookup's matching rule: tau of the ``ngram`` baseline under each rule, side by side in one run.

Greedy, on the embedded default target (SmolLM2-135M), over the first ``--num-prompts`` prompts of each
benchmark (``deepspec.eval.benchmarks.load_benchmark``, the demo's sampling seed) and, unless
``--no-loops``, three made-up prompts on which the target repeats itself (``loops``: a run of one
token, "a b a b", "0 0 0"). Each rule is the ``context_rule`` of one
:class:`~deepspec.algorithms.ngram.proposer.NGramProposer` (K = ``--num-tokens``, n-grams
``--ngram-max`` .. ``--ngram-min``, no corpus), decoded through the engine; the rules differ only in
which earlier occurrence of the context's last n tokens they copy from and where the copy stops:

- ``recent-cut``: the most recent occurrence, the copy cut at the context's end;
- ``leftmost-cut``: the earliest occurrence, cut at the end (what Hugging Face's and vLLM's proposers do);
- ``leftmost-continued``: the earliest occurrence, the copy running on into its own output;
- ``recent-continued``: the most recent occurrence, continued (the rule of
  :func:`~deepspec.algorithms.ngram.proposer.ngram_proposal`; docs/results/lookup-rule_cpu_2026-12-05).

Printed and recorded per benchmark and rule: tau (mean accepted + 1 per verify step, pooled over the
benchmark's prompts), the mean number of tokens proposed per step, and whether every output equals the
first rule's (greedy decoding is lossless, so it must). Writes ``lookup_rule.json`` under ``--output-dir``.

    python bench/lookup_rule.py --num-prompts 3 --max-new-tokens 64 --output-dir /tmp/lookup-rule
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.algorithms.ngram.proposer import continued_copy, ngram_proposal  # noqa: E402

LOOP_PROMPTS = (  # made-up prompts on which SmolLM2-135M loops (greedy)
    "Repeat after me, ten times: no no no no no no no no no no",
    "Continue the pattern for 40 more items: a b a b a b a b a b a b",
    "Continue this sequence: 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0",
)


def match_end(context: Sequence[int], *, ngram_max: int, ngram_min: int, leftmost: bool) -> int | None:
    """Where the copy starts: the end of the earliest (``leftmost``) or most recent earlier occurrence of the
    context's last n tokens, for the longest n in ``ngram_max`` .. ``ngram_min`` that has one; None without."""
    length = len(context)
    for n in range(ngram_max, ngram_min - 1, -1):
        if length < n + 1:
            continue
        suffix = list(context[length - n:])
        starts = range(length - n) if leftmost else range(length - n - 1, -1, -1)
        for start in starts:
            if list(context[start:start + n]) == suffix:
                return start + n
    return None


def make_rule(*, leftmost: bool, continued: bool):
    """A ``context_rule`` for :class:`NGramProposer` (the signature of :func:`ngram_proposal`)."""
    def rule(context: Sequence[int], *, ngram_max: int, ngram_min: int, num_tokens: int) -> list[int]:
        end = match_end(context, ngram_max=ngram_max, ngram_min=ngram_min, leftmost=leftmost)
        if end is None:
            return []
        if continued:
            return continued_copy(context, end, num_tokens)
        return [int(t) for t in context[end:end + num_tokens]]
    return rule


RULES = {
    "recent-cut": make_rule(leftmost=False, continued=False),
    "leftmost-cut": make_rule(leftmost=True, continued=False),
    "leftmost-continued": make_rule(leftmost=True, continued=True),
    "recent-continued": ngram_proposal,
}


def cpu_model() -> str:
    """The CPU's model name (lscpu's line, else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--benchmarks", default="gsm8k,humaneval,mt-bench,alpaca")
    p.add_argument("--num-prompts", type=int, default=3, help="prompts per benchmark (the demo's eval: 3)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-tokens", type=int, default=7, help="K, the most tokens proposed per step (the demo's: 7)")
    p.add_argument("--ngram-max", type=int, default=3)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--no-loops", action="store_true", help="drop the made-up repetitive prompts")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output-dir", default="runs/bench-lookup-rule")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from deepspec.algorithms.ngram.proposer import NGramProposer, check_ngram_range
    from deepspec.data.chat import render_prompt
    from deepspec.decoding.engine import SpeculativeEngine
    from deepspec.eval.benchmarks import load_benchmark
    from deepspec.eval.run import eos_token_ids_of
    from deepspec.target.load import EMBEDDED_DEFAULT, load_target
    from deepspec.utils import atomic_write_json

    try:
        check_ngram_range(ngram_max=args.ngram_max, ngram_min=args.ngram_min, field="bench")
        if args.num_tokens < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
            raise ValueError("--num-tokens, --num-prompts, --max-new-tokens: expected integers >= 1")
    except ValueError as exc:
        p.error(str(exc))
    sets = {b: [pr.messages for pr in load_benchmark(b, max_samples=args.num_prompts)]
            for b in args.benchmarks.split(",") if b}
    if not args.no_loops:
        sets["loops"] = [[{"role": "user", "content": text}] for text in LOOP_PROMPTS]

    model, tokenizer = load_target(EMBEDDED_DEFAULT)
    model.eval()
    eos = eos_token_ids_of(model, tokenizer)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    engines = {}
    for name, rule in RULES.items():
        proposer = NGramProposer(vocab_size=vocab, num_tokens=args.num_tokens, ngram_max=args.ngram_max,
                                 ngram_min=args.ngram_min, max_positions=model.config.max_position_embeddings)
        proposer.context_rule = rule
        engines[name] = SpeculativeEngine(model, [], proposer, eos)
    first = next(iter(engines))
    engines[first].generate(render_prompt(tokenizer, next(iter(sets.values()))[0]), max_new_tokens=4)  # warm-up

    t0 = time.perf_counter()
    results: dict[str, dict[str, dict]] = {}
    for bench, prompts in sets.items():
        outputs = {name: [] for name in engines}
        steps = {name: [] for name in engines}
        for messages in prompts:
            ids = render_prompt(tokenizer, messages)
            for name, engine in engines.items():  # interleaved per prompt
                res = engine.generate(ids, max_new_tokens=args.max_new_tokens)
                outputs[name].append(res.output_ids)
                steps[name].extend(res.steps)
        results[bench] = {name: {
            "tau": sum(s.num_accepted + 1 for s in st) / len(st) if st else None,
            "mean_proposed": sum(s.num_proposed for s in st) / len(st) if st else None,
            "num_steps": len(st),
            "num_output_tokens": sum(map(len, outputs[name])),
            "outputs_equal_first_rule": outputs[name] == outputs[first],
        } for name, st in steps.items()}
        row = "  ".join(f"{name} {fig['tau']:.2f}" for name, fig in results[bench].items())
        print(f"{bench:10s} tau: {row}", flush=True)
    wall = time.perf_counter() - t0

    print(f"\n| set | prompts | {' | '.join(f'tau {n}' for n in RULES)} | proposed/step {first} -> {list(RULES)[-1]} |")
    print("| --- | --- |" + " --- |" * (len(RULES) + 1))
    for bench, figs in results.items():
        taus = " | ".join(f"{figs[n]['tau']:.2f}" for n in RULES)
        print(f"| {bench} | {len(sets[bench])} | {taus} | {figs[first]['mean_proposed']:.2f} -> "
              f"{figs[list(RULES)[-1]]['mean_proposed']:.2f} |")
    same = all(fig["outputs_equal_first_rule"] for figs in results.values() for fig in figs.values())
    print(f"\nevery rule's outputs identical to {first}'s: {same}; {wall:.0f} s of decoding; CPU: {cpu_model()}, "
          f"{args.threads} thread(s)")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "lookup_rule.json", {
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"}, "target": EMBEDDED_DEFAULT,
        "cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "decode_wall_s": wall,
        "rules": list(RULES), "outputs_identical": same, "results": results,
        "loop_prompts": [] if args.no_loops else list(LOOP_PROMPTS)})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
