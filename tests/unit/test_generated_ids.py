"""The supervised tokens are exactly the tokens the target generated.

Prepared rows keep each regenerated turn's ``generated_ids``; the cache / online rule
(:func:`deepspec.data.chat.render_training_samples`) supervises exactly those ids after exactly the
prompt the target was given, never ``encode(decode(ids).strip())``. Cases on the real SmolLM2
tokenizer: ``"\\n\\n"`` generated as one token (1116) before a word (its text re-tokenises as
``198 198``), a scripted answer ``" Hi there\\n"`` (stored unstripped), an answer cut
inside a multi-byte character (its text holds U+FFFD), a whitespace-only answer (stripped it would be
``""``), and a two-turn conversation whose first answer does not survive
the text round trip. Then prepare -> cache end to end on a tiny target, and the render record check.
"""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.data.chat import (
    COUNT_KEYS,
    render_prompt,
    render_record,
    render_record_differences,
    render_training_samples,
)
from tests.helpers import byte_level_tokenizer, mask_spans, tiny_llama_target

try:
    from tests.unit.test_chat import CHATML
except ImportError:  # pytest run from another folder
    from test_chat import CHATML

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def smollm2():
    from deepspec.target.load import load_tokenizer

    return load_tokenizer("default")


def _supervised(sample) -> list[int]:
    return [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]


def _one_turn(tok, generated, *, cut=False):
    text = tok.decode(generated if cut else generated[:-1], skip_special_tokens=True)
    messages = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": text}]
    counts: dict[str, int] = {}
    samples = render_training_samples(tok, messages, generated_ids=[None, generated], cut_turns=[1] if cut else [],
                                      stop_ids=[EOS], counts=counts)
    return messages, samples, counts


@pytest.mark.parametrize("generated,cut", [
    ([34355, 30, 1116, 41462, EOS], False),  # "Sure.\n\nDone": 1116 stays one token (its text gives 198 198)
    ([21041, 665, 198, EOS], False),  # " Hi there\n": leading space and trailing newline kept
    ([70, 11458, 16739, 23274], True),  # cut inside 日 (3 bytes): the ids, not U+FFFD re-encoded
    ([32057, EOS], False),  # "  \n": whitespace only
    ([32057], True),  # whitespace only and cut
], ids=["double-newline", "hi-there", "cut-multibyte", "whitespace", "whitespace-cut"])
def test_one_turn_supervises_exactly_the_generated_ids(smollm2, generated, cut):
    messages, samples, counts = _one_turn(smollm2, generated, cut=cut)
    assert len(samples) == 1 and samples[0].suffix == ""
    prompt = render_prompt(smollm2, messages[:1])
    assert samples[0].input_ids[: len(prompt)] == prompt  # the prompt the target was given
    assert samples[0].input_ids[len(prompt):len(prompt) + len(generated)] == generated
    assert _supervised(samples[0]) == generated  # content + end-of-turn as generated (no end-of-turn when cut)
    assert counts["num_turns_ids"] == 1 and counts["num_turns_text"] == 0


def test_the_text_round_trip_is_what_was_lossy(smollm2):
    """Why ids are kept: the text of these answers does not re-tokenise to the generated ids."""
    double = [34355, 30, 1116, 41462]
    assert smollm2.encode(smollm2.decode(double), add_special_tokens=False) == [34355, 30, 198, 198, 41462]
    cut = [70, 11458, 16739, 23274]
    assert "\ufffd" in smollm2.decode(cut) and smollm2.encode(smollm2.decode(cut), add_special_tokens=False) != cut
    _, samples, counts = _one_turn(smollm2, double + [EOS])
    assert counts["num_turns_ids_not_verbatim"] == 1  # supervised from the ids, counted
    _, samples, counts = _one_turn(smollm2, [21041, 665, 198, EOS])
    assert counts["num_turns_ids_not_verbatim"] == 0  # survives the round trip: the ordinary render


def test_two_turns_first_answer_not_verbatim_gets_its_own_sample(smollm2):
    """Turn 1's ids do not appear verbatim in turn 2's prompt (its text re-tokenises differently): turn 1
    is supervised on its ids in a sample of its own, and in the full sample its text is history (mask 0),
    exactly the prompt the target saw when it answered turn 2."""
    first = [34355, 30, 1116, 41462, EOS]
    second = [21041, 665, EOS]
    messages = [{"role": "user", "content": "One?"}, {"role": "assistant", "content": smollm2.decode(first[:-1])},
                {"role": "user", "content": "Two?"}, {"role": "assistant", "content": smollm2.decode(second[:-1])}]
    counts: dict[str, int] = {}
    full, own = render_training_samples(smollm2, messages, generated_ids=[None, first, None, second],
                                        stop_ids=[EOS], counts=counts)
    prompt2 = render_prompt(smollm2, messages[:3])
    assert full.suffix == "" and full.input_ids[: len(prompt2)] == prompt2 and _supervised(full) == second
    prompt1 = render_prompt(smollm2, messages[:1])
    assert own.suffix == "/turn1" and own.input_ids == prompt1 + first and _supervised(own) == first
    assert counts == {"num_turns_ids": 2, "num_turns_ids_not_verbatim": 1, "num_turns_text": 0,
                      "num_turns_text_retokenized": 0}


def test_text_only_rows_keep_the_render_and_count_retokenised_turns(smollm2):
    """Rows without ids (imported data, servers without ids): the template's render as before, and a
    turn whose supervised content is not the tokenisation of its text is counted."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure.\n\nDone"}]
    counts: dict[str, int] = {}
    (sample,) = render_training_samples(smollm2, messages, counts=counts)
    assert _supervised(sample) == [34355, 30, 198, 198, 41462, EOS]
    assert counts["num_turns_text"] == 1 and counts["num_turns_text_retokenized"] == 0
    # a template that trims the answer (as Llama 3's does) supervises other tokens than the text's
    tok = byte_level_tokenizer(CHATML.replace("message['content']", "message['content'] | trim"))
    counts = {}
    render_training_samples(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok \n"}],
                            counts=counts)
    assert counts["num_turns_text_retokenized"] == 1


def test_generated_ids_must_match_the_messages():
    tok = byte_level_tokenizer(CHATML)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValueError, match=r"generated_ids: expected a list with one entry per message \(2"):
        render_training_samples(tok, messages, generated_ids=[[1, 2]])
    with pytest.raises(ValueError, match=r"generated_ids\[0\]: expected null or .* for a user turn"):
        render_training_samples(tok, messages, generated_ids=[[1], [2]])


class ScriptedAnswers(torch.nn.Module):
    """Answers the k-th prompt of a batch with ``answers[prompt text]`` (byte ids), padding with eos."""

    def __init__(self, tok, answers: dict[str, list[int]]):
        super().__init__()
        self.tok, self.answers = tok, answers
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def generate(self, *, input_ids, attention_mask, generation_config):
        n = generation_config.max_new_tokens
        rows = []
        for ids in input_ids.tolist():
            text = self.tok.decode(ids)
            key = next(k for k in self.answers if k in text)
            new = (self.answers[key] + [2] * n)[:n]
            rows.append(ids + new)
        return torch.tensor(rows)


def test_prepare_then_cache_supervise_the_generated_ids(tmp_path):
    """End to end on a tiny target: answers " Hi there\\n", whitespace only, and whitespace only cut by
    max_new_tokens are stored unstripped with their ids, and the cache (whitespace-only row included)
    supervises exactly those ids."""
    from deepspec.data.cache import TargetCache, write_target_cache
    from deepspec.data.prepare import PrepareConfig, run_prepare

    tok = byte_level_tokenizer(CHATML)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    answers = {"greet": enc(" Hi there\n") + [2], "blank": enc("  \n") + [2], "spaces": enc(" " * 20)}
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": k, "messages": [{"role": "user", "content": k},
                                                             {"role": "assistant", "content": "old"}]}) + "\n"
                           for k in answers))
    cfg = PrepareConfig(input=str(src), output=tmp_path / "out.jsonl", max_new_tokens=12, show_progress=False)
    run_prepare(cfg, ScriptedAnswers(tok, answers), tok, log=lambda _: None)
    rows = {r["id"]: r for r in map(json.loads, cfg.output.read_text().splitlines())}
    assert rows["greet"]["messages"][1]["content"] == " Hi there\n"  # not stripped
    assert rows["blank"]["messages"][1]["content"] == "  \n"
    assert rows["spaces"]["generated_ids"][1] == enc(" " * 12) and rows["spaces"]["truncated_turns"] == [1]

    target = tiny_llama_target(tok)
    summary = write_target_cache(cfg.output, tmp_path / "cache", target, tok, target_layer_ids=[0], max_seq_len=None,
                                 storage_dtype="float32", progress=False)
    cache = TargetCache(tmp_path / "cache")
    assert summary.num_samples == 3 and summary.turns["num_turns_ids"] == 3
    for i in range(len(cache)):
        row = rows[cache.sample_id(i)]
        ids, mask = cache[i]["input_ids"].tolist(), cache[i]["loss_mask"].tolist()
        ((a, b),) = mask_spans(mask)
        assert ids[a:b] == row["generated_ids"][1] and ids[:a] == render_prompt(tok, row["messages"][:1])
    manifest = cache.manifest
    assert manifest["stop_token_ids"] == [2] and manifest["render"]["checked_against"] == "out.jsonl.summary.json"
    assert set(manifest["turns"]) == set(COUNT_KEYS)


def test_render_record_catches_what_the_template_reads():
    """chat_template_kwargs and a template that reads the date change the render: both are found."""
    tok = byte_level_tokenizer(CHATML)
    base = render_record(tok, chat_template_kwargs=None, stop_ids=[2])
    assert render_record_differences(base, render_record(tok, chat_template_kwargs=None, stop_ids=[2])) == []
    other = render_record(tok, chat_template_kwargs={"enable_thinking": False}, stop_ids=[2])
    assert any(line.startswith("chat_template_kwargs") for line in render_record_differences(base, other))
    dated = byte_level_tokenizer("{{ strftime_now('%H:%M:%S.%f') }}" + CHATML)
    first = render_record(dated, chat_template_kwargs=None, stop_ids=[2])
    assert "strftime_now" in first["template_variables"] and "render_date" in first
    lines = render_record_differences(first, render_record(dated, chat_template_kwargs=None, stop_ids=[2]))
    assert lines[0].startswith("probe_sha256") and "strftime_now" in lines[-1]
