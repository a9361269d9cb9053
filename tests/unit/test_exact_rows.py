"""Exact rows (deepspec.target.exact_rows): a verify forward over n tokens gives, bit for bit, the logits of n
one-token forwards (chains and draft trees, bfloat16 and float32), and greedy speculative decoding in bfloat16
with a draft that proposes the target's own near-tied choices is token-identical to target-only decoding.

The target has the embedded default's layer widths (hidden 576, MLP 1536, 9 query and 3 key/value heads of 64),
the shapes whose kernels are not row-invariant, with 2 layers and a small vocabulary. Its weights are drawn
wide (std 0.3), as a trained model's outliers make them, so that a change of summation order reaches the
logits often enough for every test here to fail without exact rows (checked with them switched off)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from deepspec.algorithms.protocol import NullProposer, Proposal
from deepspec.decoding.engine import SpeculativeEngine, tree_attention_mask
from deepspec.decoding.flips import argmax_flip_positions, chunked_argmax
from deepspec.target.capture import target_forward
from deepspec.target.exact_rows import ExactRows, exact_target_forward

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512
EOS = [VOCAB + 1]  # never produced: every generation runs to max_new_tokens
PREFIX = 32


def _target(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=True,
                      initializer_range=0.3, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def target(request):
    return _target(request.param)


@pytest.fixture(scope="module")
def target_bf16():
    return _target(torch.bfloat16)


def _forward(model, ids, start, cache, **kw):
    pos = torch.arange(start, start + len(ids))[None] if "position_ids_BT" not in kw else kw.pop("position_ids_BT")
    return target_forward(model, torch.tensor([ids]), [], position_ids_BT=pos, past_key_values=cache, use_cache=True,
                          compute_logits=True, **kw).logits_BTV[0]


def _prefilled(model, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (PREFIX + 16,), generator=gen).tolist()
    cache = DynamicCache()
    _forward(model, ids[:PREFIX], 0, cache)
    return ids, cache


@pytest.mark.parametrize("n", [4, 8, 16])
def test_verify_rows_equal_one_token_forwards_bit_for_bit(target, n):
    ids, cache = _prefilled(target)
    one_cache = copy.deepcopy(cache)
    one_BV = torch.cat([_forward(target, [t], PREFIX + i, one_cache) for i, t in enumerate(ids[PREFIX:PREFIX + n])])
    with ExactRows(target)(n):
        verify_BV = _forward(target, ids[PREFIX:PREFIX + n], PREFIX, copy.deepcopy(cache))
    assert torch.equal(verify_BV, one_BV), f"{(verify_BV != one_BV).float().mean():.3f} of the logits differ"


def test_tree_rows_equal_one_token_forwards_along_their_paths(target):
    ids, cache = _prefilled(target, seed=1)
    anchor, parents = ids[PREFIX], [-1, 0, 1, -1, 3, 0]  # two branches from the anchor, one of them splitting
    nodes = ids[PREFIX + 1:PREFIX + 1 + len(parents)]
    depths = [0] * (len(parents) + 1)
    for i, p in enumerate(parents):
        depths[i + 1] = depths[p + 1] + 1
    with ExactRows(target)(len(parents) + 1):
        tree_BV = _forward(target, [anchor, *nodes], PREFIX, copy.deepcopy(cache),
                           position_ids_BT=torch.tensor([[PREFIX + d for d in depths]]),
                           attention_mask_BT=tree_attention_mask(parents, PREFIX))
    for row in range(len(parents) + 1):
        path, node = [], row - 1
        while node >= 0:
            path.insert(0, nodes[node])
            node = parents[node]
        one_cache = copy.deepcopy(cache)
        logits = [_forward(target, [t], PREFIX + i, one_cache) for i, t in enumerate([anchor, *path])][-1]
        assert torch.equal(tree_BV[row], logits[0]), f"tree row {row}"


class ScriptedProposer(NullProposer):  # its no-op prepare, reset and extend_context
    """Proposes the next K tokens of a fixed sequence (the target-only output): every draft is the target's own
    greedy choice, near-ties included, so a lossless verify accepts them all. Reads no features."""

    needs_features = False
    max_proposal_len = 7

    def __init__(self, sequence: list[int]):
        self.sequence = sequence

    def propose(self, anchor_token, anchor_pos, *, sampling, generator):
        ids = self.sequence[anchor_pos + 1:anchor_pos + 1 + self.max_proposal_len]
        return Proposal(draft_ids_N=torch.tensor(ids, dtype=torch.long),
                        draft_probs_NV=torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.long), VOCAB).float())


def test_bf16_speculative_output_with_exact_is_target_only_output(target_bf16):
    prompt = list(range(2, 14))
    ref = SpeculativeEngine(target_bf16, [], NullProposer(), EOS).generate(prompt, max_new_tokens=64).output_ids
    engine = SpeculativeEngine(target_bf16, [0], ScriptedProposer(prompt + ref), EOS, exact=True)
    res = engine.generate(prompt, max_new_tokens=64)
    assert res.output_ids == ref
    assert all(s.num_accepted == s.num_proposed for s in res.steps)
    assert target_bf16.config._attn_implementation == "sdpa"
    assert not any("forward" in m.__dict__ for m in target_bf16.modules())


def test_flip_rerun_with_exact_rows_finds_no_flip(target_bf16):
    prompt = list(range(2, 14))
    ref = SpeculativeEngine(target_bf16, [], NullProposer(), EOS).generate(prompt, max_new_tokens=64).output_ids
    chunk = chunked_argmax(target_bf16, prompt, ref, chunk_len=8, forward_fn=exact_target_forward(ExactRows(target_bf16)))
    assert argmax_flip_positions(chunk.argmax, ref) == []


def test_exact_under_the_few_row_linear_path():
    """The few-row path swaps every linear layer for the whole generation; exact verify forwards take theirs back
    to F.linear, whose rows the chunk sizes were tested with."""
    target = _target(torch.float32)
    prompt = list(range(2, 14))
    ref = SpeculativeEngine(target, [], NullProposer(), EOS, few_row_linear=True).generate(
        prompt, max_new_tokens=32).output_ids
    engine = SpeculativeEngine(target, [0], ScriptedProposer(prompt + ref), EOS, exact=True, few_row_linear=True)
    res = engine.generate(prompt, max_new_tokens=32)
    assert res.output_ids == ref
    assert all(s.num_accepted == s.num_proposed for s in res.steps)
    assert not any("forward" in m.__dict__ for m in target.modules())


def test_rows_restore_the_model_and_refuse_eager():
    model = _target(torch.bfloat16)
    exact = ExactRows(model)
    assert exact.chunk_rows["lm_head"] >= 1
    with pytest.raises(RuntimeError, match="boom"), exact(16):
        assert model.config._attn_implementation.startswith("deepspec_exact_")
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in m.__dict__ for m in model.modules())
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        ExactRows(model)
