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
    with pytest.raises(ValueError, match="no setting 'probe_evry'"):
        bench._parse_settings(["probe_evry=4"])
    with pytest.raises(ValueError, match="NAME=VALUE"):
        bench._parse_settings(["probe_every"])


def test_a_file_that_is_not_a_recording_is_refused_by_name(bench, tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text('{"results": {}}')
    with pytest.raises(SystemExit):
        bench.main(["replay", str(path)])
    assert f"{path}: not a recording" in capsys.readouterr().err
