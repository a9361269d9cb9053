"""Verify math on hand-made distributions (DESIGN.md s.6), against slow obvious rules."""

from __future__ import annotations

import math

import pytest
import torch

from deepspec.eval.verify import (
    accept_mask,
    accepted_prefix_len,
    residual_distribution,
    target_probs,
    verify,
    verify_greedy,
    verify_sampling,
)



pytestmark = pytest.mark.usefixtures("one_thread")


V = 6
EOS = 5


def _onehot(ids: list[int], v: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float()


def _logits_for(ids: list[int], v: int = V) -> torch.Tensor:
    """Logits whose argmax per row is ``ids``."""
    return _onehot(ids, v) * 10.0


def test_accepted_prefix_len():
    assert accepted_prefix_len(torch.tensor([False, True, False, False])) == 0
    assert accepted_prefix_len(torch.tensor([True, True, False, True])) == 2
    assert accepted_prefix_len(torch.tensor([True, True, True])) == 3
    assert accepted_prefix_len(torch.tensor([], dtype=torch.bool)) == 0


def test_greedy_accepts_matching_prefix_then_target_token():
    res = verify_greedy(torch.tensor([1, 2, 3]), _logits_for([1, 2, 4, 0]), eos_token_ids={EOS})
    assert res.num_accepted == 2 and res.committed == [1, 2, 4] and not res.hit_eos


def test_greedy_all_accepted_gives_bonus():
    res = verify_greedy(torch.tensor([1, 2]), _logits_for([1, 2, 3]), eos_token_ids={EOS})
    assert res.num_accepted == 2 and res.committed == [1, 2, 3]


def test_greedy_rejected_first_draft_gives_tau_one():
    res = verify_greedy(torch.tensor([1, 2, 3]), _logits_for([0, 2, 3, 4]), eos_token_ids={EOS})
    assert res.num_accepted == 0 and res.committed == [0]
    assert res.num_accepted + 1 == 1


def test_greedy_empty_proposal_is_plain_target_step():
    res = verify_greedy(torch.zeros(0, dtype=torch.long), _logits_for([3]), eos_token_ids={EOS})
    assert res.num_accepted == 0 and res.committed == [3]


def test_accepted_eos_ends_the_step():
    res = verify_greedy(torch.tensor([1, EOS, 2]), _logits_for([1, EOS, 2, 3]), eos_token_ids={EOS})
    assert res.hit_eos and res.committed == [1, EOS] and res.num_accepted == 2
    # sampling path too: p = q one-hot, everything accepted, the EOS still ends the step
    q = _onehot([1, EOS, 2])
    p = _onehot([1, EOS, 2, 3])
    res = verify_sampling(torch.tensor([1, EOS, 2]), q, p, generator=torch.Generator().manual_seed(0), eos_token_ids={EOS})
    assert res.hit_eos and res.committed == [1, EOS] and res.committed[-1] == EOS


def test_sampled_eos_bonus_sets_hit_eos():
    res = verify_greedy(torch.tensor([1]), _logits_for([1, EOS]), eos_token_ids={EOS})
    assert res.hit_eos and res.committed == [1, EOS] and res.num_accepted == 1


def test_zero_draft_prob_with_positive_target_prob_is_accepted_no_nan():
    q = torch.zeros(1, V)
    q[0, 3] = 1.0  # the draft "sampled" token 2 with q = 0 (e.g. after top-k rounding)
    p = torch.full((2, V), 1.0 / V)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        res = verify_sampling(torch.tensor([2]), q, p, generator=gen, eos_token_ids={EOS})
        assert res.num_accepted == 1 and res.committed[0] == 2
        assert all(0 <= t < V for t in res.committed)


def test_zero_target_prob_rejects_and_residual_avoids_token():
    q = _onehot([2])
    p = torch.full((2, V), 0.25)
    p[0, 2] = 0.0
    p[0, 3] = 0.0
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        res = verify_sampling(torch.tensor([2]), q, p, generator=gen, eos_token_ids=set())
        assert res.num_accepted == 0 and res.committed[0] not in (2, 3)


def test_p_equals_q_onehot_accepts_all_and_residual_is_valid():
    q = _onehot([1, 2, 3])
    p = _onehot([1, 2, 3, 4])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        res = verify_sampling(torch.tensor([1, 2, 3]), q, p, generator=gen, eos_token_ids={EOS})
        assert res.num_accepted == 3 and res.committed == [1, 2, 3, 4]
    r = residual_distribution(p[0], q[0])
    assert torch.isfinite(r).all() and math.isclose(float(r.sum()), 1.0, rel_tol=1e-6)
    assert torch.equal(r, p[0])  # mass 0 -> falls back to p


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    r = residual_distribution(p, q)
    expected = torch.tensor([0.4, 0.0, 0.1, 0.0]) / 0.5
    assert torch.allclose(r, expected)


def test_residual_fallback_when_mass_zero():
    p = torch.tensor([0.2, 0.8, 0.0])
    q = torch.tensor([0.5, 0.9, 0.1])  # q >= p everywhere
    r = residual_distribution(p, q)
    assert torch.allclose(r, p)


def test_acceptance_probability_p_over_q():
    """p(d) = 0.01, q(d) = 0.9: accepted with probability 0.01/0.9 ~ 1.11 %.

    20000 independent trials of the acceptance rule (vectorised), then 2000 through the whole
    verify_sampling step (slower per trial) with a proportionally wider tolerance."""
    expected = 0.01 / 0.9
    trials = 20000
    gen = torch.Generator().manual_seed(1234)
    u = torch.rand(trials, generator=gen)
    frac = accept_mask(torch.full((trials,), 0.01), torch.full((trials,), 0.9), u).float().mean().item()
    assert abs(frac - expected) < 4 * math.sqrt(expected * (1 - expected) / trials)

    q = torch.full((1, V), 0.1 / (V - 1))
    q[0, 0] = 0.9
    p = torch.full((V,), 0.99 / (V - 1))
    p[0] = 0.01
    trials = 2000
    accepted = sum(
        verify_sampling(torch.tensor([0]), q, torch.stack([p, p]), generator=gen, eos_token_ids=set()).num_accepted
        for _ in range(trials)
    )
    assert abs(accepted / trials - expected) < 4 * math.sqrt(expected * (1 - expected) / trials) + 1e-3


def test_rejection_sampling_reproduces_target_distribution():
    """The committed first token is distributed as p whatever q is (the lossless property)."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(V), 0)
    q = torch.softmax(torch.randn(V), 0)
    gen = torch.Generator().manual_seed(7)
    trials = 3000
    counts = torch.zeros(V)
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=gen))
        res = verify_sampling(torch.tensor([d]), q[None], torch.stack([p, p]), generator=gen, eos_token_ids=set())
        counts[res.committed[0]] += 1
    freq = counts / trials
    assert torch.all((freq - p).abs() < 4 * torch.sqrt(p * (1 - p) / trials) + 1e-3)


def test_verify_dispatch_and_target_probs_fp32():
    logits = _logits_for([1, 2]).to(torch.bfloat16)
    assert target_probs(logits, 0.7).dtype == torch.float32
    res = verify(torch.tensor([1]), None, logits, temperature=0.0, generator=None, eos_token_ids={EOS})
    assert res.committed == [1, 2]
    res = verify(torch.zeros(0, dtype=torch.long), None, _logits_for([3]) * 10, temperature=1.0,
                 generator=torch.Generator().manual_seed(0), eos_token_ids={EOS})
    assert res.committed == [3] and res.num_accepted == 0
    with pytest.raises(ValueError, match="temperature"):
        verify(torch.tensor([1]), None, logits, temperature=-1.0, generator=None, eos_token_ids={EOS})
    with pytest.raises(ValueError, match="draft_probs_NV"):
        verify(torch.tensor([1]), None, logits, temperature=1.0, generator=None, eos_token_ids={EOS})
    with pytest.raises(ValueError, match="N\\+1"):
        verify_greedy(torch.tensor([1, 2]), logits, eos_token_ids={EOS})
