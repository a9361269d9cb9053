"""The DSpark training step's device behaviour, checked on the CPU: the target side of the loss is
computed once per chunk without a graph (not recomputed in backward), the frozen lm_head is cast to
the compute dtype once (not per chunk), the block mask is built once per forward, and a micro-step
reads nothing from the device besides the loss's one ``nonzero``; the step's sums are read once.

Legend: B batch, S sequence, A anchors, K block, V vocab, N valid slots, C slots per chunk.
"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import deepspec.algorithms.dspark.loss as loss_mod
import deepspec.algorithms.dspark.model as model_mod
import deepspec.target.capture as capture_mod
from deepspec.algorithms.dspark.loss import dspark_loss, supervision_weights
from deepspec.algorithms.protocol import TrainBatch
from deepspec.algorithms.registry import get_algorithm
from deepspec.models.anchors import sample_anchors
from deepspec.train.distributed import Dist
from deepspec.train.log import StepMetrics
from tests.unit.test_dspark import batch, capture, make_draft


class _OpCounter(TorchDispatchMode):
    """Counts aten ops by name; ``to_copies`` records (input data pointer, target dtype) of each ``_to_copy``."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.to_copies: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        if name == "_to_copy" and isinstance(args[0], torch.Tensor):
            self.to_copies.append((args[0].data_ptr(), (kwargs or {}).get("dtype")))
        return func(*args, **(kwargs or {}))


def _inputs(seed=4, num_anchors=5, **draft_kw):
    target, draft = make_draft("qwen3", seed=2, markov_head_type="gated", **draft_kw)
    ids, lm = batch(B=2, S=24, seed=seed)
    feats, last = capture(target, ids)
    ap, valid = sample_anchors(lm, num_anchors, torch.Generator().manual_seed(1))
    return draft, (ids, lm, feats, last, ap, valid)


def test_the_target_side_is_computed_once_per_chunk_without_a_graph(monkeypatch):
    """Deferred (checkpointed) chunks: the target logits are computed once per chunk in the forward, under
    no_grad, and never again in backward (not with each chunk's recomputed draft logits)."""
    draft, (ids, lm, feats, last, ap, valid) = _inputs()
    calls = []
    real = capture_mod.target_draft_logits

    def counting(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    # both names: the loss's own import, and the one target_draft_probs calls
    monkeypatch.setattr(capture_mod, "target_draft_logits", counting)
    monkeypatch.setattr(loss_mod, "target_draft_logits", counting, raising=False)
    out = draft.forward_train(ids, feats, ap, valid, defer_logits=True)
    res = dspark_loss(out, ids, lm, ap, valid, last, draft.target_lm_head_weight, draft.config, chunk_slots=7)
    num_chunks = math.ceil(res.num_valid_slots / 7)
    assert num_chunks >= 3 and len(calls) == num_chunks
    res.loss.backward()
    assert draft.fc.weight.grad is not None and float(draft.fc.weight.grad.abs().sum()) > 0
    assert len(calls) == num_chunks, "the target side ran again in backward"
    assert not any(calls), "the target side ran with grad enabled"


def test_chunked_loss_equals_a_direct_computation_of_every_term():
    """The deferred, chunked loss (target logits once per chunk, softmax in float32) equals the terms written
    out from the materialised draft logits and a float64 softmax of the target's lm_head logits."""
    draft, (ids, lm, feats, last, ap, valid) = _inputs()
    cfg = draft.config
    got = dspark_loss(draft.forward_train(ids, feats, ap, valid, defer_logits=True), ids, lm, ap, valid, last,
                      draft.target_lm_head_weight, cfg, chunk_slots=5)
    with torch.no_grad():
        out = draft.forward_train(ids, feats, ap, valid)
        valid_BAK, w_BAK = supervision_weights(lm, ap, valid, cfg)
        b, a, k = valid_BAK.nonzero().unbind(-1)
        pos = ap[b, a] + k
        logp = F.log_softmax(out.logits_BAKV[b, a, k].double(), -1)
        tp = F.softmax(F.linear(last[b, pos].double(), draft.target_lm_head_weight.double()), -1)
        w = w_BAK[b, a, k].double()
        ce = (w * -logp.gather(1, ids[b, pos + 1][:, None]).squeeze(1)).sum() / w.sum()
        l1_N = (logp.exp() - tp).abs().sum(-1)
        l1 = (w * l1_N).sum() / w.sum()
        # the confidence label: the slot's greedy acceptance, counted while every earlier slot was accepted
        match_BAK = torch.zeros(valid_BAK.shape, dtype=torch.float64)
        match_BAK[b, a, k] = (logp.argmax(-1) == tp.argmax(-1)).double()
        eos = torch.zeros_like(match_BAK)
        eos[b, a, k] = torch.tensor([float(int(t) in (cfg.eos_token_ids or ())) for t in ids[b, pos + 1]],
                                    dtype=torch.float64)
        survive = torch.cumprod(match_BAK * (1 - eos), -1)
        reach = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], -1)[b, a, k]
        conf = (w * reach * F.binary_cross_entropy_with_logits(out.confidence_logits_BAK[b, a, k].double(),
                                                               match_BAK[b, a, k], reduction="none")).sum() / w.sum()
    assert got.num_valid_slots == b.numel() > 15
    for name, want in (("ce", ce), ("l1", l1), ("confidence", conf)):
        assert float(getattr(got, name)) == pytest.approx(float(want), rel=1e-5), name
    want_loss = cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.confidence_weight * conf
    assert float(got.loss.detach()) == pytest.approx(float(want_loss), rel=1e-5)


def _train_batch(ids, lm, feats, last):
    return TrainBatch(ids, lm.long(), feats, last, [0, 1])


def test_the_frozen_lm_head_is_cast_to_the_compute_dtype_once_not_per_chunk():
    """Under bf16 autocast the trainer's loss (deferred chunks, forward + backward) copies the frozen
    [V, D] lm_head to bf16 at most once, and not at all on the next micro-batch; the target logits'
    matmul then runs in bf16 (autocast alone re-casts a weight that needs no grad on every call)."""
    draft, (ids, lm, feats, last, ap, valid) = _inputs()
    algo = get_algorithm("dspark")
    prepared = algo.prepare(draft, _train_batch(ids, lm, feats, last), torch.Generator().manual_seed(0),
                            type("Cfg", (), {"num_anchors": 5, "chunked_head_loss": "on"})())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    lm_head_ptr = draft.lm_head.weight.data_ptr()
    casts = []
    for _ in range(2):
        counter = _OpCounter()
        with counter:
            res = algo.loss(draft, prepared, weight_sum=algo.weight(draft, prepared), autocast=autocast)
            res.loss.backward()
        casts.append(sum(1 for ptr, dtype in counter.to_copies if ptr == lm_head_ptr and dtype == torch.bfloat16))
    assert casts[0] <= 1 and casts[1] == 0, casts
    assert draft.frozen_as(draft.lm_head.weight, torch.bfloat16).dtype == torch.bfloat16


def test_the_block_mask_is_built_once_per_forward(monkeypatch):
    """The dense (or flex) block mask depends only on the anchors: one build per forward_train, not per layer."""
    draft, (ids, lm, feats, last, ap, valid) = _inputs()
    assert len(draft.layers) == 2
    built = []
    real = model_mod.dense_block_mask
    monkeypatch.setattr(model_mod, "dense_block_mask", lambda *a, **kw: built.append(1) or real(*a, **kw))
    draft.forward_train(ids, feats, ap, valid, use_flex=False)
    assert len(built) == 1


@pytest.mark.parametrize("variant", ["full", "deferred", "reduced"])
def test_a_micro_step_reads_nothing_from_the_device_but_the_slot_count(variant, monkeypatch):
    """loss + backward + StepMetrics.add: no item / float / bool / int of a tensor (aten._local_scalar_dense),
    no .cpu() / .tolist(); one nonzero (the loss's N). The step's sums come back in one StepMetrics.read."""
    if variant == "reduced":
        from tests.unit.test_draft_vocab import reduced_draft, some_vocab

        target, draft = reduced_draft(some_vocab(30))
        ids, lm = batch(B=2, S=24, seed=4)
        feats, last = capture(target, ids)
    else:
        draft, (ids, lm, feats, last, _, _) = _inputs()
    algo = get_algorithm("dspark")
    cfg = type("Cfg", (), {"num_anchors": 5, "chunked_head_loss": "on" if variant == "deferred" else "off"})()
    micro = [algo.prepare(draft, _train_batch(ids, lm, feats, last), torch.Generator().manual_seed(s), cfg)
             for s in range(2)]
    weight_sum = sum(algo.weight(draft, p) for p in micro)
    host_reads = []
    for name in ("cpu", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real, **kw: host_reads.append(_n)
                            or _r(self, *a, **kw))
    metrics = StepMetrics(torch.device("cpu"))
    counter = _OpCounter()
    with counter:
        for prepared in micro:
            res = algo.loss(draft, prepared, weight_sum=weight_sum, autocast=contextlib.nullcontext())
            res.loss.backward()
            metrics.add(res)
    assert counter.counts.get("_local_scalar_dense", 0) == 0
    assert counter.counts.get("nonzero", 0) == len(micro)
    assert host_reads == []
    monkeypatch.undo()
    # the one read gives what summing the per-micro-batch values on the host gives, bit for bit
    outs = [algo.loss(draft, p, weight_sum=weight_sum, autocast=contextlib.nullcontext()) for p in micro]
    row = metrics.read(Dist(0, 1, 0, torch.device("cpu")), num_tokens=7, grad_norm=torch.tensor(1.5))
    for key in outs[0].scalars():
        assert row[key] == sum(float(o.scalars()[key]) for o in outs), key
    assert row["num_tokens"] == 7.0 and row["grad_norm"] == 1.5
    pooled = outs[0].acceptance + outs[1].acceptance
    assert row["tau_estimate"] == pooled.tau() and row["greedy_tau_estimate"] == pooled.greedy_tau()
    assert set(row) >= {f"accept_rate_prefix_{k + 1}" for k in range(draft.config.num_draft_slots)}
