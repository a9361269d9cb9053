"""bench/train.py's analytic FLOP count of a DSpark training step against torch's own FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from deepspec.algorithms.dspark.loss import dspark_loss
from tests.helpers import load_bench_module
from tests.unit.test_dspark import capture, make_draft

pytestmark = pytest.mark.usefixtures("one_thread")


def _bench_train():
    return load_bench_module("train")


@pytest.mark.parametrize("heads", [True, False])
def test_dspark_step_flops_match_torch_flop_counter(heads):
    """Every slot supervised (so the materialised logits are all useful) and the dense mask: the analytic
    forward + backward count equals what torch.utils.flop_counter counts for the same step."""
    from deepspec.algorithms.dspark.config import dflash_knobs

    bench = _bench_train()
    target, draft = make_draft("qwen3", seed=3, **({} if heads else dflash_knobs()))
    draft.train()
    B, S, A = 2, 40, 5
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, target.config.vocab_size, (B, S), generator=g)
    loss_mask = torch.ones(B, S, dtype=torch.long)
    feats, last = capture(target, ids)
    K = draft.config.block_size
    anchors = torch.stack([torch.randperm(S - K - 1, generator=g)[:A].sort().values for _ in range(B)])
    valid = torch.ones(B, A, dtype=torch.bool)
    with FlopCounterMode(display=False) as counter:
        out = draft.forward_train(ids, feats, anchors, valid, use_flex=False)
        res = dspark_loss(out, ids, loss_mask, anchors, valid, last, draft.target_lm_head_weight, draft.config)
        res.loss.backward()
    assert res.num_valid_slots == B * A * draft.config.num_draft_slots  # every slot supervised
    c = draft.config
    analytic = bench.dspark_step_flops(c, anchors, valid, S, res.num_valid_slots, target.config.vocab_size,
                                       attention="dense")
    # torch's counter does not count the CPU SDPA kernel with a mask: its dense score and value products
    # (4 x heads x head_dim x queries x keys per layer, forward; twice that backward) come off the count
    queries, keys = B * A * K, S + A * K
    attention = 3 * 4 * c.num_attention_heads * c.head_dim * queries * keys * c.num_draft_layers
    assert analytic - attention == pytest.approx(counter.get_total_flops(), rel=1e-9)
    visible = bench.dspark_step_flops(draft.config, anchors, valid, S, res.num_valid_slots, target.config.vocab_size)
    assert visible < analytic  # the useful attention is a part of the dense one
