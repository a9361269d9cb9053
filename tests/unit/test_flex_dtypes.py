"""The dtypes flex_attention runs in: under bf16 autocast, ``flex_block_attention`` hands flex q, k and v
all in bfloat16, whatever dtypes its callers computed them in (flex_attention is no autocast op: q and k
leave the float32 q/k RMSNorms in float32 beside a bf16 v). Eager flex on the CPU (forward only);
tests/gpu checks the compiled kernel on CUDA the same way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
import torch.nn.functional as F

from deepspec.algorithms.dspark import model as dspark_model
from deepspec.models.anchors import sample_anchors
from deepspec.models.mask import dense_block_mask, flex_block_mask

K, HQ, HK, D = 4, 4, 2, 16


@pytest.fixture
def flex_dtypes(monkeypatch) -> list[tuple[torch.dtype, torch.dtype, torch.dtype]]:
    """The (q, k, v) dtypes of every call that reaches torch's flex_attention, however model.py imports it."""
    seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []
    real = torch_flex.flex_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch_flex, "flex_attention", recording)
    if hasattr(dspark_model, "flex_attention"):  # a module-level import would bypass the attribute above
        monkeypatch.setattr(dspark_model, "flex_attention", recording)
    return seen


def test_flex_runs_in_the_autocast_dtype(flex_dtypes):
    g = torch.Generator().manual_seed(0)
    seq_len, num_anchors = 40, 5
    loss_mask = torch.zeros(2, seq_len, dtype=torch.long)
    loss_mask[0, 10:] = 1
    loss_mask[1, seq_len - 9:] = 1
    anchors, valid = sample_anchors(loss_mask, num_anchors, g)
    Q, T = num_anchors * K, seq_len + num_anchors * K
    q_f32 = torch.randn(2, HQ, Q, D, generator=g)
    k_f32 = torch.randn(2, HK, T, D, generator=g)
    v_bf16 = torch.randn(2, HK, T, D, generator=g).bfloat16()
    block_mask = flex_block_mask(anchors, valid, seq_len, K, pad_to_blocks=True)
    error = None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            out = dspark_model.flex_block_attention(q_f32, k_f32, v_bf16, block_mask, enable_gqa=True, compiled=False)
        except (RuntimeError, ValueError) as exc:  # flex itself refuses mixed dtypes; the dtypes say why first
            error = exc
    assert flex_dtypes, "flex_attention was never called"
    assert flex_dtypes == [(torch.bfloat16,) * 3], f"q, k, v reached flex_attention in {flex_dtypes}"
    assert error is None, error
    assert out.dtype == torch.bfloat16 and out.shape == (2, HQ, Q, D)
    # the same attention in float32 from the bf16-rounded inputs: bf16 tolerance
    q, k, v = (t.bfloat16().float() for t in (q_f32, k_f32, v_bf16))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(anchors, valid, seq_len, K),
                                           enable_gqa=True)
    rows = valid.repeat_interleave(K, dim=1)[:, None, :, None].expand_as(dense)  # padding blocks' rows aside
    torch.testing.assert_close(out.float()[rows], dense[rows], rtol=2e-2, atol=2e-2)
