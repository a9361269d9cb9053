"""Attention mask of the block-parallel draft forward (DSpark / DFlash, docs/design/draft-models.md, "Block attention mask").

Legend: B batch, S sequence length (context keys), A anchors (blocks), K block_size.

Key index layout: ``[0, S)`` are context keys (position = index), ``[S, S + A*K)`` are block
keys, block ``j`` occupying ``[S + j*K, S + (j+1)*K)``. Query ``q`` belongs to block ``q // K``.

Rule (one function, used for the dense CPU mask and the CUDA flex_attention BlockMask):
  * a query of block j sees context key ``kv`` iff ``kv < anchor_pos[j]`` (strictly before the
    anchor: at inference the newest token has no target feature yet) and block j is valid;
  * it sees every key of its own block (bidirectional inside the block), never another block.
Padding blocks (``block_valid = False``) see only their own block, so no SDPA row is all-masked
(no NaN); they carry no loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def block_mask_rule(
    q_block: Tensor, kv_idx: Tensor, anchor_pos: Tensor, block_valid: Tensor, seq_len: int, block_size: int
) -> Tensor:
    """Elementwise (broadcasting) visibility: True where the query of block ``q_block`` may attend ``kv_idx``.

    ``anchor_pos`` / ``block_valid`` are the anchor position and validity of the query's block
    (already gathered), broadcastable with ``q_block`` and ``kv_idx``.
    """
    is_ctx = kv_idx < seq_len
    see_ctx = is_ctx & (kv_idx < anchor_pos) & block_valid
    own_block = (~is_ctx) & (torch.div(kv_idx - seq_len, block_size, rounding_mode="floor") == q_block)
    return see_ctx | own_block


def dense_block_mask(anchor_pos_BA: Tensor, block_valid_BA: Tensor, seq_len: int, block_size: int) -> Tensor:
    """Bool mask ``[B, 1, A*K, S + A*K]`` (True = attend) for SDPA, from :func:`block_mask_rule`."""
    B, A = anchor_pos_BA.shape
    dev = anchor_pos_BA.device
    q_block_Q = torch.arange(A * block_size, device=dev) // block_size  # [A*K]
    kv_idx_KV = torch.arange(seq_len + A * block_size, device=dev)  # [S+A*K]
    anchor_BQ1 = anchor_pos_BA[:, q_block_Q].unsqueeze(-1)
    valid_BQ1 = block_valid_BA.bool()[:, q_block_Q].unsqueeze(-1)
    mask_BQKV = block_mask_rule(q_block_Q[None, :, None], kv_idx_KV[None, None, :], anchor_BQ1, valid_BQ1,
                                seq_len, block_size)
    return mask_BQKV.unsqueeze(1)


def padded_flex_length(length: int, block: int = 128) -> int:
    """``length`` rounded up to a multiple of ``block``, and to at least two blocks (a dimension of one
    block would be specialised by torch.compile: a graph of its own)."""
    return max(2, -(-length // block)) * block


def flex_block_mask(anchor_pos_BA: Tensor, block_valid_BA: Tensor, seq_len: int, block_size: int, *,
                    device: torch.device | str | None = None, BLOCK_SIZE: int = 128, pad_to_blocks: bool = False):
    """flex_attention ``BlockMask`` for the same rule (head-independent), shape (B, 1, A*K, S+A*K).

    ``pad_to_blocks``: the query and key lengths rounded up by :func:`padded_flex_length` (the extra
    queries see nothing, the extra keys are seen by no query), so the compiled kernel sees block counts
    of at least 2 for every sequence length; the caller pads q / k / v to ``mask.seq_lengths`` and drops
    the extra rows (:func:`deepspec.algorithms.dspark.model.flex_block_attention`).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    B, A = anchor_pos_BA.shape
    valid_BA = block_valid_BA.bool()
    q_len, kv_len = A * block_size, seq_len + A * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        j = q_block.clamp(max=A - 1)  # kernels may probe padded query rows; never index out of range
        visible = block_mask_rule(q_block, kv_idx, anchor_pos_BA[b, j], valid_BA[b, j], seq_len, block_size)
        return visible & (q_idx < q_len) & (kv_idx < kv_len) if pad_to_blocks else visible

    if pad_to_blocks:
        q_len_padded, kv_len_padded = padded_flex_length(q_len, BLOCK_SIZE), padded_flex_length(kv_len, BLOCK_SIZE)
    else:
        q_len_padded, kv_len_padded = q_len, kv_len
    return create_block_mask(mask_mod, B, None, q_len_padded, kv_len_padded,
                             device=device or anchor_pos_BA.device, BLOCK_SIZE=BLOCK_SIZE)
