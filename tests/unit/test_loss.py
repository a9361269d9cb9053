"""DSpark loss vs a naive per-slot oracle (docs/design/training.md, "DSpark / DFlash loss"). Legend: B batch, S seq, A anchors, K block, V vocab, H hidden."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepspec.algorithms.dspark.config import DraftConfig, dflash_knobs
from deepspec.algorithms.dspark.loss import confidence_targets, dspark_loss, supervision_mask, supervision_weights
from deepspec.algorithms.dspark.model import DraftTrainOutput

V, H, K = 11, 6, 4


def make_config(**kw):
    base = dict(family="llama", hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=3,
                intermediate_size=8, max_position_embeddings=64, vocab_size=V, target_hidden_size=H,
                target_num_hidden_layers=4, target_layer_ids=[0, 1], num_draft_layers=1, block_size=K,
                mask_token_id=3, pad_token_id=0, eos_token_ids=[1], markov_rank=4)
    base.update(kw)
    return DraftConfig(**base)


def make_batch(B=2, S=12, A=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    lm = torch.ones(B, S, dtype=torch.uint8)
    lm[:, :2] = 0
    if B > 1:
        lm[1, 7] = 0  # a hole: supervision stops there
    ap = torch.tensor([[2, 4, 9], [3, 5, 0]])[:B, :A]
    valid = torch.tensor([[True, True, True], [True, True, False]])[:B, :A]
    logits = torch.randn(B, A, K, V, generator=g, requires_grad=True)
    conf = torch.randn(B, A, K, generator=g, requires_grad=True)
    tlh = torch.randn(B, S, H, generator=g)
    return ids, lm, ap, valid, DraftTrainOutput(logits, conf, torch.zeros(B, A, K, H)), tlh


def lm_head_fixture():
    torch.manual_seed(0)
    return nn.Linear(H, V, bias=False)


@torch.no_grad()
def oracle(out, ids, lm, ap, valid, tlh, head, cfg):
    """Slow per-slot loss; the confidence label and reach follow ``cfg.confidence_label``."""
    B, S = ids.shape
    A = ap.shape[1]
    tot = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    ws, n = 0.0, 0
    for b in range(B):
        for j in range(A):
            if not valid[b, j]:
                continue
            a = int(ap[b, j])
            reach = 1.0  # the product of the earlier slots' labels; 0 after an EOS label (it ends the step)
            for k in range(K):
                p = a + k + 1
                if p >= S or not lm[b, p]:
                    break
                w = math.exp(-k / cfg.loss_decay_gamma)
                lg = out.logits_BAKV[b, j, k].detach().double()
                ce = -F.log_softmax(lg, -1)[ids[b, p]]
                tp = F.softmax(head(tlh[b, a + k]).double(), -1)
                l1 = (F.softmax(lg, -1) - tp).abs().sum()
                if cfg.confidence_label == "greedy":
                    label = float(int(lg.argmax()) == int(tp.argmax()))
                else:
                    label = float(1 - l1 / 2)
                c = F.binary_cross_entropy_with_logits(out.confidence_logits_BAK[b, j, k].detach().double(),
                                                       torch.tensor(label, dtype=torch.float64))
                tot["ce"] += w * float(ce)
                tot["l1"] += w * float(l1)
                tot["conf"] += w * reach * float(c)
                reach *= label * (int(ids[b, p]) not in cfg.eos_token_ids)
                ws += w
                n += 1
    r = {k2: v / ws for k2, v in tot.items()}
    r["loss"] = cfg.ce_weight * r["ce"] + cfg.l1_weight * r["l1"] + cfg.confidence_weight * r["conf"]
    return r, ws, n


@pytest.mark.parametrize("rule", ["greedy", "tv"])
def test_matches_oracle(rule):
    cfg, head = make_config(confidence_label=rule), lm_head_fixture()
    ids, lm, ap, valid, out, tlh = make_batch()
    got = dspark_loss(out, ids, lm, ap, valid, tlh, head, cfg, chunk_slots=5)
    exp, ws, n = oracle(out, ids, lm, ap, valid, tlh, head, cfg)
    assert got.num_valid_slots == n
    assert math.isclose(float(got.weight_sum), ws, rel_tol=1e-6)
    for key, val in (("ce", got.ce), ("l1", got.l1), ("conf", got.confidence), ("loss", got.loss)):
        assert math.isclose(float(val.detach()), exp[key], rel_tol=1e-5), key
    assert 1.0 <= got.tau_estimate <= K + 1 and got.accept_rate_K.shape == (K,)


def test_confidence_label_is_conditional_on_earlier_slots_accepted():
    """Slot k's label is its acceptance given slots 1..k-1 accepted: a slot that matches the target after
    an earlier mismatch is not supervised (reach 0), as the eval's calibration pairs exclude it."""
    valid = torch.tensor([[[True, True, True, True]]])
    match = torch.tensor([[[True, False, True, True]]])
    prob = torch.tensor([[[0.8, 0.5, 0.9, 1.0]]])
    label, reach = confidence_targets(valid, match, prob, "greedy")
    assert label.tolist() == [[[1.0, 0.0, 1.0, 1.0]]]
    assert reach.tolist() == [[[1.0, 1.0, 0.0, 0.0]]]  # slots 3 and 4 come after the rejected slot 2
    label, reach = confidence_targets(valid, match, prob, "tv")
    assert torch.allclose(label, prob)
    assert torch.allclose(reach, torch.tensor([[[1.0, 0.8, 0.4, 0.36]]]))
    label, reach = confidence_targets(valid & torch.tensor([True, True, False, False]), match, prob, "greedy")
    assert reach.tolist() == [[[1.0, 1.0, 0.0, 0.0]]] and label[0, 0, 2:].tolist() == [0.0, 0.0]
    eos = torch.tensor([[[False, True, False, False]]])  # slot 2's label is an EOS: the step would end there
    match_all = torch.ones_like(match)
    assert confidence_targets(valid, match_all, prob, "greedy", eos_BAK=eos)[1].tolist() == [[[1.0, 1.0, 0.0, 0.0]]]
    with pytest.raises(ValueError, match="greedy"):
        confidence_targets(valid, match, prob, "sampled")


def test_greedy_confidence_loss_skips_slots_after_a_mismatch():
    """Through dspark_loss: slot 1 mismatches the target's argmax, slot 2 matches it; slot 2's confidence
    logit gets no gradient (greedy label), while the old unconditional label trained it."""
    torch.manual_seed(0)
    cfg, head = make_config(ce_weight=0.0, l1_weight=0.0, confidence_weight=1.0), lm_head_fixture()
    S = 10
    ids = torch.randint(0, V, (1, S))
    lm = torch.ones(1, S, dtype=torch.uint8)
    tlh = torch.randn(1, S, H)
    ap, valid = torch.tensor([[2]]), torch.tensor([[True]])
    tgt_arg = head(tlh[0, 2:2 + K]).argmax(-1)  # the target's argmax at slots 0..K-1
    logits = torch.zeros(1, 1, K, V)
    for k in range(K):
        tok = int(tgt_arg[k]) if k != 0 else (int(tgt_arg[0]) + 1) % V  # slot 0 wrong, the rest right
        logits[0, 0, k, tok] = 5.0
    conf = torch.zeros(1, 1, K, requires_grad=True)
    out = DraftTrainOutput(logits, conf, torch.zeros(1, 1, K, H))
    dspark_loss(out, ids, lm, ap, valid, tlh, head, cfg).loss.backward()
    g = conf.grad[0, 0]
    assert g[0] > 0  # label 0 at slot 0: pushed down
    assert torch.all(g[1:] == 0)  # slots after the first mismatch: not supervised


def test_supervision_mask_cumprod():
    ids, lm, ap, valid, _, _ = make_batch()
    m = supervision_mask(lm, ap, valid, K)
    # seq 1, anchor 5: labels at 6, 7(hole) -> only slot 0; anchor 3: labels 4,5,6,7(hole) -> 3 slots
    assert m[1, 1].tolist() == [True, False, False, False]
    assert m[1, 0].tolist() == [True, True, True, False]
    # seq 0, anchor 9, S=12: labels 10, 11, then out of range
    assert m[0, 2].tolist() == [True, True, False, False]
    assert not m[1, 2].any()  # padding block
    v2, w = supervision_weights(lm, ap, valid, block_size=K, gamma=4.0)
    assert torch.equal(v2, m) and torch.equal(supervision_weights(lm, ap, valid, make_config())[1], w)
    assert torch.allclose(w[0, 0], torch.exp(-torch.arange(K) / 4.0))


def test_padding_invariance():
    cfg, head = make_config(), lm_head_fixture()
    ids, lm, ap, valid, out, tlh = make_batch(B=1, A=2)
    pad = 5
    ids2 = torch.cat([ids, torch.zeros(1, pad, dtype=ids.dtype)], 1)
    lm2 = torch.cat([lm, torch.zeros(1, pad, dtype=lm.dtype)], 1)
    tlh2 = torch.cat([tlh, torch.randn(1, pad, H)], 1)
    l1 = dspark_loss(out, ids, lm, ap, valid, tlh, head, cfg)
    l2 = dspark_loss(out, ids2, lm2, ap, valid, tlh2, head, cfg)
    assert torch.allclose(l1.loss, l2.loss) and l1.num_valid_slots == l2.num_valid_slots


def test_padding_blocks_zero_grad_and_no_nan():
    cfg, head = make_config(), lm_head_fixture()
    ids, lm, ap, valid, out, tlh = make_batch()
    out.logits_BAKV.data[1, 2] = float("nan")  # garbage in a padding block must not leak
    got = dspark_loss(out, ids, lm, ap, valid, tlh, head, cfg)
    got.loss.backward()
    assert torch.isfinite(got.loss)
    sup = supervision_mask(lm, ap, valid, K)
    g = out.logits_BAKV.grad
    assert torch.all(g[~sup] == 0) and g[sup].abs().sum() > 0
    assert torch.all(out.confidence_logits_BAK.grad[~sup] == 0)


def test_all_padding_gives_zero_loss():
    cfg, head = make_config(), lm_head_fixture()
    ids, lm, ap, _, out, tlh = make_batch()
    got = dspark_loss(out, ids, lm, ap, torch.zeros_like(ap, dtype=torch.bool), tlh, head, cfg)
    assert float(got.loss.detach()) == 0.0 and got.num_valid_slots == 0
    got.loss.backward()
    assert torch.all(out.logits_BAKV.grad == 0)


def test_confidence_target_detached():
    cfg = make_config(ce_weight=0.0, l1_weight=0.0, confidence_weight=1.0)
    ids, lm, ap, valid, out, tlh = make_batch()
    got = dspark_loss(out, ids, lm, ap, valid, tlh, lm_head_fixture(), cfg)
    got.loss.backward()
    assert out.logits_BAKV.grad is None or torch.all(out.logits_BAKV.grad == 0)
    assert out.confidence_logits_BAK.grad.abs().sum() > 0


def test_global_weight_sum_splits_exactly():
    cfg, head = make_config(), lm_head_fixture()
    ids, lm, ap, valid, out, tlh = make_batch()
    full = dspark_loss(out, ids, lm, ap, valid, tlh, head, cfg)
    ws = supervision_weights(lm, ap, valid, cfg)[1].sum()
    parts = []
    for b in range(2):
        o = DraftTrainOutput(out.logits_BAKV[b:b + 1], out.confidence_logits_BAK[b:b + 1], out.hidden_BAKD[b:b + 1])
        parts.append(dspark_loss(o, ids[b:b + 1], lm[b:b + 1], ap[b:b + 1], valid[b:b + 1], tlh[b:b + 1], head, cfg,
                                 weight_sum=ws).loss)
    assert torch.allclose(sum(parts), full.loss, rtol=1e-6)


def test_dflash_ce_only_without_target_hidden():
    cfg = make_config(**dflash_knobs())
    ids, lm, ap, valid, out, tlh = make_batch()
    out = DraftTrainOutput(out.logits_BAKV, None, out.hidden_BAKD)
    got = dspark_loss(out, ids, lm, ap, valid, None, lm_head_fixture(), cfg)
    exp, _, _ = oracle(DraftTrainOutput(out.logits_BAKV, torch.zeros(2, 3, K), None), ids, lm, ap, valid, tlh,
                       lm_head_fixture(), make_config())
    assert math.isclose(float(got.loss.detach()), exp["ce"], rel_tol=1e-5)
    assert math.isnan(got.tau_estimate)
    with pytest.raises(ValueError, match="target_last_hidden_BSH"):
        dspark_loss(out, ids, lm, ap, valid, None, lm_head_fixture(), make_config())


# ----------------------------------------------------------------------------- with the draft model
def _draft_setup(family="llama", seed=0):
    from tests.unit.test_dspark import batch, capture, make_draft

    target, draft = make_draft(family, seed=seed)
    return target, draft, batch, capture


def test_model_loss_same_sample_padded_to_two_lengths():
    """A sample right-padded to two lengths (zero features, loss mask 0: what collate produces)
    gives the same draft logits on its blocks, the same loss and the same gradients."""
    target, draft, batch, capture = _draft_setup("qwen3")
    ids, lm = batch(B=1, S=20, seed=4)
    feats, last = capture(target, ids)
    ap, valid = torch.tensor([[4, 9, 15]]), torch.ones(1, 3, dtype=torch.bool)
    results = []
    for pad in (0, 9):
        z = lambda t: torch.cat([t, torch.zeros(1, pad, *t.shape[2:], dtype=t.dtype)], 1)  # noqa: E731
        draft.zero_grad()
        out = draft.forward_train(z(ids), z(feats), ap, valid)
        lo = dspark_loss(out, z(ids), z(lm), ap, valid, z(last), draft.lm_head, draft.config)
        lo.loss.backward()
        results.append((lo, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    assert l0.num_valid_slots == l1.num_valid_slots > 0
    torch.testing.assert_close(l1.loss, l0.loss)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=1e-5)


def test_micro_batches_give_the_global_token_weighted_mean():
    """Through the algorithm protocol (what the trainer runs): a global batch split into micro-batches,
    each normalised by the global weight sum, gives the same summed loss and accumulated gradients
    as the whole batch at once; and that loss is the weighted mean over all slots, so a sequence with
    many supervised slots weighs more than one with few (not a mean of per-sequence means)."""
    from deepspec.algorithms.dspark import _BlockMicroBatch
    from deepspec.algorithms.protocol import TrainBatch
    from deepspec.algorithms.registry import get_algorithm

    target, draft, batch, capture = _draft_setup("llama")
    ids, lm = batch(B=4, S=24, seed=5)
    lm[1, 10:] = 0  # sequence 1 has few supervised slots
    feats, last = capture(target, ids)
    ap, valid = torch.tensor([[4, 9, 15], [5, 6, 0], [3, 12, 20], [8, 0, 0]]), torch.tensor(
        [[True, True, True], [True, True, False], [True, True, True], [True, False, False]])
    algo = get_algorithm("dspark")
    nullctx = torch.autocast("cpu", enabled=False)

    def micro(rows):
        tb = TrainBatch(ids[rows], lm[rows], feats[rows], last[rows], list(rows))
        return _BlockMicroBatch(tb, ap[rows], valid[rows])

    def run(groups):
        draft.zero_grad()
        parts = [micro(g) for g in groups]
        ws = sum(algo.weight(draft, p) for p in parts)
        total = 0.0
        for p in parts:
            out = algo.loss(draft, p, weight_sum=ws, autocast=nullctx)
            out.loss.backward()
            total = total + out.loss.detach()
        return total, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    full, g_full = run([[0, 1, 2, 3]])
    split, g_split = run([[0], [1, 2], [3]])
    torch.testing.assert_close(split, full, atol=1e-6, rtol=1e-5)
    for n in g_full:
        torch.testing.assert_close(g_split[n], g_full[n], atol=1e-6, rtol=1e-4)
    # the global-batch loss is the slot-weighted mean, not the mean of per-micro-batch losses
    own = [algo.loss(draft, micro([i]), weight_sum=algo.weight(draft, micro([i])), autocast=nullctx).loss.detach()
           for i in range(4)]
    w = torch.stack([algo.weight(draft, micro([i])) for i in range(4)])
    torch.testing.assert_close(full, (torch.stack(own) * w).sum() / w.sum(), atol=1e-6, rtol=1e-5)
    assert not torch.isclose(full, torch.stack(own).mean())


def test_l1_target_is_the_final_norm_hidden_state():
    """The L1 target distribution is softmax(lm_head(final-norm hidden)) = the target's own next-token
    distribution, with a final norm weight far from 1 (a pre-norm hidden state would give another)."""
    from deepspec.target.capture import target_forward

    target, draft, batch, _ = _draft_setup("llama")
    with torch.no_grad():
        target.model.norm.weight.copy_(torch.linspace(0.3, 3.0, target.config.hidden_size))
    ids, lm = batch(B=1, S=20, seed=6)
    captured = {}
    def keep_pre_norm(module, inputs, output):  # returns None: the output is left unchanged
        captured.setdefault("pre", inputs[0].detach())

    hook = target.model.norm.register_forward_hook(keep_pre_norm)
    try:
        cap = target_forward(target, ids, [0, 1])  # the capture rule of the cache writer and online mode
    finally:
        hook.remove()
    with torch.no_grad():
        ref_logits = target(ids).logits
    last = cap.target_last_hidden_BTH
    torch.testing.assert_close(draft.lm_head(last), ref_logits, atol=1e-5, rtol=1e-5)
    ap, valid = torch.tensor([[4, 11]]), torch.ones(1, 2, dtype=torch.bool)
    out = draft.forward_train(ids, cap.target_hidden_BTF, ap, valid)
    got = dspark_loss(out, ids, lm, ap, valid, last, draft.lm_head, draft.config)
    # oracle from the target's real logits
    valid_BAK, w_BAK = supervision_weights(lm, ap, valid, draft.config)
    num = 0.0
    for j in range(2):
        for k in range(draft.config.block_size):
            if valid_BAK[0, j, k]:
                a = int(ap[0, j])
                p = torch.softmax(out.logits_BAKV[0, j, k].detach().float(), -1)
                num += float(w_BAK[0, j, k]) * float((p - torch.softmax(ref_logits[0, a + k], -1)).abs().sum())
    assert math.isclose(float(got.l1), num / float(w_BAK.sum()), rel_tol=1e-5)
    wrong = dspark_loss(out, ids, lm, ap, valid, captured["pre"], draft.lm_head, draft.config)
    assert not math.isclose(float(wrong.l1), float(got.l1), rel_tol=1e-3)  # the test can tell them apart
