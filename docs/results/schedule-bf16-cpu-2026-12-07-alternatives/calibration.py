"""Shadow calibration of the scheduler's tree estimates: a tree-of-3 auto engine whose every proposal is verified whole
(the scheduler still chooses when to draft), each node's estimated path probability logged beside whether it was
accepted. Usage: python calibration.py SET shadow REPO DRAFT (REPO: the checkout whose scheduler is read)."""
import sys, importlib.util, collections
sys.path.insert(0, sys.argv[3])
from deepspec.decoding import schedule as S
from deepspec.decoding.engine import SpeculativeEngine
spec = importlib.util.spec_from_file_location("bs", (sys.argv[3]) + "/bench/schedule.py"); bs = importlib.util.module_from_spec(spec); spec.loader.exec_module(bs)
name = sys.argv[1]; mode = sys.argv[2]  # shadow: verify all; auto: real auto
L = bs.open_target_and_draft(sys.argv[4], dtype="bfloat16")
prompts = bs.prompt_sets([name], L.tokenizer, 8)[name]
rows = []; pending = {}
osel, oobs = S.StepScheduler._select, S.StepScheduler.observe
def sel(self, proposal, *, greedy):
    kept = osel(self, proposal, greedy=greedy)
    if proposal.parents_N is not None and proposal.num_proposed:
        ranks, scores = S._sibling_ranks(proposal.parents_N), proposal.node_scores()
        path = []
        for i, p in enumerate(proposal.parents_N):
            a = self.estimator.estimate(proposal.depths_N[i], *S._node_key(proposal, i, ranks, scores))
            path.append(a * (1.0 if p < 0 else path[p]))
        if mode == "shadow":
            kept = proposal
        pending["est"] = (path, ranks, proposal.depths_N, list(proposal.parents_N))
    return kept
def obs(self, proposal, num_accepted, path, **kw):
    if proposal.parents_N is not None and "est" in pending and mode == "shadow":
        est, ranks, depths, parents = pending.pop("est")
        on = set(path or ())
        for i in range(len(est)):
            rows.append((est[i], i in on, ranks[i], depths[i]))
    return oobs(self, proposal, num_accepted, path, **kw)
S.StepScheduler._select, S.StepScheduler.observe = sel, obs
eng = SpeculativeEngine(L.model, L.layers, L.algorithm.proposer(L.draft, max_positions=L.max_positions, tree_width=3), L.eos, few_row_linear=False, schedule="auto")
eng.generate(prompts[0], max_new_tokens=8); rows.clear()
res = [eng.generate(p, max_new_tokens=64) for p in prompts]
steps = [s for r in res for s in r.steps]
print(mode, name, "tau", sum(s.num_committed for s in steps)/len(steps), "nodes", sum(s.num_nodes_verified for s in steps)/len(steps))
edges = [0, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.01]
for kind in ("first", "alt"):
    print(kind)
    for lo, hi in zip(edges, edges[1:]):
        sel_ = [(e, o) for e, o, r, d in rows if lo <= e < hi and ((r == 0) == (kind == "first"))]
        if sel_:
            print(f"  [{lo:.2f},{hi:.2f}) n={len(sel_):4d} est={sum(e for e,_ in sel_)/len(sel_):.3f} actual={sum(o for _,o in sel_)/len(sel_):.3f}")
