"""Every target family x every registered drafting algorithm: train a few steps, then decode losslessly.

For each family (Llama, SmolLM2-style tied Llama, Llama with llama3 RoPE scaling, Qwen2, Qwen3 with
q/k-norm, Mistral, Llama with linear RoPE scaling and a spare embedding row, Gemma 3 with sliding-window
layers of window 4 beside a global one and scaled embeddings, and Gemma 3 with final-logit
soft-capping and a linearly scaled global RoPE) a tiny random target
(hidden 32, 2-3 layers) and the byte-level ChatML tokenizer; each algorithm of
``deepspec.algorithms.registry.ALGORITHMS`` (whatever is registered) is trained online for 3 steps
through ``deepspec.train.loop.train``, loaded back from its checkpoint with ``load_draft``, and
its proposer (``algorithm_for_model(model).proposer``) drives the speculative engine: greedy output
must equal target-only decoding. A draft with a rotary embedding must reproduce the target's RoPE
(cos/sin, including rope scaling) exactly. DSpark uses a different Markov head variant per family.
Shape legend: T positions, H hidden.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from deepspec.algorithms.protocol import NullProposer
from deepspec.algorithms.registry import ALGORITHMS, algorithm_for_model, load_draft
from deepspec.data.chat import render_prompt
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.train.config import TrainConfig
from deepspec.train.loop import train
from tests.unit.test_chat import tiny_chatml_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
# Gemma 3: window 4 (so every prompt crosses it and every rollback is beyond it), one global layer
GEMMA3 = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"])

# name -> (config class, model class, extra config kwargs, extra vocab rows, DSpark Markov head)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False), 0, "vanilla"),
    "smollm2": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True), 0, "gated"),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE), 0, "rnn"),
    "llama-linear-rope-spare-row": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LINEAR_ROPE), 3,
                                    "vanilla"),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_hidden_layers=2), 0, "gated"),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=8), 0, "rnn"),
    "mistral": (MistralConfig, MistralForCausalLM, dict(head_dim=8, sliding_window=None), 0, "vanilla"),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, GEMMA3, 0, "gated"),
    "gemma3-softcap": (Gemma3TextConfig, Gemma3ForCausalLM,
                       dict(GEMMA3, final_logit_softcapping=2.0,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": LINEAR_ROPE}), 0, "vanilla"),
}


def _rows() -> list[dict]:
    rows = []
    for k in range(6):
        msgs = [{"role": "user", "content": f"Question {k}: why?"},
                {"role": "assistant", "content": ("answer %d is this. " % k) * (1 + k % 3)}]
        rows.append({"id": f"r{k}", "source_index": k, "messages": msgs, "truncated": False, "truncated_turns": [],
                     "split": "train"})
    return rows


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    cfg_cls, model_cls, extra, spare_rows, markov = FAMILIES[request.param]
    tok = tiny_chatml_tokenizer()
    kw = dict(COMMON, vocab_size=len(tok) + spare_rows, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    kw.update(extra)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw)).eval().requires_grad_(False)
    d = tmp_path_factory.mktemp(request.param)
    prepared = d / "prepared.jsonl"
    prepared.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    layer_ids = [0, 1] if model.config.num_hidden_layers >= 3 else [-1, 0]  # -1: the embedding output
    return request.param, model, tok, prepared, markov, layer_ids


def _generate(engine, prompt):
    return engine.generate(prompt, max_new_tokens=20)  # greedy (sampling=None)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_family_trains_and_decodes_losslessly(family, algorithm, tmp_path):
    name, model, tok, prepared, markov, layer_ids = family
    cfg = TrainConfig(online_data=str(prepared), output_dir=str(tmp_path / "run"), algorithm=algorithm,
                      target_layer_ids=layer_ids, max_seq_len=128, batch_size=2, num_anchors=4, markov_rank=8,
                      markov_head=markov, max_steps=3, lr=1e-2, warmup_frac=0.0, seed=0)
    checkpoint = train(cfg, target_model=model, tokenizer=tok)
    rows = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)

    loaded_name, draft = load_draft(checkpoint / "draft")
    assert loaded_name == algorithm
    draft = draft.eval()
    algo = algorithm_for_model(draft)
    assert algo.name == algorithm
    if algorithm == "dspark":
        assert draft.config.markov_head_type == markov
    if name.startswith(("qwen3", "gemma3")) and hasattr(draft, "layers"):
        assert all(layer.self_attn.q_norm is not None for layer in draft.layers)

    rotary = getattr(draft, "rotary_emb", None)
    if rotary is not None:  # RoPE (and its scaling) identical to the target's, from transformers' own code
        x = torch.zeros(1, 1, 32)
        pos_1T = torch.arange(model.config.max_position_embeddings)[None]
        rope = dict(model.config.rope_parameters)
        if name.startswith("gemma3"):  # one RoPE per attention type: the draft takes the global layers'
            cos_t, sin_t = model.model.rotary_emb(x, pos_1T, "full_attention")
            rope = rope["full_attention"]
        else:
            cos_t, sin_t = model.model.rotary_emb(x, pos_1T)
        cos_d, sin_d = rotary(x, pos_1T)
        assert torch.equal(cos_t, cos_d) and torch.equal(sin_t, sin_d)
        assert draft.config.rope_parameters == rope
    if name.startswith("gemma3"):  # the target's embedding scale and soft-capping, recorded with the draft
        assert draft.config.embed_scale == pytest.approx(32 ** 0.5)
        assert draft.config.final_logit_softcapping == model.config.final_logit_softcapping
        ids = torch.tensor([[3, 5, 7]])
        assert torch.equal(draft.embed(ids), model.model.embed_tokens(ids))

    assert list(getattr(draft.config, "target_layer_ids", layer_ids)) == layer_ids
    eos = [tok.eos_token_id]
    proposer = algo.proposer(draft, max_positions=model.config.max_position_embeddings)
    spec = SpeculativeEngine(model, layer_ids, proposer, eos)
    plain = SpeculativeEngine(model, layer_ids, NullProposer(), eos)
    proposed = 0
    for text in ("Question 1: why?", "Tell me a story about answers."):
        prompt = render_prompt(tok, [{"role": "user", "content": text}])
        ref = _generate(plain, prompt)
        got = _generate(spec, prompt)
        assert got.output_ids == ref.output_ids, (name, algorithm)
        proposed += sum(s.num_proposed for s in got.steps)
    assert proposed > 0  # the drafter really drafted


def test_zlab_layout_dflash_trains_and_decodes_losslessly(family, tmp_path):
    """DFlash in z-lab's layout (``--sample-from-anchor false``: each mask slot predicts its own position,
    K - 1 drafts per block) through the trainer, its checkpoint and the engine: greedy output equals
    target-only decoding, and no proposal is longer than K - 1."""
    name, model, tok, prepared, _, layer_ids = family
    cfg = TrainConfig(online_data=str(prepared), output_dir=str(tmp_path / "run"), algorithm="dflash",
                      sample_from_anchor=False, target_layer_ids=layer_ids, max_seq_len=128, batch_size=2,
                      num_anchors=4, block_size=4, max_steps=3, lr=1e-2, warmup_frac=0.0, seed=0)
    _, draft = load_draft(train(cfg, target_model=model, tokenizer=tok) / "draft")
    assert draft.config.sample_from_anchor is False and draft.config.num_draft_slots == 3
    eos = [tok.eos_token_id]
    spec = SpeculativeEngine(model, layer_ids, algorithm_for_model(draft).proposer(draft.eval()), eos)
    plain = SpeculativeEngine(model, layer_ids, NullProposer(), eos)
    prompt = render_prompt(tok, [{"role": "user", "content": "Question 1: why?"}])
    got = _generate(spec, prompt)
    assert got.output_ids == _generate(plain, prompt).output_ids, name
    assert got.steps and max(s.num_proposed for s in got.steps) == 3
