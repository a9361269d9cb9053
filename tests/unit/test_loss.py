"""DSpark loss vs a naive per-slot oracle (DESIGN s.5). Legend: B batch, S seq, A anchors, K block, V vocab, H hidden."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepspec.models.config import DraftConfig, dflash_knobs
from deepspec.models.dspark import DraftTrainOutput
from deepspec.models.loss import dspark_loss, supervision_mask, supervision_weights

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
    B, S = ids.shape
    A = ap.shape[1]
    tot = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    ws, n = 0.0, 0
    for b in range(B):
        for j in range(A):
            if not valid[b, j]:
                continue
            a = int(ap[b, j])
            for k in range(K):
                p = a + k + 1
                if p >= S or not lm[b, p]:
                    break
                w = math.exp(-k / cfg.loss_decay_gamma)
                lg = out.logits_BAKV[b, j, k].detach().double()
                ce = -F.log_softmax(lg, -1)[ids[b, p]]
                tp = F.softmax(head(tlh[b, a + k]).double(), -1)
                l1 = (F.softmax(lg, -1) - tp).abs().sum()
                c = F.binary_cross_entropy_with_logits(out.confidence_logits_BAK[b, j, k].detach().double(),
                                                       (1 - l1 / 2).detach())
                tot["ce"] += w * float(ce)
                tot["l1"] += w * float(l1)
                tot["conf"] += w * float(c)
                ws += w
                n += 1
    r = {k2: v / ws for k2, v in tot.items()}
    r["loss"] = cfg.ce_weight * r["ce"] + cfg.l1_weight * r["l1"] + cfg.confidence_weight * r["conf"]
    return r, ws, n


def test_matches_oracle():
    cfg, head = make_config(), lm_head_fixture()
    ids, lm, ap, valid, out, tlh = make_batch()
    got = dspark_loss(out, ids, lm, ap, valid, tlh, head, cfg, chunk_slots=5)
    exp, ws, n = oracle(out, ids, lm, ap, valid, tlh, head, cfg)
    assert got.num_valid_slots == n
    assert math.isclose(float(got.weight_sum), ws, rel_tol=1e-6)
    for key, val in (("ce", got.ce), ("l1", got.l1), ("conf", got.confidence), ("loss", got.loss)):
        assert math.isclose(float(val.detach()), exp[key], rel_tol=1e-5), key
    assert 1.0 <= got.tau_estimate <= K + 1 and got.accept_rate_K.shape == (K,)


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
