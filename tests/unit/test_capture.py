"""Tests for deepspec.target.capture (tiny random Llama / Qwen3 targets, CPU).

Shape legend: B batch, T tokens, H hidden, F = n * H features, V vocab.
Oracle for "feature of layer i": a forward hook on model.model.layers[i] (its raw output), and a
pre-hook on layers[0] for -1 (the embedding output); HF hidden_states are checked against both.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from deepspec.target import capture
from deepspec.target.capture import (
    TargetOutput,
    capture_hooks,
    default_target_layer_ids,
    positions_from_attention_mask,
    target_forward,
    validate_target_layer_ids,
)

NUM_LAYERS = 4
COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attn_implementation="sdpa",
)


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=True)).eval()


def _qwen3():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=False)).eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return _llama() if request.param == "llama" else _qwen3()


def _oracle_layer_outputs(model, input_ids_BT, **kw):
    """Raw outputs of every decoder layer (hooks) + the embedding output + HF outputs."""
    outs: dict[int, torch.Tensor] = {}
    hs = []
    for i, layer in enumerate(model.model.layers):
        hs.append(layer.register_forward_hook(
            lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o)))
    hs.append(model.model.layers[0].register_forward_pre_hook(
        lambda m, a, k: outs.__setitem__(-1, a[0] if a else k["hidden_states"]), with_kwargs=True))
    try:
        with torch.no_grad():
            hf = model(input_ids=input_ids_BT, output_hidden_states=True, **kw)
    finally:
        for h in hs:
            h.remove()
    return outs, hf


def _num_hooks(model) -> int:
    return sum(len(layer._forward_hooks) + len(layer._forward_pre_hooks) for layer in model.model.layers)


def test_default_ids():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-4B
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]  # SmolLM2-135M (upstream DFlash rounding)
    assert default_target_layer_ids(28, 1) == [14]
    for L in (8, 12, 28, 36, 40, 64):
        ids = default_target_layer_ids(L)
        assert ids[0] == 1 and ids[-1] == L - 3 and ids == sorted(set(ids))
        assert validate_target_layer_ids(ids, L) == ids
    with pytest.raises(ValueError, match="too shallow"):
        default_target_layer_ids(4, 5)


def test_validate_rejects_last_layer_with_reason():
    with pytest.raises(ValueError, match="final norm") as e:
        validate_target_layer_ids([1, 29], 30)
    assert "29" in str(e.value) and "[-1, 28]" in str(e.value)
    with pytest.raises(ValueError, match="out of range"):
        validate_target_layer_ids([30], 30)
    with pytest.raises(ValueError, match="out of range"):
        validate_target_layer_ids([-2], 30)
    with pytest.raises(ValueError, match="duplicate"):
        validate_target_layer_ids([1, 1], 30)
    with pytest.raises(ValueError, match="empty"):
        validate_target_layer_ids([], 30)
    with pytest.raises(ValueError, match="ints"):
        validate_target_layer_ids([1.0], 30)
    assert validate_target_layer_ids((-1, 0, 28), 30) == [-1, 0, 28]


def test_features_are_decoder_layer_outputs_and_hf_hidden_states(model):
    g = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(0, 97, (2, 9), generator=g)
    layer_ids = [-1, 0, 2]
    oracle, hf = _oracle_layer_outputs(model, ids_BT)
    out = target_forward(model, ids_BT, layer_ids, compute_logits=True)
    assert isinstance(out, TargetOutput)
    H = model.config.hidden_size
    assert out.target_hidden_BTF.shape == (2, 9, 3 * H)
    for k, i in enumerate(layer_ids):
        feat = out.target_hidden_BTF[..., k * H:(k + 1) * H]
        assert torch.equal(feat, oracle[i])
        assert torch.equal(feat, hf.hidden_states[i + 1])  # DESIGN: layer i == hidden_states[i + 1]
    # Finding on transformers 5.x: HF's last hidden_states entry is the final-NORM output,
    # not the raw output of the last decoder layer -> L-1 must be rejected.
    last = model.config.num_hidden_layers - 1
    assert len(hf.hidden_states) == NUM_LAYERS + 1
    assert torch.equal(hf.hidden_states[-1], model.model.norm(oracle[last]))
    assert not torch.allclose(hf.hidden_states[-1], oracle[last])
    assert torch.equal(out.target_last_hidden_BTH, hf.hidden_states[-1])
    assert torch.equal(out.logits_BTV, hf.logits)
    assert torch.equal(model.lm_head(out.target_last_hidden_BTH), hf.logits)
    # logits are only computed when asked for
    assert target_forward(model, ids_BT, layer_ids).logits_BTV is None
    # our hooks are removed afterwards (HF's own output-capturing hooks, installed lazily, may stay)
    before = _num_hooks(model)
    target_forward(model, ids_BT, layer_ids)
    assert _num_hooks(model) == before


def test_hooks_removed_on_error(model):
    before = _num_hooks(model)
    with pytest.raises(Exception):
        target_forward(model, torch.full((1, 3), 10_000), [-1, 0])  # out-of-vocab id -> embedding error
    assert _num_hooks(model) == before


def test_padding_left_and_right_match_unpadded(model):
    g = torch.Generator().manual_seed(2)
    a = torch.randint(3, 97, (7,), generator=g)
    b = torch.randint(3, 97, (4,), generator=g)
    layer_ids = [0, 2]
    ref_a = target_forward(model, a[None], layer_ids, compute_logits=True)
    ref_b = target_forward(model, b[None], layer_ids, compute_logits=True)
    pad = 0
    for side in ("right", "left"):
        b_pad = torch.cat([b, torch.full((3,), pad)]) if side == "right" else torch.cat([torch.full((3,), pad), b])
        m_b = (torch.arange(7) < 4) if side == "right" else (torch.arange(7) >= 3)
        ids_BT = torch.stack([a, b_pad])
        mask_BT = torch.stack([torch.ones(7, dtype=torch.long), m_b.long()])
        out = target_forward(model, ids_BT, layer_ids, attention_mask_BT=mask_BT, compute_logits=True)
        assert torch.isfinite(out.target_hidden_BTF[1][m_b]).all()
        torch.testing.assert_close(out.target_hidden_BTF[0], ref_a.target_hidden_BTF[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.target_hidden_BTF[1][m_b], ref_b.target_hidden_BTF[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.target_last_hidden_BTH[1][m_b], ref_b.target_last_hidden_BTH[0],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.logits_BTV[1][m_b], ref_b.logits_BTV[0], rtol=1e-5, atol=1e-5)


def test_positions_from_attention_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert positions_from_attention_mask(mask, 5).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]
    assert positions_from_attention_mask(mask, 2).tolist() == [[1, 2], [2, 2]]


def test_incremental_decoding_with_dynamic_cache(model):
    """Prefill then feed tokens with a DynamicCache and explicit positions == one full forward."""
    g = torch.Generator().manual_seed(3)
    ids_T = torch.randint(3, 97, (10,), generator=g)
    layer_ids = [-1, 1, 2]
    full = target_forward(model, ids_T[None], layer_ids, compute_logits=True)

    cache = DynamicCache(config=model.config)
    pre = target_forward(model, ids_T[None, :6], layer_ids, past_key_values=cache, use_cache=True,
                         compute_logits=True)
    assert pre.past_key_values is cache and cache.get_seq_length() == 6
    step1 = target_forward(model, ids_T[None, 6:9], layer_ids, past_key_values=cache, use_cache=True,
                           position_ids_BT=torch.arange(6, 9)[None], compute_logits=True)
    assert cache.get_seq_length() == 9
    # crop (as after a rejected draft) and re-feed with an attention mask covering past + new
    cache.crop(-1)  # transformers 5.24: crop(n>0) raises; a negative n removes that many tokens
    step2 = target_forward(model, ids_T[None, 8:10], layer_ids, past_key_values=cache, use_cache=True,
                           attention_mask_BT=torch.ones(1, 10, dtype=torch.long), compute_logits=True)
    assert cache.get_seq_length() == 10
    got_F = torch.cat([pre.target_hidden_BTF, step1.target_hidden_BTF[:, :2], step2.target_hidden_BTF], 1)
    got_H = torch.cat([pre.target_last_hidden_BTH, step1.target_last_hidden_BTH[:, :2],
                       step2.target_last_hidden_BTH], 1)
    got_V = torch.cat([pre.logits_BTV, step1.logits_BTV[:, :2], step2.logits_BTV], 1)
    torch.testing.assert_close(got_F, full.target_hidden_BTF, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_H, full.target_last_hidden_BTH, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_V, full.logits_BTV, rtol=1e-5, atol=1e-5)


def test_invalid_layer_ids_rejected_at_call(model):
    with pytest.raises(ValueError, match="final norm"):
        target_forward(model, torch.ones(1, 3, dtype=torch.long), [NUM_LAYERS - 1])


def test_kept_hooks_give_the_same_features_and_are_added_once(model, monkeypatch):
    """Inside capture_hooks, target_forward reads the kept hooks (added once for every forward inside) and
    returns what it returns outside; other ids still get their own hooks; all are gone after the block."""
    g = torch.Generator().manual_seed(4)
    ids_T = torch.randint(3, 97, (9,), generator=g)
    layer_ids = [-1, 0, 2]
    outside = [target_forward(model, ids_T[None, :5], layer_ids), target_forward(model, ids_T[None, 5:], layer_ids)]
    added = []
    real_add = capture._add_capture_hooks
    monkeypatch.setattr(capture, "_add_capture_hooks", lambda *a: added.append(a[1]) or real_add(*a))
    before = _num_hooks(model)
    with capture_hooks(model, layer_ids):
        assert _num_hooks(model) == before + len(layer_ids)
        inside = [target_forward(model, ids_T[None, :5], layer_ids), target_forward(model, ids_T[None, 5:], layer_ids)]
        other = target_forward(model, ids_T[None, :5], [1])
        with capture_hooks(model, layer_ids):  # re-entered with the same ids: the outer hooks serve
            again = target_forward(model, ids_T[None, :5], layer_ids)
    assert _num_hooks(model) == before
    assert added == [layer_ids, [1]]  # the kept hooks once, and the call with other ids its own
    for a, b in zip(inside + [again], outside + [outside[0]]):
        torch.testing.assert_close(a.target_hidden_BTF, b.target_hidden_BTF, rtol=0, atol=0)
    torch.testing.assert_close(other.target_hidden_BTF, target_forward(model, ids_T[None, :5], [1]).target_hidden_BTF,
                               rtol=0, atol=0)


def test_kept_hooks_removed_on_error_and_other_ids_refused(model):
    before = _num_hooks(model)
    with pytest.raises(RuntimeError, match="layers \\[0, 2\\] are kept"):
        with capture_hooks(model, [0, 2]):
            with capture_hooks(model, [1]):
                pass
    assert _num_hooks(model) == before
    with pytest.raises(ValueError, match="final norm"):
        with capture_hooks(model, [NUM_LAYERS - 1]):
            pass
    assert _num_hooks(model) == before
