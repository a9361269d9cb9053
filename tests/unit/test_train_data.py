import pytest
import torch

from deepspec.train.data import (
    collate,
    epoch_order,
    micro_batch_seed,
    rank_micro_batches,
    step_sample_indices,
)


def test_each_epoch_sees_every_sample_once_and_order_is_reproducible():
    # 10 samples, global batch 4: steps straddle epochs; the stream is the epoch orders concatenated
    stream = [i for step in range(5) for i in step_sample_indices(10, 4, seed=5, step=step)]
    assert stream[:10] == epoch_order(10, seed=5, epoch=0) and stream[10:] == epoch_order(10, seed=5, epoch=1)
    assert sorted(stream[:10]) == list(range(10)) and stream[10:] != stream[:10]
    assert step_sample_indices(10, 4, seed=5, step=3) == step_sample_indices(10, 4, seed=5, step=3)
    assert step_sample_indices(10, 4, seed=6, step=0) != step_sample_indices(10, 4, seed=5, step=0)
    with pytest.raises(ValueError, match="no samples"):
        step_sample_indices(0, 4, seed=5, step=0)


def test_ranks_take_disjoint_shares_that_match_one_process_with_accumulation():
    for step in range(4):
        one = rank_micro_batches(10, batch_size=2, grad_accum_steps=4, seed=1, step=step)
        two = [p for r in range(2) for p in rank_micro_batches(10, batch_size=2, grad_accum_steps=2, seed=1,
                                                               step=step, rank=r, world_size=2)]
        four = [p for r in range(4) for p in rank_micro_batches(10, batch_size=2, grad_accum_steps=1, seed=1,
                                                                step=step, rank=r, world_size=4)]
        assert one == two == four  # same micro-batches, same slots (so the same anchor seeds)
        assert [p.slot for p in one] == [0, 2, 4, 6]
        assert [i for p in one for i in p.indices] == step_sample_indices(10, 8, seed=1, step=step)
    assert micro_batch_seed(0, 3, 2) == micro_batch_seed(0, 3, 2) != micro_batch_seed(0, 3, 4)
    with pytest.raises(ValueError, match="rank"):
        rank_micro_batches(10, batch_size=2, grad_accum_steps=1, seed=1, step=0, rank=2, world_size=2)


def test_collate_right_pads_with_zero_loss_mask():
    def sample(n):
        return {
            "input_ids": torch.arange(1, n + 1, dtype=torch.int32),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "target_hidden": torch.randn(n, 6, dtype=torch.bfloat16),
            "target_last_hidden": torch.randn(n, 3),
        }

    a, b = sample(3), sample(5)
    batch = collate([a, b], [0, 1])
    assert batch.input_ids_BS.shape == (2, 5) and batch.input_ids_BS.dtype == torch.long
    assert batch.loss_mask_BS[0].tolist() == [1, 1, 1, 0, 0]
    assert batch.target_hidden_BSF.dtype == torch.float32
    assert torch.equal(batch.target_hidden_BSF[0, :3], a["target_hidden"].float())
    assert batch.target_hidden_BSF[0, 3:].abs().sum() == 0
