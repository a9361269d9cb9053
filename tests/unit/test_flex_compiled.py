"""The compiled flex_attention path, forward on the CPU (flex has no CPU backward;
tests/gpu covers gradients on CUDA): one dynamic-shape graph serves every sequence length and anchor
count, its output equals the dense SDPA mask's, and a fallback to the unfused kernel is an error."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from deepspec.algorithms.dspark import model as dspark_model
from deepspec.models.anchors import sample_anchors
from deepspec.models.mask import dense_block_mask, flex_block_mask

K, HQ, HK, D = 4, 4, 2, 16


@pytest.fixture
def fresh_compile(monkeypatch):
    """A clean torch._dynamo cache, and flex compiled as the model compiles it but with the ``aot_eager``
    backend: torch._dynamo's guards and recompiles (what these tests check) do not depend on the
    backend, and the CPU inductor template for flex fails to build its C++ for the padded lengths
    (torch 2.13, "cur_qSplitSize8 was not declared"); on CUDA inductor emits Triton (tests/gpu)."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=True, fullgraph=True, backend="aot_eager")
    monkeypatch.setattr(dspark_model, "_compiled_flex_attention", lambda: compiled)
    yield
    torch._dynamo.reset()


def _inputs(seq_len: int, num_anchors: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(2, seq_len, dtype=torch.long)
    loss_mask[0, seq_len // 4:] = 1
    loss_mask[1, seq_len - 9:] = 1  # few candidates: padding blocks in sample 1
    anchors, valid = sample_anchors(loss_mask, num_anchors, g)
    Q, T = num_anchors * K, seq_len + num_anchors * K
    q = torch.randn(2, HQ, Q, D, generator=g)
    k, v = torch.randn(2, HK, T, D, generator=g), torch.randn(2, HK, T, D, generator=g)
    return q, k, v, anchors, valid


def test_one_graph_for_every_length_and_equal_to_the_dense_mask(fresh_compile):
    for i, (seq_len, num_anchors) in enumerate([(129, 8), (137, 8), (300, 12), (64, 5), (700, 40)]):
        q, k, v, anchors, valid = _inputs(seq_len, num_anchors, seed=i)
        block_mask = flex_block_mask(anchors, valid, seq_len, K, pad_to_blocks=True)
        # after the first call nothing may compile again: the graph is shape-dynamic
        with torch._dynamo.config.patch(error_on_recompile=i > 0), torch.no_grad():
            out = dspark_model.flex_block_attention(q, k, v, block_mask, enable_gqa=True)
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(anchors, valid, seq_len, K),
                                               enable_gqa=True)
        rows = valid.repeat_interleave(K, dim=1)[:, None, :, None].expand_as(out)  # padding blocks' rows aside
        assert torch.isfinite(out[rows]).all()
        torch.testing.assert_close(out[rows], dense[rows], rtol=1e-4, atol=1e-5)


def test_a_fallback_to_the_unfused_kernel_is_an_error(fresh_compile):
    q, k, v, anchors, valid = _inputs(129, 8, seed=0)
    block_mask = flex_block_mask(anchors, valid, 129, K, pad_to_blocks=True)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        dspark_model.flex_block_attention(q, k, v, block_mask, enable_gqa=True)
        # another dtype needs another graph: past the limit torch.compile would run flex unfused
        with pytest.raises(RuntimeError, match="recompile limit.*materialises the full"):
            dspark_model.flex_block_attention(q.double(), k.double(), v.double(), block_mask, enable_gqa=True)
