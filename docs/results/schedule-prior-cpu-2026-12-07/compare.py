"""Side by side in one process: the scheduler as it is, and the same scheduler without the requests' mean factor
(each request's factor shrunk towards 1) and without the flush's price (a probe priced as if the draft's context
were current). Prompt sets in eval's order, the engines kept across sets (their running figures carry over, as
in eval), every prompt run by every engine in ABBA order, twice.

    python docs/results/schedule-prior-cpu-2026-12-07/compare.py --draft runs/demo/train --tree-width 3
    python docs/results/schedule-prior-cpu-2026-12-07/compare.py --draft runs/recipe/train-eagle3 \\
        --sets gsm8k mt-bench alpaca arena-hard-v2

Run from the repository root (bfloat16 where the CPU has bf16 units). Prints, per set and engine, the speedup
over target-only (pooled time per token), tau, the steps that called the draft and their extra time over a
target-only step against the tokens they gained, and the mean forward of the steps that did not call it (the same
computation as target-only's: their difference is the host's noise between the engines' runs).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path.cwd()), str(Path.cwd() / "bench")]
from schedule import open_target_and_draft, prompt_sets  # noqa: E402

from deepspec.algorithms.protocol import NullProposer  # noqa: E402
from deepspec.decoding.engine import SpeculativeEngine  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--draft", required=True)
p.add_argument("--tree-width", type=int, default=1)
p.add_argument("--sets", nargs="+", default=["gsm8k", "humaneval", "mt-bench", "alpaca"])
p.add_argument("--num-prompts", type=int, default=4)
p.add_argument("--max-new-tokens", type=int, default=64)
p.add_argument("--repeats", type=int, default=2)
args = p.parse_args()

loaded = open_target_and_draft(args.draft)
model, tok, draft, algorithm = loaded.model, loaded.tokenizer, loaded.draft, loaded.algorithm
eos, layers, max_pos = loaded.eos, loaded.layers, loaded.max_positions


def drafting_engine(*, mean_factor: bool) -> SpeculativeEngine:
    engine = SpeculativeEngine(model, layers, algorithm.proposer(draft, max_positions=max_pos,
                                                                 tree_width=args.tree_width), eos, schedule="auto")
    sched = engine.ensure_scheduler()
    if not mean_factor:
        sched.estimator.request_prior_decay = 1.0  # the mean stays at 1: each request's factor shrunk towards 1
        plan = sched.plan
        sched.plan = lambda max_depth, pending=0: plan(max_depth, 0)  # the flush unpriced
    return engine


engines = {"target-only": SpeculativeEngine(model, layers, NullProposer(), eos),
           "scheduler": drafting_engine(mean_factor=True),
           "without mean factor, flush": drafting_engine(mean_factor=False)}
sets = prompt_sets(args.sets, tok, args.num_prompts)
for engine in engines.values():  # warm-up
    engine.generate(next(iter(sets.values()))[0], max_new_tokens=8)
print(f"{next(model.parameters()).dtype}, {torch.get_num_threads()} threads, draft {args.draft}, "
      f"tree width {args.tree_width}")
for name, prompts in sets.items():
    runs = {k: [] for k in engines}
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            order = list(engines.items())
            for k, engine in (order if (i + rep) % 2 == 0 else order[::-1]):
                runs[k].append(engine.generate(prompt, max_new_tokens=args.max_new_tokens))
    per_token = {k: sum(r.total_time_s for r in rs) / sum(r.num_new_tokens for r in rs) for k, rs in runs.items()}
    base_step = statistics.mean(s.time_s for r in runs["target-only"] for s in r.steps)
    base_forward = statistics.mean(s.verify_s for r in runs["target-only"] for s in r.steps)
    print(f"== {name}: target-only step {base_step * 1000:.2f} ms, forward {base_forward * 1000:.2f} ms")
    for k, rs in runs.items():
        if k == "target-only":
            continue
        steps = [s for r in rs for s in r.steps]
        drafted = [s for s in steps if s.drafted]
        extra = sum(s.time_s for s in drafted) - len(drafted) * base_step
        gained = sum(s.num_committed - 1 for s in drafted)
        tau = sum(s.num_committed for s in steps) / len(steps)
        plain = [s.verify_s for s in steps if not s.drafted]
        forward = f"{statistics.mean(plain) * 1000:.2f} ms" if plain else "-"
        first = sum(1 for r in rs if r.steps and r.steps[0].drafted)
        print(f"  {k:27} {per_token['target-only'] / per_token[k]:.3f}x  tau {tau:.2f}  steps {len(steps)}, draft "
              f"called on {len(drafted)} ({first} of {len(rs)} requests' first steps): {extra * 1000:.0f} ms over "
              f"target-only steps for {gained} tokens; plain steps' forward {forward}")
