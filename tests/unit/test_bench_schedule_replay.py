"""bench/schedule_replay.py: the recorded acceptance is the engine's, and the replay prices steps as modelled."""

import pytest
import torch

from deepspec.algorithms.protocol import Proposal
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.schedule import StepCostCurve
from tests.helpers import load_bench_module
from tests.unit.test_engine import LAYER_IDS, PROMPT, VOCAB, OracleProposer, hf_greedy, target  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench():
    return load_bench_module("schedule_replay")


def test_accepted_path_walks_the_matching_nodes(bench):
    assert bench.accepted_path([5, 6, 7], None, [5, 6, 9, 1]) == [0, 1]
    assert bench.accepted_path([5, 6, 7], None, [4, 6, 7]) == []
    assert bench.accepted_path([5, 6], None, [5]) == [0]  # the answer ends before the chain
    # a tree: the anchor's children 5 and 8, 5's child 6, 8's children 2 and 3
    tree_ids, parents = [5, 8, 6, 2, 3], [-1, -1, 0, 1, 1]
    assert bench.accepted_path(tree_ids, parents, [8, 3, 0]) == [1, 4]  # through the second choice
    assert bench.accepted_path(tree_ids, parents, [5, 6, 0]) == [0, 2]
    assert bench.accepted_path(tree_ids, parents, [6, 5]) == []  # the right tokens at the wrong depths


class FlakyOracle(OracleProposer):
    """The target's own continuation, wrong at slot ``pos % 3`` on every other position."""

    def _propose(self, anchor_token, anchor_pos, sampling, generator):
        ids = super()._propose(anchor_token, anchor_pos, sampling, generator).draft_ids_N.clone()
        slot = anchor_pos % 3
        if anchor_pos % 2 == 0 and slot < len(ids):
            ids[slot] = (ids[slot] + 1) % VOCAB
        return Proposal(draft_ids_N=ids, draft_probs_NV=torch.nn.functional.one_hot(ids, VOCAB).float())


def test_recorded_acceptance_is_what_the_engine_accepts(bench, target):  # noqa: F811
    seq = PROMPT + hf_greedy(target, PROMPT, 24, 1)
    res = SpeculativeEngine(target, LAYER_IDS, FlakyOracle(32, seq), [1], schedule="fixed").generate(
        PROMPT, max_new_tokens=24)
    [row] = bench.record_set(target, LAYER_IDS, FlakyOracle(32, seq), [PROMPT], [res.output_ids])
    assert row["prompt_len"] == len(PROMPT) and len(row["steps"]) == len(res.output_ids) - 1
    position, accepted = 0, []
    for step in res.steps:  # each engine step verified the proposal recorded at the position it started from
        assert len(row["steps"][position]["path"]) == step.num_accepted
        accepted.append(step.num_accepted)
        position += step.num_committed
    assert len(set(accepted)) > 1  # the check met more than one outcome


def _recording(accepted: int, num_prompts: int = 4, length: int = 40) -> tuple[list[dict], StepCostCurve, dict]:
    """Chains of 3 accepted ``accepted`` deep at every position; a plain step of 10 ms, verifying 3 nodes +1 ms, a
    draft call 1 ms."""
    step = {"ids": [0, 1, 2], "parents": None, "scores": [None] * 3, "path": list(range(accepted))}
    rows = [{"set": "s", "prompt": i, "prompt_len": 8, "steps": [step] * length} for i in range(num_prompts)]
    curve = StepCostCurve((1, 4), (0.010, 0.011))
    costs = {"plain_forward_s": 0.010, "plain_overhead_s": 0.0, "propose_s": 0.001, "flush_s_per_position": 0.0,
             "verify_excess_s": 0.0, "verify_overhead_s": 0.0}
    return rows, curve, costs


def test_replay_prices_fixed_steps_by_the_cost_model(bench):
    rows, curve, costs = _recording(accepted=3)
    cost = bench.CostModel(curve, costs)
    [(name, fixed)] = bench.replay_rows(rows, None, cost, max_depth=3, width=1).items()
    # 40 positions, 4 committed a step: 10 steps of 10 + 1 + 1 ms against 40 plain steps of 10 ms
    assert fixed["speedup"] == pytest.approx(400 / 120) and fixed["tau"] == pytest.approx(4.0)
    assert fixed["frac_plain_steps"] == 0.0
    doubled = bench.replay_rows(rows, None, bench.CostModel(curve, costs, scale=2.0), max_depth=3, width=1)
    assert doubled[name]["speedup"] == pytest.approx(400 / 130)  # the draft call doubled, the target's curve not


@pytest.mark.parametrize("accepted", [3, 0])
def test_replayed_scheduler_drafts_where_it_pays_and_not_where_it_does_not(bench, accepted):
    rows, curve, costs = _recording(accepted)
    cost = bench.CostModel(curve, costs)
    fixed = bench.replay_rows(rows, None, cost, max_depth=3, width=1)["s"]
    auto = bench.replay_rows(rows, lambda: bench.StepScheduler(curve), cost, max_depth=3, width=1)["s"]
    if accepted:
        assert auto["frac_plain_steps"] == 0.0 and auto["speedup"] == pytest.approx(fixed["speedup"])
    else:
        assert fixed["speedup"] < 0.9  # every verify rejected: 12 ms a token against 10
        assert auto["frac_plain_steps"] > 0.8 and auto["speedup"] > 0.97


def test_settings_name_scheduler_and_estimator_attributes(bench):
    assert bench._parse_settings(["probe_every=4", "estimator.request_strength=5.5", "probe_budget=null"]) == (
        {"probe_every": 4, "probe_budget": None}, {"request_strength": 5.5})
    with pytest.raises(ValueError, match="no numeric setting 'probe_evry'"):
        bench._parse_settings(["probe_evry=4"])
    with pytest.raises(ValueError, match="NAME=VALUE"):
        bench._parse_settings(["probe_every"])
    for bad, why in [("probe_every=abc", "an integer"), ("probe_every=1.5", "an integer"),
                     ("probe_every=-1", ">= 0"), ("estimator.decay=2", "<= 1"), ("rate_decay=null", "a number")]:
        with pytest.raises(ValueError, match=why):
            bench._parse_settings([bad])


def _write_recording(path, rows, curve, costs):
    import json

    path.write_text(json.dumps({"curve": curve.to_dict(), "costs": costs, "records": rows, "tree_width": 1,
                                "max_proposal_len": 3}))
    return str(path)


def test_a_recording_is_checked_whole_and_its_faults_named_by_record_and_step(bench, tmp_path):
    rows, curve, costs = _recording(accepted=2, num_prompts=2, length=10)
    good = _write_recording(tmp_path / "good.json", rows, curve, costs)
    assert len(bench.load_recording(good)["records"]) == 2
    faults = [
        (lambda r: r[1]["steps"][7].update(path=[0, 2]), r"records\[1\] \(s, prompt 1\), steps\[7\]: path: node 2"),
        (lambda r: r[0]["steps"][9].update(scores=[None]), r"records\[0\] \(s, prompt 0\), steps\[9\]: scores"),
        (lambda r: r[0]["steps"][3].update(parents=[-1, 5, 1]), r"steps\[3\]: parents"),
        (lambda r: r[1]["steps"].__setitem__(4, None), r"steps\[4\]: expected an object"),
        (lambda r: r[0].update(steps=[]), r"records\[0\] \(s, prompt 0\): expected prompt_len >= 1 and at least"),
    ]
    for i, (breaking, message) in enumerate(faults):
        broken = [dict(r, steps=[dict(s) for s in r["steps"]]) for r in rows]  # a step late in the file counts too
        breaking(broken)
        with pytest.raises(ValueError, match=message):
            bench.load_recording(_write_recording(tmp_path / f"bad{i}.json", broken, curve, costs))
    with pytest.raises(ValueError, match="costs: .* plain_forward_s"):
        bench.load_recording(_write_recording(tmp_path / "cost.json", rows, curve, dict(costs, plain_forward_s=0)))
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(ValueError, match="text.json: not JSON"):
        bench.load_recording(str(tmp_path / "text.json"))


def test_a_file_that_is_not_a_recording_is_refused_by_name(bench, tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text('{"results": {}}')
    with pytest.raises(SystemExit):
        bench.main(["replay", str(path)])
    assert f"{path}: not a recording" in capsys.readouterr().err
