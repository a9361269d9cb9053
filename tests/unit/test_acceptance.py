"""Pooled training-time acceptance estimates (deepspec.models.acceptance) against obvious loops."""

import math

import torch

from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.algorithms.dspark.loss import dspark_loss
from deepspec.algorithms.eagle3.loss import eagle3_loss
from deepspec.models.acceptance import AcceptanceCounts, chain_acceptance, tau_from_counts
from tests.unit.test_eagle3 import V as EV
from tests.unit.test_eagle3 import make_draft as make_eagle3
from tests.unit.test_eagle3 import sample
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


def test_a_chain_that_ends_at_an_accepted_eos_commits_no_bonus_token():
    """Five accepted drafts, the fifth an EOS: the step commits 5 tokens (the original's 5.0, not accepted + 1 =
    6.0), and the slots after the EOS are never verified, so they are not counted."""
    valid, match = torch.ones(1, 7, dtype=torch.bool), torch.ones(1, 7, dtype=torch.bool)
    eos = torch.zeros(1, 7, dtype=torch.bool)
    eos[0, 4] = True
    got = chain_acceptance(valid, match, torch.ones(1, 7), eos)
    assert got.greedy_tau() == 5.0 and got.tau() == 5.0
    assert got.count_K.tolist() == [1, 1, 1, 1, 1, 0, 0] and got.greedy_ended_K.tolist() == [0, 0, 0, 0, 1, 0, 0]
    assert chain_acceptance(valid, match, torch.ones(1, 7)).greedy_tau() == 8.0  # no EOS: 7 accepted + 1
    rejected = match.clone()
    rejected[0, 4] = False  # the EOS is drafted wrong: the target's token is committed, as any rejection
    assert chain_acceptance(valid, rejected, None, eos).greedy_tau() == 5.0
    assert torch.equal(AcceptanceCounts.unpack(got.pack()).pack(), got.pack())


def test_eos_counts_match_a_slow_loop():
    g = torch.Generator().manual_seed(2)
    X, k = 60, 6
    valid = torch.rand(X, k, generator=g) < 0.9
    match = torch.rand(X, k, generator=g) < 0.7
    prob = torch.rand(X, k, generator=g)
    eos = torch.rand(X, k, generator=g) < 0.2
    got = chain_acceptance(valid, match, prob, eos)
    count, greedy, soft, greedy_end, soft_end = ([0.0] * k for _ in range(5))
    for x in range(X):
        alive, p = True, 1.0
        for j in range(k):
            if not valid[x, j]:
                break
            count[j] += 1
            alive = alive and bool(match[x, j])
            p *= float(prob[x, j])
            greedy[j] += float(alive)
            soft[j] += p
            if eos[x, j]:
                greedy_end[j] += float(alive)
                soft_end[j] += p
                break  # nothing after an EOS is verified
    for name, want in (("count_K", count), ("greedy_survive_K", greedy), ("survive_K", soft),
                       ("greedy_ended_K", greedy_end), ("ended_K", soft_end)):
        assert torch.allclose(getattr(got, name), torch.tensor(want, dtype=torch.float64), atol=1e-6), name
    want_tau = 1.0 + sum((s - e) / n for s, e, n in zip(greedy, greedy_end, count) if n)
    assert math.isclose(got.greedy_tau(), want_tau)


def test_the_losses_pass_the_eos_labels():
    """DSpark's and Eagle3's losses mark the slots whose label (the data's next token) is an EOS of the draft
    config: the chains stop being counted after it."""
    cfg, head = make_config(), lm_head_fixture()  # eos_token_ids [1]
    ids, lm, ap, valid, out, tlh = make_batch()
    ids[ids == 1] = 2
    ids[0, 4] = 1  # the label of slot 1 of the block anchored at 2
    with_eos = dspark_loss(out, ids, lm, ap, valid, tlh, head, cfg).acceptance
    without = dspark_loss(out, ids, lm, ap, valid, tlh, head, make_config(eos_token_ids=[])).acceptance
    assert (without.count_K - with_eos.count_K).tolist() == [0, 0, 1, 1]  # slots 2, 3 of that block
    assert with_eos.greedy_ended_K[[0, 2, 3]].sum() == 0 and without.greedy_ended_K.sum() == 0

    target = LlamaForCausalLM(LlamaConfig(vocab_size=EV, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          eos_token_id=1, pad_token_id=0)).eval()
    d = make_eagle3(target, steps=3)
    ids_e, lm_e, feats, last = sample(target, S=16)  # ids in [2, V): no EOS but the one set here
    ids_e[0, 10] = 1
    got = eagle3_loss(d, ids_e, lm_e, feats, last).acceptance
    d.config.eos_token_ids = []
    free = eagle3_loss(d, ids_e, lm_e, feats, last).acceptance
    # step k of the chain at row t predicts x_{t+k+2}: the EOS is step 0 of row 8 (steps 1, 2 not counted) and
    # step 1 of row 7 (step 2 not counted)
    assert (free.count_K - got.count_K).tolist() == [0, 1, 2]
    assert free.greedy_ended_K.sum() == 0
