"""Reduced draft vocabulary: selection, id maps, save/load, loss, proposer, lossless greedy.

Legend: B batch, S seq, A anchors, K block, V target vocab, W draft vocab, N valid slots. Tiny random
targets only (the embedded target: tests/integration/test_lossless_real.py).
"""

from collections import Counter

import pytest
import torch

from deepspec.algorithms.dspark.config import dflash_knobs, draft_config_from_target
from deepspec.algorithms.dspark.loss import dspark_loss, supervision_weights
from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.dspark.proposer import DSparkProposer
from deepspec.algorithms.protocol import NullProposer
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.verify import SamplingParams
from deepspec.models.anchors import sample_anchors
from deepspec.models.vocab import (count_supervised_tokens, d2t_from_offsets, d2t_to_offsets, scatter_to_target,
                                   select_draft_vocab, t2d_mask, t2d_table, validate_d2t)
from tests.unit.test_dspark import LAYER_IDS, MASK, V, batch, capture, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def reduced_draft(d2t, *, seed=0, heads=True, markov="vanilla"):
    target = tiny_target("llama", seed)
    knobs = {} if heads else dflash_knobs()
    cfg = draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=LAYER_IDS, mask_token_id=MASK,
                                   markov_rank=8, markov_head_type=markov,
                                   draft_vocab_size=None if d2t is None else int(d2t.numel()), **knobs)
    torch.manual_seed(seed + 1)
    draft = DSparkDraftModel.from_target(target, cfg, d2t=d2t)
    if draft.markov_head is not None:
        torch.manual_seed(seed + 2)
        torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.5)
    return target, draft


def some_vocab(n=24, seed=0):
    """A draft vocabulary of ``n`` ids that contains the mask-free range the test batches use, unsorted ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(V, generator=g)[:n]).values


# ----------------------------------------------------------------------------- selection
def slow_select(samples, V_, n):
    c = Counter()
    for s in samples:
        for tok, m in zip(s["input_ids"].tolist(), s["loss_mask"].tolist()):
            if m:
                c[tok] += 1
    ranked = sorted(range(V_), key=lambda t: (-c[t], t))
    return sorted(ranked[:n]), c


@pytest.mark.parametrize("n", [1, 5, 17, 40, V])
def test_selection_matches_slow_counter(n):
    g = torch.Generator().manual_seed(3)
    samples = []
    for _ in range(6):
        T = int(torch.randint(3, 30, (1,), generator=g))
        ids = torch.randint(0, 30, (T,), generator=g) ** 2 % V  # skewed, with ties; < 30 distinct ids
        samples.append({"input_ids": ids.to(torch.int32), "loss_mask": (torch.rand(T, generator=g) < 0.7).to(torch.uint8)})
    want, c = slow_select(samples, V, n)
    counts = count_supervised_tokens(samples, V)
    assert counts.tolist() == [c[t] for t in range(V)]
    d2t = select_draft_vocab(counts, n)
    assert d2t.dtype == torch.int64 and d2t.tolist() == want
    if n == 40:  # fewer distinct supervised ids than n: filled with unseen ids, smallest first
        seen = sorted(t for t in range(V) if c[t])
        assert len(seen) < n and set(seen) <= set(d2t.tolist())


def test_selection_ties_by_id_and_errors():
    counts = torch.tensor([0, 5, 3, 5, 3, 0])
    assert select_draft_vocab(counts, 3).tolist() == [1, 2, 3]  # 1 and 3 (5 each), then 2 before 4
    for bad in (0, 7, True):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            select_draft_vocab(counts, bad)
    with pytest.raises(ValueError, match="token ids in"):
        count_supervised_tokens([{"input_ids": torch.tensor([9]), "loss_mask": torch.tensor([1])}], 6)


def test_id_maps():
    d2t = torch.tensor([2, 3, 7, 9])
    assert t2d_table(d2t, 10).tolist() == [-1, -1, 0, 1, -1, -1, -1, 2, -1, 3]
    assert t2d_mask(d2t, 10).tolist() == [t in (2, 3, 7, 9) for t in range(10)]
    assert d2t_to_offsets(d2t).tolist() == [2, 2, 5, 6]  # vLLM / EAGLE-3: target = draft + offset
    assert torch.equal(d2t_from_offsets(d2t_to_offsets(d2t)), d2t)
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    full = scatter_to_target(q, d2t, 10)
    assert full.shape == (1, 10) and torch.equal(full[0, d2t], q[0]) and float(full.sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("d2t, match", [
    (torch.tensor([0, 1, V]), "target ids in"),
    (torch.tensor([0, -1, 2]), "target ids in"),
    (torch.tensor([0, 1, 1]), "distinct"),
    (torch.tensor([0, 1]), "expected 3 entries"),
    (torch.tensor([0.0, 1.0, 2.0]), "integer tensor"),
])
def test_validate_d2t_errors(d2t, match):
    with pytest.raises(ValueError, match=match):
        validate_d2t(d2t, vocab_size=V, draft_vocab_size=3, source="x/d2t")


# ----------------------------------------------------------------------------- model, save / load
def test_reduced_draft_shapes_and_frozen_rows():
    d2t = some_vocab()
    target, draft = reduced_draft(d2t)
    W = d2t.numel()
    assert draft.lm_head.weight.shape == (W, 32) and not draft.lm_head.weight.requires_grad
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[d2t])
    assert draft.markov_head.markov_w1.weight.shape == (V, 8)  # indexed by previous *target* ids
    assert draft.markov_head.markov_w2.weight.shape == (W, 8)
    assert torch.equal(draft.target_lm_head_weight, target.lm_head.weight)
    assert "d2t" in draft.state_dict() and "target_lm_weight" not in draft.state_dict()
    with pytest.raises(ValueError, match="d2t"):
        DSparkDraftModel.from_target(target, draft.config)  # reduced config without a map
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=LAYER_IDS, mask_token_id=MASK,
                                 draft_vocab_size=V + 1)


def test_id_map_survives_save_load_and_bad_maps_are_load_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    d2t = some_vocab()
    _, draft = reduced_draft(d2t)
    draft.save_pretrained(tmp_path / "d")
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "d")
    assert loaded.d2t.dtype == torch.int64 and torch.equal(loaded.d2t, d2t)
    assert loaded.config.draft_vocab_size == d2t.numel()
    for k, v in draft.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    with pytest.raises(ValueError, match="target_lm_weight"):
        loaded.target_lm_head_weight  # noqa: B018  (a loaded reduced draft cannot compute its training loss)

    weights = tmp_path / "d" / "model.safetensors"
    state = load_file(str(weights))
    for bad, match in [(torch.cat([d2t[:-1], torch.tensor([V + 3])]), "target ids in"),
                       (d2t[:-1], "expected 24 entries"),
                       (torch.cat([d2t[:-1], d2t[:1]]), "distinct")]:
        save_file({**state, "d2t": bad.contiguous()}, str(weights))
        with pytest.raises(ValueError, match=f"d2t.*{match}"):
            DSparkDraftModel.from_pretrained(tmp_path / "d")
    save_file({k: v for k, v in state.items() if k != "d2t"}, str(weights))
    with pytest.raises(ValueError, match="d2t.*received none"):
        DSparkDraftModel.from_pretrained(tmp_path / "d")


def test_full_vocab_draft_with_a_d2t_is_a_load_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _, draft = reduced_draft(None)
    draft.save_pretrained(tmp_path / "d")
    weights = tmp_path / "d" / "model.safetensors"
    save_file({**load_file(str(weights)), "d2t": torch.arange(4)}, str(weights))
    with pytest.raises(ValueError, match="d2t.*draft_vocab_size null"):
        DSparkDraftModel.from_pretrained(tmp_path / "d")


# ----------------------------------------------------------------------------- loss
def slow_reduced_loss(logits_BAKW, conf_BAK, ids, lm, ap, bv, th_BSH, target_lm_VD, d2t, cfg):
    """Slot by slot, in target id space: the draft distribution scattered into V."""
    valid, w = supervision_weights(lm, ap, bv, cfg)
    ws = float(w.sum())
    ce = l1 = conf = 0.0
    B, A, K, _ = logits_BAKW.shape
    eos = set(cfg.eos_token_ids or ())
    for b in range(B):
        for a in range(A):
            reach = 1.0  # the confidence label counts while every earlier slot was accepted (greedy, no EOS)
            for k in range(K):
                if not valid[b, a, k]:
                    reach = 0.0
                    continue
                pos = int(ap[b, a]) + k
                label = int(ids[b, pos + 1])
                pd_V = torch.zeros(target_lm_VD.shape[0], dtype=torch.float64)
                pd_V[d2t] = torch.softmax(logits_BAKW[b, a, k].double(), -1)
                pt_V = torch.softmax((th_BSH[b, pos] @ target_lm_VD.T).double(), -1)
                wk = float(w[b, a, k])
                if label in d2t.tolist():
                    ce += wk * -float(torch.log(pd_V[label]))
                l1_slot = float((pd_V - pt_V).abs().sum())
                l1 += wk * l1_slot
                y = float(int(pd_V.argmax()) == int(pt_V.argmax()))  # greedy acceptance of the slot
                x = float(conf_BAK[b, a, k])
                conf += wk * reach * (max(x, 0) - x * y + torch.log1p(torch.exp(torch.tensor(-abs(x)))).item())
                reach *= y * (label not in eos)
    return ce / ws, l1 / ws, conf / ws


def _train_inputs(draft, target, seed=0, B=2, S=24):
    ids, lm = batch(B, S, seed)
    feats, last = capture(target, ids)
    ap, bv = sample_anchors(lm, 4, torch.Generator().manual_seed(seed))
    out = draft.forward_train(ids, feats, ap, bv)
    return ids, lm, feats, last, ap, bv, out


def test_reduced_loss_matches_slow_version():
    d2t = some_vocab(30)
    target, draft = reduced_draft(d2t)
    ids, lm, feats, last, ap, bv, out = _train_inputs(draft, target)
    assert out.logits_BAKV.shape[-1] == d2t.numel()
    res = dspark_loss(out, ids, lm, ap, bv, last, draft.target_lm_head_weight, draft.config, d2t_W=draft.d2t,
                      chunk_slots=5)
    ce, l1, conf = slow_reduced_loss(out.logits_BAKV.detach(), out.confidence_logits_BAK.detach(), ids, lm, ap, bv,
                                     last, target.lm_head.weight.detach(), d2t, draft.config)
    assert res.num_labels_outside_vocab > 0  # the batch has labels the draft cannot propose
    assert float(res.ce) == pytest.approx(ce, rel=1e-4)
    assert float(res.l1) == pytest.approx(l1, rel=1e-4)
    assert float(res.confidence) == pytest.approx(conf, rel=1e-4)
    res.loss.backward()  # differentiable through the reduced logits
    assert draft.fc.weight.grad is not None and draft.markov_head.markov_w2.weight.grad is not None


def test_reduced_top1_diagnostic_compares_target_ids():
    d2t = some_vocab(30)
    target, draft = reduced_draft(d2t)
    ids, lm, feats, last, ap, bv, out = _train_inputs(draft, target)
    res = dspark_loss(out, ids, lm, ap, bv, last, draft.target_lm_head_weight, draft.config, d2t_W=draft.d2t)
    valid, _ = supervision_weights(lm, ap, bv, draft.config)
    hits = torch.zeros(draft.config.block_size)
    counts = torch.zeros(draft.config.block_size)
    for b, a, k in valid.nonzero().tolist():
        pos = int(ap[b, a]) + k
        drafted = int(d2t[out.logits_BAKV[b, a, k].argmax()])
        hits[k] += float(drafted == int((last[b, pos] @ target.lm_head.weight.T).argmax()))
        counts[k] += 1
    assert torch.allclose(res.top1_match_K, hits / counts.clamp_min(1))


@pytest.mark.parametrize("heads", [True, False], ids=["dspark", "dflash"])
def test_identity_map_over_the_full_vocab_equals_the_full_draft(heads):
    _, full = reduced_draft(None, heads=heads)
    target, red = reduced_draft(torch.arange(V), heads=heads)
    for k, v in full.state_dict().items():
        assert torch.equal(v, red.state_dict()[k]), k  # same seed, same init, same shapes
    inputs = _train_inputs(full, target)
    ids, lm, feats, last, ap, bv, out_full = inputs
    out_red = red.forward_train(ids, feats, ap, bv)
    assert torch.equal(out_full.logits_BAKV, out_red.logits_BAKV)
    a = dspark_loss(out_full, ids, lm, ap, bv, last, full.lm_head, full.config)
    b = dspark_loss(out_red, ids, lm, ap, bv, last, red.target_lm_head_weight, red.config, d2t_W=red.d2t)
    for name in ("loss", "ce", "l1", "confidence"):
        x, y = float(getattr(a, name).detach()), float(getattr(b, name).detach())
        assert x == pytest.approx(y, rel=1e-6, abs=1e-7), name
    assert torch.equal(a.top1_match_K, b.top1_match_K) and b.num_labels_outside_vocab == 0


# ----------------------------------------------------------------------------- proposer, lossless
@pytest.mark.parametrize("markov", ["vanilla", "rnn"])
def test_proposer_returns_target_ids_and_full_vocab_probs(markov):
    d2t = some_vocab(20)
    target, draft = reduced_draft(d2t, markov=markov)
    ids = torch.randint(6, V, (1, 12), generator=torch.Generator().manual_seed(1))
    feats, _ = capture(target, ids)
    prop = DSparkProposer(draft)
    prop.extend_context(feats[0, :11], ids[0, :11].tolist())
    greedy = prop.propose(int(ids[0, 11]), 11, sampling=SamplingParams(), generator=None)
    assert set(greedy.draft_ids_N.tolist()) <= set(d2t.tolist())
    # the serial rule by hand: argmax over draft ids, mapped to target ids, prev = the target id
    hidden_KD, base_KW = draft.block_hidden(prop.cache, int(ids[0, 11]), 11)
    prev, state, want = torch.tensor([int(ids[0, 11])]), None, []
    for k in range(greedy.num_proposed):
        logits_W, _, state = draft.slot_step(hidden_KD[k], base_KW[k], prev, state)
        prev = d2t[logits_W.argmax()].view(1)
        want.append(int(prev))
    assert greedy.draft_ids_N.tolist() == want
    sampled = prop.propose(int(ids[0, 11]), 11, sampling=SamplingParams(temperature=1.0, top_k=5),
                           generator=torch.Generator().manual_seed(0))
    q = sampled.draft_probs_NV
    assert q.shape == (sampled.num_proposed, V) and q.dtype == torch.float32
    outside = torch.ones(V, dtype=torch.bool)
    outside[d2t] = False
    assert float(q[:, outside].abs().sum()) == 0.0
    assert torch.allclose(q.sum(-1), torch.ones(q.shape[0]))
    assert all(float(q[i, t]) > 0 for i, t in enumerate(sampled.draft_ids_N.tolist()))


@pytest.mark.parametrize("n", [8, 40])
def test_reduced_draft_greedy_is_lossless_on_a_tiny_target(n):
    target, draft = reduced_draft(some_vocab(n, seed=n))
    prompt = torch.randint(6, V, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    base = SpeculativeEngine(target, LAYER_IDS, NullProposer(), [1]).generate(prompt, max_new_tokens=30)
    spec = SpeculativeEngine(target, LAYER_IDS, DSparkProposer(draft), [1]).generate(prompt, max_new_tokens=30)
    assert spec.output_ids == base.output_ids
    assert sum(s.num_proposed for s in spec.steps) > 0
