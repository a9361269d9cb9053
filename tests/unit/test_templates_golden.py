"""Golden tests of chat rendering + loss masks with the real tokenizers.

Templates: SmolLM2 (ChatML, the embedded default target's tokenizer), Qwen3 (real tokenizer shipped in
``tests/fixtures/qwen3_tokenizer``, thinking on and off, single and multi-turn), a Llama-3-STYLE
fixture (``tests/fixtures/llama3_style_tokenizer``: Llama 3's special tokens and add-BOS behaviour,
a Llama-3-style Jinja template written for DeepSpec, not Meta's file) and a Gemma-3-STYLE fixture
(``tests/fixtures/gemma3_style_tokenizer``: a small SentencePiece-style ``GemmaTokenizer`` with
Gemma's specials ``<pad>`` 0 ``<eos>`` 1 ``<bos>`` 2 ``<unk>`` 3 ``<mask>`` 4 ``<start_of_turn>`` 5
``<end_of_turn>`` 6, byte-fallback tokens ``<0x00>``..``<0xFF>``, ``▁`` word pieces and Gemma's add-BOS
behaviour; not Google's files). Its chat template is DeepSpec's shipped ``--chat-template gemma3``
(``deepspec/data/chat_templates/gemma3.jinja``), copied in when the fixture is built and checked equal
here. Rebuild the fixture with ``.venv/bin/python tests/fixtures/gemma3_style_tokenizer/make.py``, then
its golden file with ``.venv/bin/python tests/golden/make_golden.py gemma3_style``.

The golden ids/masks live in ``tests/golden/<template>.json``; regenerate with
``.venv/bin/python tests/golden/make_golden.py [TEMPLATE ...]``. Independently of the stored ids,
every case is checked against hand-written supervised texts (``CASES[...]["expect"]`` in
make_golden.py) and against the prefix property: the supervised span of assistant turn ``i`` starts
exactly after ``render_prompt(messages[:i])``.
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
    stop_token_ids,
    template_end_of_turn_ids,
)
from deepspec.target.load import chat_template_path
from tests.helpers import mask_spans

_spec = importlib.util.spec_from_file_location("make_golden", Path(__file__).resolve().parents[1] / "golden" /
                                               "make_golden.py")
mg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mg)

HEADERS = {"smollm2_chatml": "<|im_start|>assistant\n", "qwen3": "<|im_start|>assistant\n",
           "llama3_style": "<|start_header_id|>assistant<|end_header_id|>\n\n",
           "gemma3_style": "<start_of_turn>model\n"}
# Templates that write bos_token themselves with a tokenizer that also adds BOS on encode.
BOS_WRITTEN_BY_TEMPLATE = {"llama3_style", "gemma3_style"}

_TOKENIZERS: dict = {}


def _tok(name):
    if name not in _TOKENIZERS:
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
        if template in BOS_WRITTEN_BY_TEMPLATE:
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


# -------------------------------------------------------------------------------------- Gemma 3


def _gemma_fixture_builder():
    spec = importlib.util.spec_from_file_location("gemma3_style_make", mg.GEMMA3_STYLE_DIR / "make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gemma3_style_fixture_template_is_the_shipped_file():
    """The fixture tests DeepSpec's own --chat-template gemma3: its copy may not drift from the file."""
    shipped = chat_template_path("gemma3")
    assert shipped.name == "gemma3.jinja" and shipped.is_file()
    text = shipped.read_text(encoding="utf-8")
    assert (mg.GEMMA3_STYLE_DIR / "chat_template.jinja").read_text(encoding="utf-8") == text
    assert _tok("gemma3_style").chat_template == text


def test_gemma3_style_fixture_matches_its_build_script():
    built, tok = _gemma_fixture_builder().build(), _tok("gemma3_style")
    assert type(tok).__name__ == "GemmaTokenizer"
    assert built.get_vocab() == tok.get_vocab() and len(tok) < 2000
    text = "  What is the capital of France?\n\nParis \u2014 Lumi\u00e8re.  "
    assert built(text).input_ids == tok(text).input_ids


def test_gemma3_style_specials_bytes_and_pieces():
    tok = _tok("gemma3_style")
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    assert tok.convert_tokens_to_ids(specials) == list(range(7))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["<0x00>", "<0xFF>"]) == [7, 262]
    assert {5, 6} <= set(tok.all_special_ids)
    # SentencePiece style: spaces are "▁" inside pieces, no prefix space, unknown characters as bytes
    ids = tok.encode("What is the capital of France?", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["What", "▁is", "▁the", "▁capital", "▁of", "▁France", "?"]
    ids = tok.encode("\u00e8", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["<0xC3>", "<0xA8>"] and tok.decode(ids) == "\u00e8"
    assert tok.encode("<start_of_turn>model\n", add_special_tokens=False)[0] == 5  # a special, never split


def test_gemma3_style_exactly_one_bos():
    tok = _tok("gemma3_style")
    bos = tok.bos_token_id
    assert tok("hi").input_ids[0] == bos  # the tokenizer adds BOS itself (Gemma: add_bos_token) ...
    text = tok.apply_chat_template([mg.U1, mg.A1], tokenize=False)
    assert text.startswith("<bos><start_of_turn>user\n")  # ... and the template writes bos_token too,
    assert tok(text).input_ids[:2] == [bos, bos]  # so the naive text-then-encode path doubles it
    ids, mask = render_with_loss_mask(tok, [mg.U1, mg.A1])
    assert ids.count(bos) == 1 and ids[0] == bos and mask[0] == 0
    assert render_prompt(tok, [mg.U1]).count(bos) == 1


def test_gemma3_style_stop_tokens_are_end_of_turn():
    tok = _tok("gemma3_style")
    assert template_end_of_turn_ids(tok) == [6]  # <end_of_turn>; the "\n" after it is ordinary text
    assert stop_token_ids(tok) == [1, 6]  # the tokenizer's <eos> and the template's <end_of_turn>
    assert stop_token_ids(tok, generation_eos=[1, 6]) == [1, 6]  # as Gemma 3's generation_config lists them


def test_gemma3_style_prompt_folds_system_and_ends_with_model_header():
    tok = _tok("gemma3_style")
    prompt = render_prompt(tok, [mg.SYS, mg.U1])
    assert tok.decode(prompt) == ("<bos><start_of_turn>user\nYou answer briefly.\n\nWhat is the capital of France?"
                                  "<end_of_turn>\n<start_of_turn>model\n")
    model, newline = tok.encode("model\n", add_special_tokens=False)
    assert prompt[-3:] == [5, model, newline]
    history = render_prompt(tok, [mg.U1, mg.A1, mg.U2])
    assert tok.decode(history).endswith("Paris.<end_of_turn>\n<start_of_turn>user\nAnd its population?<end_of_turn>\n"
                                        "<start_of_turn>model\n")


def test_gemma3_style_eval_path_and_training_path_agree():
    """The evaluation prompt (eval/run.py) is token for token the prompt training supervises after."""
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from deepspec.eval.run import render_benchmark_prompts

    tok = _tok("gemma3_style")
    eval_ids = render_benchmark_prompts(tok, {"b": [BenchmarkPrompt(id="p0", turns=(mg.U1["content"],))]})["b"][0]
    (s,) = render_training_samples(tok, [mg.U1, mg.A1])
    assert s.input_ids[:s.loss_mask.index(1)] == eval_ids


def test_gemma3_style_trimmed_answer_is_counted_not_drift():
    """The template trims answers, so the generation prompt stays a token prefix (no drift error); the
    trimmed text is supervised and the difference from the stored text is counted (chat.py: "compared
    with the text's own tokenisation and a difference is counted, never silently repaired")."""
    tok = _tok("gemma3_style")
    counts: dict = {}
    (s,) = render_training_samples(tok, [mg.U1, mg.PADDED], counts=counts)
    assert counts["num_turns_text"] == 1 and counts["num_turns_text_retokenized"] == 1
    assert tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m]) == \
        "The capital of France is Paris.<end_of_turn>"
    counts = {}
    render_training_samples(tok, [mg.U1, mg.A1], counts=counts)
    assert counts["num_turns_text_retokenized"] == 0  # an untrimmed answer survives the text round trip
    # The single-sequence API agrees (the template rewrites no history).
    assert render_with_loss_mask(tok, [mg.U1, mg.PADDED]) == (s.input_ids, s.loss_mask)


def test_gemma3_style_padded_generated_ids_are_supervised_verbatim():
    """When the ids the target generated are known, a padded answer is supervised on exactly those ids
    (whitespace included) after exactly its prompt, and as trimmed history in later turns' prompts."""
    tok = _tok("gemma3_style")
    gen = tok.encode(mg.PADDED["content"], add_special_tokens=False) + [6]
    messages = [mg.U1, mg.PADDED, mg.U2, mg.A2]
    counts: dict = {}
    samples = render_training_samples(tok, messages, generated_ids=[None, gen, None, None], counts=counts)
    assert [s.suffix for s in samples] == ["", "/turn1"]
    assert counts["num_turns_ids"] == 1 and counts["num_turns_ids_not_verbatim"] == 1
    full, own = samples
    prompt = render_prompt(tok, [mg.U1])
    assert own.input_ids == prompt + gen and own.loss_mask == [0] * len(prompt) + [1] * len(gen)
    # in the full sample turn 1 is history (mask 0); only answer 3 is supervised
    assert [tok.decode(full.input_ids[a:b]) for a, b in _spans(full.loss_mask)] == [mg.A2["content"] + "<end_of_turn>"]


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
