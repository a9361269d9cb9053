"""Batches for draft training, read from the target cache or computed online.

Legend: B sequences per micro-batch, S padded sequence length, F = n_layers * H target features, H hidden.

The data order is a pure function of ``(seed, step, rank, world_size)`` (epoch permutations seeded
by ``(seed, epoch)``, concatenated, cut into global batches of ``batch_size x grad_accum_steps x
world_size`` samples), so an exact resume only needs the step counter: nothing skipped, nothing repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from deepspec.algorithms.protocol import TrainBatch


def epoch_order(num_samples: int, *, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch: a permutation seeded by ``(seed, epoch)``."""
    return list(_epoch_order(num_samples, seed, epoch))


@lru_cache(maxsize=4)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(num_samples, generator=generator).tolist())


def step_sample_indices(num_samples: int, global_batch: int, *, seed: int, step: int) -> list[int]:
    """The ``global_batch`` sample indices of optimizer step ``step`` (0-based): slots
    ``[step * global_batch, (step + 1) * global_batch)`` of the epoch orders concatenated.

    Every sample is seen exactly once per epoch; a step may straddle two epochs (its last slots
    then come from the next epoch's order).

    Raises:
        ValueError: no samples.
    """
    if num_samples <= 0:
        raise ValueError("the target cache holds no samples; run `deepspec cache` on non-empty prepared data")
    out: list[int] = []
    pos = step * global_batch
    while len(out) < global_batch:
        epoch, index = divmod(pos, num_samples)
        take = min(global_batch - len(out), num_samples - index)
        out.extend(_epoch_order(num_samples, seed, epoch)[index : index + take])
        pos += take
    return out


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch of one rank: its samples and the global slot of its first sample in the step."""

    slot: int  # position of indices[0] among the step's global batch (seeds the micro-batch's RNG)
    indices: list[int]


def rank_micro_batches(num_samples: int, *, batch_size: int, grad_accum_steps: int, seed: int, step: int,
                       rank: int = 0, world_size: int = 1) -> list[MicroBatchPlan]:
    """The micro-batches of ``rank`` at optimizer step ``step``: a pure function of
    ``(seed, step, rank, world_size)`` (and the sizes).

    The step's global batch is ``batch_size * grad_accum_steps * world_size`` samples
    (:func:`step_sample_indices`); rank ``r`` takes the contiguous share
    ``[r * batch_size * grad_accum_steps, (r + 1) * batch_size * grad_accum_steps)``, cut into
    ``grad_accum_steps`` micro-batches of ``batch_size``. Ranks' shares are disjoint and together
    cover the global batch, so 2 ranks x 1 micro-batch and 1 rank x 2 micro-batches see the same
    micro-batches (same samples, same slots) in the same step.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    per_rank = batch_size * grad_accum_steps
    order = step_sample_indices(num_samples, per_rank * world_size, seed=seed, step=step)
    base = rank * per_rank
    return [
        MicroBatchPlan(base + m * batch_size, order[base + m * batch_size : base + (m + 1) * batch_size])
        for m in range(grad_accum_steps)
    ]


def micro_batch_seed(seed: int, step: int, slot: int) -> int:
    """Seed of the generator a micro-batch's random choices (e.g. DSpark's anchors) are drawn with: a
    function of ``(seed, step, slot)`` only, so neither resume nor the rank/accumulation split changes them."""
    return ((seed * 1_000_003 + step) * 1_000_003 + slot) % (2**63 - 1)


def collate(samples: list[dict[str, torch.Tensor]], sample_indices: list[int]) -> TrainBatch:
    """Right-pad samples into a batch: dicts from :class:`deepspec.data.cache.reader.TargetCache` or
    :class:`deepspec.data.online.OnlineTargetFeatures` (``input_ids`` [T], ``loss_mask`` [T],
    ``target_hidden`` [T, F], ``target_last_hidden`` [T, H], any dtypes). Ids and mask become
    int64, features float32; each sample's rows are copied unchanged, so a sample's tensors do not
    depend on its batch position or on its neighbours' lengths. ``target_logsumexp`` / ``target_argmax``
    (a format-3 cache) become float32 (NaN padded) / int64 (-1 padded) ``[B, S]`` when every sample
    has them, else None."""
    seq_len = max(int(s["input_ids"].shape[0]) for s in samples)
    batch_size = len(samples)
    feat_dim = samples[0]["target_hidden"].shape[-1]
    hidden = samples[0]["target_last_hidden"].shape[-1]
    input_ids_BS = torch.zeros(batch_size, seq_len, dtype=torch.long)
    loss_mask_BS = torch.zeros(batch_size, seq_len, dtype=torch.long)
    target_hidden_BSF = torch.zeros(batch_size, seq_len, feat_dim, dtype=torch.float32)
    target_last_hidden_BSH = torch.zeros(batch_size, seq_len, hidden, dtype=torch.float32)
    stats = all("target_logsumexp" in s and "target_argmax" in s for s in samples)
    lse_BS = torch.full((batch_size, seq_len), float("nan")) if stats else None
    argmax_BS = torch.full((batch_size, seq_len), -1, dtype=torch.long) if stats else None
    for b, sample in enumerate(samples):
        length = int(sample["input_ids"].shape[0])
        input_ids_BS[b, :length] = sample["input_ids"].long()
        loss_mask_BS[b, :length] = sample["loss_mask"].long()
        target_hidden_BSF[b, :length] = sample["target_hidden"].float()
        target_last_hidden_BSH[b, :length] = sample["target_last_hidden"].float()
        if stats:
            lse_BS[b, :length] = sample["target_logsumexp"].float()
            argmax_BS[b, :length] = sample["target_argmax"].long()
    return TrainBatch(input_ids_BS, loss_mask_BS, target_hidden_BSF, target_last_hidden_BSH, sample_indices,
                      lse_BS, argmax_BS)
