"""The trace behind this record's long-prompt figures: target forward ms per step on arena-hard-v2's longest
prompt, target-only beside an Eagle3 engine that drafts on one step only (--draft-at), and that call's ms.

    python docs/results/recipe-cpu-2026-12-06-excess/trace_long_prompt.py --draft runs/recipe/train-eagle3

Run from the repository root, after `make recipe` (bfloat16 where the CPU has bf16 units, as the recipe's eval).
"""

import argparse
import statistics
import sys
from pathlib import Path


sys.path[:0] = [str(Path.cwd()), str(Path.cwd() / "bench")]
from schedule import open_target_and_draft, prompt_sets  # noqa: E402

from deepspec.algorithms.protocol import NullProposer  # noqa: E402
from deepspec.decoding.engine import SpeculativeEngine  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--draft", required=True)
p.add_argument("--draft-at", type=int, default=10, help="the one step that calls the draft (1 token)")
p.add_argument("--max-new-tokens", type=int, default=30)
args = p.parse_args()

loaded = open_target_and_draft(args.draft)
model, tok, draft, algorithm, eos = loaded.model, loaded.tokenizer, loaded.draft, loaded.algorithm, loaded.eos
layers, max_pos = loaded.layers, loaded.max_positions
dtype = next(model.parameters()).dtype
drafting = SpeculativeEngine(model, layers, algorithm.proposer(draft, max_positions=max_pos, tree_width=1), eos,
                             schedule="auto")
plain = SpeculativeEngine(model, layers, NullProposer(), eos)
sched = drafting.ensure_scheduler()
step = {"i": 0}


def plan(max_depth: int, pending: int = 0) -> bool:  # the scheduler's plan replaced: draft one token on one step only
    i, step["i"] = step["i"], step["i"] + 1
    sched.depth_limit, sched.probing, sched.proposing = 1, False, i == args.draft_at
    if not sched.proposing:
        sched.plain_streak += 1
    return sched.proposing


sched.plan = plan
prompt = max(prompt_sets(["arena-hard-v2"], tok, 4)["arena-hard-v2"], key=len)
print(f"{dtype}, prompt of {len(prompt)} tokens")
for rep in range(2):
    step["i"] = 0
    base = plain.generate(prompt, max_new_tokens=args.max_new_tokens)
    step["i"] = 0
    run = drafting.generate(prompt, max_new_tokens=args.max_new_tokens)
    one = [s.verify_s * 1000 for s in base.steps]
    drafted = [s for s in run.steps if s.drafted]
    print(f"pass {rep}: target-only one-token forward median {statistics.median(one):.1f} ms; "
          f"Eagle3 engine one-token forward median "
          f"{statistics.median(s.verify_s * 1000 for s in run.steps if not s.drafted):.1f} ms; "
          f"its drafted step: propose {drafted[0].propose_s * 1000:.1f} ms (the prompt's features flushed), "
          f"verify of {drafted[0].num_nodes_verified + 1} tokens {drafted[0].verify_s * 1000:.1f} ms")
