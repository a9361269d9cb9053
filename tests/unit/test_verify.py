"""Verify math on hand-made distributions (docs/design/decoding.md, "Sampling and verify"), against slow obvious rules.

Covers sampling filters (temperature, top-k, top-p); greedy acceptance; T > 0
acceptance ``min(1, p/q)`` with independent uniforms; the residual ``max(0, p - q)`` and its
fallback; ``q(x) = 0`` without NaN; the all-accepted prefix; a batch mixing greedy and sampling
rows; the EOS rule; proposers scoring their tokens with the exact distribution they sampled from;
the ``p = 0.01, q = 0.9`` acceptance rate.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepspec.decoding.verify import (
    SamplingParams,
    VerifyResult,
    accept_mask,
    accepted_prefix_len,
    accepted_prefix_lens,
    residual_distribution,
    sampling_probs,
    verify,
    verify_greedy,
    verify_sampling,
)

pytestmark = pytest.mark.usefixtures("one_thread")


V = 6
EOS = 5
T1 = SamplingParams(temperature=1.0)


def _onehot(ids: list[int], v: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float()


def _logits_for(ids: list[int], v: int = V) -> torch.Tensor:
    """Logits whose argmax per row is ``ids``."""
    return _onehot(ids, v) * 10.0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- SamplingParams
def test_sampling_params_validation_names_the_field():
    assert SamplingParams().greedy and not T1.greedy
    assert SamplingParams(temperature=0.0, top_k=5, top_p=0.5).greedy  # filters do not change greedy
    for kwargs, field in [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                          ({"temperature": float("inf")}, "temperature"), ({"top_k": -1}, "top_k"),
                          ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"), ({"top_p": 0.0}, "top_p"),
                          ({"top_p": 1.5}, "top_p"), ({"top_p": -0.2}, "top_p")]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**kwargs)
    with pytest.raises(TypeError):
        SamplingParams(0.7)  # keyword-only
    with pytest.raises(ValueError, match="temperature"):
        sampling_probs(torch.zeros(3), SamplingParams())


# ----------------------------------------------------------------------------- sampling_probs
def _slow_sampling_probs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The rules of SamplingParams written as plain Python loops over tokens (float64)."""
    z = [float(x) / params.temperature for x in logits_V.double()]
    keep = set(range(len(z)))
    if 0 < params.top_k < len(z):
        kth = sorted(z, reverse=True)[params.top_k - 1]
        keep = {i for i in keep if z[i] >= kth}  # ties with the k-th logit stay
    m = max(z[i] for i in keep)
    e = {i: math.exp(z[i] - m) for i in keep}
    probs = {i: e[i] / sum(e.values()) for i in keep}
    if params.top_p < 1.0:
        order = sorted(probs, key=lambda i: -probs[i])
        mass, kept = 0.0, []
        for i in order:  # smallest prefix with mass >= top_p
            kept.append(i)
            mass += probs[i]
            if mass >= params.top_p:
                break
        threshold = probs[kept[-1]]
        probs = {i: p for i, p in probs.items() if p >= threshold}  # ties with the last kept token stay
        total = sum(probs.values())
        probs = {i: p / total for i, p in probs.items()}
    return torch.tensor([probs.get(i, 0.0) for i in range(len(z))], dtype=torch.float64)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.6), SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.7), SamplingParams(temperature=0.8, top_k=5, top_p=0.6),
    SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0, top_k=50),
])
def test_sampling_probs_matches_slow_rules(params):
    logits_XV = torch.randn(4, 3, 10, generator=_gen(0)) * 2
    probs_XV = sampling_probs(logits_XV, params)
    assert probs_XV.dtype == torch.float32 and probs_XV.shape == logits_XV.shape
    torch.testing.assert_close(probs_XV.sum(-1), torch.ones(4, 3))
    for row_V, got_V in zip(logits_XV.reshape(-1, 10), probs_XV.reshape(-1, 10)):
        want_V = _slow_sampling_probs(row_V, params)
        assert torch.equal(got_V > 0, want_V > 0), (got_V, want_V)
        torch.testing.assert_close(got_V.double(), want_V, atol=1e-6, rtol=1e-5)


def test_sampling_probs_plain_temperature_and_dtypes():
    logits = torch.randn(3, V, generator=_gen(1)).to(torch.bfloat16)
    got = sampling_probs(logits, SamplingParams(temperature=0.7))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.softmax(logits.float() / 0.7, -1))


def test_top_k_and_top_p_boundaries():
    # top-k: keep the k most likely; every token tied with the k-th is kept (no tie broken by id)
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, 2.0])
    probs = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, False, True, True, False, True]
    probs = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert probs.tolist() == [1.0, 0, 0, 0, 0, 0]
    # top-p: the smallest most-likely set with mass >= top_p; always at least one token
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    for top_p, kept in [(0.5, 1), (0.50001, 2), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1e-9, 1)]:
        got = sampling_probs(p.log(), SamplingParams(temperature=1.0, top_p=top_p))
        assert int((got > 0).sum()) == kept, (top_p, got)
        torch.testing.assert_close(got[:kept], p[:kept] / p[:kept].sum())
    # top-p ties: tokens tied with the last kept one all stay
    got = sampling_probs(torch.tensor([0.4, 0.2, 0.2, 0.2]).log(), SamplingParams(temperature=1.0, top_p=0.5))
    assert (got > 0).all()
    # order: top-k first, then top-p on the renormalised top-k distribution
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    got = sampling_probs(p.log(), SamplingParams(temperature=1.0, top_k=2, top_p=0.55))
    assert (got > 0).tolist() == [True, False, False, False]  # 0.4/0.7 = 0.57 >= 0.55
    got = sampling_probs(p.log(), SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    assert (got > 0).tolist() == [True, True, False, False]


# ----------------------------------------------------------------------------- prefix / greedy
def test_accepted_prefix_len():
    assert accepted_prefix_len(torch.tensor([False, True, False, False])) == 0
    assert accepted_prefix_len(torch.tensor([True, True, False, True])) == 2
    assert accepted_prefix_len(torch.tensor([True, True, True])) == 3
    assert accepted_prefix_len(torch.tensor([], dtype=torch.bool)) == 0
    rows = torch.tensor([[False, True, False, False], [True, True, False, True], [True] * 4])
    assert accepted_prefix_lens(rows).tolist() == [0, 2, 4]


def test_greedy_accepts_matching_prefix_then_target_token():
    res = verify_greedy(torch.tensor([1, 2, 3]), _logits_for([1, 2, 4, 0]), eos_token_ids={EOS})
    assert res.num_accepted == 2 and res.committed == [1, 2, 4] and not res.hit_eos
    # a later match after a mismatch does not count ([T, F, T] -> 1)
    res = verify_greedy(torch.tensor([1, 2, 3]), _logits_for([1, 0, 3, 4]), eos_token_ids={EOS})
    assert res.num_accepted == 1 and res.committed == [1, 0]


def test_greedy_all_accepted_gives_bonus():
    res = verify_greedy(torch.tensor([1, 2]), _logits_for([1, 2, 3]), eos_token_ids={EOS})
    assert res.num_accepted == 2 and res.committed == [1, 2, 3]


def test_greedy_rejected_first_draft_gives_tau_one():
    res = verify_greedy(torch.tensor([1, 2, 3]), _logits_for([0, 2, 3, 4]), eos_token_ids={EOS})
    assert res.num_accepted == 0 and res.committed == [0]


def test_greedy_empty_proposal_is_plain_target_step():
    res = verify_greedy(torch.zeros(0, dtype=torch.long), _logits_for([3]), eos_token_ids={EOS})
    assert res.num_accepted == 0 and res.committed == [3]


# ----------------------------------------------------------------------------- EOS
def test_accepted_eos_ends_the_step():
    res = verify_greedy(torch.tensor([1, EOS, 2]), _logits_for([1, EOS, 2, 3]), eos_token_ids={EOS})
    assert res.hit_eos and res.committed == [1, EOS] and res.num_accepted == 2
    # sampling path too: p = q one-hot, everything accepted, the EOS still ends the step
    q = _onehot([1, EOS, 2])
    p = _onehot([1, EOS, 2, 3])
    res = verify_sampling(torch.tensor([1, EOS, 2]), q, p, generator=_gen(0), eos_token_ids={EOS})
    assert res.hit_eos and res.committed == [1, EOS] and res.num_accepted == 2
    # an EOS at the first draft: one token committed, no bonus
    res = verify(torch.tensor([EOS, 2]), None, _logits_for([EOS, 2, 3]), sampling=SamplingParams(),
                 generator=None, eos_token_ids={EOS})
    assert res == VerifyResult(num_accepted=1, committed=[EOS], hit_eos=True)


def test_rejected_eos_is_not_committed():
    # greedy: the EOS draft differs from the target argmax -> the target token replaces it
    res = verify_greedy(torch.tensor([1, EOS, 2]), _logits_for([1, 3, 2, 3]), eos_token_ids={EOS})
    assert not res.hit_eos and res.committed == [1, 3] and res.num_accepted == 1
    # sampling: p(EOS) = 0 at slot 2 -> rejected, the residual never gives EOS
    q = _onehot([1, EOS, 2])
    p = torch.full((4, V), 1.0 / (V - 1))
    p[:, EOS] = 0.0
    p[0] = _onehot([1])[0]
    for seed in range(10):
        res = verify_sampling(torch.tensor([1, EOS, 2]), q, p, generator=_gen(seed), eos_token_ids={EOS})
        assert res.num_accepted == 1 and len(res.committed) == 2 and EOS not in res.committed and not res.hit_eos


def test_sampled_eos_bonus_sets_hit_eos():
    res = verify_greedy(torch.tensor([1]), _logits_for([1, EOS]), eos_token_ids={EOS})
    assert res.hit_eos and res.committed == [1, EOS] and res.num_accepted == 1


# ----------------------------------------------------------------------------- T > 0 acceptance
def test_acceptance_uses_one_independent_uniform_per_draft_in_order():
    """Replaying the generator: draft i is accepted iff u_i < p(d_i)/q(d_i), u = torch.rand(N) drawn
    first; the count is the all-accepted prefix; then one residual draw at the first rejection."""
    drafts = torch.tensor([0, 1, 2, 3])
    q = torch.full((4, V), 0.1)
    q[torch.arange(4), drafts] = 0.5
    p = torch.full((5, V), 0.1)
    ratios = torch.tensor([0.9, 0.5, 0.2, 0.7])  # p(d_i)/q(d_i)
    p[torch.arange(4), drafts] = ratios * 0.5
    p = p / p.sum(-1, keepdim=True)
    ratios = p[torch.arange(4), drafts] / 0.5
    seen = set()
    for seed in range(40):
        res = verify_sampling(drafts, q, p, generator=_gen(seed), eos_token_ids=set())
        replay = _gen(seed)
        u = torch.rand(4, generator=replay)
        want = accepted_prefix_len(u < ratios)
        assert res.num_accepted == want and res.committed[:want] == drafts[:want].tolist()
        extra = torch.multinomial(residual_distribution(p[want], q[want]) if want < 4 else p[4], 1, generator=replay)
        assert res.committed[want] == int(extra)
        seen.add(want)
    assert len(seen) >= 3  # the seeds exercise several prefix lengths


def test_accept_mask_is_min_one_p_over_q_without_division():
    p = torch.tensor([0.2, 0.2, 0.0, 0.3, 0.0, 0.5])
    q = torch.tensor([0.4, 0.4, 0.0, 0.0, 0.6, 0.5])
    u = torch.tensor([0.49, 0.51, 0.0, 0.99, 0.0, 0.999])
    # 0.49 < 0.5 accept; 0.51 > 0.5 reject; p = q = 0 reject; q = 0 < p accept; p = 0 reject; p = q accept
    assert accept_mask(p, q, u).tolist() == [True, False, False, True, False, True]


def test_zero_draft_prob_with_positive_target_prob_is_accepted_no_nan():
    q = torch.zeros(1, V)
    q[0, 3] = 1.0  # the draft "sampled" token 2 with q = 0 (e.g. after top-k rounding)
    p = torch.full((2, V), 1.0 / V)
    gen = _gen(0)
    for _ in range(50):
        res = verify_sampling(torch.tensor([2]), q, p, generator=gen, eos_token_ids={EOS})
        assert res.num_accepted == 1 and res.committed[0] == 2
        assert all(0 <= t < V for t in res.committed)


def test_zero_draft_and_target_prob_rejects_and_residual_is_finite():
    q = torch.zeros(1, V)
    q[0, 3] = 1.0
    p = torch.full((2, V), 0.25)
    p[0, 2] = p[0, 3] = 0.0  # the draft token 2 has p = q = 0
    gen = _gen(0)
    for _ in range(50):
        res = verify_sampling(torch.tensor([2]), q, p, generator=gen, eos_token_ids=set())
        assert res.num_accepted == 0 and res.committed[0] in (0, 1, 4, 5)
    r = residual_distribution(p[0], q[0])
    assert torch.isfinite(r).all() and torch.allclose(r, p[0])


def test_zero_target_prob_rejects_and_residual_avoids_token():
    q = _onehot([2])
    p = torch.full((2, V), 0.25)
    p[0, 2] = 0.0
    p[0, 3] = 0.0
    gen = _gen(1)
    for _ in range(50):
        res = verify_sampling(torch.tensor([2]), q, p, generator=gen, eos_token_ids=set())
        assert res.num_accepted == 0 and res.committed[0] not in (2, 3)


def test_p_equals_q_onehot_accepts_all_and_residual_is_valid():
    q = _onehot([1, 2, 3])
    p = _onehot([1, 2, 3, 4])
    gen = _gen(0)
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


def test_target_p_goes_through_the_same_filters():
    """verify's p is sampling_probs(target logits): a draft outside the target's top-k is always
    rejected and the replacement always lies inside the target's top-k."""
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0, 0.0], [0.0] * V])
    q = torch.full((1, V), 1.0 / V)
    params = SamplingParams(temperature=1.0, top_k=2)
    for seed in range(30):
        res = verify(torch.tensor([3]), q, logits, sampling=params, generator=_gen(seed), eos_token_ids=set())
        assert res.num_accepted == 0 and res.committed[0] in (0, 1)
    # without the filter p(3) > 0 and the same draft is sometimes accepted
    accepted = sum(verify(torch.tensor([3]), q, logits, sampling=T1, generator=_gen(s), eos_token_ids=set()).num_accepted
                   for s in range(300))
    assert accepted > 0


def test_acceptance_probability_p_over_q():
    """p(d) = 0.01, q(d) = 0.9: accepted with probability 0.01/0.9 ~ 1.11 %, over 20,000 seeded
    trials of the whole verify step (binomial bound, 4 standard deviations)."""
    expected = 0.01 / 0.9
    trials = 20000
    q = torch.full((1, V), 0.1 / (V - 1))
    q[0, 0] = 0.9
    p = torch.full((V,), 0.99 / (V - 1))
    p[0] = 0.01
    logits = torch.stack([p, p]).log()  # sampling_probs at T = 1 gives back p
    gen = _gen(1234)
    accepted = sum(verify(torch.tensor([0]), q, logits, sampling=T1, generator=gen, eos_token_ids=set()).num_accepted
                   for _ in range(trials))
    sd = math.sqrt(expected * (1 - expected) / trials)
    assert abs(accepted / trials - expected) < 4 * sd, accepted / trials
    # the vectorised rule agrees
    u = torch.rand(trials, generator=gen)
    frac = accept_mask(torch.full((trials,), 0.01), torch.full((trials,), 0.9), u).float().mean().item()
    assert abs(frac - expected) < 4 * sd


def test_rejection_sampling_reproduces_target_distribution():
    """The committed first token is distributed as p whatever q is (the lossless property)."""
    p = torch.softmax(torch.randn(V, generator=_gen(0)), 0)
    q = torch.softmax(torch.randn(V, generator=_gen(1)), 0)
    gen = _gen(7)
    trials = 3000
    counts = torch.zeros(V)
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=gen))
        res = verify_sampling(torch.tensor([d]), q[None], torch.stack([p, p]), generator=gen, eos_token_ids=set())
        counts[res.committed[0]] += 1
    freq = counts / trials
    assert torch.all((freq - p).abs() < 4 * torch.sqrt(p * (1 - p) / trials) + 1e-3)


def test_verify_dispatch_and_errors():
    logits = _logits_for([1, 2]).to(torch.bfloat16)
    res = verify(torch.tensor([1]), None, logits, sampling=SamplingParams(), generator=None, eos_token_ids={EOS})
    assert res.committed == [1, 2]
    res = verify(torch.zeros(0, dtype=torch.long), None, _logits_for([3]) * 10, sampling=T1,
                 generator=_gen(0), eos_token_ids={EOS})
    assert res.committed == [3] and res.num_accepted == 0
    with pytest.raises(ValueError, match="sampling"):
        verify(torch.tensor([1]), None, logits, sampling=1.0, generator=None, eos_token_ids={EOS})
    with pytest.raises(ValueError, match="draft_probs_NV"):
        verify(torch.tensor([1]), None, logits, sampling=T1, generator=None, eos_token_ids={EOS})
    with pytest.raises(ValueError, match="N\\+1"):
        verify_greedy(torch.tensor([1, 2]), logits, eos_token_ids={EOS})


# ----------------------------------------------------------------------------- proposers
def _check_proposal(proposal, logits_rows, params, seed):
    """draft_probs_NV is sampling_probs of the very logits the proposer computed, zero outside the
    top-k set, the sampled token has q > 0, and replaying the generator on those rows draws the
    same tokens (sampled from and scored with the same tensor)."""
    n = proposal.num_proposed
    assert n == len(logits_rows) and n > 0
    q_NV = proposal.draft_probs_NV
    logits_NV = torch.stack([row.float() for row in logits_rows])
    assert q_NV.dtype == torch.float32
    assert torch.equal(q_NV, sampling_probs(logits_NV, params))
    topk_NV = torch.zeros_like(q_NV, dtype=torch.bool).scatter_(1, logits_NV.topk(params.top_k, -1).indices, True)
    assert (q_NV[~topk_NV] == 0).all() and ((q_NV > 0).sum(-1) <= params.top_k).all()
    assert (q_NV.gather(1, proposal.draft_ids_N[:, None]) > 0).all()
    replay = _gen(seed)
    assert [int(torch.multinomial(q, 1, generator=replay)) for q in q_NV] == proposal.draft_ids_N.tolist()


def _recording(obj, name, pick):
    """Wrap the bound method ``obj.name`` to record ``pick(output)`` of each call."""
    seen, inner = [], getattr(obj, name)

    def wrapper(*args, **kwargs):
        out = inner(*args, **kwargs)
        seen.append(pick(out).detach().clone())
        return out

    setattr(obj, name, wrapper)
    return seen


def test_dspark_proposer_samples_and_scores_with_the_same_filtered_probs():
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from tests.unit.test_dspark import batch, capture, make_draft

    target, draft = make_draft("llama")
    ids, _ = batch(B=1, S=20)
    feats, _ = capture(target, ids)
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.95)
    prop = DSparkProposer(draft)
    prop.extend_context(feats[0, :12], ids[0, :12].tolist())
    seen = _recording(draft, "slot_step", lambda out: out[0])
    proposal = prop.propose(int(ids[0, 12]), 12, sampling=params, generator=_gen(3))
    _check_proposal(proposal, seen, params, seed=3)


def test_eagle3_proposer_samples_and_scores_with_the_same_filtered_probs():
    from deepspec.algorithms.eagle3.proposer import Eagle3Proposer
    from tests.unit.test_dspark import batch, tiny_target
    from tests.unit.test_eagle3 import features, make_draft

    target = tiny_target("llama")
    draft = make_draft(target, steps=5)
    ids, _ = batch(B=1, S=20)
    feats, _ = features(target, ids)
    params = SamplingParams(temperature=1.1, top_k=3)
    prop = Eagle3Proposer(draft)
    prop.extend_context(feats[0, :12], ids[0, :12].tolist())
    seen = _recording(draft, "logits", lambda out: out.reshape(-1))
    proposal = prop.propose(int(ids[0, 12]), 12, sampling=params, generator=_gen(4))
    _check_proposal(proposal, seen, params, seed=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_tokens_pick_the_first_of_tied_maxima_in_every_dtype(dtype):
    """The greedy rule, checked against a slow one: the first index holding the row's largest value, ties
    included (bfloat16 ties often: 8 bits of mantissa), and the verify that reads it."""
    from deepspec.target.decoding import greedy_tokens

    g = torch.Generator().manual_seed(0)
    logits_NV = (torch.randn(6, 4099, generator=g) * 3).to(dtype)
    logits_NV[1, 17] = logits_NV[1, 4000] = logits_NV[1].max() + 1  # an exact tie: the first wins
    logits_NV[2, :] = 0.0  # all tied: index 0
    slow = [max(range(row.numel()), key=lambda i, r=row.tolist(): (r[i], -i)) for row in logits_NV]
    got = greedy_tokens(logits_NV)
    assert got.dtype == torch.int64 and got.tolist() == slow
    assert got[1] == 17 and got[2] == 0
    assert greedy_tokens(logits_NV[3]).item() == slow[3]
    drafts_N = torch.tensor(slow[:3])  # the target's own choices for rows 0..2: accepted, then row 3's token
    res = verify_greedy(drafts_N, logits_NV[:4], eos_token_ids=())
    assert res.num_accepted == 3 and res.committed == [*slow[:3], slow[3]]
