"""FSDP2 reaches a draft's training outputs however the installed torch looks for them.

FSDP2 registers its pre-backward hook (the all-gather before the backward, the reduce-scatter queued after it) on
the tensors of what a registered forward method returns. torch 2.13 looks inside dataclasses; torch 2.11 flattens
the output with ``torch.utils._pytree``, for which the drafts' ``DraftTrainOutput`` is one leaf: without the flat
tuple of tensors beside it, no hook fired and the sharded parameters never received a gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from deepspec.algorithms.dspark.model import DraftTrainOutput
from deepspec.train.config import TrainConfig
from deepspec.train.distributed import Dist, shard_model
from tests.unit.test_dspark import batch, capture, make_draft

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_method_fsdp_wraps_returns_every_output_tensor_where_pytree_finds_it():
    from deepspec.train.distributed import _outputs_for_fsdp

    base = torch.randn(2, 3, requires_grad=True)

    def forward_train():
        return DraftTrainOutput(logits_BAKV=None, confidence_logits_BAK=base[0], hidden_BAKD=base * 2)

    out, tensors = _outputs_for_fsdp(forward_train)()
    assert isinstance(out, DraftTrainOutput)
    assert out.confidence_logits_BAK._base is None  # a view is cloned (an in-place op on it would skip the hook)
    leaves = [t for t in tree_flatten((out, tensors))[0] if torch.is_tensor(t)]
    for t in (out.confidence_logits_BAK, out.hidden_BAKD):
        assert any(leaf is t for leaf in leaves)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    dist.destroy_process_group()


def test_a_sharded_draft_gets_gradients_when_fsdp_flattens_outputs_with_pytree(one_rank_group, monkeypatch, tmp_path):
    fsdp_state = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_state")

    def register_with_pytree(self, output):  # torch 2.11's FSDPState._register_pre_backward_hook
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    monkeypatch.setattr(fsdp_state.FSDPState, "_register_pre_backward_hook", register_with_pytree)
    target, draft = make_draft()
    ids, _ = batch(B=1, S=24)
    feats, _ = capture(target, ids)
    cfg = TrainConfig(cache_dir=str(tmp_path), output_dir=str(tmp_path / "out"), dtype="fp32")
    model = shard_model(draft.train(), cfg, one_rank_group)
    anchors = torch.tensor([[4, 12]])
    out = model.forward_train(ids, feats, anchors, torch.ones(1, 2, dtype=torch.bool), use_flex=False)
    assert isinstance(out, DraftTrainOutput)
    sum(t.float().square().mean() for t in (out.logits_BAKV, out.hidden_BAKD, out.confidence_logits_BAK)).backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for _, p in trainable), [n for n, p in trainable if p.grad is None]
    assert any(float(p.grad.to_local().abs().sum()) > 0 for _, p in trainable)
