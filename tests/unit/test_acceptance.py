"""Pooled training-time acceptance estimates (deepspec.models.acceptance) against obvious loops."""

import math

import torch

from deepspec.algorithms.dspark.loss import dspark_loss
from deepspec.models.acceptance import AcceptanceCounts, chain_acceptance, tau_from_counts
from tests.unit.test_loss import K, lm_head_fixture, make_batch, make_config


def _runs(runs: list[int], k: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Chains whose leading-accepted runs are ``runs`` (every slot supervised)."""
    match = torch.zeros(len(runs), k, dtype=torch.bool)
    for x, r in enumerate(runs):
        match[x, :r] = True
        if r + 1 < k:
            match[x, r + 1:] = torch.rand(k - r - 1) < 0.5  # slots after the first miss do not count
    return torch.ones(len(runs), k, dtype=torch.bool), match


def test_issue_example_is_grouping_invariant():
    torch.manual_seed(0)
    valid, match = _runs([3, 2, 1, 0])
    whole = chain_acceptance(valid, match, None)
    assert math.isclose(whole.greedy_tau(), 2.5)
    for groups in ([[0, 2], [1, 3]], [[0, 1], [2, 3]], [[0], [1], [2], [3]]):
        total = AcceptanceCounts.zeros(7)
        for g in groups:
            total = total + chain_acceptance(valid[g], match[g], None)
        assert math.isclose(total.greedy_tau(), 2.5), groups


def test_matches_slow_loop():
    g = torch.Generator().manual_seed(1)
    X, k = 40, 6
    valid = torch.rand(X, k, generator=g) < 0.9
    match = torch.rand(X, k, generator=g) < 0.6
    prob = torch.rand(X, k, generator=g)
    got = chain_acceptance(valid, match, prob)
    count = [0.0] * k
    greedy = [0.0] * k
    soft = [0.0] * k
    for x in range(X):
        alive, p = True, 1.0
        for j in range(k):
            if not valid[x, j]:
                break  # supervision stops at the first invalid slot
            count[j] += 1
            alive = alive and bool(match[x, j])
            greedy[j] += float(alive)
            p *= float(prob[x, j])
            soft[j] += p
    assert torch.allclose(got.count_K, torch.tensor(count, dtype=torch.float64))
    assert torch.allclose(got.greedy_survive_K, torch.tensor(greedy, dtype=torch.float64))
    assert torch.allclose(got.survive_K, torch.tensor(soft, dtype=torch.float64), atol=1e-6)
    tau = 1.0
    for s, n in zip(greedy, count):
        if n == 0:
            break
        tau += s / n
    assert math.isclose(got.greedy_tau(), tau)


def test_tau_never_nan_and_pack_roundtrip():
    assert tau_from_counts(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)) == 1.0
    valid, match = _runs([2, 5])
    a = chain_acceptance(valid, match, None)
    assert torch.equal(AcceptanceCounts.unpack(a.pack()).pack(), a.pack())


def test_dspark_loss_counts_add_up_over_micro_batches():
    """Splitting a batch in two gives counts whose sum is the whole batch's, so the trainer's pooled
    tau does not depend on the micro-batching."""
    from deepspec.algorithms.dspark.model import DraftTrainOutput

    cfg, head = make_config(), lm_head_fixture()
    ids, lm, ap, valid, out, tlh = make_batch()
    whole = dspark_loss(out, ids, lm, ap, valid, tlh, head, cfg).acceptance
    parts = AcceptanceCounts.zeros(K)
    for b in range(ids.shape[0]):
        o = DraftTrainOutput(out.logits_BAKV[b:b + 1], out.confidence_logits_BAK[b:b + 1], out.hidden_BAKD[b:b + 1])
        parts = parts + dspark_loss(o, ids[b:b + 1], lm[b:b + 1], ap[b:b + 1], valid[b:b + 1], tlh[b:b + 1], head,
                                    cfg).acceptance
    assert torch.allclose(whole.pack(), parts.pack())
    assert 1.0 <= whole.tau() <= K + 1 and 1.0 <= whole.greedy_tau() <= K + 1
