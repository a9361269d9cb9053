"""Anchor sampling for block-parallel drafters (DSpark / DFlash training, docs/design/training.md, "Anchors").

Legend: B batch, S sequence length, A anchors per sequence.

An anchor is a position ``a`` with ``loss_mask[a] = loss_mask[a+1] = 1``: the anchor token is
target-generated and so is at least the first token the block must predict. Anchors are drawn
uniformly without replacement per sequence and sorted; when a sequence has fewer than ``A``
candidates the remaining blocks are *padding blocks* (``block_valid = False``, ``anchor_pos = 0``)
that carry no loss, no metric and no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def anchor_candidates(loss_mask_BS: Tensor) -> Tensor:
    """Bool ``[B, S]``: True at ``a`` iff ``loss_mask[a]`` and ``loss_mask[a+1]`` (last column False)."""
    m_BS = loss_mask_BS.bool()
    cand_BS = torch.zeros_like(m_BS)
    cand_BS[:, :-1] = m_BS[:, :-1] & m_BS[:, 1:]
    return cand_BS


def sample_anchors(
    loss_mask_BS: Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Draw up to ``num_anchors`` anchors per sequence, uniformly without replacement, sorted.

    Args:
        loss_mask_BS: ``[B, S]`` (any dtype; nonzero = supervised).
        num_anchors: A > 0.
        generator: torch RNG on the mask's device (None = global RNG).
    Returns:
        ``anchor_pos_BA`` int64 ``[B, A]`` (valid anchors ascending first, then padding blocks at 0)
        and ``block_valid_BA`` bool ``[B, A]``.
    Raises:
        ValueError: ``num_anchors <= 0`` or ``loss_mask_BS`` not 2-D.
    """
    if num_anchors <= 0:
        raise ValueError(f"num_anchors: expected a positive integer, received {num_anchors!r}. Use e.g. 512.")
    if loss_mask_BS.dim() != 2:
        raise ValueError(f"loss_mask_BS: expected shape [B, S], received {tuple(loss_mask_BS.shape)}. "
                         "Add a batch dimension.")
    cand_BS = anchor_candidates(loss_mask_BS)
    B, S = cand_BS.shape
    # Uniform random keys; non-candidates get +inf so they sort last. Taking the A smallest keys is
    # uniform sampling without replacement among candidates.
    keys_BS = torch.rand((B, S), generator=generator, device=cand_BS.device)
    keys_BS = keys_BS.masked_fill(~cand_BS, float("inf"))
    A_eff = min(num_anchors, S)
    keys_BA, idx_BA = torch.topk(keys_BS, A_eff, dim=1, largest=False)
    valid_BA = torch.isfinite(keys_BA)
    # Sort valid anchors ascending, padding (pos S as sort key) last.
    sort_key_BA = torch.where(valid_BA, idx_BA, torch.full_like(idx_BA, S))
    sort_key_BA, order_BA = torch.sort(sort_key_BA, dim=1)
    valid_BA = torch.gather(valid_BA, 1, order_BA)
    anchor_pos_BA = torch.where(valid_BA, sort_key_BA, torch.zeros_like(sort_key_BA))
    if A_eff < num_anchors:
        pad = num_anchors - A_eff
        anchor_pos_BA = torch.cat([anchor_pos_BA, anchor_pos_BA.new_zeros(B, pad)], dim=1)
        valid_BA = torch.cat([valid_BA, valid_BA.new_zeros(B, pad)], dim=1)
    return anchor_pos_BA.long(), valid_BA
