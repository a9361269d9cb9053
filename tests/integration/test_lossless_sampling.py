"""Lossless speculative sampling at T > 0, shown with chi-square tests (docs/design/decoding.md).

Rejection sampling (Leviathan et al. 2023, Alg. 1 and Theorem 3.5; Chen et al. 2023, Alg. 2) makes
every committed token follow the target's distribution whatever the draft proposes. Here:

- verify level (pure, no model): the first committed token follows ``p_0`` and, when a step commits
  two or more tokens, the second follows ``p_1`` (with and without top-k / top-p);
- engine level: a tiny random fp32 Llama target (V = 12) through the real ``SpeculativeEngine``
  with a random bigram proposer whose ``q`` differs from the target's ``p``; the joint distribution
  of output tokens 1 and 2 (token 1 comes from the prefill, token 2 is the first token a verify
  step commits) and the marginal of token 3 match the target's own, computed exactly from its
  logits over every 1- and 2-token continuation, with and without top-k / top-p;
- the same on a tiny random Gemma 3 target (sliding-window layers of window 2 beside a global one,
  scaled embeddings, final-logit soft-capping at 3) with an untrained DSpark draft of it: the
  prefill's and every verify step's logits must be soft-capped as the model's own forward;
- draft trees at T > 0 (``verify_tree``: the walk follows the target's own draws): the committed
  sequence of a fixed tree follows the target exactly (verify level), and DSpark's trees, alone and
  with prompt lookup's match beside them, keep the engine's output the target's (engine level);
- the step scheduler (``deepspec.decoding.schedule``) choosing each step's length, for chains cut on
  per-slot scores, trees and lookup: the output is the target's; a cut that reads the drawn token fails;
- reduced draft vocabularies (DSpark chains, Eagle3 chains and trees, ``d2t``): the tokens out of the
  draft's reach still get their target probability;
- power: a deliberately broken acceptance rule (always accept, or no residual) fails the same test,
  and so does an engine whose prefill drops the soft-capping, a tree verified with either broken
  rule, a tree walk that takes the argmax at T > 0, and an engine that verifies with the target's or
  the draft's row of the next position (chains, trees, lookup, a reduced vocabulary).

The p-values come from the chi-square distribution (cells with expected count < 5 pooled); a
token with target probability 0 (filtered out) must never appear. Everything is seeded.
"""

from __future__ import annotations

import pytest
import torch

import deepspec.decoding.verify as verify_mod
from deepspec.algorithms.protocol import DraftTree, Proposal, draw_token
from deepspec.decoding.verify import SamplingParams, sampling_probs, verify, verify_tree

pytestmark = pytest.mark.usefixtures("one_thread")

V = 12
PROMPT = [0, 3, 7, 5]
PASS_P = 1e-3   # a correct sampler passes (seeded: deterministic; by chance it fails 0.1 % of seeds)
FAIL_P = 1e-6   # a broken rule must be rejected at least this strongly

PLAIN = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)


def chi_square_pvalue(counts_V: torch.Tensor, probs_V: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of ``counts`` to ``probs`` (float64 p-value).

    Cells with probability 0 must be empty (else 0.0 is returned: the sampler produced an
    impossible token); cells with expected count < 5 are pooled into one cell.
    """
    counts = counts_V.double()
    probs = probs_V.double() / probs_V.double().sum()
    n = counts.sum()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * n
    big = expected >= 5
    obs_cells = torch.cat([counts[big], counts[~big & (probs > 0)].sum().view(1)])
    exp_cells = torch.cat([expected[big], expected[~big & (probs > 0)].sum().view(1)])
    if float(exp_cells[-1]) == 0:
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    dof = obs_cells.numel() - 1
    assert dof >= 1, "too few cells for a chi-square test"
    chi2 = ((obs_cells - exp_cells) ** 2 / exp_cells).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2))


def test_chi_square_pvalue_sanity():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert chi_square_pvalue(torch.tensor([500.0, 300, 200, 0]), p) > 0.99
    assert chi_square_pvalue(torch.tensor([300.0, 300, 400, 0]), p) < 1e-10
    assert chi_square_pvalue(torch.tensor([500.0, 300, 199, 1]), p) == 0.0
    # chi2 = 1 on 1 dof: p-value = P(X > 1) = 0.3173; chi2 = 4: 0.0455
    assert chi_square_pvalue(torch.tensor([55.0, 45]), torch.tensor([0.5, 0.5])) == pytest.approx(0.3173, abs=1e-4)
    assert chi_square_pvalue(torch.tensor([60.0, 40]), torch.tensor([0.5, 0.5])) == pytest.approx(0.0455, abs=1e-4)


# ----------------------------------------------------------------------------- verify level
def _verify_level_counts(params: SamplingParams, trials: int, seed: int):
    """Counts of the first committed token, and of the second when a step commits >= 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    target_logits_N1V = torch.randn(3, V, generator=g) * 1.5
    draft_logits_NV = torch.randn(2, V, generator=g) * 1.5  # q unrelated to p
    q_NV = sampling_probs(draft_logits_NV, params)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(trials):
        ids_N = torch.cat([torch.multinomial(q, 1, generator=g) for q in q_NV])
        res = verify(ids_N, q_NV, target_logits_N1V, sampling=params, generator=g, eos_token_ids=())
        first[res.committed[0]] += 1
        if len(res.committed) >= 2:
            second[res.committed[1]] += 1
    p_N1V = sampling_probs(target_logits_N1V, params)
    return first, second, p_N1V, q_NV


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_verify_level_committed_tokens_follow_target(params):
    first, second, p_N1V, q_NV = _verify_level_counts(params, trials=4000, seed=1)
    assert second.sum() > 500
    assert chi_square_pvalue(first, p_N1V[0]) > PASS_P
    assert chi_square_pvalue(second, p_N1V[1]) > PASS_P
    assert chi_square_pvalue(first, q_NV[0]) < FAIL_P  # the test can tell p from q


def _always_accept(p, q, u):
    return torch.ones_like(p, dtype=torch.bool)


def _residual_is_p(p_V, q_V):
    return p_V.float() / p_V.float().sum()


BROKEN_RULES = {"always_accept": ("accept_mask", _always_accept),
                "no_residual": ("residual_distribution", _residual_is_p)}


@pytest.mark.parametrize("broken", sorted(BROKEN_RULES))
def test_verify_level_broken_rule_is_rejected(monkeypatch, broken):
    monkeypatch.setattr(verify_mod, *BROKEN_RULES[broken])
    first, _, p_N1V, _ = _verify_level_counts(PLAIN, trials=2000, seed=1)
    assert chi_square_pvalue(first, p_N1V[0]) < FAIL_P


# a fixed tree over V tokens: the anchor's children 1 and 2; node 0 (token 1) has child 3 (node 2)
TREE_IDS, TREE_PARENTS = torch.tensor([1, 2, 3]), (-1, -1, 0)


def _exact_tree_commits(p_N1V: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Every committed sequence of one tree step and its probability, when each token the walk meets is a
    draw from the target row of the node it stands at (rows: anchor, node 0, node 1, node 2)."""
    p = p_N1V.double()
    out: dict[tuple[int, ...], float] = {}
    for y1 in range(V):
        if y1 == 1:
            for y2 in range(V):
                if y2 == 3:
                    for y3 in range(V):
                        out[(1, 3, y3)] = float(p[0, 1] * p[1, 3] * p[3, y3])
                else:
                    out[(1, y2)] = float(p[0, 1] * p[1, y2])
        elif y1 == 2:
            for y2 in range(V):
                out[(2, y2)] = float(p[0, 2] * p[2, y2])
        else:
            out[(y1,)] = float(p[0, y1])
    return out


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_verify_level_tree_commits_follow_target(params):
    g = torch.Generator().manual_seed(3)
    logits_N1V = torch.randn(4, V, generator=g) * 1.5
    logits_N1V[0, 1] += 2.0  # the branch through node 0 and node 2 is walked often
    logits_N1V[1, 3] += 2.0
    exact = _exact_tree_commits(sampling_probs(logits_N1V, params))
    cells = {seq: i for i, seq in enumerate(exact)}
    counts = torch.zeros(len(cells))
    for _ in range(6000):
        res, path = verify_tree(TREE_IDS, TREE_PARENTS, logits_N1V, sampling=params, generator=g, eos_token_ids=())
        assert [TREE_IDS[i] for i in path] == res.committed[:-1] and res.num_accepted == len(path)
        counts[cells[tuple(res.committed)]] += 1
    assert sum(counts[i] for seq, i in cells.items() if len(seq) == 3) > 100  # the deepest path is walked
    probs = torch.tensor(list(exact.values()))
    assert chi_square_pvalue(counts, probs) > PASS_P


def _sampled_chain_tree_counts(params: SamplingParams, trials: int):
    """Counts of the first committed token and of (first, second) pairs over ``trials`` steps of the tree of
    :func:`test_verify_level_tree_with_a_sampled_chain_follows_target`; with p0 and the rows after each first token."""
    g = torch.Generator().manual_seed(4)
    logits0_V = torch.randn(V, generator=g) * 1.5
    logits1_VV = torch.randn(V, V, generator=g) * 1.5  # the target's row after each first token
    q0_V = sampling_probs(torch.randn(V, generator=g) * 1.5, params)
    q1_VV = sampling_probs(torch.randn(V, V, generator=g) * 1.5, params)
    score_V = torch.randn(V, generator=g)
    first, pairs = torch.zeros(V), torch.zeros(V, V)
    for _ in range(trials):
        s = int(torch.multinomial(q0_V, 1, generator=g))
        d = int(score_V.masked_fill(torch.arange(V) == s, float("-inf")).argmax())
        s2 = int(torch.multinomial(q1_VV[s], 1, generator=g))
        ids = torch.tensor([s, d, s2, (d + 1) % V])
        probs = torch.zeros(4, V)
        probs[0], probs[2] = q0_V, q1_VV[s]
        probs[1, d] = probs[3, (d + 1) % V] = 1.0
        rows = torch.stack([logits0_V, logits1_VV[s], logits1_VV[d], logits0_V, logits0_V])
        res, _ = verify_tree(ids, (-1, -1, 0, 1), rows, draft_probs_NV=probs, sampling=params, generator=g,
                             eos_token_ids=())
        first[res.committed[0]] += 1
        if len(res.committed) >= 2:
            pairs[res.committed[0], res.committed[1]] += 1
    return first, pairs, sampling_probs(logits0_V, params), sampling_probs(logits1_VV, params)


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_verify_level_tree_with_a_sampled_chain_follows_target(params):
    """A tree as DSpark builds it at T > 0: under the anchor, s ~ q0 first, then d, the best other token by a
    fixed score (chosen after s, so it depends on s); under s, s2 ~ q1[s]; under d, a chosen child. The first
    committed token follows p0 and, where a second is committed, it follows the target row of the first."""
    first, pairs, p0_V, p1_VV = _sampled_chain_tree_counts(params, trials=6000)
    assert pairs.sum() > 300
    assert chi_square_pvalue(first, p0_V) > PASS_P
    expected = pairs.sum(1, keepdim=True) * p1_VV  # second | first
    assert chi_square_pvalue(pairs.flatten(), (expected / expected.sum()).flatten()) > PASS_P


@pytest.mark.parametrize("broken", sorted(BROKEN_RULES))
def test_verify_level_tree_with_a_broken_rule_is_rejected(monkeypatch, broken):
    monkeypatch.setattr(verify_mod, *BROKEN_RULES[broken])
    first, _, p0_V, _ = _sampled_chain_tree_counts(PLAIN, trials=3000)
    assert chi_square_pvalue(first, p0_V) < FAIL_P


def _lookup_beside_a_sampled_draft_first_tokens(draft_first: bool, trials: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First committed tokens over 3 tokens, p = (.5, .25, .25): a draft token s ~ q = (.5, .5, 0) and a
    lookup's chosen token 0 beside it, the draft's node first (DraftTree's order), or the match first with
    a sampled copy of it dropped (the order that is not exact: rejected, the copy would change the residual)."""
    g = torch.Generator().manual_seed(5)
    p_V, q_V = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.5, 0.5, 0.0])
    logits_N1V = p_V.log().expand(3, 3)
    first = torch.zeros(3)
    for _ in range(trials):
        s = int(torch.multinomial(q_V, 1, generator=g))
        if draft_first:
            tree = DraftTree()
            tree.add(-1, s, q_V)
            tree.add_path([0])
            prop = tree.to_proposal()
            ids, probs = prop.draft_ids_N, prop.draft_probs_NV
        else:  # the match first; a sampled copy of it merged away
            ids = torch.tensor([0] if s == 0 else [0, s])
            probs = torch.stack([torch.tensor([1.0, 0, 0])] + ([q_V] if s else []))
        res, _ = verify_tree(ids, (-1,) * len(ids), logits_N1V[: len(ids) + 1], draft_probs_NV=probs,
                             sampling=PLAIN, generator=g, eos_token_ids=())
        first[res.committed[0]] += 1
    return first, p_V


def test_verify_level_lookup_beside_a_sampled_draft_follows_target():
    first, p_V = _lookup_beside_a_sampled_draft_first_tokens(draft_first=True, trials=6000)
    assert chi_square_pvalue(first, p_V) > PASS_P
    first, p_V = _lookup_beside_a_sampled_draft_first_tokens(draft_first=False, trials=6000)
    assert chi_square_pvalue(first, p_V) < FAIL_P  # the other order is biased: (.5, .375, .125)


def test_verify_level_tree_walk_by_argmax_is_rejected():
    """The same test rejects a walk that takes the argmax at T > 0 (greedy verify under sampling)."""
    g = torch.Generator().manual_seed(3)
    logits_N1V = torch.randn(4, V, generator=g) * 1.5
    exact = _exact_tree_commits(sampling_probs(logits_N1V, PLAIN))
    cells = {seq: i for i, seq in enumerate(exact)}
    counts = torch.zeros(len(cells))
    for _ in range(2000):
        res, _ = verify_tree(TREE_IDS, TREE_PARENTS, logits_N1V, generator=g, eos_token_ids=())  # greedy
        counts[cells[tuple(res.committed)]] += 1
    assert chi_square_pvalue(counts, torch.tensor(list(exact.values()))) < FAIL_P


# ----------------------------------------------------------------------------- engine level
@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=None,
                      pad_token_id=0)
    model = LlamaForCausalLM(cfg).float().eval().requires_grad_(False)
    with torch.no_grad():  # spread the random logits: distributions far from uniform, and from q
        model.lm_head.weight.mul_(6.0)
    return model


@pytest.fixture(scope="module")
def gemma3_target():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
                           sliding_window=2, layer_types=["sliding_attention", "full_attention"],
                           final_logit_softcapping=3.0, tie_word_embeddings=False, max_position_embeddings=32,
                           bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).float().eval().requires_grad_(False)
    with torch.no_grad():  # logits far beyond the cap before capping: the cap changes p visibly
        model.lm_head.weight.mul_(60.0)
    return model


def untrained_dspark_proposer(model, seed: int = 3, tree_width: int = 1):
    """An untrained DSpark drafter of ``model`` (target layer 0's features, full vocabulary)."""
    from deepspec.algorithms.dspark.config import draft_config_from_target
    from deepspec.algorithms.dspark.model import DSparkDraftModel
    from deepspec.algorithms.dspark.proposer import DSparkProposer

    cfg = draft_config_from_target(model.config, num_draft_layers=1, target_layer_ids=[0], mask_token_id=V - 1,
                                   block_size=3, markov_rank=4)
    torch.manual_seed(seed)
    return DSparkProposer(DSparkDraftModel.from_target(model, cfg).eval(), max_positions=32, tree_width=tree_width)


def untrained_eagle3_proposer(model, seed: int = 3, tree_width: int = 1, d2t: torch.Tensor | None = None):
    """An untrained Eagle3 drafter of ``model`` (target layer 0's features, 3 steps); ``d2t``: its reduced
    vocabulary (None: the full one)."""
    from deepspec.algorithms.eagle3.config import eagle3_config_from_target
    from deepspec.algorithms.eagle3.model import Eagle3DraftModel
    from deepspec.algorithms.eagle3.proposer import Eagle3Proposer

    cfg = eagle3_config_from_target(model.config, target_layer_ids=[0], ttt_steps=3,
                                    draft_vocab_size=None if d2t is None else int(d2t.numel()))
    torch.manual_seed(seed)
    draft = Eagle3DraftModel.from_target(model, cfg, d2t=d2t).eval()
    return Eagle3Proposer(draft, max_positions=32, tree_width=tree_width)


def reduced_vocab_eagle3_proposer(model, seed: int = 3, tree_width: int = 1):
    """An untrained Eagle3 drafter proposing from 6 of the 12 target tokens, its head scaled so that each
    step's ``q`` is peaked and differs from the next step's (an untrained one is near uniform)."""
    proposer = untrained_eagle3_proposer(model, seed, tree_width, d2t=torch.tensor([1, 2, 4, 6, 8, 9]))
    with torch.no_grad():
        proposer.model.lm_head.weight.mul_(10.0)
    return proposer


class BigramProposer:
    """An untrained stand-in drafter: slot logits are a fixed random table row of the previous token
    (the anchor, then the token just drafted), so ``q`` has nothing to do with the target's ``p``.
    Tokens come from ``draw_token`` (the proposers' own helper: ``q = sampling_probs(logits)``,
    sampled from and returned)."""

    max_proposal_len = 2

    def __init__(self, seed: int):
        self.table_VV = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 2.0

    def prepare(self, num_positions):
        pass

    def reset(self):
        pass

    def extend_context(self, target_hidden_TF, token_ids_T):
        pass

    def propose(self, anchor_token, anchor_pos, *, sampling, generator):
        prev, ids, probs = int(anchor_token), [], []
        for _ in range(self.max_proposal_len):
            tok, q_V = draw_token(self.table_VV[prev], sampling, generator)
            ids.append(tok)
            probs.append(q_V)
            prev = int(tok)
        return Proposal(draft_ids_N=torch.cat(ids), draft_probs_NV=None if sampling.greedy else torch.stack(probs))


@torch.no_grad()
def exact_target_distributions(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-only sampling after PROMPT, from the target's own logits over all V first tokens and all
    V*V first-two-token continuations (float64): the joint ``[V, V]`` of output tokens 1 and 2, and
    the marginal ``[V]`` of output token 3."""
    prompt = torch.tensor(PROMPT)
    p0_V = sampling_probs(model(prompt[None]).logits[0, -1], params).double()
    a = torch.arange(V)
    seq1 = torch.cat([prompt.expand(V, -1), a[:, None]], 1)
    p1_VV = sampling_probs(model(seq1).logits[:, -1], params).double()  # [a, b]
    seq2 = torch.cat([prompt.expand(V * V, -1), a.repeat_interleave(V)[:, None], a.repeat(V)[:, None]], 1)
    p2_VVV = sampling_probs(model(seq2).logits[:, -1], params).double().view(V, V, V)  # [a, b, c]
    return p0_V[:, None] * p1_VV, torch.einsum("a,ab,abc->c", p0_V, p1_VV, p2_VVV)


def engine_samples(model, params: SamplingParams, trials: int, seed: int, max_new_tokens: int = 3, proposer=None,
                   schedule="fixed", sizes: list[int] | None = None):
    """Over ``trials`` seeded generations: counts ``[V, V]`` of output tokens (1, 2), counts ``[V]``
    of output token 3 (zeros when ``max_new_tokens < 3``), and the number of drafts accepted by the
    first verify step. ``proposer`` defaults to :class:`BigramProposer`; ``schedule`` goes to the engine;
    ``sizes`` (a list) receives every step's verified draft nodes."""
    from deepspec.decoding.engine import SpeculativeEngine

    engine = SpeculativeEngine(model, [0], proposer or BigramProposer(seed=5), [V + 1], schedule=schedule)
    g = torch.Generator().manual_seed(seed)
    joint_VV, third_V = torch.zeros(V, V), torch.zeros(V)
    accepted = 0
    for _ in range(trials):
        res = engine.generate(PROMPT, max_new_tokens=max_new_tokens, sampling=params, generator=g)
        out = res.output_ids
        joint_VV[out[0], out[1]] += 1
        if max_new_tokens >= 3:
            third_V[out[2]] += 1
        accepted += res.steps[0].num_accepted
        if sizes is not None:
            sizes.extend(s.num_nodes_verified for s in res.steps)
    return joint_VV, third_V, accepted


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_engine_sampling_follows_target_distribution(target, params):
    joint_VV, third_V = exact_target_distributions(target, params)
    trials = 1200
    counts_VV, counts_V, accepted = engine_samples(target, params, trials, seed=0)
    assert 0.05 * trials < accepted < 1.9 * trials  # drafts are accepted and rejected
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_gemma3_engine_sampling_follows_target_distribution(gemma3_target, params):
    joint_VV, third_V = exact_target_distributions(gemma3_target, params)
    trials = 1200
    counts_VV, counts_V, accepted = engine_samples(gemma3_target, params, trials, seed=0,
                                                   proposer=untrained_dspark_proposer(gemma3_target))
    assert 0.05 * trials < accepted < 1.9 * trials  # drafts are accepted and rejected
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


def test_gemma3_engine_without_soft_capping_is_rejected(gemma3_target, monkeypatch):
    import deepspec.decoding.engine as engine_mod

    monkeypatch.setattr(engine_mod, "target_logits", lambda model, h: model.get_output_embeddings()(h))
    joint_VV, _ = exact_target_distributions(gemma3_target, PLAIN)
    counts_VV, _, _ = engine_samples(gemma3_target, PLAIN, trials=1200, seed=0, max_new_tokens=2)
    assert chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten()) < FAIL_P


@pytest.mark.parametrize("broken", sorted(BROKEN_RULES))
def test_engine_broken_acceptance_rule_is_rejected(target, monkeypatch, broken):
    monkeypatch.setattr(verify_mod, *BROKEN_RULES[broken])
    joint_VV, _ = exact_target_distributions(target, PLAIN)
    counts_VV, _, _ = engine_samples(target, PLAIN, trials=1200, seed=0, max_new_tokens=2)
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    assert p_joint < FAIL_P, p_joint



def reduced_vocab_dspark_proposer(model, seed: int = 3):
    """An untrained DSpark drafter (target layer 0's features) proposing from 6 of the 12 target tokens."""
    from deepspec.algorithms.dspark.config import draft_config_from_target
    from deepspec.algorithms.dspark.model import DSparkDraftModel
    from deepspec.algorithms.dspark.proposer import DSparkProposer

    d2t = torch.tensor([1, 2, 4, 6, 8, 9])
    cfg = draft_config_from_target(model.config, num_draft_layers=1, target_layer_ids=[0], mask_token_id=V - 1,
                                   block_size=3, markov_rank=4, draft_vocab_size=int(d2t.numel()))
    torch.manual_seed(seed)
    draft = DSparkDraftModel.from_target(model, cfg, d2t=d2t)
    torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=1.0)
    return DSparkProposer(draft)


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_reduced_vocab_dspark_sampling_follows_target_distribution(target, params):
    """Half the target's tokens are out of the draft's reach (q = 0 there): the residual max(0, p - q)
    must still give them their target probability."""
    joint_VV, third_V = exact_target_distributions(target, params)
    trials = 1200
    counts_VV, counts_V, accepted = engine_samples(target, params, trials, seed=0,
                                                   proposer=reduced_vocab_dspark_proposer(target))
    assert 0.05 * trials < accepted
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


@pytest.mark.parametrize(("params", "tree_width"), [(PLAIN, 1), (FILTERED, 3)], ids=["plain-chain", "topk_topp-tree3"])
def test_reduced_vocab_eagle3_sampling_follows_target_distribution(target, params, tree_width):
    """Eagle3 at T > 0 with a reduced vocabulary (``d2t``: 6 of the 12 target tokens), chains and trees:
    the tokens out of the draft's reach get their target probability from the residual."""
    joint_VV, third_V = exact_target_distributions(target, params)
    trials = 1200
    proposer = reduced_vocab_eagle3_proposer(target, tree_width=tree_width)
    counts_VV, counts_V, accepted = engine_samples(target, params, trials, seed=9, proposer=proposer)
    assert 0.05 * trials < accepted < 2.9 * trials  # drafts are accepted and rejected
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


def _next_row(rows_XV: torch.Tensor) -> torch.Tensor:
    """Row i replaced by row i + 1 (the last row kept): each position reads the next position's distribution."""
    return torch.cat([rows_XV[1:], rows_XV[-1:]]) if rows_XV.shape[0] > 1 else rows_XV


def shift_verify_rows(monkeypatch, which: str) -> None:
    """Make the engine verify every step with ``which`` ("target" or "draft") distribution off by one
    position (:func:`_next_row`), chains and trees alike; a draft without rows (chosen nodes) gets its
    point masses shifted."""
    import deepspec.decoding.engine as engine_mod

    def shifted(ids_N, probs_NV, logits_N1V):
        if which == "target":
            return probs_NV, _next_row(logits_N1V)
        if probs_NV is None:
            probs_NV = torch.nn.functional.one_hot(ids_N, logits_N1V.shape[-1]).float()
        return _next_row(probs_NV), logits_N1V

    def chain(ids_N, probs_NV, logits_N1V, **kwargs):
        return verify_mod.verify(ids_N, *shifted(ids_N, probs_NV, logits_N1V), **kwargs)

    def tree(ids_N, parents_N, logits_N1V, *, draft_probs_NV=None, **kwargs):
        probs_NV, logits_N1V = shifted(ids_N, draft_probs_NV, logits_N1V)
        return verify_mod.verify_tree(ids_N, parents_N, logits_N1V, draft_probs_NV=probs_NV, **kwargs)

    monkeypatch.setattr(engine_mod, "verify", chain)
    monkeypatch.setattr(engine_mod, "verify_tree", tree)


def _shift_proposers(target):
    """The proposals the shifted-row power test runs: chains, trees, lookup and a reduced vocabulary."""
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    def spread_dspark_tree():  # an untrained DSpark's q is close to p: its bigram bias spread makes them differ
        proposer = untrained_dspark_proposer(target, tree_width=3)
        torch.manual_seed(11)
        torch.nn.init.normal_(proposer.model.markov_head.markov_w2.weight, std=1.0)
        return proposer

    return {
        "chain": lambda: BigramProposer(seed=5),
        "tree": spread_dspark_tree,
        "lookup": lambda: LookupFirstProposer(untrained_dspark_proposer(target), vocab_size=V, ngram_max=2,
                                              ngram_min=1),
        "reduced_vocab": lambda: reduced_vocab_eagle3_proposer(target),
    }


@pytest.mark.parametrize("which", ["target", "draft"])
@pytest.mark.parametrize("kind", ["chain", "tree", "lookup", "reduced_vocab"])
def test_a_row_shifted_by_one_position_is_rejected(target, monkeypatch, kind, which):
    """Power: verifying with the target's or the draft's distribution of the next position (an off-by-one
    between rows and draft tokens) fails the test, for chains, trees, lookup and a reduced vocabulary."""
    proposer = _shift_proposers(target)[kind]()
    shift_verify_rows(monkeypatch, which)
    joint_VV, _ = exact_target_distributions(target, PLAIN)
    trials = {"target": 1000, "draft": 600}[which]  # p < 1e-16 and < 1e-90 (seeded), the weakest of the four
    counts_VV, _, _ = engine_samples(target, PLAIN, trials=trials, seed=0, max_new_tokens=2, proposer=proposer)
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    assert p_joint < FAIL_P, p_joint


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_engine_ngram_baseline_follows_target_distribution(target, params):
    """The n-gram baseline's proposals are deterministic (one-hot q): accepted with probability p(d),
    replaced from p without d on rejection, so the output is still the target's distribution."""
    from deepspec.algorithms.ngram.proposer import NGramProposer

    joint_VV, third_V = exact_target_distributions(target, params)
    trials = 1200
    # the prompt's ids 0, 3, 7, 5: an anchor among them is a 1-gram match, and the lookup proposes
    proposer = NGramProposer(vocab_size=V, num_tokens=2, ngram_max=2, ngram_min=1)
    counts_VV, counts_V, accepted = engine_samples(target, params, trials, seed=1, proposer=proposer)
    assert 0.02 * trials < accepted
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_lookup_first_draft_follows_target_distribution(target, params):
    """Prompt lookup in front of a DSpark draft: steps proposed by the lookup (one-hot q) and steps
    proposed by the draft (its own q) mix within the same generations; the output is still the
    target's distribution."""
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    joint_VV, third_V = exact_target_distributions(target, params)
    trials = 1200
    # an anchor among the prompt's ids 0, 3, 7, 5 is a 1-gram match: the lookup proposes, else the draft
    proposer = LookupFirstProposer(untrained_dspark_proposer(target), vocab_size=V, ngram_max=2, ngram_min=1)
    counts_VV, counts_V, accepted = engine_samples(target, params, trials, seed=2, proposer=proposer)
    assert proposer.steps_from_lookup > 0.1 * trials and proposer.steps_from_draft > 0.1 * trials
    assert 0.02 * trials < accepted
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_lookup_first_with_a_corpus_follows_target_distribution(target, params):
    """Context lookup, then a corpus of earlier answers, then the draft: steps of all three kinds mix
    within the same generations (the corpus holds only some tokens, so some anchors reach the draft);
    the output is still the target's distribution."""
    from deepspec.algorithms.ngram.corpus import NGramCorpus
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    joint_VV, third_V = exact_target_distributions(target, params)
    trials = 1200
    corpus = NGramCorpus([[3, 7, 5, 9, 3, 2], [7, 7, 5, 3, 1], [5, 2, 9]], ngram_max=2)
    proposer = LookupFirstProposer(untrained_dspark_proposer(target), vocab_size=V, ngram_max=2, ngram_min=2,
                                   corpus=corpus, corpus_ngram_min=1)
    counts_VV, counts_V, accepted = engine_samples(target, params, trials, seed=4, proposer=proposer)
    assert proposer.lookup.steps_from_corpus > 0.1 * trials and proposer.steps_from_draft > 0.1 * trials
    assert 0.02 * trials < accepted
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_dspark_tree_sampling_follows_target_distribution(target, params):
    """DSpark's draft trees at T > 0 (3 nodes per slot, chosen from the draft's filtered distribution),
    verified by the target's own draws: the output is the target's distribution."""
    joint_VV, third_V = exact_target_distributions(target, params)
    trials = 1200
    proposer = untrained_dspark_proposer(target, tree_width=3)
    counts_VV, counts_V, accepted = engine_samples(target, params, trials, seed=5, proposer=proposer)
    assert 0.05 * trials < accepted < 2.9 * trials  # drafts are accepted and rejected (K = 3)
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chain", "tree3"])
@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_eagle3_sampling_follows_target_distribution(target, params, tree_width):
    """Eagle3's chains, and its draft trees (3 nodes per depth, each depth drafted in one step), at T > 0,
    verified by the target's own draws: the output is the target's distribution."""
    joint_VV, third_V = exact_target_distributions(target, params)
    trials = 1200
    proposer = untrained_eagle3_proposer(target, tree_width=tree_width)
    counts_VV, counts_V, accepted = engine_samples(target, params, trials, seed=7, proposer=proposer)
    assert 0.05 * trials < accepted < 2.9 * trials  # drafts are accepted and rejected (K = 3)
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_lookup_beside_a_dspark_tree_follows_target_distribution(target, params):
    """Prompt lookup's match verified beside DSpark's tree at T > 0 (tree steps and draft-only tree steps
    mix): the output is the target's distribution."""
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    joint_VV, third_V = exact_target_distributions(target, params)
    trials = 1200
    proposer = LookupFirstProposer(untrained_dspark_proposer(target, tree_width=3), vocab_size=V, ngram_max=2,
                                   ngram_min=1, tree=True)
    counts_VV, counts_V, accepted = engine_samples(target, params, trials, seed=6, proposer=proposer)
    assert proposer.steps_from_lookup > 0.1 * trials and proposer.steps_from_draft > 0.1 * trials
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


# ----------------------------------------------------------------------------- the step scheduler at T > 0


class ScoredBigramProposer(BigramProposer):
    """:class:`BigramProposer` with a per-slot score known before the slot's draw (its ``q``'s largest
    probability, a function of the previous token only): what a confidence head gives the scheduler."""

    max_proposal_len = 3

    def propose(self, anchor_token, anchor_pos, *, sampling, generator):
        prev, ids, probs, conf = int(anchor_token), [], [], []
        for _ in range(self.max_proposal_len):
            conf.append(float(sampling_probs(self.table_VV[prev], sampling).max()))
            tok, q_V = draw_token(self.table_VV[prev], sampling, generator)
            ids.append(tok)
            probs.append(q_V)
            prev = int(tok)
        return Proposal(draft_ids_N=torch.cat(ids), draft_probs_NV=None if sampling.greedy else torch.stack(probs),
                        confidence_N=torch.tensor(conf))


def _scheduler(probe_every: int = 2):
    """A scheduler whose cost curve makes it cut proposals at every length (a second and third draft token
    cost little, a fourth much), with a short plain-step streak (0: it always proposes, with no probe budget
    to space its probes)."""
    from deepspec.decoding.schedule import StepCostCurve, StepScheduler

    return StepScheduler(StepCostCurve((1, 2, 3, 4), (0.010, 0.0103, 0.0112, 0.02)), probe_every=probe_every,
                         probe_budget=0.01 if probe_every else None)


def _scheduled_proposers(target):
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    return {
        "chain": lambda: ScoredBigramProposer(seed=5),
        "tree": lambda: untrained_dspark_proposer(target, tree_width=3),
        "lookup": lambda: LookupFirstProposer(untrained_dspark_proposer(target), vocab_size=V, ngram_max=2,
                                              ngram_min=1),
    }


@pytest.mark.parametrize("kind", ["chain", "tree", "lookup"])
@pytest.mark.parametrize("params", [PLAIN, FILTERED], ids=["plain", "topk_topp"])
def test_scheduled_steps_follow_target_distribution(target, params, kind):
    """With the scheduler choosing each step's length (chains cut by a sequential rule on per-slot scores,
    trees at a depth planned before the draw, lookup and draft steps mixed, plain steps between), the
    output is still the target's distribution."""
    joint_VV, third_V = exact_target_distributions(target, params)
    trials, sizes = 1200, []
    counts_VV, counts_V, _ = engine_samples(target, params, trials, seed=8, proposer=_scheduled_proposers(target)[kind](),
                                            schedule=_scheduler(), sizes=sizes)
    assert len(set(sizes)) >= 2, sorted(set(sizes))  # the scheduler did choose different lengths
    p_joint = chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten())
    p_third = chi_square_pvalue(counts_V, third_V)
    assert p_joint > PASS_P and p_third > PASS_P, (p_joint, p_third)


def test_a_schedule_that_reads_the_drawn_token_is_rejected(target, monkeypatch):
    """Power: a cut that looks at the token drawn at a slot (keep the first draft only when it is its
    ``q``'s most likely token) conditions the accepted tokens on their own value, and the test sees it."""
    from deepspec.decoding.schedule import StepScheduler

    def peeking_select(self, proposal, *, greedy):
        if proposal.num_proposed == 0:
            return proposal
        q_V = proposal.draft_probs_NV[0]
        keep = int(q_V.argmax()) == int(proposal.draft_ids_N[0])
        return proposal.truncated(proposal.num_proposed if keep else 0)

    monkeypatch.setattr(StepScheduler, "select", peeking_select)
    joint_VV, _ = exact_target_distributions(target, PLAIN)
    counts_VV, _, _ = engine_samples(target, PLAIN, trials=3000, seed=8, max_new_tokens=2,
                                     proposer=ScoredBigramProposer(seed=5), schedule=_scheduler(probe_every=0))
    assert chi_square_pvalue(counts_VV.flatten(), joint_VV.flatten()) < FAIL_P
