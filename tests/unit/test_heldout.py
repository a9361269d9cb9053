"""Held-out greedy tau by replay (deepspec.train.heldout) equals the engine's, step for step."""

from __future__ import annotations

import pytest
import torch

from deepspec.algorithms.dspark.proposer import DSparkProposer
from deepspec.algorithms.eagle3.proposer import Eagle3Proposer
from deepspec.algorithms.protocol import NullProposer, Proposal
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.engine import StepRecord
from deepspec.eval.metrics import calibration_pairs
from deepspec.models.calibration import fit_calibration
from deepspec.train.heldout import (HeldoutReference, heldout_calibration, heldout_tau, make_reference,
                                    replay_greedy)
from tests.unit.test_dspark import LAYER_IDS, make_draft
from tests.unit.test_eagle3 import make_draft as make_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 1


class PlannedProposer(NullProposer):  # its no-op prepare, reset and extend_context
    """Knows the target's greedy output; proposes ``anchor_pos % (K + 1)`` right tokens, then a wrong one."""

    def __init__(self, full: list[int], k: int = 4):
        self.full, self.max_proposal_len = full, k

    def propose(self, anchor_token, anchor_pos, *, sampling, generator):
        right = anchor_pos % (self.max_proposal_len + 1)
        ids = self.full[anchor_pos + 1: anchor_pos + 1 + right]
        if len(ids) < self.max_proposal_len:
            ids = ids + [(self.full[anchor_pos + 1 + len(ids)] + 1) % 50 + 2 if anchor_pos + 1 + len(ids) < len(self.full)
                         else 3]
        return Proposal(draft_ids_N=torch.tensor(ids, dtype=torch.long))


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [("bench-a", "p0", [0] + torch.randint(2, 60, (9,), generator=g).tolist()),
            ("bench-b", "p1", [0] + torch.randint(2, 60, (14,), generator=g).tolist())]


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "planned"])
def test_replay_equals_engine(kind):
    target, draft = make_draft()
    with torch.no_grad():  # sharpen the random target: no near-ties between the two feature paths
        target.lm_head.weight.mul_(8.0)
    target.requires_grad_(False)
    max_new = 20
    refs = make_reference(target, _prompts(), LAYER_IDS, [EOS], max_new_tokens=max_new, block_size=8)
    for ref in refs:
        full = ref.prompt_ids + ref.output_ids
        if kind == "dspark":
            proposer = DSparkProposer(draft)
        elif kind == "eagle3":
            proposer = Eagle3Proposer(make_eagle3(target), k=4)
        else:
            proposer = PlannedProposer(full)
        engine = SpeculativeEngine(target, LAYER_IDS, proposer, [EOS])
        got = engine.generate(ref.prompt_ids, max_new_tokens=max_new)
        base = SpeculativeEngine(target, LAYER_IDS, NullProposer(), [EOS]).generate(ref.prompt_ids,
                                                                                    max_new_tokens=max_new)
        assert got.output_ids == base.output_ids == ref.output_ids[:len(got.output_ids)]
        replay = replay_greedy(proposer, ref, max_new_tokens=max_new, eos_token_ids=[EOS])
        assert replay.accepted == [s.num_accepted for s in got.steps]
        assert replay.committed == [s.num_committed for s in got.steps]
        # the step records the calibration fit reads are the engine's (DSpark: with the head's confidences)
        assert [(s.num_proposed, s.num_accepted, s.num_committed) for s in replay.steps] == [
            (s.num_proposed, s.num_accepted, s.num_committed) for s in got.steps]
        if kind == "dspark":
            assert [len(s.confidence) for s in replay.steps] == [len(s.confidence) for s in got.steps]
            assert [c for s in replay.steps for c in s.confidence] == pytest.approx(
                [c for s in got.steps for c in s.confidence], abs=1e-5)
        else:
            assert all(s.confidence is None for s in replay.steps)
        assert replay.num_output_tokens == len(got.output_ids)
        if kind == "planned":
            assert sum(replay.accepted) > 0  # the comparison covers accepted drafts, not only rejections


def test_heldout_tau_pools_steps_per_benchmark():
    target, _ = make_draft()
    refs = make_reference(target, _prompts(), LAYER_IDS, [EOS], max_new_tokens=12, block_size=4)
    result = heldout_tau(PlannedProposer(refs[0].prompt_ids + refs[0].output_ids), refs[:1], max_new_tokens=12,
                         eos_token_ids=[EOS])
    steps = replay_greedy(PlannedProposer(refs[0].prompt_ids + refs[0].output_ids), refs[0], max_new_tokens=12,
                          eos_token_ids=[EOS]).accepted
    assert result["heldout_tau"] == pytest.approx(1 + sum(steps) / len(steps))  # no step ends at an EOS here
    assert result["heldout_tau_bench-a"] == result["heldout_tau"]
    # a reference cut (no EOS) before max_new_tokens + K tokens cannot check the last proposals
    short = HeldoutReference("bench-a", "cut", [0, 5, 6], [7, 8, 9], torch.zeros(6, refs[0].target_hidden_TF.shape[1]))
    with pytest.raises(ValueError, match="needs 104"):
        replay_greedy(PlannedProposer([0, 5, 6, 7, 8, 9]), short, max_new_tokens=100, eos_token_ids=[EOS])


def test_a_step_that_ends_at_an_accepted_eos_counts_what_it_committed():
    """The draft proposes the reference's last 5 tokens, the fifth an EOS: the step commits 5 tokens (no bonus
    token after the EOS), and held-out tau is 5.0 as eval's, not accepted + 1 = 6.0."""
    class Oracle(PlannedProposer):
        def propose(self, anchor_token, anchor_pos, *, sampling, generator):
            return Proposal(draft_ids_N=torch.tensor(self.full[anchor_pos + 1: anchor_pos + 1 + self.max_proposal_len]))

    prompt, out = [0, 5, 6], [7, 8, 9, 10, 11, EOS]  # 7 from the prefill, then one step: 8 9 10 11 EOS
    ref = HeldoutReference("bench-a", "eos", prompt, out, torch.zeros(len(prompt) + len(out), 4))
    replay = replay_greedy(Oracle(prompt + out, k=7), ref, max_new_tokens=20, eos_token_ids=[EOS])
    assert (replay.accepted, replay.committed, replay.num_output_tokens) == ([5], [5], 6)
    assert replay.tau == 5.0
    assert heldout_tau(Oracle(prompt + out, k=7), [ref], max_new_tokens=20, eos_token_ids=[EOS])["heldout_tau"] == 5.0


def test_the_curve_reference_target_runs_in_the_caches_capture_dtype():
    """A cache captured in bfloat16 (``deepspec cache --dtype bfloat16``) gets its held-out reference from a
    bf16 copy of the target; a float32 cache and online data (no capture record) use the target itself."""
    from types import SimpleNamespace

    from deepspec.train.heldout import capture_target

    target = torch.nn.Linear(4, 4)
    bf16 = capture_target(target, SimpleNamespace(manifest={"capture": {"device": "cpu", "dtype": "bfloat16"}}))
    assert bf16 is not target and bf16.weight.dtype == torch.bfloat16 and target.weight.dtype == torch.float32
    assert torch.equal(bf16.weight, target.weight.to(torch.bfloat16))
    assert capture_target(target, SimpleNamespace(manifest={"capture": {"dtype": "float32"}})) is target
    assert capture_target(target, SimpleNamespace(manifest={"format": "online"})) is target
    assert capture_target(target, SimpleNamespace(manifest={}), torch.device("cpu")) is target


def test_the_curve_reference_target_goes_to_the_training_device(monkeypatch):
    """The reference runs where the draft trains (a GPU), not on the host the cache mode loaded it on."""
    from types import SimpleNamespace

    import deepspec.train.heldout as heldout

    seen = []
    monkeypatch.setattr(heldout, "cast_for_decoding", lambda m, dtype, device=None, **kw: seen.append((dtype, device)) or m)
    target = torch.nn.Linear(4, 4)
    heldout.capture_target(target, SimpleNamespace(manifest={"capture": {"dtype": "bfloat16"}}), torch.device("cuda", 0))
    heldout.capture_target(target, SimpleNamespace(manifest={}), torch.device("cuda", 0))
    assert seen == [(torch.bfloat16, torch.device("cuda", 0)), (torch.float32, torch.device("cuda", 0))]


def test_heldout_calibration_fits_the_eval_pairs_of_the_replayed_steps():
    """The fit reads the eval's calibration pairs (slots up to the first rejection), raw confidences."""
    import random

    rng = random.Random(0)
    steps = []
    for _ in range(300):
        conf = tuple(rng.uniform(0.3, 0.95) for _ in range(3))
        accepted = 0
        while accepted < 3 and rng.random() < conf[accepted] ** 3:  # overconfident
            accepted += 1
        steps.append(StepRecord(num_proposed=3, num_accepted=accepted, num_committed=accepted + 1, time_s=0.0,
                                confidence=conf))
    figures, cal = heldout_calibration(steps + [StepRecord(num_proposed=0, num_accepted=0, num_committed=1,
                                                           time_s=0.0)])
    pairs = calibration_pairs(steps)
    assert figures["heldout_conf_pairs"] == len(pairs)
    assert (cal.per_depth, cal.pooled) == (fit_calibration(pairs).per_depth, fit_calibration(pairs).pooled)
    assert cal.info["num_pairs"] == len(pairs) and cal.info["num_steps"] == 300
    assert figures["heldout_conf_ece_calibrated"] < figures["heldout_conf_ece"] / 2
    assert figures["heldout_conf_mean"] > figures["heldout_conf_accept_rate"]
    assert heldout_calibration([StepRecord(num_proposed=2, num_accepted=1, num_committed=2, time_s=0.0)]) == ({}, None)
