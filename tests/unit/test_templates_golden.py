"""Golden tests of chat rendering + loss masks with the real tokenizers (issue 3, item 2).

Templates: SmolLM2 (ChatML, the embedded default target's tokenizer), Qwen3 (real tokenizer in
``../shared/tokenizers/qwen3``, thinking on and off, single and multi-turn) and a Llama-3-STYLE
fixture (``tests/fixtures/llama3_style_tokenizer``: Llama 3's special tokens and add-BOS behaviour,
a Llama-3-style Jinja template written for DeepSpec, not Meta's file).

The golden ids/masks live in ``tests/golden/<template>.json``; regenerate with
``.venv/bin/python tests/golden/make_golden.py``. Independently of the stored ids, every case is
checked against hand-written supervised texts (``CASES[...]["expect"]`` in make_golden.py) and
against the prefix property: the supervised span of assistant turn ``i`` starts exactly after
``render_prompt(messages[:i])``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from deepspec.data.chat import (
    render_prompt,
    render_training_samples,
    render_with_loss_mask,
)
from tests.helpers import mask_spans

_spec = importlib.util.spec_from_file_location("make_golden", Path(__file__).resolve().parents[1] / "golden" /
                                               "make_golden.py")
mg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mg)

HEADERS = {"smollm2_chatml": "<|im_start|>assistant\n", "qwen3": "<|im_start|>assistant\n",
           "llama3_style": "<|start_header_id|>assistant<|end_header_id|>\n\n"}

_TOKENIZERS: dict = {}


def _tok(name):
    if name not in _TOKENIZERS:
        if name == "qwen3" and not mg.QWEN3_DIR.is_dir():
            pytest.skip(f"Qwen3 tokenizer not found at {mg.QWEN3_DIR}")
        _TOKENIZERS[name] = mg.load_tokenizer(name)
    return _TOKENIZERS[name]


_spans = mask_spans


CASE_IDS = [(t, c) for t, spec in mg.TEMPLATES.items() for c in spec["cases"]]


@pytest.mark.parametrize("template,case_name", CASE_IDS, ids=[f"{t}-{c}" for t, c in CASE_IDS])
def test_golden_case(template, case_name):
    tok = _tok(template)
    case = mg.TEMPLATES[template]["cases"][case_name]
    messages, kwargs, cut = case["messages"], case.get("kwargs"), case.get("cut_turns", [])
    samples = render_training_samples(tok, messages, cut_turns=cut, chat_template_kwargs=kwargs)

    # 1. the stored golden ids and masks
    golden = json.loads((mg.GOLDEN_DIR / f"{template}.json").read_text(encoding="utf-8"))["cases"][case_name]
    assert golden["messages"] == messages and golden["chat_template_kwargs"] == kwargs
    assert [{"suffix": s.suffix, "input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples] \
        == golden["samples"]

    # 2. the exact supervised text, sample by sample, and the prefix property per sample
    expect = case["expect"]
    assert [s.suffix for s in samples] == list(expect)
    supervised_turns = []
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for s in samples:
        ids, mask = s.input_ids, s.loss_mask
        assert len(ids) == len(mask) and set(mask) <= {0, 1} and 0 < sum(mask) < len(mask)
        spans = _spans(mask)
        assert len(spans) == len(expect[s.suffix])
        for (a, b), (turn, text) in zip(spans, expect[s.suffix]):
            assert tok.decode(ids[a:b]) == text
            prompt = render_prompt(tok, messages[:turn], chat_template_kwargs=kwargs)
            assert ids[:a] == prompt  # generation-prompt render is an exact token prefix of the sample
            assert tok.decode(prompt).endswith(HEADERS[template] + (
                "<think>\n\n</think>\n\n" if kwargs == mg.OFF else ""))  # header (+ empty think) not supervised
            supervised_turns.append(turn)
        # the sample is the template's own render: of the conversation up to its last assistant turn
        # (a trailing user turn is dropped), or of messages[:i+1] for a "/turn<i>" sample.
        end = last_assistant + 1 if s.suffix == "" else int(s.suffix.removeprefix("/turn")) + 1
        text = tok.apply_chat_template(messages[:end], tokenize=False, **(kwargs or {}))
        assert tok.decode(ids) == text
        # exactly one BOS, never doubled
        bos = tok.bos_token_id
        if template == "llama3_style":
            assert ids[0] == bos and ids.count(bos) == 1
        elif bos is not None:
            assert ids[:2] != [bos, bos]
    # every assistant turn (before a trailing user turn) is supervised exactly once
    assert sorted(supervised_turns) == [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    # no system/user text is supervised
    for s in samples:
        sup = tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])
        for m in messages:
            if m["role"] != "assistant":
                assert m["content"] not in sup


# ------------------------------------------------------------------------------- Qwen3 think rule


def test_qwen3_think_off_empty_block_belongs_to_prompt():
    tok = _tok("qwen3")
    (s,) = render_training_samples(tok, [mg.U1, mg.A1], chat_template_kwargs=mg.OFF)
    think, end_think = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    for t in (think, end_think):
        pos = s.input_ids.index(t)
        assert s.loss_mask[pos] == 0
    assert s.input_ids.count(think) == 1


def test_qwen3_think_on_reasoning_end_think_answer_supervised():
    tok = _tok("qwen3")
    (s,) = render_training_samples(tok, [mg.U1, mg.T1])
    think, end_think = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert s.loss_mask[s.input_ids.index(think)] == 1 and s.loss_mask[s.input_ids.index(end_think)] == 1
    last_header = len(s.input_ids) - 1 - s.input_ids[::-1].index(im_start)
    assert s.loss_mask[last_header: last_header + 3] == [0, 0, 0]  # <|im_start|> assistant \n
    sup = tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])
    assert sup == f"<think>\n{mg.R1}\n</think>\n\nThe capital of France is Paris.<|im_end|>"


@pytest.mark.parametrize("kwargs", [None, mg.OFF, {"enable_thinking": True}], ids=["default", "off", "on"])
def test_qwen3_eval_path_and_training_path_agree(kwargs):
    """The evaluation prompt (eval/run.py) is token for token the prompt training supervises after."""
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from deepspec.eval.run import render_benchmark_prompts

    tok = _tok("qwen3")
    answer = mg.A1 if kwargs == mg.OFF else mg.T1
    eval_ids = render_benchmark_prompts(tok, {"b": [BenchmarkPrompt(id="p0", turns=(mg.U1["content"],))]},
                                        chat_template_kwargs=kwargs)["b"][0]
    (s,) = render_training_samples(tok, [mg.U1, answer], chat_template_kwargs=kwargs)
    first = s.loss_mask.index(1)
    assert s.input_ids[:first] == eval_ids
    assert tok.decode(eval_ids).endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if kwargs == mg.OFF
                                                                        else ""))


@pytest.mark.parametrize("kwargs", [None, mg.OFF], ids=["on", "off"])
def test_qwen3_multiturn_single_sequence_api_raises(kwargs):
    tok = _tok("qwen3")
    messages = [mg.U1, mg.T1 if kwargs is None else mg.A1, mg.U2, mg.T2 if kwargs is None else mg.A2]
    with pytest.raises(ValueError, match="template drift.*render_training_samples"):
        render_with_loss_mask(tok, messages, chat_template_kwargs=kwargs)


def test_qwen3_think_block_with_thinking_off_is_drift():
    """A reasoning answer rendered with enable_thinking=False was not generated from that prompt."""
    tok = _tok("qwen3")
    with pytest.raises(ValueError, match="template drift at assistant turn 1"):
        render_training_samples(tok, [mg.U1, mg.T1], chat_template_kwargs=mg.OFF)


# ------------------------------------------------------------------------------------- BOS / Llama 3


def test_llama3_style_exactly_one_bos():
    tok = _tok("llama3_style")
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert tok("hi").input_ids[0] == bos  # the tokenizer adds BOS itself ...
    text = tok.apply_chat_template([mg.U1, mg.A1], tokenize=False)
    assert tok(text).input_ids[:2] == [bos, bos]  # ... so the naive text-then-encode path doubles it
    ids, mask = render_with_loss_mask(tok, [mg.U1, mg.A1])
    assert ids.count(bos) == 1 and ids[0] == bos and mask[0] == 0
    assert render_prompt(tok, [mg.U1]).count(bos) == 1


def test_doubled_bos_is_refused():
    tok = mg.load_tokenizer("llama3_style")  # a private copy: the template is changed below
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    with pytest.raises(ValueError, match="two BOS"):
        render_prompt(tok, [mg.U1])


@pytest.mark.parametrize("template", list(mg.TEMPLATES))
def test_truncation_keeps_prefixes_and_refuses_empty_masks(template):
    tok = _tok(template)
    kwargs = mg.OFF if template == "qwen3" else None
    messages = [mg.U1, mg.A1, mg.U2, mg.A2]
    samples = render_training_samples(tok, messages, chat_template_kwargs=kwargs)
    assert len(samples) == (2 if template == "qwen3" else 1)
    firsts = [s.loss_mask.index(1) for s in samples]
    # a cut before every answer: nothing to supervise is an error, never an all-zero sample
    with pytest.raises(ValueError, match="supervises 0"):
        render_training_samples(tok, messages, max_seq_len=min(firsts), chat_template_kwargs=kwargs)
    # a cut inside the first answer: each kept sample is a prefix of its untruncated self; a sample
    # left without supervised tokens is dropped (Qwen3: the full sample, whose only span is answer 2)
    cut = min(firsts) + 2
    short = render_training_samples(tok, messages, max_seq_len=cut, chat_template_kwargs=kwargs)
    by_suffix = {s.suffix: s for s in samples}
    assert [s.suffix for s in short] == (["/turn1"] if template == "qwen3" else [""])
    for s in short:
        full = by_suffix[s.suffix]
        assert s.input_ids == full.input_ids[:cut] and s.loss_mask == full.loss_mask[:cut] and sum(s.loss_mask) == 2
