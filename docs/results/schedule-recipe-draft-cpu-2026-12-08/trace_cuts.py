"""Trace chain-auto's cuts on gsm8k with the recipe's DSpark draft: for each drafting step, the chain's tokens,
how many the schedule kept, how many the whole chain would have committed (greedy: matches with the output).

    python docs/results/schedule-recipe-draft-cpu-2026-12-08/trace_cuts.py runs/recipe/train
"""
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench")); sys.path.insert(0, str(ROOT))
import schedule as B
from deepspec.decoding import schedule as S
from deepspec.decoding.engine import SpeculativeEngine
events = []
orig_select, orig_observe, orig_plan = S.StepScheduler.select, S.StepScheduler.observe, S.StepScheduler.plan
def plan(self, max_depth, pending=0, width=1):
    r = orig_plan(self, max_depth, pending, width); events.append(("plan", r, self.probing)); return r
def select(self, proposal, *, greedy):
    kept = orig_select(self, proposal, greedy=greedy)
    conf = proposal.confidence_N.tolist() if proposal.confidence_N is not None else None
    events.append(("sel", proposal.draft_ids_N.tolist(), kept.num_proposed, conf, self.estimator.request_factor()))
    return kept
def observe(self, proposal, num_accepted, path, **kw):
    events.append(("obs", proposal.num_proposed, num_accepted, kw["num_committed"])); return orig_observe(self, proposal, num_accepted, path, **kw)
S.StepScheduler.select, S.StepScheduler.observe, S.StepScheduler.plan = select, observe, plan
L = B.open_target_and_draft(sys.argv[1], dtype="bfloat16")
prompts = B.prompt_sets(["gsm8k"], L.tokenizer, 8)["gsm8k"]
prop = L.algorithm.proposer(L.draft, max_positions=L.max_positions, tree_width=1)
eng = SpeculativeEngine(L.model, L.layers, prop, L.eos, schedule="auto")
eng.generate(prompts[0], max_new_tokens=8)
tot = collections.Counter()
for p in prompts:
    events.clear()
    res = eng.generate(p, max_new_tokens=64)
    out = list(res.output_ids)
    pos = 1  # the first token comes from the prefill
    pend = None; line = []
    for e in events:
        if e[0] == "sel": pend = e
        elif e[0] == "obs":
            if pend is not None:
                ids, kept = pend[1], pend[2]
                would = 0
                for i, t in enumerate(ids):
                    if pos + i < len(out) and out[pos + i] == t: would += 1
                    else: break
                acc = e[2]
                tot["steps"] += 1; tot["kept"] += kept; tot["acc"] += min(acc, kept); tot["would"] += would
                tot["lost"] += max(would - kept, 0) if kept < len(ids) else 0
                if kept == 0: tot["cut_whole"] += 1; tot["cut_whole_would"] += would
                line.append(f"{kept}/{len(ids)}:{acc}|{would}")
                pend = None
            else:
                tot["plain_no_propose"] += 1; line.append(".")
            pos += e[3]
    print(" ".join(line))
print(dict(tot))
