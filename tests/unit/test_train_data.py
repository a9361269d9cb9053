import torch

from deepspec.train.data import collate, epoch_order, micro_batch_indices


def test_each_epoch_sees_every_sample_once_and_order_is_reproducible():
    seen = [i for m in range(3) for i in micro_batch_indices(10, 4, seed=5, micro_step=m)]
    assert sorted(seen) == list(range(10))
    nxt = [i for m in range(3, 6) for i in micro_batch_indices(10, 4, seed=5, micro_step=m)]
    assert sorted(nxt) == list(range(10)) and nxt != seen
    assert epoch_order(10, seed=5, epoch=0) == epoch_order(10, seed=5, epoch=0)


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
