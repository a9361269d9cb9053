"""Scheduler replay: the step scheduler judged on recorded proposals, without timing noise.

One timed run of 8 prompts moves by about 3 % between runs of the same code on a shared 2-core host, as much as a
scheduling change is worth. The replay separates the two: what the draft proposes and what the target accepts is
recorded once, and the scheduler's choices are then replayed on it with step costs from a cost model measured in
the same recording, so two policies meet the same proposals at the same prices. Greedy decoding only.

``record``: per prompt set (``--prompts NAME=FILE`` JSONL with ``turns``, or a benchmark name), the target decodes
every prompt greedily; one target forward over prompt and answer gives the draft's features at every position, and
the draft proposes at every output position (as if each step committed one token), each proposal stored with the
nodes the target's greedy answer accepts. The same process times, side by side, target-only steps and the draft's
proposals verified whole (``--schedule fixed``), and measures the engine's cost curve: the cost model is a plain
step's seconds, a draft call's, the prompt flush per position, a verify's excess over the curve and its
bookkeeping.

``replay``: every prompt's decoding is replayed with ``fixed`` (every proposal verified whole) and ``auto`` (this
checkout's ``StepScheduler``; ``--set NAME=VALUE``, repeatable, sets a scheduler attribute, ``--set
estimator.NAME=VALUE`` an estimator's): from position to position by the tokens each step commits (a plain step
one), each step priced by the cost model (``--cost-scale``: the draft call, excess and bookkeeping scaled, for a
host where they cost more or less). One scheduler per set (fresh, as in ``bench/schedule.py``), and with
``--mixed`` also every set's prompts shuffled into one stream served by one scheduler (a server's traffic), the
mean over ``--orders`` shuffles. Printed per set: ``fixed`` and ``auto``, the speedup (target-only seconds / the
method's, pooled over prompts); ``median``, auto's median over prompts; ``plain``, auto's share of plain steps;
``auto/best``, auto's speedup over the better of fixed's and 1.0 (target-only); with ``--mixed``, auto's speedup in
the mixed stream and the same ratio. The recording is checked whole before the replay (a missing field or an
inconsistent proposal is named by record and step). The replay ignores what recording cannot see: a step's cost
beyond the model's (a kernel's first call, the host's load) and, in bfloat16, a near-tie where a verify's argmax
differs from the one-token decode's.

    python bench/schedule_replay.py record --draft runs/demo/train --prompts gsm8k humaneval mt-bench alpaca \\
        --num-prompts 16 --dtype bfloat16 --tree-width 3 --output runs/replay/tree3.json
    python bench/schedule_replay.py replay runs/replay/tree3.json --mixed --set probe_every=4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepspec.algorithms.protocol import NullProposer, Proposal  # noqa: E402
from deepspec.decoding.engine import SpeculativeEngine  # noqa: E402
from deepspec.decoding.schedule import AcceptanceEstimator, StepCostCurve, StepScheduler  # noqa: E402
from deepspec.decoding.verify import SamplingParams  # noqa: E402
from deepspec.device import dtype_name  # noqa: E402
from deepspec.target.capture import target_forward  # noqa: E402
from deepspec.target.load import EMBEDDED_DEFAULT  # noqa: E402
from deepspec.utils import atomic_write_json  # noqa: E402

GREEDY = SamplingParams()


def accepted_path(draft_ids: Sequence[int], parents: Sequence[int] | None, continuation: Sequence[int]) -> list[int]:
    """The nodes greedy verification accepts: the proposal's nodes (a chain: ``parents`` None; a tree: each
    node's parent index, -1 for the anchor's children, parents before children) that match ``continuation`` (the
    target's greedy tokens after the anchor) at their depth, every ancestor matching too, in depth order. Siblings
    hold distinct tokens, so at most one node per depth matches on the accepted path."""
    path: list[int] = []
    for i, token in enumerate(draft_ids):
        parent = (i - 1) if parents is None else parents[i]
        extends = parent == (path[-1] if path else -1)  # a child of the path's last node (of the anchor: -1)
        if extends and len(path) < len(continuation) and token == continuation[len(path)]:
            path.append(i)
    return path


def record_set(model, layers: list[int], proposer, prompts: list[list[int]], answers: list[list[int]]) -> list[dict]:
    """Every output position's proposal for each prompt and its answer (the target's greedy output): per position
    ``{"ids", "parents" (None: a chain), "scores" (None where unscored), "path"}``, ``path`` from
    :func:`accepted_path` against the answer's next tokens."""
    rows = []
    with torch.inference_mode():
        for prompt, answer in zip(prompts, answers):
            ids = list(prompt) + list(answer[:-1])
            feats = target_forward(model, torch.tensor([ids]), layers).target_hidden_BTF[0]
            proposer.reset()
            proposer.prepare(len(ids) + proposer.max_proposal_len + 1)
            proposer.extend_context(feats[: len(prompt)], list(prompt))
            steps = []
            for t in range(len(answer) - 1):
                p = proposer.propose(answer[t], len(prompt) + t, sampling=GREEDY, generator=None)
                draft_ids = p.draft_ids_N.tolist()
                parents = None if p.parents_N is None else list(p.parents_N)
                steps.append({"ids": draft_ids, "parents": parents, "scores": p.node_scores(),
                              "path": accepted_path(draft_ids, parents, answer[t + 1:])})
                proposer.extend_context(feats[len(prompt) + t: len(prompt) + t + 1], [answer[t]])
            rows.append({"prompt_len": len(prompt), "steps": steps})
    return rows


def measure_costs(baseline: list, fixed: list, curve: StepCostCurve, prompt_lens: list[int]) -> dict[str, float]:
    """The replay's cost model from timed runs side by side (``GenerationResult`` lists of target-only and of
    the fixed proposal verified whole, one per prompt): a plain step's forward and overhead, a draft call (its
    median; the prompt's flush apart, per position, from each request's first call), a verify's forward beyond the
    curve scaled to the plain forward, and a verifying step's overhead; medians over steps, in seconds."""
    plain = [s for r in baseline for s in r.steps]
    steps = [s for r in fixed for s in r.steps[1:]]
    forward_1 = statistics.median(s.verify_s for s in plain)
    scale = forward_1 / curve.seconds_for(1)
    propose = statistics.median(s.propose_s for s in steps)
    flush = [max(r.steps[0].propose_s - propose, 0.0) / n for r, n in zip(fixed, prompt_lens) if r.steps]
    return {
        "plain_forward_s": forward_1,
        "plain_overhead_s": statistics.median(s.time_s - s.propose_s - s.verify_s for s in plain),
        "propose_s": propose,
        "flush_s_per_position": statistics.median(flush) if flush else 0.0,
        "verify_excess_s": statistics.median(s.verify_s - scale * curve.seconds_for(s.num_nodes_verified + 1)
                                             for s in steps),
        "verify_overhead_s": statistics.median(s.time_s - s.propose_s - s.verify_s for s in steps),
    }


def record(args: argparse.Namespace) -> dict:
    """The ``record`` stage (module docstring); returns what it writes to ``args.output``."""
    spec = importlib.util.spec_from_file_location("bench_schedule", Path(__file__).with_name("schedule.py"))
    schedule_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(schedule_bench)  # its target and draft loading and prompt sets
    loaded = schedule_bench.open_target_and_draft(args.draft, args.target, args.dtype)
    model, draft, algorithm = loaded.model, loaded.draft, loaded.algorithm
    few_row = next(model.parameters()).dtype == torch.float32
    proposer = algorithm.proposer(draft, max_positions=loaded.max_positions, tree_width=args.tree_width)
    base_engine = SpeculativeEngine(model, loaded.layers, NullProposer(), loaded.eos, few_row_linear=few_row)
    fixed_engine = SpeculativeEngine(model, loaded.layers, proposer, loaded.eos, few_row_linear=few_row,
                                     schedule="fixed")
    auto_engine = SpeculativeEngine(model, loaded.layers, proposer, loaded.eos, few_row_linear=few_row,
                                    schedule="auto")
    curve = auto_engine.ensure_scheduler().curve  # the engine's measured (cached) curve
    records, baseline, fixed, lens = [], [], [], []
    for set_name, prompts in schedule_bench.prompt_sets(args.prompts, loaded.tokenizer, args.num_prompts).items():
        t0 = time.perf_counter()
        for engine in (base_engine, fixed_engine):
            engine.generate(prompts[0], max_new_tokens=8)  # warm-up, untimed
        answers = []
        for prompt in prompts:
            base = base_engine.generate(prompt, max_new_tokens=args.max_new_tokens)
            fixed.append(fixed_engine.generate(prompt, max_new_tokens=args.max_new_tokens))
            baseline.append(base)
            answers.append(base.output_ids)
            lens.append(len(prompt))
        rows = record_set(model, loaded.layers, proposer, prompts, answers)
        # an answer of one token (the target's EOS at once) has no position a draft proposes at
        records.extend({"set": set_name, "prompt": i, **row} for i, row in enumerate(rows) if row["steps"])
        skipped = sum(not row["steps"] for row in rows)
        print(f"{set_name}: {len(prompts) - skipped} prompts recorded in {time.perf_counter() - t0:.0f} s"
              + (f" ({skipped} answered in one token, left out)" if skipped else ""), flush=True)
    out = {"draft": args.draft, "target": args.target, "dtype": dtype_name(next(model.parameters()).dtype),
           "tree_width": args.tree_width, "max_proposal_len": proposer.max_proposal_len,
           "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "curve": curve.to_dict(),
           "costs": measure_costs(baseline, fixed, curve, lens), "records": records}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(args.output), out)
    print("cost model (ms):", {k: round(v * 1e3, 3) for k, v in out["costs"].items()})
    return out


class CostModel:
    """A step's seconds in the replay: ``costs`` from :func:`measure_costs`, the curve rescaled to the measured
    plain forward; ``scale`` multiplies what drafting adds (the call, the flush, the excess, the bookkeeping)."""

    def __init__(self, curve: StepCostCurve, costs: dict[str, float], scale: float = 1.0):
        self.curve = curve
        self.k = costs["plain_forward_s"] / curve.seconds_for(1)
        self.plain_overhead_s = costs["plain_overhead_s"]
        self.propose_s = scale * costs["propose_s"]
        self.flush_s = scale * costs["flush_s_per_position"]
        self.excess_s = scale * max(costs["verify_excess_s"], 0.0)
        self.verify_overhead_s = costs["plain_overhead_s"] + scale * max(
            costs["verify_overhead_s"] - costs["plain_overhead_s"], 0.0)

    def forward_s(self, num_nodes: int) -> float:
        """The verify forward over the anchor and ``num_nodes`` draft nodes (0: a plain step's)."""
        return self.k * self.curve.seconds_for(num_nodes + 1) + (self.excess_s if num_nodes else 0.0)

    def plain_step_s(self) -> float:
        return self.forward_s(0) + self.plain_overhead_s


def _proposal(step: dict) -> Proposal:
    """A recorded proposal with node ``i``'s token replaced by ``i`` (the scheduler reads no token; a kept subset's
    tokens then name the recorded nodes it kept)."""
    scores = torch.tensor([float("nan") if s is None else float(s) for s in step["scores"]])
    return Proposal(draft_ids_N=torch.arange(len(step["ids"])), confidence_N=scores,
                    parents_N=None if step["parents"] is None else tuple(step["parents"]))


def replay_request(row: dict, sched: StepScheduler | None, cost: CostModel, max_depth: int, width: int
                   ) -> tuple[float, int, int]:
    """One request replayed: ``sched`` None verifies every proposal whole. Returns (seconds, steps, plain steps)."""
    steps = row["steps"]
    t, seconds, num_steps, num_plain, last_call = 0, 0.0, 0, 0, -1
    if sched is not None:
        sched.reset()
    while t < len(steps):
        step = steps[t]
        pending = row["prompt_len"] + t + 1 if last_call < 0 else t - last_call
        drafted = sched is None or sched.plan(max_depth, pending=pending, width=width)
        proposal = _proposal(step) if drafted else Proposal.empty()
        num_drafted = proposal.num_proposed
        if sched is not None:
            proposal = sched.select(proposal, greedy=True)
        kept = proposal.draft_ids_N.tolist()
        accepted = 0
        for node in step["path"]:
            if node not in kept:
                break
            accepted += 1
        path = None if proposal.parents_N is None else [kept.index(n) for n in step["path"][:accepted]]
        propose_s = cost.propose_s + cost.flush_s * pending if drafted else None
        last_call = t if drafted else last_call
        forward_s = cost.forward_s(len(kept))
        overhead_s = cost.verify_overhead_s if kept else cost.plain_overhead_s
        step_s = forward_s + overhead_s + (propose_s or 0.0)
        if sched is not None:
            sched.observe(proposal, accepted, path, verify_s=forward_s, propose_s=propose_s, overhead_s=overhead_s,
                          num_committed=accepted + 1, step_s=step_s, num_drafted=num_drafted)
        seconds += step_s
        num_steps += 1
        num_plain += not kept
        t += accepted + 1
    return seconds, num_steps, num_plain


def replay_rows(rows: list[dict], make_scheduler: Callable[[], StepScheduler] | None, cost: CostModel,
                max_depth: int, width: int) -> dict[str, dict[str, float]]:
    """``rows`` replayed in order by one scheduler (None: fixed); per set: ``speedup`` (pooled target-only seconds
    / the method's), ``speedup_median`` (over prompts), ``frac_plain_steps``, ``tau`` (positions per step)."""
    sched = make_scheduler() if make_scheduler is not None else None
    per: dict[str, list[tuple[float, float, int, int, int]]] = {}
    for row in rows:
        seconds, num_steps, num_plain = replay_request(row, sched, cost, max_depth, width)
        base = len(row["steps"]) * cost.plain_step_s()
        per.setdefault(row["set"], []).append((base, seconds, num_steps, num_plain, len(row["steps"])))
    return {name: {"speedup": sum(r[0] for r in rs) / sum(r[1] for r in rs),
                   "speedup_median": statistics.median(r[0] / r[1] for r in rs),
                   "frac_plain_steps": sum(r[3] for r in rs) / sum(r[2] for r in rs),
                   "tau": sum(r[4] for r in rs) / sum(r[2] for r in rs)} for name, rs in per.items()}


def _parse_settings(settings: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``NAME=VALUE`` (a numeric StepScheduler attribute) and ``estimator.NAME=VALUE`` (an AcceptanceEstimator's) as
    two keyword dicts; values parsed as JSON. Raises ValueError for a malformed setting, a name neither class has, a
    value of the wrong type (an integer setting given a fraction, text) or out of range (negative; a decay above 1);
    ``probe_budget`` alone may be null (no budget)."""
    sched_kw: dict[str, Any] = {}
    est_kw: dict[str, Any] = {}
    for item in settings:
        if "=" not in item:
            raise ValueError(f"--set: expected NAME=VALUE, got {item!r}")
        name, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        target, cls = (est_kw, AcceptanceEstimator) if name.startswith("estimator.") else (sched_kw, StepScheduler)
        name = name.removeprefix("estimator.")
        default = cls.__dataclass_fields__[name].default if name in cls.__dataclass_fields__ else None
        if not isinstance(default, (int, float)) or isinstance(default, bool):  # curve, estimator: no default
            raise ValueError(f"--set: {cls.__name__} has no numeric setting {name!r}")
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        optional = name == "probe_budget"  # null turns the probe budget off
        if not (numeric or (optional and value is None)) or (type(default) is int and not isinstance(value, int)):
            raise ValueError(f"--set {item}: expected {'an integer' if type(default) is int else 'a number'}"
                             f"{' or null' if optional else ''}")
        if numeric and (value < 0 or (name.endswith("decay") and value > 1)):
            raise ValueError(f"--set {item}: expected a value >= 0{' and <= 1' if name.endswith('decay') else ''}")
        target[name] = value
    return sched_kw, est_kw


COST_FIELDS = ("plain_forward_s", "plain_overhead_s", "propose_s", "flush_s_per_position", "verify_excess_s",
               "verify_overhead_s")


def load_recording(path: str) -> dict:
    """A recording written by ``record``, checked whole: its cost model (finite numbers, a positive plain forward), the
    curve, and every record's set, prompt length and steps (each proposal's ids, parents (None: a chain; else each
    node's parent index, below its own), scores of the same length, and an accepted path of node indices that walks
    from the anchor down one node per depth). Raises ValueError naming the file and the record (its set and prompt) and
    step at fault, and FileNotFoundError."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); pass a recording of `schedule_replay.py record`") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a recording of `schedule_replay.py record`; record one first")
    missing = [k for k in ("curve", "costs", "records", "tree_width", "max_proposal_len") if k not in data]
    if missing:
        raise ValueError(f"{path}: not a recording of `schedule_replay.py record` (no {', '.join(missing)}); "
                         "record one first")
    costs = data["costs"]
    bad = [k for k in COST_FIELDS if not isinstance(costs.get(k), (int, float)) or not math.isfinite(costs[k])]
    if bad or costs["plain_forward_s"] <= 0:
        raise ValueError(f"{path}: costs: expected finite seconds for {', '.join(COST_FIELDS)} and a positive "
                         f"plain_forward_s; {', '.join(bad) or 'plain_forward_s'} is not")
    try:
        StepCostCurve.from_dict(data["curve"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: curve: {exc}") from None
    for key in ("tree_width", "max_proposal_len"):
        if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 1:
            raise ValueError(f"{path}: {key}: expected an integer >= 1, got {data[key]!r}")
    if not data["records"]:
        raise ValueError(f"{path}: records: empty; record at least one prompt")
    for r, row in enumerate(data["records"]):
        where = f"{path}: records[{r}]"
        if not isinstance(row, dict) or not all(k in row for k in ("set", "prompt_len", "steps")):
            raise ValueError(f"{where}: expected an object with set, prompt_len and steps")
        where += f" ({row['set']}, prompt {row.get('prompt', r)})"
        if not isinstance(row["prompt_len"], int) or row["prompt_len"] < 1 or not isinstance(row["steps"], list) \
                or not row["steps"]:
            raise ValueError(f"{where}: expected prompt_len >= 1 and at least one step (an answer of 2+ tokens)")
        for t, step in enumerate(row["steps"]):
            problem = _step_problem(step)
            if problem:
                raise ValueError(f"{where}, steps[{t}]: {problem}")
    return data


def _step_problem(step: Any) -> str | None:
    """What is wrong with one recorded proposal, or None."""
    if not isinstance(step, dict) or not all(k in step for k in ("ids", "parents", "scores", "path")):
        return "expected an object with ids, parents, scores and path"
    n, parents, path = len(step["ids"]), step["parents"], step["path"]
    if len(step["scores"]) != n:
        return f"scores: expected {n} (one per node), got {len(step['scores'])}"
    if any(c is not None and (not isinstance(c, (int, float)) or not 0 <= c <= 1) for c in step["scores"]):
        return "scores: expected each null (unscored) or a number in [0, 1]"
    if parents is not None and (len(parents) != n or any(not -1 <= p < i for i, p in enumerate(parents))):
        return "parents: expected one per node, each -1 (the anchor) or the index of an earlier node"
    if not isinstance(path, list) or any(not isinstance(i, int) or not 0 <= i < n for i in path):
        return f"path: expected node indices in 0..{n - 1}"
    for depth, node in enumerate(path):
        parent = (node - 1) if parents is None else parents[node]
        if parent != (path[depth - 1] if depth else -1):
            return f"path: node {node} is not a child of the path's previous node"
    return None


def replay(args: argparse.Namespace) -> dict:
    """The ``replay`` stage (module docstring); prints and returns ``{"per_set" | "mixed": {method: {set: row}}}``."""
    data = load_recording(args.record)
    curve = StepCostCurve.from_dict(data["curve"])
    cost = CostModel(curve, data["costs"], args.cost_scale)
    sched_kw, est_kw = _parse_settings(args.set)

    def make() -> StepScheduler:
        return StepScheduler(curve, estimator=AcceptanceEstimator(**est_kw), **sched_kw)

    width, depth = max(int(data["tree_width"]), 1), int(data["max_proposal_len"])
    rows = data["records"]
    sets = list(dict.fromkeys(r["set"] for r in rows))
    result: dict[str, dict] = {"per_set": {"fixed": {}, "auto": {}}}
    for name in sets:
        mine = [r for r in rows if r["set"] == name]
        result["per_set"]["fixed"].update(replay_rows(mine, None, cost, depth, width))
        result["per_set"]["auto"].update(replay_rows(mine, make, cost, depth, width))
    if args.mixed:
        runs = []
        for seed in range(args.orders):
            order = list(rows)
            random.Random(seed).shuffle(order)
            runs.append(replay_rows(order, make, cost, depth, width))
        result["mixed"] = {"auto": {name: {k: statistics.mean(run[name][k] for run in runs) for k in runs[0][name]}
                                        for name in sets}}
    print(f"replay of {args.record} ({data.get('dtype', 'dtype not recorded')}, {'chain' if width == 1 else f'tree of {width}'}, "
          f"cost scale {args.cost_scale}{', ' + ' '.join(args.set) if args.set else ''})")
    print(f"{'set':12} {'fixed':>7} {'auto':>7} {'median':>7} {'plain':>6} {'auto/best':>9}"
          + (f" {'mixed':>7} {'mixed/best':>10}" if args.mixed else ""))
    for name in sets:
        fixed, auto = result["per_set"]["fixed"][name], result["per_set"]["auto"][name]
        best = max(fixed["speedup"], 1.0)
        line = (f"{name:12} {fixed['speedup']:7.3f} {auto['speedup']:7.3f} {auto['speedup_median']:7.3f} "
                f"{auto['frac_plain_steps']:6.2f} {auto['speedup'] / best:9.3f}")
        if args.mixed:
            mixed = result["mixed"]["auto"][name]["speedup"]
            line += f" {mixed:7.3f} {mixed / best:10.3f}"
        print(line)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    r = sub.add_parser("record", help="record proposals, acceptance and the cost model", formatter_class=fmt)
    r.add_argument("--draft", required=True, help="a trained draft (deepspec train run folder or checkpoint)")
    r.add_argument("--target", default=EMBEDDED_DEFAULT, help="the target the draft was trained for")
    r.add_argument("--prompts", nargs="+", default=["gsm8k", "mt-bench"], help="benchmark names or NAME=FILE.jsonl")
    r.add_argument("--num-prompts", type=int, default=16, help="prompts per set")
    r.add_argument("--max-new-tokens", type=int, default=64, help="output tokens per prompt")
    r.add_argument("--tree-width", type=int, default=3, help="nodes per slot (1: chains)")
    r.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | auto (deepspec.device.resolve_dtype)")
    r.add_argument("--output", default="runs/replay/record.json", help="the recording (JSON)")
    s = sub.add_parser("replay", help="replay fixed and auto scheduling on a recording", formatter_class=fmt)
    s.add_argument("record", help="a recording written by the record stage")
    s.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a numeric StepScheduler attribute (estimator.NAME: AcceptanceEstimator's), e.g. probe_every=4; "
                        "repeat for several")
    s.add_argument("--cost-scale", type=float, default=1.0,
                   help="multiplies the draft call, flush, verify excess and bookkeeping of the recorded cost model")
    s.add_argument("--mixed", action="store_true", help="also replay every set's prompts shuffled into one stream")
    s.add_argument("--orders", type=int, default=6, help="shuffles the mixed stream is averaged over (--mixed)")
    args = p.parse_args(argv)
    try:
        if args.stage == "record":
            if args.num_prompts < 1 or args.max_new_tokens < 2 or args.tree_width < 1:
                r.error("--num-prompts >= 1, --max-new-tokens >= 2 and --tree-width >= 1 expected")
            return record(args)
        if not math.isfinite(args.cost_scale) or args.cost_scale <= 0 or args.orders < 1:
            s.error(f"expected a finite --cost-scale > 0 and --orders >= 1, got {args.cost_scale} and {args.orders}")
        return replay(args)
    except (ValueError, FileNotFoundError) as exc:
        (r if args.stage == "record" else s).error(str(exc))


if __name__ == "__main__":
    main()
