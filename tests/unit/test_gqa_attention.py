"""Grouped-query verify attention: the same attention as transformers' sdpa, without the repeated key/value heads."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from deepspec.decoding.engine import SpeculativeEngine, tree_attention_mask
from deepspec.target.gqa_attention import GQA_SDPA, GroupedQueryVerify
from tests.unit.test_engine import LAYER_IDS, RandomProposer, target  # noqa: F401


def _llama(kv_heads: int, dtype: torch.dtype = torch.float32, attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=kv_heads, max_position_embeddings=256, attn_implementation=attn)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _repeats(monkeypatch) -> list[int]:
    """Count transformers' sdpa repeating the key/value heads."""
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    real = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda x, n: calls.append(n) or real(x, n))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [False, True])
def test_a_verify_under_it_is_bit_for_bit_sdpa_without_repeating_the_heads(dtype, tree, monkeypatch):
    model = _llama(kv_heads=2, dtype=dtype)
    gqa = GroupedQueryVerify(model)
    assert gqa.applies
    ids = torch.randint(2, 97, (1, 120), generator=torch.Generator().manual_seed(1))
    kwargs = {}
    if tree:  # an anchor and two children, each with a child: positions by depth, the tree's mask
        parents = [-1, 0, 0, 1, 2]
        kwargs = {"attention_mask": tree_attention_mask(parents[1:], 112, "cpu"),
                  "position_ids": torch.tensor([[112, 113, 113, 114, 114]])}
    new = ids[:, 112:117] if tree else ids[:, 112:]
    repeats = _repeats(monkeypatch)
    with torch.inference_mode():
        cache = model(ids[:, :112], past_key_values=DynamicCache(), use_cache=True).past_key_values
        before = len(repeats)
        stock = model(new, past_key_values=copy.deepcopy(cache), use_cache=True, **kwargs).logits
        assert len(repeats) > before  # sdpa repeats the heads under a mask
        before = len(repeats)
        with gqa():
            assert model.config._attn_implementation == GQA_SDPA
            swapped = model(new, past_key_values=copy.deepcopy(cache), use_cache=True, **kwargs).logits
        assert len(repeats) == before  # not under the swap
    assert model.config._attn_implementation == "sdpa"  # restored
    assert torch.equal(stock, swapped)


def test_it_applies_only_to_grouped_query_sdpa_models_on_the_cpu():
    assert not GroupedQueryVerify(_llama(kv_heads=8)).applies  # one key/value head per query head: no repeat
    assert not GroupedQueryVerify(_llama(kv_heads=2, attn="eager")).applies
    model = _llama(kv_heads=8)
    with GroupedQueryVerify(model)():
        assert model.config._attn_implementation == "sdpa"  # a context that does not apply changes nothing


def test_the_config_is_restored_after_an_exception():
    model = _llama(kv_heads=2)
    with pytest.raises(RuntimeError, match="boom"), GroupedQueryVerify(model)():
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_the_engine_verifies_under_it_and_plain_steps_do_not(target, monkeypatch):  # noqa: F811
    """A drafting engine's verify forwards run the grouped-query attention; its one-token steps and the prefill run
    sdpa as target-only decoding does; exact verification keeps its own attention."""
    width = target.config.hidden_size * len(LAYER_IDS)
    engine = SpeculativeEngine(target, LAYER_IDS, RandomProposer(width, seed=2), [1], schedule="fixed")
    seen = []
    real = engine.forward_fn

    def spy(model, input_ids_BT, *args, **kwargs):
        seen.append((input_ids_BT.shape[1], model.config._attn_implementation))
        return real(model, input_ids_BT, *args, **kwargs)

    engine.forward_fn = spy
    engine.generate([5, 6, 7, 8], max_new_tokens=12)
    prefill, *steps = seen
    assert prefill == (4, "sdpa")
    assert {impl for n, impl in steps if n > 1} == {GQA_SDPA} and {impl for n, impl in steps if n == 1} <= {"sdpa"}
    assert engine._cost_key(8)["gqa_verify"] is True
    exact = SpeculativeEngine(target, LAYER_IDS, RandomProposer(width, seed=2), [1], schedule="fixed", exact=True)
    assert exact._gqa_verify is None and exact._cost_key(8)["gqa_verify"] is False
