"""Block attention mask vs a slow loop oracle (docs/design/draft-models.md, "Block attention mask"). Legend: B batch, A anchors, K block, S seq."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from deepspec.models.mask import dense_block_mask, flex_block_mask
from tests.helpers import require_flex_attention_on_cpu


def oracle(anchor_pos_BA, block_valid_BA, S, K):
    B, A = anchor_pos_BA.shape
    out = torch.zeros(B, 1, A * K, S + A * K, dtype=torch.bool)
    for b in range(B):
        for q in range(A * K):
            j = q // K
            a = int(anchor_pos_BA[b, j])
            valid = bool(block_valid_BA[b, j])
            for kv in range(S + A * K):
                if kv < S:
                    vis = valid and kv < a
                else:
                    vis = (kv - S) // K == j
                out[b, 0, q, kv] = vis
    return out


CASES = [
    # overlapping anchors (a1 < a2 < a1 + K), anchor near the end, padding block
    (torch.tensor([[2, 4, 13, 0], [0, 1, 2, 3]]), torch.tensor([[True, True, True, False], [True, True, True, True]]), 15, 7),
    (torch.tensor([[5, 0, 0]]), torch.tensor([[True, False, False]]), 9, 3),
    (torch.tensor([[0, 8]]), torch.tensor([[True, True]]), 10, 4),
]


@pytest.mark.parametrize("anchor_pos, valid, S, K", CASES)
def test_dense_mask_matches_oracle(anchor_pos, valid, S, K):
    got = dense_block_mask(anchor_pos, valid, S, K)
    assert got.dtype == torch.bool
    assert torch.equal(got, oracle(anchor_pos, valid, S, K))


def test_no_empty_rows_and_sdpa_finite():
    anchor_pos, valid, S, K = CASES[0]
    mask = dense_block_mask(anchor_pos, valid, S, K)
    assert mask.any(-1).all()  # every query sees at least its own block (incl. anchor 0, padding)
    B, _, Q, KV = mask.shape
    q, k, v = torch.randn(B, 2, Q, 8), torch.randn(B, 2, KV, 8), torch.randn(B, 2, KV, 8)
    assert torch.isfinite(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).all()


def test_block_never_sees_other_blocks_or_its_anchor_position():
    anchor_pos, valid, S, K = CASES[0]
    m = dense_block_mask(anchor_pos, valid, S, K)[0, 0]
    # block 1 (anchor 4) : context 0..3 only, own block only
    rows = m[K:2 * K]
    assert rows[:, :4].all() and not rows[:, 4:S].any()
    assert rows[:, S + K:S + 2 * K].all() and not rows[:, S:S + K].any() and not rows[:, S + 2 * K:].any()


def test_flex_forward_matches_dense_on_cpu():
    anchor_pos, valid, S, K = CASES[0]
    require_flex_attention_on_cpu()
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bm = flex_block_mask(anchor_pos, valid, S, K, device="cpu")
        B, A = anchor_pos.shape
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, 4, A * K, 8, generator=g)
        k = torch.randn(B, 2, S + A * K, 8, generator=g)
        v = torch.randn(B, 2, S + A * K, 8, generator=g)
        out_flex = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    out_dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(anchor_pos, valid, S, K),
                                               enable_gqa=True)
    torch.testing.assert_close(out_flex, out_dense, atol=1e-5, rtol=1e-5)


def attention_oracle(q, k, v, anchor_pos_BA, block_valid_BA, S, K):
    """Python loop attention: each query softmaxes over exactly the keys the rule lets it see
    (context keys strictly before its block's anchor when the block is valid, its own block's keys)."""
    B, Hq, Q, d = q.shape
    Hk = k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hk)  # GQA: consecutive query heads share a KV head
            for qi in range(Q):
                j = qi // K
                a, valid = int(anchor_pos_BA[b, j]), bool(block_valid_BA[b, j])
                keys = [kv for kv in range(S) if valid and kv < a] + [S + j * K + i for i in range(K)]
                scores = torch.stack([q[b, h, qi] @ k[b, hk, kv] for kv in keys]) / d ** 0.5
                w = torch.softmax(scores, 0)
                out[b, h, qi] = sum(w[i] * v[b, hk, kv] for i, kv in enumerate(keys))
    return out


@pytest.mark.parametrize("anchor_pos, valid, S, K", CASES)
def test_flex_and_dense_attention_equal_loop_oracle(anchor_pos, valid, S, K):
    B, A = anchor_pos.shape
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, 4, A * K, 8, generator=g)
    k = torch.randn(B, 2, S + A * K, 8, generator=g)
    v = torch.randn(B, 2, S + A * K, 8, generator=g)
    exp = attention_oracle(q, k, v, anchor_pos, valid, S, K)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(anchor_pos, valid, S, K),
                                           enable_gqa=True)
    torch.testing.assert_close(dense, exp, atol=1e-5, rtol=1e-5)
    require_flex_attention_on_cpu()
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bm = flex_block_mask(anchor_pos, valid, S, K, device="cpu")
        flex = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(flex, exp, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(flex).all() and torch.isfinite(dense).all()


def test_flex_block_mask_materialises_to_the_dense_mask():
    """The BlockMask built from the rule, turned back into a dense bool mask, is the dense mask."""
    for anchor_pos, valid, S, K in CASES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bm = flex_block_mask(anchor_pos, valid, S, K, device="cpu", BLOCK_SIZE=8)
        B, A = anchor_pos.shape
        q_idx = torch.arange(A * K)[:, None]
        kv_idx = torch.arange(S + A * K)[None, :]
        dense = torch.stack([bm.mask_mod(torch.tensor(b), torch.tensor(0), q_idx, kv_idx) for b in range(B)])
        assert torch.equal(dense.unsqueeze(1), dense_block_mask(anchor_pos, valid, S, K))
