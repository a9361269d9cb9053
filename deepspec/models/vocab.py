"""Reduced draft vocabulary: which target tokens a draft can propose, and the id maps.

Legend: V target vocabulary size, N draft vocabulary size (N <= V), T tokens of one sample.

A draft with a reduced vocabulary scores only N target tokens: its output layer is the target's
``lm_head`` rows ``d2t`` (``[N, D]``) and its logits are over draft ids ``0 .. N-1``. The target still
verifies in its full vocabulary, so decoding stays lossless (docs/design/draft-models.md, "Reduced draft
vocabulary"). Terms as in EAGLE-3 / SpecForge / vLLM:

* ``d2t_N`` (int64 ``[N]``): draft id -> target id. DeepSpec stores **absolute target ids**, sorted
  ascending (as EAGLE-3's ``used_tokens.sort()``). vLLM's and EAGLE-3's checkpoints store *offsets*
  ``target_id - draft_id`` under the same name: :func:`d2t_to_offsets` / :func:`d2t_from_offsets` convert.
* ``t2d`` target -> draft: :func:`t2d_table` (int64 ``[V]``, -1 where a target token has no draft id)
  and :func:`t2d_mask` (bool ``[V]``, vLLM / EAGLE-3's ``t2d`` tensor).

Selection (:func:`select_draft_vocab`): the N target ids most frequent among the *supervised* tokens
of the training data (``loss_mask == 1``: the labels the draft is trained to predict), ties broken by
the smaller id. When fewer than N distinct ids occur, the rest is filled with the ids that never
occur, smallest first (a draft vocabulary always has exactly N entries, so its size is what the flag
says). Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


def is_reduced_vocab(vocab_size: int, draft_vocab_size: int | None) -> bool:
    """Whether a draft vocabulary of ``draft_vocab_size`` tokens (None: the full one) over a target vocabulary
    of ``vocab_size`` is *reduced*: set and smaller than the target's (N < V).

    The one rule for everything that writes or reads a draft's id maps outside DeepSpec (``deepspec export``:
    whether ``draft_vocab_size``, ``lm_head`` and ``d2t`` are shipped, and what the export check expects). It is
    vLLM's (``llama_eagle3.py``, ``qwen3_dflash.py``: a ``d2t`` only when ``draft_vocab_size != vocab_size``;
    ``qwen3_dspark.py``: when ``draft_vocab_size < vocab_size``): a draft vocabulary of all V target tokens
    (``train --draft-vocab-size V``, EAGLE-3's usual setting) maps every id and is the full vocabulary there.
    Inside DeepSpec such a draft keeps its ``d2t`` buffer (a permutation of ``0..V-1``, the identity when
    chosen by :func:`select_draft_vocab`).
    """
    return draft_vocab_size is not None and int(draft_vocab_size) < int(vocab_size)


def count_supervised_tokens(samples: Iterable[dict[str, Any]], vocab_size: int) -> Tensor:
    """int64 ``[V]``: how often each target id occurs where ``loss_mask == 1``, over ``samples``
    (dicts with ``input_ids`` ``[T]`` and ``loss_mask`` ``[T]``, any integer dtypes: what
    :meth:`deepspec.data.cache.reader.TargetCache.read` returns).

    Raises:
        ValueError: a token id outside ``[0, vocab_size)`` or a sample whose two tensors differ in length.
    """
    counts_V = torch.zeros(vocab_size, dtype=torch.int64)
    for i, sample in enumerate(samples):
        ids_T = torch.as_tensor(sample["input_ids"]).long().reshape(-1)
        mask_T = torch.as_tensor(sample["loss_mask"]).reshape(-1).bool()
        if ids_T.shape != mask_T.shape:
            raise ValueError(f"count_supervised_tokens: sample {i}: expected input_ids and loss_mask of one length, "
                             f"received {tuple(ids_T.shape)} and {tuple(mask_T.shape)}.")
        labels = ids_T[mask_T]
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab_size):
            raise ValueError(f"count_supervised_tokens: sample {i}: expected token ids in [0, {vocab_size}), received "
                             f"ids {int(labels.min())}..{int(labels.max())}. The data was tokenised for another target.")
        counts_V += torch.bincount(labels, minlength=vocab_size)
    return counts_V


def select_draft_vocab(counts_V: Tensor, draft_vocab_size: int) -> Tensor:
    """``d2t_N`` (int64, sorted ascending): the ``draft_vocab_size`` ids with the largest counts, ties
    (including the ids with count 0, which fill a vocabulary larger than the distinct ids seen) broken
    by the smaller id.

    Raises:
        ValueError: ``draft_vocab_size`` outside ``[1, V]``.
    """
    V = int(counts_V.shape[0])
    n = draft_vocab_size
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= V:
        raise ValueError(f"draft_vocab_size: expected an integer in [1, {V}] (the target vocabulary), received {n!r}. "
                         "Pick a smaller draft vocabulary, or 0 / None for the full one.")
    # a stable sort of ids 0..V-1 by descending count keeps equal counts in id order
    order_V = torch.sort(-counts_V.long(), stable=True).indices
    return torch.sort(order_V[:n]).values.long()


def validate_d2t(d2t_N: Any, *, vocab_size: int, draft_vocab_size: int, source: str = "d2t") -> Tensor:
    """Check a draft -> target id map read from a checkpoint; return it as int64 ``[N]``.

    Raises:
        ValueError: naming ``source``: not a 1-D integer tensor, a length other than ``draft_vocab_size``
            (the config's), an entry outside ``[0, vocab_size)`` or a repeated entry.
    """
    if not isinstance(d2t_N, Tensor) or d2t_N.dim() != 1 or d2t_N.is_floating_point() or d2t_N.is_complex():
        shape = tuple(d2t_N.shape) if isinstance(d2t_N, Tensor) else type(d2t_N).__name__
        raise ValueError(f"{source}: expected a 1-D integer tensor [draft_vocab_size={draft_vocab_size}], received "
                         f"{shape}{f' {d2t_N.dtype}' if isinstance(d2t_N, Tensor) else ''}. Re-save the draft with DeepSpec.")
    if d2t_N.shape[0] != draft_vocab_size:
        raise ValueError(f"{source}: expected {draft_vocab_size} entries (config draft_vocab_size), received "
                         f"{d2t_N.shape[0]}. The weights and config.json belong to different drafts.")
    d2t_N = d2t_N.long()
    bad = (d2t_N < 0) | (d2t_N >= vocab_size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{source}: expected target ids in [0, {vocab_size}) (absolute ids, not vLLM offsets), "
                         f"received {int(d2t_N[i])} at draft id {i}. Convert offsets with d2t_from_offsets, or "
                         "re-save the draft for this target.")
    sorted_N = d2t_N.sort().values
    repeated = sorted_N[1:][sorted_N[1:] == sorted_N[:-1]]
    if repeated.numel():
        raise ValueError(f"{source}: expected distinct target ids, received target id {int(repeated[0])} more than "
                         "once. Re-save the draft.")
    return d2t_N


def t2d_table(d2t_N: Tensor, vocab_size: int) -> Tensor:
    """int64 ``[V]``: the draft id of each target id, -1 where the target id is not in the draft vocabulary."""
    t2d_V = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t_N.device)
    t2d_V[d2t_N.long()] = torch.arange(d2t_N.shape[0], device=d2t_N.device)
    return t2d_V


def t2d_mask(d2t_N: Tensor, vocab_size: int) -> Tensor:
    """bool ``[V]``: target ids in the draft vocabulary (vLLM / EAGLE-3's ``t2d``)."""
    return t2d_table(d2t_N, vocab_size) >= 0


def d2t_to_offsets(d2t_N: Tensor) -> Tensor:
    """Absolute ids -> vLLM / EAGLE-3 offsets ``d2t[i] - i`` (int64 ``[N]``)."""
    return d2t_N.long() - torch.arange(d2t_N.shape[0], device=d2t_N.device)


def d2t_from_offsets(offsets_N: Tensor) -> Tensor:
    """vLLM / EAGLE-3 offsets -> absolute ids ``offsets[i] + i`` (int64 ``[N]``)."""
    return offsets_N.long() + torch.arange(offsets_N.shape[0], device=offsets_N.device)


def scatter_to_target(probs_XN: Tensor, d2t_N: Tensor, vocab_size: int) -> Tensor:
    """A distribution over draft ids ``[..., N]`` as one over target ids ``[..., V]`` (zeros outside the
    draft vocabulary; same dtype)."""
    out = probs_XN.new_zeros(*probs_XN.shape[:-1], vocab_size)
    out[..., d2t_N.to(probs_XN.device)] = probs_XN
    return out
