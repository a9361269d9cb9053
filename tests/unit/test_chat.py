"""Chat rendering and loss masks (docs/design/data.md, "Chat templates and loss masks").

Fast tests use a tiny byte-level ChatML tokenizer built in-process (with the ChatML template, or the
real Qwen3 chat template text, which rewrites history). The golden tests with the real tokenizers
(SmolLM2, Qwen3, Llama-3-style) are in test_templates_golden.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepspec.data.chat import (
    render_prompt,
    render_training_samples,
    render_with_loss_mask,
    stop_token_ids,
    template_end_of_turn_ids,
)
from tests.helpers import byte_level_tokenizer, mask_spans

QWEN3_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_tokenizer" / "tokenizer_config.json"

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
    return byte_level_tokenizer(CHATML, extra_specials=("<repo_name>",))


@pytest.fixture(scope="module")
def tiny_tok():
    return tiny_chatml_tokenizer()


_spans = mask_spans


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


def test_stop_token_ids_of_the_tiny_chatml_tokenizer(tiny_tok):
    assert template_end_of_turn_ids(tiny_tok) == [2]  # <|im_end|>; the "\n" after it is not special
    assert stop_token_ids(tiny_tok) == [2]
    assert stop_token_ids(tiny_tok, generation_eos=[0, 2]) == [0, 2]


def test_cut_answer_keeps_content_but_not_its_end_of_turn(tiny_tok):
    ids, full_mask = render_with_loss_mask(tiny_tok, THREE_TURNS)
    cut = [i for i, m in enumerate(THREE_TURNS) if m["role"] == "assistant"][1]
    ids_c, mask_c = render_with_loss_mask(tiny_tok, THREE_TURNS, cut_turns={cut})
    assert ids_c == ids
    (a0, b0), (a1, b1), (a2, b2) = _spans(full_mask)
    spans_c = _spans(mask_c)
    assert spans_c == [(a0, b0), (a1, b1 - 1), (a2, b2)]  # only the cut turn's <|im_end|> lost its 1
    assert tiny_tok.decode(ids[b1 - 1 : b1]) == "<|im_end|>"


# --------------------------------------------------------------------------- template kwargs, rewriting


def test_chat_template_kwargs_reach_the_template(tiny_tok):
    tok = tiny_chatml_tokenizer()
    tok.chat_template = CHATML.replace("'<|im_start|>assistant\n' }}",
                                       "'<|im_start|>assistant\n' }}{% if tag is defined %}{{ tag }}{% endif %}")
    msgs = THREE_TURNS[:2]
    plain = render_prompt(tok, msgs[:1])
    tagged = render_prompt(tok, msgs[:1], chat_template_kwargs={"tag": "[x]"})
    assert tok.decode(tagged) == tok.decode(plain) + "[x]"
    # the tag is written by the generation prompt only: a stored answer would have to start with it
    with pytest.raises(ValueError, match="template drift"):
        render_with_loss_mask(tok, msgs, chat_template_kwargs={"tag": "[x]"})
    with pytest.raises(ValueError, match="template drift"):
        render_training_samples(tok, msgs, chat_template_kwargs={"tag": "[x]"})
    with pytest.raises(ValueError, match="add_generation_prompt"):
        render_prompt(tok, msgs[:1], chat_template_kwargs={"add_generation_prompt": False})


def test_non_rewriting_template_gives_one_sample(tiny_tok):
    ids, mask = render_with_loss_mask(tiny_tok, THREE_TURNS)
    (s,) = render_training_samples(tiny_tok, THREE_TURNS)
    assert (s.input_ids, s.loss_mask, s.suffix) == (ids, mask, "")


@pytest.fixture(scope="module")
def tiny_qwen3():
    """The tiny byte-level tokenizer with the real Qwen3 chat template (rewrites earlier think blocks)."""
    tok = tiny_chatml_tokenizer()
    tok.chat_template = json.loads(QWEN3_CONFIG.read_text(encoding="utf-8"))["chat_template"]
    return tok


THINK = [
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"},
    {"role": "user", "content": "Q3"},
    {"role": "assistant", "content": "<think>\nr3\n</think>\n\nA3"},
]
NO_THINK = [m if m["role"] == "user" else {**m, "content": m["content"].split("\n\n")[-1]} for m in THINK]


@pytest.mark.parametrize("messages,kwargs", [(THINK, None), (NO_THINK, {"enable_thinking": False})],
                         ids=["thinking-on", "thinking-off"])
def test_rewriting_template_supervises_each_turn_once_as_generated(tiny_qwen3, messages, kwargs):
    tok = tiny_qwen3
    samples = render_training_samples(tok, messages, chat_template_kwargs=kwargs)
    assert [s.suffix for s in samples] == ["", "/turn1", "/turn3"]
    seen = []
    for s in samples:
        assert 0 < sum(s.loss_mask) < len(s.loss_mask)
        spans = _spans(s.loss_mask)
        assert len(spans) == 1  # a rewritten turn is masked 0 wherever it appears rewritten
        (a, b), = spans
        turn = 5 if s.suffix == "" else int(s.suffix[len("/turn"):])
        assert s.input_ids[:a] == render_prompt(tok, messages[:turn], chat_template_kwargs=kwargs)
        assert tok.decode(s.input_ids[a:b]) == messages[turn]["content"] + "<|im_end|>"
        seen.append(turn)
    assert sorted(seen) == [1, 3, 5]
    with pytest.raises(ValueError, match="render_training_samples"):
        render_with_loss_mask(tok, messages, chat_template_kwargs=kwargs)
    # the full sample still shows turns 1 and 3 (rewritten, without think blocks), unsupervised
    full = tok.decode(samples[0].input_ids)
    assert "assistant\nA1<|im_end|>" in full and "assistant\nA2<|im_end|>" in full and full.count("<think>") == 1


def test_rewriting_template_cut_turns_and_trailing_user(tiny_qwen3):
    tok = tiny_qwen3
    samples = render_training_samples(tok, THINK, cut_turns={3})
    by = {s.suffix: s for s in samples}
    sup = tok.decode([t for t, m in zip(by["/turn3"].input_ids, by["/turn3"].loss_mask) if m])
    assert sup == THINK[3]["content"]  # cut: content supervised, <|im_end|> not
    # ending on a user turn: the trailing user turn is in no sample; the last answer is in the full one
    samples = render_training_samples(tok, THINK[:5])
    assert [s.suffix for s in samples] == ["", "/turn1"]
    assert "Q3" not in tok.decode(samples[0].input_ids)


@pytest.mark.parametrize("messages,kwargs", [(THREE_TURNS, None), (NO_THINK, {"enable_thinking": False})],
                         ids=["chatml", "qwen3-off"])
def test_empty_assistant_turn_supervises_only_end_of_turn(tiny_tok, tiny_qwen3, messages, kwargs):
    tok = tiny_tok if kwargs is None else tiny_qwen3
    msgs = [messages[0], {"role": "assistant", "content": ""}]
    (s,) = render_training_samples(tok, msgs, chat_template_kwargs=kwargs)
    assert [t for t, m in zip(s.input_ids, s.loss_mask) if m] == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_conversation_ending_on_user_turn(tiny_tok):
    ids, mask = render_with_loss_mask(tiny_tok, THREE_TURNS[:5])
    ids4, mask4 = render_with_loss_mask(tiny_tok, THREE_TURNS[:4])
    assert (ids, mask) == (ids4, mask4)  # the trailing user turn is part of no training sample


def test_template_without_assistant_spans_raises(tiny_tok):
    drops = tiny_chatml_tokenizer()  # writes user/system turns only: assistant answers vanish
    drops.chat_template = CHATML.replace("{% for message in messages %}",
                                         "{% for message in messages if message['role'] != 'assistant' %}")
    with pytest.raises(ValueError, match="no tokens for it"):
        render_training_samples(drops, THREE_TURNS)
    no_eot = tiny_chatml_tokenizer()  # answers written without an end-of-turn token
    no_eot.chat_template = CHATML.replace("message['content'] + '<|im_end|>'", "message['content'] + '\n\n'")
    with pytest.raises(ValueError, match="no end-of-turn token"):
        render_with_loss_mask(no_eot, THREE_TURNS)
    only_answers = tiny_chatml_tokenizer()  # nothing but the answers: an all-ones mask must not pass
    only_answers.chat_template = ("{% for m in messages if m['role'] == 'assistant' %}"
                                  "{{ m['content'] + '<|im_end|>' }}{% endfor %}")
    with pytest.raises(ValueError, match="supervises"):
        render_training_samples(only_answers, THREE_TURNS[:2])


def test_a_template_that_renders_an_empty_prompt_is_refused():
    tok = tiny_chatml_tokenizer()
    tok.chat_template = "{% for m in messages %}{% endfor %}"
    with pytest.raises(ValueError, match="renders this conversation as an empty prompt"):
        render_prompt(tok, [{"role": "user", "content": "hi"}])
