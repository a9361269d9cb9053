"""Plain-step forward cost: the target-only engine beside the demo draft's engine with every step forced plain,
interleaved (4 mt-bench first turns, 64 tokens, twice). Usage: python plain_steps.py DRAFT (e.g. runs/demo/train)."""
import sys, statistics, importlib.util
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]  # the repository
sys.path.insert(0, str(ROOT))
from deepspec.decoding import schedule as S
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.algorithms.protocol import NullProposer
spec = importlib.util.spec_from_file_location("bs", str(ROOT / "bench" / "schedule.py")); bs = importlib.util.module_from_spec(spec); spec.loader.exec_module(bs)
L = bs.open_target_and_draft(sys.argv[1], dtype="bfloat16")
prompts = bs.prompt_sets(["mt-bench"], L.tokenizer, 4)["mt-bench"]
def never(self, max_depth, pending=0, width=1):
    self.plain_streak = 0; self.probing = False; self.proposing = False; return False
S.StepScheduler.plan = never
t = SpeculativeEngine(L.model, L.layers, NullProposer(), L.eos, few_row_linear=False)
d = SpeculativeEngine(L.model, L.layers, L.algorithm.proposer(L.draft, max_positions=L.max_positions, tree_width=3), L.eos, few_row_linear=False, schedule="auto")
for e in (t, d): e.generate(prompts[0], max_new_tokens=8)
V = {"t": [], "d": []}; O = {"t": [], "d": []}; T = {"t": 0.0, "d": 0.0}; N = {"t": 0, "d": 0}
for rep in range(2):
    for i, p in enumerate(prompts):
        for k, e in ((("t", t), ("d", d)) if i % 2 == 0 else (("d", d), ("t", t))):
            r = e.generate(p, max_new_tokens=64)
            V[k] += [s.verify_s * 1e3 for s in r.steps]; O[k] += [(s.time_s - s.verify_s - s.propose_s) * 1e3 for s in r.steps]
            T[k] += r.total_time_s; N[k] += r.num_new_tokens
for k in V:
    print(k, "verify median %.2f mean %.2f" % (statistics.median(V[k]), statistics.mean(V[k])), "overhead median %.3f" % statistics.median(O[k]), "ms/token %.2f" % (T[k] / N[k] * 1e3))
print("speedup d vs t: %.3f" % ((T["t"] / N["t"]) / (T["d"] / N["d"])))
