"""Dataset sources: spec resolution, file formats, Hugging Face datasets (offline), split (docs/design/data.md, "Dataset sources")."""

from __future__ import annotations

import json

import pytest

from deepspec.data import sources
from deepspec.data.conversations import DemoRecords, SkipRow
from deepspec.data.sources import (
    SourceRow,
    SourceUnavailableError,
    assign_split,
    dataset_rows,
    open_source,
    row_key,
    source_row_messages,
)

OPENAI = {"id": "o1", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]}
PERFECTBLEND = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q3"},
                                  {"from": "gpt", "value": "A3"}], "source": "airoboros"}
BAD = {"messages": [{"role": "user", "content": "Q"}]}  # no assistant turn


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _collect(src):
    out = []
    for r in src.located:
        try:
            out.append((r.index, r.where, source_row_messages(r)))
        except SkipRow as exc:
            out.append((r.index, r.where, exc.reason))
    return out


# ------------------------------------------------------------------------------------------- JSONL


def test_jsonl_rows_in_order_with_file_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(OPENAI) + "\n\n" + json.dumps(BAD) + "\n" + json.dumps(SHAREGPT) + "\n")
    src = open_source(str(path))
    assert src.num_lost == 0 and src.num_records is None and "JSONL" in src.description
    got = _collect(src)
    assert [(i, w) for i, w, _ in got] == [(0, f"{path}:1"), (1, f"{path}:3"), (2, f"{path}:4")]
    assert got[0][2][1] == {"role": "assistant", "content": "A"}
    assert got[1][2] == "no assistant turn after the first user turn"
    assert got[2][2][0] == {"role": "user", "content": "Q2"}


def test_jsonl_malformed_line_raises_or_is_yielded_as_unreadable(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(OPENAI) + "\n{oops\n" + json.dumps(SHAREGPT) + "\n")
    rows = open_source(str(path)).rows
    assert next(rows) == OPENAI
    with pytest.raises(ValueError, match=r"d\.jsonl:2: malformed JSON.*skip_unreadable"):
        next(rows)
    located = list(open_source(str(path), skip_unreadable=True).located)
    assert [r.index for r in located] == [0, 1, 2]
    assert located[1].row is None and "malformed JSON" in located[1].error
    with pytest.raises(SkipRow, match=r"d\.jsonl:2: malformed JSON") as info:
        source_row_messages(located[1])
    assert info.value.where == f"{path}:2"


# -------------------------------------------------------------------------------------------- JSON


def test_json_array_and_object_layouts(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([OPENAI, SHAREGPT, PERFECTBLEND]))
    src = open_source(str(arr))
    assert src.num_records == 3 and src.num_lost == 0
    got = _collect(src)
    assert [w for _, w, _ in got] == [f"{arr}[0]", f"{arr}[1]", f"{arr}[2]"]
    assert got[2][2][0] == {"role": "system", "content": "S"}

    obj = tmp_path / "o.json"
    obj.write_text(json.dumps({"version": 2, "data": [SHAREGPT, BAD]}))
    assert list(open_source(str(obj)).rows) == [SHAREGPT, BAD]


@pytest.mark.parametrize("payload", [{"version": 2, "items": [OPENAI]}, {"data": [OPENAI], "rows": [OPENAI]}])
def test_json_object_without_one_known_list_is_an_error(tmp_path, payload):
    path = tmp_path / "o.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=r"o\.json: a \.json input must be a JSON array.*exactly one of"):
        open_source(str(path))


def test_json_errors_name_file_and_position(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "data": [1,\n  }\n')
    with pytest.raises(ValueError, match=r"bad\.json:3: malformed JSON"):
        open_source(str(path))
    path.write_text('"just a string"')
    with pytest.raises(ValueError, match=r"bad\.json: a \.json input must be a JSON array of rows, got str"):
        open_source(str(path))
    path.write_text('[{"a": 1}, {"a": oops}, {"a": 3}]')
    with pytest.raises(ValueError, match=r"bad\.json: element 1 .* corrupt"):
        open_source(str(path))


def test_truncated_json_array_counts_the_cut_record_as_lost(tmp_path):
    path = tmp_path / "cut.json"
    full = json.dumps([OPENAI, SHAREGPT, PERFECTBLEND])
    path.write_text(full[: full.index('"airoboros"')])
    src = open_source(str(path))
    assert src.num_lost == 1 and src.num_records == 2
    assert list(src.rows) == [OPENAI, SHAREGPT]


def test_non_object_json_element_is_a_skip_with_where(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([OPENAI, [1, 2]]))
    got = _collect(open_source(str(path)))
    assert got[1] == (1, f"{path}[1]", "row is a list, expected an object")


# ----------------------------------------------------------------------------------------- Parquet


def test_parquet_read_in_batches(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}],
             "source": "pb"} for i in range(7)]
    rows[4]["conversations"] = [{"from": "gpt", "value": "orphan"}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    src = open_source(str(path), parquet_batch_rows=2)
    assert src.num_records == 7 and "Parquet" in src.description
    got = _collect(src)
    assert [(i, w) for i, w, _ in got] == [(i, f"{path}[{i}]") for i in range(7)]
    assert got[6][2] == [{"role": "user", "content": "q6"}, {"role": "assistant", "content": "a6"}]
    assert got[4][2] == "no user turn"


def test_parquet_with_openai_messages_and_nullable_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [OPENAI, {"id": "o2", "messages": [{"role": "user", "content": "Q", "name": "bob"},
                                              {"role": "assistant", "content": "A"}]}]
    path = tmp_path / "m.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    got = _collect(open_source(str(path)))
    assert got[0][2] == OPENAI["messages"]  # the unified schema adds name=None to every turn: ignored
    assert got[1][2] == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


def test_unreadable_parquet_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet: not a readable Parquet file"):
        open_source(str(path))


# ------------------------------------------------------------------------------------------ folders


def test_folder_of_files_in_name_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mix"
    folder.mkdir()
    _write_jsonl(folder / "b.jsonl", [SHAREGPT])
    (folder / "a.json").write_text(json.dumps([OPENAI]))
    pq.write_table(pa.Table.from_pylist([PERFECTBLEND]), folder / "c.parquet")
    (folder / "notes.txt").write_text("ignored")
    src = open_source(str(folder))
    assert src.num_records is None  # the JSONL file has no count up front
    located = list(src.located)
    assert [r.index for r in located] == [0, 1, 2]
    assert [r.where for r in located] == [f"{folder / 'a.json'}[0]", f"{folder / 'b.jsonl'}:1",
                                          f"{folder / 'c.parquet'}[0]"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no .jsonl/.json/.parquet files"):
        open_source(str(empty))


def test_saved_dataset_folder_goes_through_datasets(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([PERFECTBLEND, SHAREGPT | {"source": "x"}])
    ds.save_to_disk(str(tmp_path / "saved"))
    src = open_source(str(tmp_path / "saved"))
    assert src.num_records == 2 and "saved dataset" in src.description
    got = _collect(src)
    assert got[0][1] == f"{tmp_path / 'saved'}[0]"
    assert got[0][2][0] == {"role": "system", "content": "S"}
    assert got[1][2] == [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]

    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "dd"))
    assert len(list(open_source(str(tmp_path / "dd"), hf_split="test").rows)) == 1
    with pytest.raises(ValueError, match=r"without split 'validation'.*\['test', 'train'\]"):
        open_source(str(tmp_path / "dd"), hf_split="validation")


# ------------------------------------------------------------------------- Hugging Face dataset ids


@pytest.fixture
def hub_reachable(monkeypatch):
    """Tests that point `datasets.load_dataset` at local data must not depend on this machine's DNS."""
    monkeypatch.setattr(sources, "_hub_unreachable", lambda: None)


def test_hf_id_loads_through_datasets_streaming(tmp_path, monkeypatch, hub_reachable):
    """The hub loader is pointed at local data: the real `datasets` streaming path, no network."""
    import datasets

    data = _write_jsonl(tmp_path / "hub.jsonl", [PERFECTBLEND, BAD, OPENAI])
    calls = []
    real_load = datasets.load_dataset

    def local_load(path, name=None, split=None, streaming=False, **kw):
        calls.append((path, name, split, streaming))
        return real_load("json", data_files=str(data), split="train", streaming=streaming,
                         cache_dir=str(tmp_path / "hf-cache"))

    monkeypatch.setattr(datasets, "load_dataset", local_load)
    src = open_source("mlabonne/open-perfectblend")
    assert src.num_records is None and "Hugging Face dataset mlabonne/open-perfectblend, split train" in src.description
    got = _collect(src)
    assert calls == [("mlabonne/open-perfectblend", None, "train", True)]
    assert [w for _, w, _ in got] == [f"mlabonne/open-perfectblend:train[{i}]" for i in range(3)]
    assert got[0][2][0] == {"role": "system", "content": "S"}
    assert got[1][2] == "no assistant turn after the first user turn"

    src = open_source("hf:org/name:test_sft", hf_config="all", hf_streaming=False)
    assert calls[-1] == ("org/name", "all", "test_sft", False)
    assert src.num_records == 3 and next(src.located).where == "org/name:test_sft[0]"


def test_hf_network_failure_names_id_and_suggests_local_file(monkeypatch, hub_reachable):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/name' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    # A ValueError subclass: the CLI reports it as a user error (exit 2, no traceback).
    with pytest.raises(SourceUnavailableError,
                       match=r"'org/name' \(split 'validation'\).*ConnectionError.*local file") as info:
        open_source("org/name:validation")
    assert isinstance(info.value, ValueError)


def test_hf_unresolvable_hub_fails_at_once_without_calling_datasets(monkeypatch):
    import socket

    import datasets

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    def must_not_run(*args, **kwargs):
        raise AssertionError("load_dataset would spend ~25 s retrying")

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT", *sources._PROXY_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(datasets, "load_dataset", must_not_run)
    with pytest.raises(SourceUnavailableError, match=r"'org/name' \(split 'train'\).*huggingface\.co cannot be "
                                                      r"resolved.*local file.*HF_HUB_OFFLINE=1"):
        open_source("org/name")
    # Offline mode set: no DNS check; datasets decides (it reads its cache and fails fast by itself).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert sources._hub_unreachable() is None


def test_hf_failure_while_streaming_names_the_row(monkeypatch, hub_reachable):
    import datasets

    def stream():
        yield OPENAI
        raise ConnectionError("connection reset")

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: stream())
    rows = open_source("org/name").located
    assert next(rows).row == OPENAI
    with pytest.raises(SourceUnavailableError, match=r"'org/name' \(split 'train'\) at row 1: ConnectionError"):
        next(rows)


def test_dataset_rows_converts_a_dataset():
    import datasets

    ds = datasets.Dataset.from_list([SHAREGPT, PERFECTBLEND])
    got = list(dataset_rows(ds, name="mem"))
    assert [r.where for r in got] == ["mem[0]", "mem[1]"]
    assert source_row_messages(got[1])[1] == {"role": "user", "content": "Q3"}


# ------------------------------------------------------------------------------- spec resolution


def test_existing_path_wins_over_dataset_id(tmp_path, monkeypatch, hub_reachable):
    import datasets

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    _write_jsonl(tmp_path / "org" / "name.jsonl", [OPENAI])
    (tmp_path / "org" / "data").mkdir()
    _write_jsonl(tmp_path / "org" / "data" / "x.jsonl", [SHAREGPT])

    def no_hub(*a, **k):
        raise AssertionError("must not reach the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    assert list(open_source("org/data").rows) == [SHAREGPT]  # a local folder, not a dataset id
    monkeypatch.setattr(datasets, "load_dataset", lambda path, **k: datasets.Dataset.from_list([OPENAI]))
    assert next(open_source("hf:org/data").located).where == "org/data:train[0]"  # hf: forces the hub


def test_missing_paths_and_unknown_specs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source("./nope")
    with pytest.raises(ValueError, match="neither an existing path nor a Hugging Face dataset id"):
        open_source("just-a-name")
    with pytest.raises(ValueError, match="expected 'sharegpt-demo'"):
        open_source("  ")
    with pytest.raises(ValueError, match="hf:org/name"):
        open_source("hf:no-slash")
    other = tmp_path / "rows.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format"):
        open_source(str(other))


def test_sharegpt_demo_spec(monkeypatch):
    demo = DemoRecords(rows=[SHAREGPT, BAD], num_records=2, num_lost=1)
    monkeypatch.setattr(sources, "load_sharegpt_demo", lambda n: demo)
    src = open_source("sharegpt-demo")
    assert src.num_lost == 1 and src.num_records == 2
    assert [r.where for r in src.located] == ["sharegpt-demo[0]", "sharegpt-demo[1]"]


# ------------------------------------------------------------------------------------------ split


def test_split_fraction_zero_and_one():
    keys = [str(i) for i in range(200)]
    assert {assign_split(k, heldout_fraction=0.0, seed=0) for k in keys} == {"train"}
    assert {assign_split(k, heldout_fraction=1.0, seed=0) for k in keys} == {"heldout"}


def test_split_fraction_is_close_and_seeded():
    keys = [f"row-{i}" for i in range(5000)]
    a = [assign_split(k, heldout_fraction=0.2, seed=7) for k in keys]
    frac = a.count("heldout") / len(a)
    assert 0.18 < frac < 0.22  # binomial sd ~0.0057: 3.5 sd either side
    assert a == [assign_split(k, heldout_fraction=0.2, seed=7) for k in keys]
    assert [assign_split(k, heldout_fraction=0.2, seed=7) for k in reversed(keys)] == a[::-1]  # order-free
    b = [assign_split(k, heldout_fraction=0.2, seed=8) for k in keys]
    assert sum(x != y for x, y in zip(a, b)) > 1000  # ~32% differ for independent draws
    # a larger fraction only adds held-out rows
    c = [assign_split(k, heldout_fraction=0.3, seed=7) for k in keys]
    assert all(y == "heldout" for x, y in zip(a, c) if x == "heldout")


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), "0.1", True, None])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="heldout_fraction"):
        assign_split("k", heldout_fraction=fraction, seed=0)


def test_split_rejects_bad_seed_and_key():
    with pytest.raises(ValueError, match="seed"):
        assign_split("k", heldout_fraction=0.1, seed=1.5)
    with pytest.raises(ValueError, match="key"):
        assign_split(3, heldout_fraction=0.1, seed=0)


def test_row_key_prefers_ids():
    assert row_key({"id": "abc"}, 5) == "abc"
    assert row_key({"id": 12}, 5) == "12"
    assert row_key({"id": "", "uuid": "u-1"}, 5) == "u-1"
    assert row_key({"prompt_id": "p"}, 5) == "p"
    assert row_key({"id": None, "messages": []}, 5) == "5"
    assert row_key(None, 9) == "9"


def test_source_row_messages_passes_where():
    with pytest.raises(SkipRow) as info:
        source_row_messages(SourceRow(3, "f.jsonl:4", BAD))
    assert info.value.where == "f.jsonl:4" and info.value.reason.startswith("no assistant turn")
