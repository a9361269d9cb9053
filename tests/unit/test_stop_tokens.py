"""One stop-token rule for prepare, the cache's loss mask, evaluation and serve.

The rule (:func:`deepspec.data.chat.stop_token_ids`) is derived from the target's generation config,
the tokenizer's eos and the chat template's end-of-turn token, never from a list of token names:
Qwen3's ``</s>`` (id 128247) is an ordinary token, its ``<|endoftext|>`` (151643) a stop token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from deepspec.data.chat import render_prompt, stop_token_ids, target_stop_token_ids, template_end_of_turn_ids
from tests.helpers import qwen3_tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_STYLE_DIR = ROOT / "tests" / "fixtures" / "llama3_style_tokenizer"
# Qwen3-4B's own generation_config.json (sampling defaults and two eos ids)
QWEN3_GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                           "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
LLAMA3_STYLE_EOS = [257, 260]  # <|end_of_text|>, <|eot_id|>: what Llama 3 Instruct's generation_config lists


def test_smollm2_stops_on_im_end_only():
    from deepspec.target.load import load_generation_config, load_tokenizer

    tok = load_tokenizer("default")
    assert template_end_of_turn_ids(tok) == [2]
    assert stop_token_ids(tok, generation_eos=load_generation_config("default")["eos_token_id"]) == [2]


def test_qwen3_stop_ids_come_from_its_generation_config_not_token_names():
    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    assert tok.convert_ids_to_tokens([128247, 151643, 151645]) == ["</s>", "<|endoftext|>", "<|im_end|>"]
    assert template_end_of_turn_ids(tok) == [151645]
    stop = stop_token_ids(tok, generation_eos=QWEN3_GENERATION_CONFIG["eos_token_id"])
    assert stop == [151643, 151645]
    assert 128247 not in stop  # `</s>` is an ordinary token in Qwen3's vocabulary


def test_llama3_style_stop_ids_are_the_generation_configs():
    tok = AutoTokenizer.from_pretrained(str(LLAMA3_STYLE_DIR))
    assert template_end_of_turn_ids(tok) == [260]
    assert stop_token_ids(tok, generation_eos=LLAMA3_STYLE_EOS) == [257, 260]
    assert stop_token_ids(tok) == [260]  # without the target's generation config: tokenizer + template


class ScriptedLlama3Target(torch.nn.Module):
    """A target with the Llama-3-style fixture's vocabulary whose generation_config lists [257, 260] and
    which answers every prompt with ``5 6 <|end_of_text|> 7 8 ...`` (never stopping by itself)."""

    ANSWER = [5, 6, 257, 7, 8, 9, 10, 11]

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = GenerationConfig(eos_token_id=LLAMA3_STYLE_EOS, bos_token_id=256, pad_token_id=257)
        self.stops_seen: list[list[int]] = []

    def generate(self, *, input_ids, attention_mask, generation_config):
        self.stops_seen.append(list(generation_config.eos_token_id))
        n = generation_config.max_new_tokens
        new = (self.ANSWER * n)[:n]
        return torch.cat([input_ids, torch.tensor([new] * input_ids.shape[0])], dim=1)


def test_llama3_style_prepare_stops_where_eval_does_and_is_not_cut(tmp_path):
    """prepare stops on <|end_of_text|> (257) as eval does; the answer [5, 6, 257, 7, ...] ends at the
    stop token, is not flagged cut, and is supervised exactly as generated."""
    from deepspec.data.backends import LocalBackend
    from deepspec.data.cache import iter_prepared_samples
    from deepspec.data.prepare import PrepareConfig, run_prepare, summary_path_for
    from deepspec.eval.run import eos_token_ids_of

    tok = AutoTokenizer.from_pretrained(str(LLAMA3_STYLE_DIR))
    model = ScriptedLlama3Target()
    assert eos_token_ids_of(model, tok) == LocalBackend(model, tok).eos_ids == target_stop_token_ids(model, tok) \
        == [257, 260]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "old"}]}) + "\n")
    cfg = PrepareConfig(input=str(src), output=tmp_path / "out.jsonl", max_new_tokens=8, show_progress=False)
    summary = run_prepare(cfg, model, tok, log=lambda _: None)
    assert model.stops_seen == [[257, 260]] and summary.truncated == 0
    (row,) = [json.loads(line) for line in cfg.output.read_text().splitlines()]
    assert row["generated_ids"] == [None, [5, 6, 257]] and row["truncated"] is False
    assert json.loads(summary_path_for(cfg.output).read_text())["decoding"]["stop_token_ids"] == [257, 260]

    (sample,) = [s for s in iter_prepared_samples([row], tok, max_seq_len=None, stop_ids=[257, 260])]
    prompt = render_prompt(tok, row["messages"][:1])
    _, ids, mask = sample
    assert ids == prompt + [5, 6, 257] and mask == [0] * len(prompt) + [1, 1, 1]


def test_cache_refuses_prepared_data_recorded_with_another_stop_set(tmp_path):
    from deepspec.data.cache import check_prepared_render
    from deepspec.data.chat import render_record

    tok = AutoTokenizer.from_pretrained(str(LLAMA3_STYLE_DIR))
    prepared = tmp_path / "p.jsonl"
    prepared.write_text("")
    summary = tmp_path / "p.jsonl.summary.json"
    summary.write_text(json.dumps({"render": render_record(tok, chat_template_kwargs=None, stop_ids=[260])}))
    with pytest.raises(ValueError, match=r"stop_token_ids: prepared \[260\], now \[257, 260\]"):
        check_prepared_render(prepared, tok, [257, 260])
    assert check_prepared_render(prepared, tok, [260])["checked_against"] == "p.jsonl.summary.json"
    summary.unlink()
    assert check_prepared_render(prepared, tok, [257, 260])["checked_against"] is None  # imported data
