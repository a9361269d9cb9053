"""A drafting engine's plain step against target-only's, and the noise floor of a chat row's speedup.

Two measurements, each in one process, with a trained draft on the CPU:

- ``overhead``: a DSpark engine whose scheduler plans every step (its own ``plan``) but never drafts,
  against target-only, their runs interleaved on one prompt: the per-step verify forward and the Python
  around it (propose, the scheduler, the rest of the step). Run it with ``--root`` at two checkouts, in
  alternating processes, to put two versions of the engine side by side.
- ``argmax``: the greedy choice over a verify's rows of the target's logits (its vocabulary, its dtype):
  torch's argmax on them against ``greedy_tokens`` (float32 on the CPU), interleaved, the median of 300 each.
- ``noise``: three more target-only engines (A, B, C) and the draft's ``auto`` engine (D) beside target-only
  (T), each prompt run ``--repeats`` times in eval's order (the methods reversed on every other prompt and
  repeat): each engine's pooled speedup over T as eval computes it, the fastest of the first k runs of each
  prompt, for k = 1, 2, 3, R, and from the median run.

Usage: python plain_step.py overhead|argmax|noise --draft RUN [--root CHECKOUT] [--sets alpaca,mt-bench]
       [--prompts 4] [--repeats 16] [--tokens 64]
"""

import argparse
import os
import statistics
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("part", choices=["overhead", "argmax", "noise"])
p.add_argument("--draft", required=True)
p.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
p.add_argument("--sets", default="alpaca")
p.add_argument("--prompts", type=int, default=4)
p.add_argument("--repeats", type=int, default=16)
p.add_argument("--tokens", type=int, default=64)
args = p.parse_args()
root = os.path.abspath(args.root)
sys.path[:0] = [root, os.path.join(root, "bench")]

from deepspec.algorithms.protocol import NullProposer  # noqa: E402
from deepspec.decoding.engine import SpeculativeEngine  # noqa: E402
from schedule import open_target_and_draft, prompt_sets  # noqa: E402  (bench/schedule.py of --root)

L = open_target_and_draft(args.draft)


def drafting_engine() -> SpeculativeEngine:
    proposer = L.algorithm.proposer(L.draft, max_positions=L.max_positions, tree_width=1)
    return SpeculativeEngine(L.model, L.layers, proposer, L.eos, schedule="auto")


def target_only() -> SpeculativeEngine:
    return SpeculativeEngine(L.model, L.layers, NullProposer(), L.eos)


sets = prompt_sets(args.sets.split(","), L.tokenizer, args.prompts)
print(f"root {root}; draft {args.draft}; {args.part}; sets {args.sets}; {args.prompts} prompts; "
      f"{args.repeats} repeats; {args.tokens} tokens")

if args.part == "overhead":
    T, D = target_only(), drafting_engine()
    sched = D.ensure_scheduler()
    plan = sched.plan
    sched.plan = lambda max_depth, pending=0: (plan(max_depth, pending), False)[1]  # plans, never drafts
    prompt = next(iter(sets.values()))[0]
    for e in (T, D):
        e.generate(prompt, max_new_tokens=8)
    runs = {"T": [], "D": []}
    for r in range(args.repeats):
        for name, e in (("T", T), ("D", D)) if r % 2 == 0 else (("D", D), ("T", T)):
            runs[name].append(e.generate(prompt, max_new_tokens=args.tokens))
    parts = {}
    for name, rs in runs.items():
        steps = [s for r in rs for s in r.steps]

        def ms(f):
            return statistics.mean(f(s) for s in steps) * 1e3

        parts[name] = {"verify": ms(lambda s: s.verify_s), "propose": ms(lambda s: s.propose_s),
                       "schedule": ms(lambda s: s.schedule_s),
                       "rest": ms(lambda s: s.time_s - s.verify_s - s.propose_s - s.schedule_s)}
        print(name, " ".join(f"{k} {v:.3f} ms" for k, v in parts[name].items()),
              f"| step {ms(lambda s: s.time_s):.3f} ms")
    python = {n: parts[n]["propose"] + parts[n]["schedule"] + parts[n]["rest"] for n in parts}
    print(f"D - T per plain step: Python {1e3 * (python['D'] - python['T']):.1f} us, "
          f"verify forward {1e3 * (parts['D']['verify'] - parts['T']['verify']):.1f} us")
elif args.part == "argmax":
    import torch

    from deepspec.target.decoding import greedy_tokens

    vocab = int(L.model.get_output_embeddings().weight.shape[0])
    dtype = next(L.model.parameters()).dtype
    with torch.inference_mode():
        for rows in (1, 2, 4, 8):
            logits = torch.randn(rows, vocab).to(dtype)
            assert torch.equal(logits.argmax(-1), greedy_tokens(logits))
            plain, greedy = [], []
            for _ in range(300):
                t0 = time.perf_counter()
                logits.argmax(-1)
                t1 = time.perf_counter()
                greedy_tokens(logits)
                plain.append(t1 - t0)
                greedy.append(time.perf_counter() - t1)
            print(f"{rows} rows x {vocab} ({dtype}): argmax {statistics.median(plain) * 1e6:.0f} us, "
                  f"greedy_tokens {statistics.median(greedy) * 1e6:.0f} us")
else:
    names = ["T", "A", "B", "C", "D"]
    engines = {n: target_only() for n in names[:-1]} | {"D": drafting_engine()}
    R = args.repeats
    for e in engines.values():
        e.generate(next(iter(sets.values()))[0], max_new_tokens=8)
    for set_name, prompts in sets.items():
        t = {n: [[0.0] * R for _ in prompts] for n in names}
        for i, prompt in enumerate(prompts):
            order = names if i % 2 == 0 else names[::-1]
            for r in range(R):
                for n in order if r % 2 == 0 else order[::-1]:
                    t[n][i][r] = engines[n].generate(prompt, max_new_tokens=args.tokens).total_time_s
        for n in names:
            print(set_name, n, " | ".join(" ".join(f"{x:.3f}" for x in t[n][i]) for i in range(len(prompts))))
        for k in sorted({1, 2, 3, R}):
            base = sum(min(t["T"][i][:k]) for i in range(len(prompts)))
            print(f"  fastest of {k}:", " ".join(
                f"{n} {base / sum(min(t[n][i][:k]) for i in range(len(prompts))):.3f}" for n in names[1:]))
        base = sum(statistics.median(t["T"][i]) for i in range(len(prompts)))
        print(f"  median of {R}:", " ".join(
            f"{n} {base / sum(statistics.median(t[n][i]) for i in range(len(prompts))):.3f}" for n in names[1:]))
