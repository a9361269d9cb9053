"""Prepare stage: selection, counting, turn-by-turn regeneration, order, truncation flags, atomicity.

A scripted fake target (deterministic answers that depend on the prompt) checks the bookkeeping
exactly; a tiny random Llama checks the real ``model.generate`` path (left padding: batched output
equals one-at-a-time output).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from deepspec.data.chat import render_prompt, render_record
from deepspec.data.prepare import (
    PrepareConfig,
    heldout_path_for,
    journal_path_for,
    read_journal,
    run_prepare,
    skipped_path_for,
)
from deepspec.data.sources import assign_split
from deepspec.stages import run_prepare_stage

try:
    from tests.unit.test_chat import tiny_chatml_tokenizer
except ImportError:  # pytest run from another folder: tests/unit itself is on sys.path
    from test_chat import tiny_chatml_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_chatml_tokenizer()


class ScriptedTarget(torch.nn.Module):
    """Answers ``ans<L>`` (L = unpadded prompt length) then eos; prompts with L % 4 == 0 never stop."""

    def __init__(self, tok, fail_on_call: int | None = None):
        super().__init__()
        self.tok = tok
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls = 0
        self.fail_on_call = fail_on_call

    def generate(self, *, input_ids, attention_mask, generation_config):
        self.calls += 1
        if self.fail_on_call is not None and self.calls >= self.fail_on_call:
            raise RuntimeError("simulated crash")
        n = generation_config.max_new_tokens
        pad = generation_config.pad_token_id
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            first = mask.index(1)
            assert all(mask[first:]) and not any(mask[:first]), "expected left padding"
            assert all(t == pad for t in ids[:first])
            length = len(ids) - first
            if length % 4 == 0:
                new = self.tok.encode("x" * n, add_special_tokens=False)[:n]
            else:
                new = (self.tok.encode(f"ans{length}", add_special_tokens=False) + [self.tok.eos_token_id])[:n]
            rows.append(ids + new + [pad] * (n - len(new)))
        return torch.tensor(rows)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _conv(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


ROWS = [
    _conv(("human", "q0"), ("gpt", "old")),
    _conv(("human", "only a question")),  # no assistant turn: skipped
    _conv(("human", "q2 first"), ("gpt", "old"), ("human", "q2 second"), ("gpt", "old"), ("human", "tail")),
    _conv(("human", "z" * 400), ("gpt", "old")),  # first prompt too long: skipped
    _conv(("human", "q4"), ("gpt", "old"), ("human", "y" * 300), ("gpt", "old")),  # 2nd turn too long: stops
    _conv(("human", "q5 xx"), ("gpt", "old")),
    _conv(("human", "never read"), ("gpt", "old")),
]


def _run(tmp_path, tok, model, **overrides):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, ROWS)
    knobs = dict(input=str(src), output=tmp_path / "out.jsonl", num_conversations=4, max_new_tokens=8,
                 batch_size=2, max_prompt_tokens=300, max_turns=None, show_progress=False)
    knobs.update(overrides)
    cfg = PrepareConfig(**knobs)
    return cfg, run_prepare(cfg, model, tok, log=lambda _: None)


def test_prepare_counts_order_turns_and_flags(tmp_path, tok):
    cfg, summary = _run(tmp_path, tok, ScriptedTarget(tok))
    assert (summary.read, summary.kept, summary.skipped, summary.failed) == (6, 4, 2, 0)
    assert summary.read == summary.kept + summary.skipped + summary.failed
    rows = [json.loads(line) for line in cfg.output.read_text(encoding="utf-8").splitlines()]
    assert [r["source_index"] for r in rows] == [0, 2, 4, 5]  # input order
    for row in rows:
        msgs = row["messages"]
        assert msgs[-1]["role"] == "assistant" and "old" not in [m["content"] for m in msgs]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt_len = len(render_prompt(tok, msgs[:i]))  # regenerated history is the context
            if prompt_len % 4 == 0:
                assert m["content"] == "x" * cfg.max_new_tokens and i in row["truncated_turns"]
            else:
                assert m["content"] == f"ans{prompt_len}" and i not in row["truncated_turns"]
        assert row["truncated"] == bool(row["truncated_turns"])
    by_src = {r["source_index"]: r for r in rows}
    assert [m["role"] for m in by_src[4]["messages"]] == ["user", "assistant"]  # 2nd prompt did not fit
    assert summary.truncated == sum(r["truncated"] for r in rows)
    skipped = [json.loads(line) for line in skipped_path_for(cfg.output).read_text().splitlines()]
    assert [(s["source_index"], s["status"]) for s in skipped] == [(1, "skipped"), (3, "skipped")]
    assert "no assistant turn" in skipped[0]["reason"] and "max_prompt_tokens" in skipped[1]["reason"]


def test_prepare_two_turns_use_regenerated_history(tmp_path, tok):
    cfg, _ = _run(tmp_path, tok, ScriptedTarget(tok), num_conversations=2)
    rows = [json.loads(line) for line in cfg.output.read_text(encoding="utf-8").splitlines()]
    multi = rows[1]["messages"]
    assert [m["role"] for m in multi] == ["user", "assistant", "user", "assistant"]  # trailing user dropped
    assert multi[2]["content"] == "q2 second"


def test_prepare_max_turns_caps_regeneration(tmp_path, tok):
    cfg, _ = _run(tmp_path, tok, ScriptedTarget(tok), max_turns=1)
    rows = [json.loads(line) for line in cfg.output.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 4
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)


def test_prepare_strict_mode_names_the_row(tmp_path, tok):
    with pytest.raises(ValueError, match=r"in.jsonl:2 \(id in-1\).*no assistant turn"):
        _run(tmp_path, tok, ScriptedTarget(tok), skip_bad_rows=False)


def test_prepare_crash_leaves_no_output_and_resume_completes(tmp_path, tok):
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tmp_path, tok, ScriptedTarget(tok, fail_on_call=2))
    journal = journal_path_for(tmp_path / "out.jsonl")
    # No final file, no temp file left; only the journal of the finished conversations.
    assert sorted(tmp_path.iterdir()) == sorted([tmp_path / "in.jsonl", journal])
    header, entries = read_journal(journal)
    assert header["format"] == "deepspec-prepare-journal/1" and len(entries) == 2  # batch 1 of 2 rows finished
    resumed_target = ScriptedTarget(tok)
    cfg, summary = _run(tmp_path, tok, resumed_target)
    assert summary.num_resumed == 2 and not journal.exists()
    resumed = cfg.output.read_bytes()
    # The resumed run regenerated only the missing rows and equals an uninterrupted run byte for byte.
    fresh_cfg, fresh = _run(tmp_path, tok, ScriptedTarget(tok), output=tmp_path / "fresh.jsonl")
    assert fresh.num_resumed == 0 and fresh.num_regenerated_turns > summary.num_regenerated_turns
    assert resumed == fresh_cfg.output.read_bytes()


def _dated_tokenizer():
    """The tiny ChatML tokenizer behind a system line that prints today's date (as Llama 3 templates do)."""
    tok = tiny_chatml_tokenizer()
    tok.chat_template = "{{ 'Today is ' + strftime_now('%d %b %Y') + '.\\n' }}" + tok.chat_template
    return tok


def _set_clock(monkeypatch, day: int) -> None:
    """Make ``strftime_now`` in chat templates, and the render record, read March ``day``, 2026."""
    import datetime
    import types

    from transformers.utils import chat_template_utils

    from deepspec.data import chat

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 3, day, 12, 0)

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)
    monkeypatch.setattr(chat, "datetime", types.SimpleNamespace(datetime=Clock), raising=False)


def test_resume_on_another_day_with_a_dated_template_is_refused(tmp_path, monkeypatch):
    """A template that prints the date renders other prompts the next day: resuming the journal then
    would pair its answers with prompts the target never saw, so it is refused (naming the date); on
    the day it started the run resumes, and the summary records the resumed rows' render."""
    tok = _dated_tokenizer()
    _set_clock(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tmp_path, tok, ScriptedTarget(tok, fail_on_call=2))
    journal = journal_path_for(tmp_path / "out.jsonl")
    _, entries = read_journal(journal)
    assert entries  # the first batch finished on day 1
    _set_clock(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"renders differently \(probe_sha256.*strftime_now.*2026-03-01.*"
                                         r"2026-03-02.*delete .*partial.jsonl to start over"):
        _run(tmp_path, tok, ScriptedTarget(tok))
    assert journal.exists() and not (tmp_path / "out.jsonl").exists()  # nothing written, the journal kept
    _set_clock(monkeypatch, 1)
    cfg, summary = _run(tmp_path, tok, ScriptedTarget(tok))
    assert summary.num_resumed == len(entries) and not journal.exists()
    recorded = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert recorded["resumed_render"] == recorded["render"] and recorded["render"]["render_date"] == "2026-03-01"


def test_cache_refuses_resumed_rows_rendered_differently(tmp_path, monkeypatch):
    """The cache checks the summary's record of the resumed rows: a render that differs from the rest's
    (another day) is refused, and so is a resumed file of a dated template without that record (as
    prepare wrote before it checked the render on resume); the file as prepare wrote it is accepted."""
    from deepspec.data.cache import check_prepared_render

    tok = _dated_tokenizer()
    _set_clock(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tmp_path, tok, ScriptedTarget(tok, fail_on_call=2))
    cfg, _ = _run(tmp_path, tok, ScriptedTarget(tok))
    summary_path = tmp_path / "out.jsonl.summary.json"
    good = json.loads(summary_path.read_text())
    assert check_prepared_render(cfg.output, tok, [2])["checked_against"] == summary_path.name
    _set_clock(monkeypatch, 2)
    day_two = json.loads(json.dumps(good))
    day_two["render"] = render_record(tok, chat_template_kwargs=None, stop_ids=[2])
    summary_path.write_text(json.dumps(day_two))  # rows resumed on day 1, the rest rendered on day 2
    with pytest.raises(ValueError, match=r"\d+ rows resumed .* rendered differently .*probe_sha256"):
        check_prepared_render(cfg.output, tok, [2])
    del day_two["resumed_render"]  # the same file without the record of the resumed rows' render
    summary_path.write_text(json.dumps(day_two))
    with pytest.raises(ValueError, match=r"did not record their render .*strftime_now"):
        check_prepared_render(cfg.output, tok, [2])


def test_prepare_config_validation(tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        PrepareConfig(input="sharegpt-demo", output=tmp_path / "o.jsonl", batch_size=0)
    with pytest.raises(ValueError, match="temperature"):
        PrepareConfig(input="sharegpt-demo", output=tmp_path / "o.jsonl", temperature=-1.0)


def _tiny_llama(tok):
    """A random 2-layer Llama over ``tok``'s vocabulary (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def test_prepare_real_generate_batched_equals_unbatched(tmp_path, tok):
    model = _tiny_llama(tok)
    outs = []
    for batch_size in (1, 3):
        out = tmp_path / f"b{batch_size}.jsonl"
        _run(tmp_path, tok, model, output=out, batch_size=batch_size, max_new_tokens=6)
        outs.append([json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()])
    assert outs[0] == outs[1]
    assert [r["source_index"] for r in outs[0]] == [0, 2, 4, 5]


def test_prepare_template_failure_is_counted_as_failed(tmp_path):
    tok = tiny_chatml_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['content'] == 'q0' %}{{ raise_exception('no q0') }}"
                         "{% endif %}{% endfor %}" + tok.chat_template)
    cfg, summary = _run(tmp_path, tok, ScriptedTarget(tok))
    assert (summary.read, summary.kept, summary.skipped, summary.failed) == (7, 4, 2, 1)
    skipped = [json.loads(line) for line in skipped_path_for(cfg.output).read_text().splitlines()]
    assert skipped[0]["source_index"] == 0 and skipped[0]["status"] == "failed" and "no q0" in skipped[0]["reason"]


def test_journal_torn_last_line_is_ignored_and_cut(tmp_path, tok):
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tmp_path, tok, ScriptedTarget(tok, fail_on_call=2))
    journal = journal_path_for(tmp_path / "out.jsonl")
    good = journal.read_bytes()
    _, entries = read_journal(journal)
    journal.write_bytes(good + b'{"source_index": 5, "id": "in-5", "sta')  # a kill in the middle of a line
    header, torn_entries = read_journal(journal)
    assert torn_entries == entries and journal.read_bytes() == good  # ignored, and cut off in place
    journal.write_bytes(good + b'{"source_index": 5, "id"')
    cfg, summary = _run(tmp_path, tok, ScriptedTarget(tok))
    assert summary.num_resumed == len(entries) and summary.kept == 4
    rows = [json.loads(line) for line in cfg.output.read_text(encoding="utf-8").splitlines()]
    assert [r["source_index"] for r in rows] == [0, 2, 4, 5]  # nothing duplicated, nothing skipped


def test_journal_corrupt_middle_line_and_other_settings_are_refused(tmp_path, tok):
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tmp_path, tok, ScriptedTarget(tok, fail_on_call=2))
    journal = journal_path_for(tmp_path / "out.jsonl")
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens: 8 -> 9\)"):
        _run(tmp_path, tok, ScriptedTarget(tok), max_new_tokens=9)
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text(lines[0] + "{broken\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match="malformed journal line"):
        read_journal(journal)


def test_prepare_heldout_split_and_chat_template_kwargs(tmp_path, tok):
    cfg_all, _ = _run(tmp_path, tok, ScriptedTarget(tok), output=tmp_path / "all.jsonl")
    all_rows = [json.loads(line) for line in cfg_all.output.read_text().splitlines()]
    assert all(r["split"] == "train" and "chat_template_kwargs" not in r for r in all_rows)
    assert heldout_path_for(cfg_all.output).read_text() == ""
    cfg, summary = _run(tmp_path, tok, ScriptedTarget(tok), heldout_fraction=0.5, split_seed=3,
                        enable_thinking=False)
    train = [json.loads(line) for line in cfg.output.read_text().splitlines()]
    heldout = [json.loads(line) for line in heldout_path_for(cfg.output).read_text().splitlines()]
    assert (summary.num_train, summary.num_heldout) == (len(train), len(heldout))
    assert summary.kept == summary.num_train + summary.num_heldout == 4
    for rows, split in ((train, "train"), (heldout, "heldout")):  # the split is the row key's (no ids: its index)
        assert all(r["split"] == split == assign_split(str(r["source_index"]), heldout_fraction=0.5, seed=3)
                   for r in rows)
    assert train and heldout  # seed 3 splits these 4 rows 2/2 (a pure function of the row key)
    assert sorted(r["source_index"] for r in train + heldout) == [0, 2, 4, 5]
    assert all(r["chat_template_kwargs"] == {"enable_thinking": False} for r in train + heldout)
    summary_json = json.loads(cfg.output.with_name("out.jsonl.summary.json").read_text())
    s = summary_json["summary"]
    assert s["read"] == s["kept"] + s["skipped"] + s["failed"]


@pytest.mark.parametrize("field,value", [
    ("backend", "vllm"), ("top_p", 0.0), ("top_p", 1.5), ("heldout_fraction", 1.0), ("heldout_fraction", -0.1),
    ("max_concurrency", 0), ("max_retries", -1), ("request_timeout_s", 0.0), ("retry_backoff_s", -1.0),
    ("enable_thinking", "yes"), ("chunk_conversations", 0), ("split_seed", 1.5), ("api_key_env", ""),
    ("base_urls", ["http://x/v1"]),  # base_urls with the local backend
])
def test_prepare_config_new_fields_are_validated(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        PrepareConfig(input="sharegpt-demo", output=tmp_path / "o.jsonl", **{field: value})


def test_prepare_config_openai_needs_http_urls(tmp_path):
    with pytest.raises(ValueError, match="base_urls"):
        PrepareConfig(input="sharegpt-demo", output=tmp_path / "o.jsonl", backend="openai")
    with pytest.raises(ValueError, match="base_urls.*not an http"):
        PrepareConfig(input="sharegpt-demo", output=tmp_path / "o.jsonl", backend="openai", base_urls=["host:80"])
    cfg = PrepareConfig(input="sharegpt-demo", output=tmp_path / "o.jsonl", backend="openai",
                        base_urls=["http://a:1/v1", "http://b:2/v1"])
    assert cfg.chat_template_kwargs is None


def _log_run(tmp_path, tok, model, **overrides):
    lines: list[str] = []
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, ROWS)
    knobs = dict(input=str(src), output=tmp_path / "out.jsonl", num_conversations=4, max_new_tokens=8,
                 batch_size=2, max_prompt_tokens=300, max_turns=None, show_progress=False)
    knobs.update(overrides)
    cfg = PrepareConfig(**knobs)
    return cfg, run_prepare(cfg, model, tok, log=lines.append), lines


def test_skipped_rows_carry_their_location_in_a_folder_input(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "data"
    folder.mkdir()
    # a.jsonl: blank lines make the line number differ from the source index.
    (folder / "a.jsonl").write_text("\n" + json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n", encoding="utf-8")
    pq.write_table(pa.Table.from_pylist([ROWS[5], ROWS[3]]), folder / "b.parquet")
    (folder / "c.json").write_text(json.dumps([ROWS[1]]), encoding="utf-8")
    cfg, summary, lines = _log_run(tmp_path, tok, ScriptedTarget(tok), input=str(folder), num_conversations=None)
    assert (summary.read, summary.kept, summary.skipped) == (5, 2, 3)
    skipped = [json.loads(line) for line in skipped_path_for(cfg.output).read_text().splitlines()]
    assert [(s["source_index"], s["where"]) for s in skipped] == [
        (1, f"{folder / 'a.jsonl'}:4"), (3, f"{folder / 'b.parquet'}[1]"), (4, f"{folder / 'c.json'}[0]")]
    shown = [line for line in lines if line.startswith("prepare: skipped ")]
    assert shown[0] == f"prepare: skipped {folder / 'a.jsonl'}:4 (id data-1): no assistant turn after the first " \
                       f"user turn"
    assert len(shown) == 3 and "max_prompt_tokens" in shown[1]


def test_failed_rows_carry_their_location_and_the_console_shows_the_first_five(tmp_path):
    tok = tiny_chatml_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['content'].startswith('q') %}{{ raise_exception('no q') }}"
                         "{% endif %}{% endfor %}" + tok.chat_template)
    rows = [_conv(("human", f"q{i}"), ("gpt", "old")) for i in range(7)]
    src = tmp_path / "many.jsonl"
    _write_jsonl(src, rows)
    cfg, summary, lines = _log_run(tmp_path, tok, ScriptedTarget(tok), input=str(src), num_conversations=None)
    assert (summary.read, summary.kept, summary.failed) == (7, 0, 7)
    skipped = [json.loads(line) for line in skipped_path_for(cfg.output).read_text().splitlines()]
    assert [s["where"] for s in skipped] == [f"{src}:{i + 1}" for i in range(7)]
    assert sum(line.startswith(f"prepare: failed {src}:") for line in lines) == 5
    assert f"prepare: ... 2 more in {skipped_path_for(cfg.output)}" in lines
    assert lines[-1] == (f"prepare: warning: no conversation kept (7 read); see {skipped_path_for(cfg.output)} "
                         f"for the reasons")
    assert cfg.output.read_text() == ""  # outputs are still written (empty), the skipped rows with their reasons
    with pytest.raises(ValueError, match=r"prepare: no conversation kept \(7 read = skipped 0 \+ failed 7\); "
                                         r"each row's reason is in .*out.skipped.jsonl"):
        run_prepare_stage(cfg, target_model=ScriptedTarget(tok), tokenizer=tok)  # the stage (CLI: exit 2)


def test_lost_in_source_is_printed_only_when_nonzero(tmp_path, tok):
    _, summary, lines = _log_run(tmp_path, tok, ScriptedTarget(tok))
    assert summary.lost_in_source == 0 and not any(" lost in " in line for line in lines)
    cut = tmp_path / "cut.json"
    cut.write_text("[" + ",".join(json.dumps(r) for r in ROWS[:2]) + ', {"conversations": [{"from": "hu',
                   encoding="utf-8")
    _, summary, lines = _log_run(tmp_path, tok, ScriptedTarget(tok), input=str(cut), output=tmp_path / "c.jsonl")
    assert summary.lost_in_source == 1
    assert "; 1 record lost in the source file itself (never read; " in lines[0]


def test_strict_messages_name_the_cli_flag(tmp_path, tok):
    with pytest.raises(ValueError, match=r"--skip-bad-rows true"):
        _run(tmp_path, tok, ScriptedTarget(tok), skip_bad_rows=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{oops\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON.*--skip-bad-rows true"):
        _run(tmp_path, tok, ScriptedTarget(tok), input=str(bad), skip_bad_rows=False)


def test_prepare_output_must_be_a_file_path(tmp_path):
    (tmp_path / "out").mkdir()
    for output in (tmp_path / "out", f"{tmp_path / 'new'}/"):
        with pytest.raises(ValueError, match=r"PrepareConfig\.output=.*expected a file path, got a folder"):
            PrepareConfig(input="sharegpt-demo", output=output)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"PrepareConfig\.output=.*afile is a file"):
        PrepareConfig(input="sharegpt-demo", output=tmp_path / "afile" / "sub" / "o.jsonl")


def test_prepare_creates_a_missing_output_folder(tmp_path, tok):
    cfg, summary = _run(tmp_path, tok, ScriptedTarget(tok), output=tmp_path / "new" / "sub" / "out.jsonl")
    assert summary.kept == 4 and len(cfg.output.read_text().splitlines()) == 4
    assert skipped_path_for(cfg.output).is_file() and heldout_path_for(cfg.output).is_file()


def test_failed_output_write_leaves_no_side_files_under_final_names(tmp_path, tok):
    output = tmp_path / "out.jsonl"

    class BlockOutput(ScriptedTarget):  # a folder appears at the output path while the run is working
        def generate(self, **kwargs):
            output.mkdir(exist_ok=True)
            return super().generate(**kwargs)

    with pytest.raises(IsADirectoryError):
        _run(tmp_path, tok, BlockOutput(tok), output=output)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["in.jsonl", "out.jsonl", "out.jsonl.partial.jsonl"]  # the folder, the input, the journal
    assert not any(output.iterdir())


def test_local_backend_uses_the_few_row_path_for_small_float32_batches(tok, monkeypatch):
    import deepspec.target.few_row_linear as frl
    from deepspec.data.backends import BATCH_FEW_ROW_MAX_ROWS, GenerationParams, LocalBackend, TurnRequest

    model = _tiny_llama(tok)
    assert LocalBackend(model, tok, batch_size=64).few_row_rows == BATCH_FEW_ROW_MAX_ROWS
    assert LocalBackend(model, tok, batch_size=3).few_row_rows == 3
    assert LocalBackend(model, tok, batch_size=3, few_row_linear="off").few_row_rows == 0
    assert LocalBackend(model, tok, batch_size=1).few_row_rows == 0  # one row: F.linear's GEMV either way
    assert LocalBackend(copy.deepcopy(model).to(torch.bfloat16), tok, batch_size=3).few_row_rows == 0
    with pytest.raises(ValueError, match="few_row_linear"):
        LocalBackend(model, tok, few_row_linear="fast")

    rows_seen = []
    real = frl.few_row_forward
    monkeypatch.setattr(frl, "few_row_forward", lambda layer, x, max_rows: rows_seen.append(max_rows) or
                        real(layer, x, max_rows))
    generation = GenerationParams(max_new_tokens=5)
    requests = [TurnRequest(key=str(i), messages=[{"role": "user", "content": text}], generation=generation)
                for i, text in enumerate(["hello there", "abc", "a longer question here"])]
    answers = {}
    for mode in ("on", "off"):
        got = {}
        LocalBackend(model, tok, batch_size=3, few_row_linear=mode).generate(requests, got.__setitem__)
        answers[mode] = [got[i].token_ids for i in range(len(requests))]
        assert bool(rows_seen) == (mode == "on") and set(rows_seen) <= {3}
        rows_seen.clear()
    assert answers["on"] == answers["off"]
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))  # restored
