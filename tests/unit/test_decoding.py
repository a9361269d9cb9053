"""Pinned decoding: a target whose ``generation_config.json`` holds sampling defaults decodes the same
everywhere DeepSpec decodes.

The tiny 3-layer random Llama target is saved with ``{"do_sample": true, "temperature": 0.6,
"top_k": 20, "top_p": 0.95, "repetition_penalty": 1.3}`` and loaded back with ``load_target``, as a
real checkpoint would be. Greedy regeneration in ``prepare`` (local backend), the engine's
target-only baseline and the Hugging Face ``generate()`` baseline of the eval must all equal a
plain argmax loop; before pinning, ``generate()`` applied the checkpoint's repetition penalty.
"""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.data.chat import render_prompt
from deepspec.target.decoding import pinned_generate
from tests.helpers import byte_level_tokenizer

try:
    from tests.unit.test_chat import CHATML
except ImportError:  # pytest run from another folder
    from test_chat import CHATML

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.3}
QUESTIONS = ["hello there", "what is two plus two?", "name a colour"]
MAX_NEW_TOKENS = 32


def _weights(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2, initializer_range=0.3)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def sampling_target(tmp_path_factory):
    """(model, tokenizer, folder): the tiny target saved with the sampling generation_config and reloaded."""
    from transformers import GenerationConfig

    from deepspec.target.load import load_target

    tok = byte_level_tokenizer(CHATML)
    model = _weights(tok)
    model.generation_config = GenerationConfig(**SAMPLING_DEFAULTS, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    folder = tmp_path_factory.mktemp("sampling-target")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    saved = json.loads((folder / "generation_config.json").read_text())
    assert {k: saved[k] for k in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS
    loaded, loaded_tok = load_target(str(folder))
    assert loaded.generation_config.repetition_penalty == 1.3
    return loaded, loaded_tok, folder


def argmax_loop(model, prompt: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """The obvious greedy decoder: one full forward per token, argmax, stop after a stop token."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t in stop:
                break
    return out


def _prompts(tok):
    return [render_prompt(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]


def test_greedy_prepare_engine_and_hf_generate_equal_the_argmax_loop(sampling_target, tmp_path):
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.data.prepare import PrepareConfig, run_prepare, summary_path_for
    from deepspec.decoding.engine import SpeculativeEngine
    from deepspec.decoding.verify import SamplingParams
    from deepspec.eval.run import eos_token_ids_of, hf_generate

    model, tok, _ = sampling_target
    stop = eos_token_ids_of(model, tok)
    assert stop == [2]
    expected = [argmax_loop(model, p, MAX_NEW_TOKENS, set(stop)) for p in _prompts(tok)]
    ids = torch.tensor([_prompts(tok)[0]])
    with torch.no_grad():  # what generate() does unpinned: the checkpoint's repetition penalty applies
        unpinned = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=MAX_NEW_TOKENS, eos_token_id=stop, pad_token_id=2)
    assert unpinned[0, ids.shape[1]:].tolist() != expected[0]  # so the equalities below can fail

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "conversations": [
        {"from": "human", "value": q}, {"from": "gpt", "value": "old"}]}) + "\n" for i, q in enumerate(QUESTIONS)))
    cfg = PrepareConfig(input=str(src), output=tmp_path / "out.jsonl", max_new_tokens=MAX_NEW_TOKENS, batch_size=2,
                        show_progress=False)
    run_prepare(cfg, model, tok, log=lambda _: None)
    rows = [json.loads(line) for line in cfg.output.read_text().splitlines()]
    assert [r["generated_ids"][1] for r in rows] == expected  # prepare's greedy == the argmax loop

    engine = SpeculativeEngine(model, [], NullProposer(), stop)
    for prompt, want in zip(_prompts(tok), expected):
        assert engine.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingParams()).output_ids == want
        assert hf_generate(model, prompt, max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingParams(), eos=stop,
                           pad=2).output_ids == want

    decoding = json.loads(summary_path_for(cfg.output).read_text())["decoding"]
    assert decoding["do_sample"] is False and decoding["repetition_penalty"] == 1.0 and decoding["top_k"] == 0
    assert decoding["stop_token_ids"] == [2]
    assert {k: decoding["checkpoint_settings_ignored"][k] for k in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS
    assert model.generation_config.repetition_penalty == 1.3  # the checkpoint's config is restored after use


def test_eval_report_hf_generate_identical_and_decoding_recorded(sampling_target, tmp_path):
    from deepspec.decoding.verify import SamplingParams
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from deepspec.eval.run import run_eval

    model, tok, _ = sampling_target
    benches = {"tiny": [BenchmarkPrompt(id=f"p{i}", turns=(q,)) for i, q in enumerate(QUESTIONS)]}
    res = run_eval(model, tok, [0], {}, benches, max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingParams(), seed=0,
                   out_dir=tmp_path, progress=False, warmup=False, log=lambda _: None)
    assert res["benchmarks"]["tiny"]["hf-generate"]["frac_identical_to_baseline"] == 1.0
    decoding = res["config"]["decoding"]
    assert decoding["repetition_penalty"] == 1.0 and decoding["checkpoint_settings_ignored"]["top_k"] == 20
    assert "ignored from the target's generation_config" in (tmp_path / "eval_report.md").read_text()


def test_sampling_ignores_the_checkpoint_defaults(sampling_target):
    """Seeded sampling at T=1 (no top-k / top-p) on the sampling-config target equals the same weights
    with transformers' default generation config: the checkpoint's 0.6 / 20 / 0.95 / 1.3 never apply."""
    model, tok, _ = sampling_target
    plain = _weights(tok)
    prompt = torch.tensor([_prompts(tok)[0]])
    outs = []
    for m in (model, plain):
        torch.manual_seed(7)
        outs.append(pinned_generate(m, prompt, torch.ones_like(prompt), max_new_tokens=MAX_NEW_TOKENS, temperature=1.0,
                                    stop_token_ids=[2], pad_token_id=2).tolist())
    assert outs[0] == outs[1]


def test_no_checkpoint_field_leaks_not_even_unlisted_ones(sampling_target):
    """Fields DeepSpec does not set itself (``suppress_tokens``, ``bad_words_ids``, ``min_length``) are
    not taken from the checkpoint either: its generation config is out of reach during the call."""
    from transformers import GenerationConfig

    model, tok, _ = sampling_target
    prompt = _prompts(tok)[1]
    want = argmax_loop(model, prompt, MAX_NEW_TOKENS, {2})
    saved = model.generation_config
    model.generation_config = GenerationConfig(suppress_tokens=[want[0]], bad_words_ids=[[want[1]]], min_length=200,
                                               eos_token_id=2, pad_token_id=2)
    try:
        ids = torch.tensor([prompt])
        out = pinned_generate(model, ids, torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, temperature=0.0,
                              stop_token_ids=[2], pad_token_id=2)
        assert model.generation_config.suppress_tokens == [want[0]]  # restored
    finally:
        model.generation_config = saved
    assert out[0, len(prompt):].tolist() == want


def test_the_output_layer_gets_contiguous_inputs_and_the_hook_is_removed(sampling_target):
    """transformers slices ``hidden[:, -1:, :]`` at the prefill; a non-contiguous ``[B, 1, H]`` input
    makes ``torch.matmul`` copy the output weight once per row (pinned_generate's docstring). Every
    input the output layer sees during a batched pinned_generate is contiguous, the greedy ids are the
    argmax loop's, and the hook does not outlive the call."""
    from deepspec.data.backends import _left_pad

    model, tok, _ = sampling_target
    head = model.get_output_embeddings()
    seen: list[tuple[int, bool]] = []
    record = head.register_forward_hook(lambda m, args, out: seen.append((args[0].shape[0], args[0].is_contiguous())))
    try:
        prompts = _prompts(tok)
        ids_BT, mask_BT = _left_pad(prompts, 2)
        with torch.no_grad():  # without the hook the prefill's input is the non-contiguous slice
            model(input_ids=ids_BT, attention_mask=mask_BT, logits_to_keep=1)
        assert seen == [(len(prompts), False)]
        seen.clear()
        out = pinned_generate(model, ids_BT, mask_BT, max_new_tokens=8, temperature=0.0, stop_token_ids=[2],
                              pad_token_id=2)
        assert len(seen) >= 2 and all(contiguous for _, contiguous in seen)
        assert not head._forward_pre_hooks
        for b, prompt in enumerate(prompts):
            want = argmax_loop(model, prompt, 8, {2})
            assert out[b, ids_BT.shape[1]:ids_BT.shape[1] + len(want)].tolist() == want
    finally:
        record.remove()
