"""Batches for draft training, read from the target cache or computed online.

Legend: B sequences per micro-batch, S padded sequence length, F = n_layers * H target features, H hidden.

The data order is a pure function of ``(seed, epoch)``, so an exact resume only needs the global
micro-batch counter: the trainer skips nothing and repeats nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainBatch:
    """One micro-batch, right-padded. Padding has ``loss_mask`` 0 so it carries no anchor and no loss."""

    input_ids_BS: torch.Tensor  # int64
    loss_mask_BS: torch.Tensor  # int64 (0/1)
    target_hidden_BSF: torch.Tensor  # float32
    target_last_hidden_BSH: torch.Tensor  # float32
    sample_indices: list[int]


def epoch_order(num_samples: int, *, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch: a permutation seeded by ``(seed, epoch)``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def micro_batch_indices(num_samples: int, batch_size: int, *, seed: int, micro_step: int) -> list[int]:
    """Sample indices of global micro-batch number ``micro_step`` (0-based), epochs concatenated.

    Every epoch is cut into ``ceil(num_samples / batch_size)`` micro-batches (the last one may be
    smaller), so each sample is seen exactly once per epoch.
    """
    if num_samples <= 0:
        raise ValueError("the target cache holds no samples; run `deepspec cache` on non-empty prepared data")
    per_epoch = -(-num_samples // batch_size)
    epoch, index = divmod(micro_step, per_epoch)
    order = epoch_order(num_samples, seed=seed, epoch=epoch)
    return order[index * batch_size : (index + 1) * batch_size]


def collate(samples: list[dict[str, torch.Tensor]], sample_indices: list[int]) -> TrainBatch:
    """Right-pad samples into a batch: dicts from :class:`deepspec.data.cache.TargetCache` or
    :class:`deepspec.data.online.OnlineTargetFeatures` (``input_ids`` [T], ``loss_mask`` [T],
    ``target_hidden`` [T, F], ``target_last_hidden`` [T, H], any dtypes). Ids and mask become
    int64, features float32; each sample's rows are copied unchanged, so a sample's tensors do not
    depend on its batch position or on its neighbours' lengths."""
    seq_len = max(int(s["input_ids"].shape[0]) for s in samples)
    batch_size = len(samples)
    feat_dim = samples[0]["target_hidden"].shape[-1]
    hidden = samples[0]["target_last_hidden"].shape[-1]
    input_ids_BS = torch.zeros(batch_size, seq_len, dtype=torch.long)
    loss_mask_BS = torch.zeros(batch_size, seq_len, dtype=torch.long)
    target_hidden_BSF = torch.zeros(batch_size, seq_len, feat_dim, dtype=torch.float32)
    target_last_hidden_BSH = torch.zeros(batch_size, seq_len, hidden, dtype=torch.float32)
    for b, sample in enumerate(samples):
        length = int(sample["input_ids"].shape[0])
        input_ids_BS[b, :length] = sample["input_ids"].long()
        loss_mask_BS[b, :length] = sample["loss_mask"].long()
        target_hidden_BSF[b, :length] = sample["target_hidden"].float()
        target_last_hidden_BSH[b, :length] = sample["target_last_hidden"].float()
    return TrainBatch(input_ids_BS, loss_mask_BS, target_hidden_BSF, target_last_hidden_BSH, sample_indices)
