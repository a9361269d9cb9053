"""Dataset sources: open a spec, yield its raw rows in source order (docs/design/data.md, "Dataset sources").

A *spec* names where conversations come from. :func:`open_source` resolves it in this order:

1. ``"sharegpt-demo"``: the ShareGPT V3 demo set (:func:`conversations.load_sharegpt_demo`).
2. ``"hf:<org>/<name>[:<split>]"``: always a Hugging Face dataset id, even if a local path of
   that name exists.
3. An existing local path (``~`` expanded) always wins over a dataset id:
   - ``*.jsonl``: one JSON object per line, read line by line;
   - ``*.json``: a JSON array of rows, or an object holding the array under one of
     :data:`JSON_LIST_KEYS` (``"data"``, ``"rows"``, ...); read whole (use JSONL or Parquet for
     large data). A truncated array keeps its complete rows and counts the cut one in ``num_lost``;
   - ``*.parquet``: read in record batches (:meth:`pyarrow.parquet.ParquetFile.iter_batches`),
     never whole;
   - a folder written by ``datasets`` ``save_to_disk`` (it holds ``dataset_info.json``/
     ``state.json`` or ``dataset_dict.json``): loaded with :func:`datasets.load_from_disk`;
   - any other folder: its ``*.jsonl`` / ``*.json`` / ``*.parquet`` files (not recursive), in
     sorted name order, one after the other (every file is opened up front, so the ``.json`` ones
     are held in memory together).
4. A spec that looks like a path (ends in a known suffix, starts with ``/ ./ ../ ~`` ) but does not
   exist: :class:`FileNotFoundError`.
5. ``"<org>/<name>[:<split>]"``: a Hugging Face dataset id, loaded with
   :func:`datasets.load_dataset` (``streaming=True`` by default: rows arrive as they download, no
   full copy on disk). The ``:<split>`` suffix overrides ``hf_split``. A dataset that cannot be
   loaded raises :class:`SourceUnavailableError` (a ``ValueError``: the CLI prints it and exits 2).
   When the Hub's host name does not resolve (no network) it is raised at once, instead of after
   the ~25 s of retries ``datasets`` would spend; the check is skipped when ``HF_HUB_OFFLINE`` /
   ``HF_DATASETS_OFFLINE`` is set (``datasets`` then uses its local cache) or a proxy is configured.
6. Anything else: :class:`ValueError` listing the accepted forms.

Every row comes out as a :class:`SourceRow` with its 0-based ``index`` in source order and a
``where`` that names it for error messages and the skipped-rows file: ``file.jsonl:12`` (1-based
line), ``file.json[3]`` / ``file.parquet[3]`` (0-based row), ``org/name:train[3]``,
``sharegpt-demo[3]``. Accounting (read = kept + skipped + failed) is the prepare stage's job; this
module guarantees that each raw record gives exactly one :class:`SourceRow`, and that
:func:`source_row_messages` turns it into messages or a :class:`SkipRow` with a reason.

The train/held-out split (:func:`assign_split`) is a pure function of (row key, seed, fraction),
so it does not depend on row order, on which rows were skipped, or on a resume.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepspec.data.conversations import (
    Message,
    SkipRow,
    iter_jsonl_records,
    load_sharegpt_demo,
    normalise_messages,
    recover_json_array,
)

SHAREGPT_DEMO = "sharegpt-demo"
HF_PREFIX = "hf:"
FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")
# Keys of a top-level JSON object that may hold the list of rows (exactly one must be present).
JSON_LIST_KEYS: tuple[str, ...] = ("data", "rows", "train", "examples", "records", "instances")
# Row fields that hold a row id, tried in order (see :func:`row_key`).
ID_FIELDS: tuple[str, ...] = ("id", "uuid", "prompt_id", "conversation_id")
SPLITS: tuple[str, ...] = ("train", "heldout")

class SourceUnavailableError(ValueError):
    """A source that cannot be opened or read for reasons outside the file format: a Hugging Face
    dataset without network access, an unknown id or split, the ``datasets`` package missing.
    The message names the source and how to use a local file instead. A ``ValueError`` subclass,
    so the CLI reports it as a user error (exit 2, no traceback)."""


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_HF_SPLIT = re.compile(r"^[\w.\-\[\]%:]+$")  # "train", "train[:1000]", "test_sft"


@dataclass(frozen=True)
class SourceRow:
    """One raw record of a source.

    ``index``: 0-based position in the source (source order; counts unreadable records too).
    ``where``: names the record (``file.jsonl:12``, ``file.parquet[3]``, ``org/name:train[3]``).
    ``row``: the raw row as read (normally a dict); None when ``error`` is set.
    ``error``: why the record could not be read at all (a malformed JSONL line); only produced when
    the source was opened with ``skip_unreadable=True``, otherwise such a record raises.
    """

    index: int
    where: str
    row: Any
    error: str | None = None


@dataclass(kw_only=True)
class SourceRows:
    """An opened source. Iterate ``located`` (or ``rows``) once; both share one underlying reader.

    ``located``: iterator of :class:`SourceRow` in source order (use this to get ``where``).
    ``num_lost``: records the source itself lost and that never reach ``located`` (the cut record
    of a truncated JSON array); add it to the accounting as lost, never as read.
    ``description``: one line for logs, e.g. ``"Parquet file data.parquet (1000 rows)"``.
    ``num_records``: records the source holds when known up front (JSON arrays, Parquet, the demo,
    a ``save_to_disk`` folder), else None (JSONL, streamed Hugging Face datasets).
    """

    located: Iterator[SourceRow]
    num_lost: int
    description: str
    num_records: int | None = None

    @property
    def rows(self) -> Iterator[Any]:
        """The raw rows alone, in source order (None for an unreadable record, see SourceRow.error)."""
        return (r.row for r in self.located)

    def __iter__(self) -> Iterator[SourceRow]:
        return self.located


def source_row_messages(source_row: SourceRow) -> list[Message]:
    """Normalised messages of one :class:`SourceRow` (see :func:`normalise_messages` for the rules).

    Raises:
        SkipRow: the record was unreadable (``reason`` = its read error) or the row is unusable;
            ``where`` is the record's location.
    """
    if source_row.error is not None:
        raise SkipRow(source_row.error, where=source_row.where)
    return normalise_messages(source_row.row, where=source_row.where)


def row_key(row: Any, source_index: int) -> str:
    """The key of a row for :func:`assign_split`: its id when it has one, else its source index.

    The id is the first of :data:`ID_FIELDS` holding a non-empty string or an int; an id keeps a
    row's split when the source is re-ordered or filtered, the index only while it is not.
    """
    if isinstance(row, dict):
        for name in ID_FIELDS:
            value = row.get(name)
            if isinstance(value, str) and value.strip():
                return value
            if isinstance(value, int) and not isinstance(value, bool):
                return str(value)
    return str(source_index)


def assign_split(key: str, *, heldout_fraction: float, seed: int) -> str:
    """``"heldout"`` for about ``heldout_fraction`` of all keys, else ``"train"``.

    Rule: ``u = int(sha256(f"{seed}:{key}")[:8 bytes], big-endian) / 2**64`` is uniform in [0, 1);
    the row is held out when ``u < heldout_fraction``. A pure function of (key, seed, fraction): it
    does not depend on row order, on other rows, or on a resume; a larger fraction only moves rows
    from train to held-out (the held-out set grows monotonically with the fraction).

    Raises:
        ValueError: ``heldout_fraction`` not a number in [0, 1], ``seed`` not an int, ``key`` not a str.
    """
    if isinstance(heldout_fraction, bool) or not isinstance(heldout_fraction, (int, float)) \
            or math.isnan(heldout_fraction) or not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction!r}: expected a number in [0, 1] "
                         f"(0 keeps every row in train; 0.05 holds out about 5%).")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r}: expected an int.")
    if not isinstance(key, str):
        raise ValueError(f"key={key!r}: expected a str (the row id or the source index as text; see row_key).")
    if heldout_fraction == 0.0:
        return "train"
    digest = hashlib.sha256(f"{seed}:{key}".encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    return "heldout" if u < heldout_fraction else "train"


# ---------------------------------------------------------------------------------------- open_source


def open_source(spec: str, *, hf_split: str = "train", hf_config: str | None = None, hf_streaming: bool = True,
                skip_unreadable: bool = False, parquet_batch_rows: int = 1024) -> SourceRows:
    """Open a conversation source; rows are read lazily, in source order.

    Args:
        spec: ``"sharegpt-demo"``, a local ``.jsonl``/``.json``/``.parquet`` file or folder, or a
            Hugging Face dataset id ``"[hf:]org/name[:split]"`` (resolution rules: module docstring).
        hf_split: split of a Hugging Face dataset (or of a ``save_to_disk`` DatasetDict) when the
            spec names none; ``datasets`` slice syntax (``"train[:1000]"``) is accepted.
        hf_config: configuration name of a Hugging Face dataset (``load_dataset(name=...)``).
        hf_streaming: stream a Hugging Face dataset instead of downloading it whole first.
        skip_unreadable: a malformed JSONL line becomes a :class:`SourceRow` with ``error`` set
            (so the caller can skip and count it) instead of raising.
        parquet_batch_rows: rows per Parquet record batch (memory bound of the reader).

    Raises:
        FileNotFoundError: a path-like spec that does not exist.
        ValueError: an unrecognised spec, an unreadable file (message names the file and row), a
            folder without data files.
        SourceUnavailableError: a Hugging Face dataset that cannot be loaded (no network, unknown
            id or split, ``datasets`` not installed); the message names the id and how to use a
            local file instead. Also raised while iterating, when streaming fails mid-way.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"input={spec!r}: expected 'sharegpt-demo', a .jsonl/.json/.parquet file or folder, "
                         f"or a Hugging Face dataset id 'org/name[:split]'.")
    if parquet_batch_rows <= 0:
        raise ValueError(f"parquet_batch_rows={parquet_batch_rows}: expected a positive integer.")
    spec = spec.strip()
    if spec == SHAREGPT_DEMO:
        return _open_demo()
    if spec.startswith(HF_PREFIX):
        dataset_id, split = _parse_hf_spec(spec[len(HF_PREFIX):], hf_split, strict=True)
        return open_hf_dataset(dataset_id, split=split, config=hf_config, streaming=hf_streaming)
    path = Path(spec).expanduser()
    if path.exists():
        return _open_path(path, hf_split=hf_split, skip_unreadable=skip_unreadable,
                          parquet_batch_rows=parquet_batch_rows)
    if spec.endswith(FILE_SUFFIXES) or spec.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"input {spec!r} does not exist (resolved to {path.resolve()}).")
    parsed = _parse_hf_spec(spec, hf_split, strict=False)
    if parsed is not None:
        return open_hf_dataset(parsed[0], split=parsed[1], config=hf_config, streaming=hf_streaming)
    raise ValueError(f"input={spec!r} is neither an existing path nor a Hugging Face dataset id. Expected "
                     f"'{SHAREGPT_DEMO}', a .jsonl/.json/.parquet file or a folder of them, or 'org/name[:split]' "
                     f"(prefix 'hf:' to force a dataset id).")


def _parse_hf_spec(text: str, default_split: str, *, strict: bool) -> tuple[str, str] | None:
    dataset_id, _, split = text.partition(":")
    split = split or default_split
    if _HF_ID.match(dataset_id) and _HF_SPLIT.match(split):
        return dataset_id, split
    if strict:
        raise ValueError(f"input='hf:{text}': expected a Hugging Face dataset id 'hf:org/name' or "
                         f"'hf:org/name:split'.")
    return None


def _open_demo() -> SourceRows:
    demo = load_sharegpt_demo(None)
    located = (SourceRow(i, f"{SHAREGPT_DEMO}[{i}]", row) for i, row in enumerate(demo.rows))
    return SourceRows(located=located, num_lost=demo.num_lost, num_records=demo.num_records,
                      description=f"ShareGPT V3 demo set ({demo.num_records} records, {demo.num_lost} lost "
                                  f"to the file's truncation)")


def _open_path(path: Path, *, hf_split: str, skip_unreadable: bool, parquet_batch_rows: int) -> SourceRows:
    if path.is_dir():
        if _is_saved_dataset(path):
            return _open_saved_dataset(path, split=hf_split)
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(FILE_SUFFIXES))
        if not files:
            raise ValueError(f"input folder {path} holds no {'/'.join(FILE_SUFFIXES)} files (not searched "
                             f"recursively) and is not a `datasets` save_to_disk folder.")
    else:
        if not path.name.endswith(FILE_SUFFIXES):
            raise ValueError(f"input file {path}: unknown format; expected a name ending in "
                             f"{', '.join(FILE_SUFFIXES)}.")
        files = [path]
    # Open every file up front (cheap: JSON parses, Parquet reads its footer) so format errors
    # surface before any row is processed and the totals are known.
    opened = [_open_file(f, skip_unreadable=skip_unreadable, parquet_batch_rows=parquet_batch_rows) for f in files]
    num_lost = sum(o.num_lost for o in opened)
    counts = [o.num_records for o in opened]
    num_records = None if any(c is None for c in counts) else sum(counts)
    names = ", ".join(f.name for f in files[:5]) + (", ..." if len(files) > 5 else "")
    description = opened[0].description if len(opened) == 1 else f"folder {path} ({len(opened)} files: {names})"
    return SourceRows(located=_chain_reindexed(opened), num_lost=num_lost, num_records=num_records,
                      description=description)


def _chain_reindexed(opened: list[SourceRows]) -> Iterator[SourceRow]:
    index = 0
    for source in opened:
        for r in source.located:
            yield SourceRow(index, r.where, r.row, r.error)
            index += 1


def _open_file(path: Path, *, skip_unreadable: bool, parquet_batch_rows: int) -> SourceRows:
    if path.name.endswith(".jsonl"):
        return SourceRows(located=_jsonl_rows(path, skip_unreadable), num_lost=0, num_records=None,
                          description=f"JSONL file {path}")
    if path.name.endswith(".json"):
        return _open_json(path)
    return _open_parquet(path, parquet_batch_rows)


def _jsonl_rows(path: Path, skip_unreadable: bool) -> Iterator[SourceRow]:
    for index, (line_no, row, error) in enumerate(iter_jsonl_records(path)):
        where = f"{path}:{line_no}"
        if error is not None and not skip_unreadable:
            raise ValueError(f"{where}: {error} (to skip and count such lines instead: `deepspec prepare "
                             f"--skip-bad-rows true`, or open_source(..., skip_unreadable=True))")
        yield SourceRow(index, where, row, error)


def _open_json(path: Path) -> SourceRows:
    text = path.read_text(encoding="utf-8")
    num_lost = 0
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if not text.lstrip().startswith("["):
            raise ValueError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg} at column {exc.colno}). A .json "
                             f"input must hold one JSON array of rows (or use .jsonl, one row per line).") from None
        try:  # a JSON array cut off mid-record (a killed writer): keep the complete records, count the cut one
            data, num_lost = recover_json_array(text)
        except ValueError as inner:
            raise ValueError(f"{path}: {inner}") from None
    del text
    if isinstance(data, dict):
        present = [k for k in JSON_LIST_KEYS if isinstance(data.get(k), list)]
        if len(present) != 1:
            raise ValueError(f"{path}: a .json input must be a JSON array of rows, or an object holding that "
                             f"array under exactly one of {list(JSON_LIST_KEYS)}; found an object with keys "
                             f"{sorted(data)[:10]}.")
        data = data[present[0]]
    elif not isinstance(data, list):
        raise ValueError(f"{path}: a .json input must be a JSON array of rows, got {type(data).__name__}.")
    rows: list[Any] = data
    located = (SourceRow(i, f"{path}[{i}]", row) for i, row in enumerate(rows))
    return SourceRows(located=located, num_lost=num_lost, num_records=len(rows),
                      description=f"JSON file {path} ({len(rows)} rows" +
                                  (f", {num_lost} cut off by truncation)" if num_lost else ")"))


def _open_parquet(path: Path, batch_rows: int) -> SourceRows:
    import pyarrow.parquet as pq

    try:
        parquet_file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a broken footer or a non-Parquet file
        raise ValueError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc}).") from None
    num_rows = parquet_file.metadata.num_rows
    columns = parquet_file.schema_arrow.names

    def located() -> Iterator[SourceRow]:
        index = 0
        batches = parquet_file.iter_batches(batch_size=batch_rows)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as exc:
                raise ValueError(f"{path}[{index}]: cannot read the Parquet batch starting at row {index} "
                                 f"({type(exc).__name__}: {exc}).") from None
            for row in batch.to_pylist():
                yield SourceRow(index, f"{path}[{index}]", row)
                index += 1

    return SourceRows(located=located(), num_lost=0, num_records=num_rows,
                      description=f"Parquet file {path} ({num_rows} rows; columns {columns[:8]})")


# ------------------------------------------------------------------------------ Hugging Face datasets


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "dataset_info.json").is_file() and (path / "state.json").is_file())


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise SourceUnavailableError("Hugging Face dataset inputs need the `datasets` package: pip install "
                                     "datasets (or pass a local .jsonl/.json/.parquet file).") from exc
    return datasets


def _open_saved_dataset(path: Path, *, split: str) -> SourceRows:
    datasets = _import_datasets()
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"input folder {path} is a saved DatasetDict without split {split!r} "
                             f"(splits: {sorted(loaded)}); pass --hf-split (hf_split).")
        loaded, name = loaded[split], f"{path}:{split}"
    else:
        name = str(path)
    return SourceRows(located=dataset_rows(loaded, name=name), num_lost=0, num_records=len(loaded),
                      description=f"saved dataset {name} ({len(loaded)} rows; columns {loaded.column_names[:8]})")


def _hf_unavailable(dataset_id: str, split: str, exc: BaseException | str, index: int | None = None,
                    data_files: list[str] | None = None) -> SourceUnavailableError:
    at = "" if index is None else f" at row {index}"
    cause = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    if data_files:
        urls = " ".join(f"https://huggingface.co/datasets/{dataset_id}/resolve/main/{f}" for f in data_files)
        return SourceUnavailableError(
            f"cannot load Hugging Face dataset {dataset_id!r} (files {', '.join(data_files)}){at}: {cause}. "
            f"Without network access, download {urls} where a network exists and pass the local file instead.")
    return SourceUnavailableError(
        f"cannot load Hugging Face dataset {dataset_id!r} (split {split!r}){at}: {cause}. "
        f"Check the id and split; without network access, export the dataset where a network exists "
        f"(datasets.load_dataset({dataset_id!r}, split={split!r}).to_json('data.jsonl') or .to_parquet"
        f"('data.parquet')) and pass the local file instead (or set HF_HUB_OFFLINE=1 to use a copy "
        f"already in the `datasets` cache).")


_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _hub_unreachable() -> str | None:
    """Why the Hugging Face Hub surely cannot be reached (its host name does not resolve), else None.

    A quick check so that an offline run fails at once instead of after the retries of ``datasets``.
    Returns None (no opinion) when offline mode is set (``datasets`` then reads its cache and fails
    fast by itself) or a proxy is configured (the proxy resolves names, not this machine).
    """
    import os
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE") for k in _OFFLINE_ENV):
        return None
    if any(os.environ.get(k) for k in _PROXY_ENV):
        return None
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, 443)
    except (socket.gaierror, UnicodeError) as exc:
        return f"the Hub host {host} cannot be resolved (no network? {exc})"
    return None


def open_hf_dataset(dataset_id: str, *, split: str = "train", config: str | None = None, streaming: bool = True,
                    data_files: list[str] | None = None) -> SourceRows:
    """Rows of a Hugging Face dataset through ``datasets.load_dataset`` (lazily, in order).

    ``data_files``: read these files of the dataset repo (paths inside it) with the ``json`` builder
    instead, for repos whose loading script ``datasets`` no longer runs (``split`` is then "train",
    the builder's only split). Raises SourceUnavailableError at once when the Hub host does not
    resolve (offline), on any load error, and while iterating when streaming fails; the message names
    the dataset and how to use a local copy.
    """
    datasets = _import_datasets()

    def unavailable(exc: BaseException | str, index: int | None = None) -> SourceUnavailableError:
        return _hf_unavailable(dataset_id, split, exc, index, data_files)

    unreachable = _hub_unreachable()
    if unreachable is not None:
        raise unavailable(unreachable)
    try:
        if data_files:
            loaded = datasets.load_dataset("json", data_files=[f"hf://datasets/{dataset_id}/{f}" for f in data_files],
                                           split="train", streaming=streaming)
        else:
            loaded = datasets.load_dataset(dataset_id, name=config, split=split, streaming=streaming)
    except Exception as exc:  # network, hub and split errors come as many types; all end here
        raise unavailable(exc) from exc
    name = f"{dataset_id}:{split}"
    num_records = None if streaming else len(loaded)
    located = dataset_rows(loaded, name=name, on_error=unavailable)
    return SourceRows(located=located, num_lost=0, num_records=num_records,
                      description=f"Hugging Face dataset {dataset_id}" + (f" ({config})" if config else "") +
                                  f", split {split}" + (" (streaming)" if streaming else f" ({num_records} rows)"))


def dataset_rows(dataset: Any, *, name: str,
                 on_error: Callable[[BaseException, int], Exception] | None = None) -> Iterator[SourceRow]:
    """Rows of a ``datasets.Dataset`` / ``IterableDataset`` (any iterable of row dicts) as SourceRows.

    ``where`` is ``f"{name}[{index}]"``. Nested features come out as Python lists and dicts (a
    ShareGPT ``conversations`` column is a list of ``{"from", "value"}`` dicts); fields a row lacks
    in a unified Arrow schema are None, which :func:`normalise_messages` treats as absent.

    Raises:
        the exception built by ``on_error(exc, index)`` from a failure while reading row ``index``
        (e.g. a dropped network connection while streaming), or that failure itself when
        ``on_error`` is None.
    """
    iterator = iter(dataset)
    index = 0
    while True:
        try:
            row = next(iterator)
        except StopIteration:
            return
        except Exception as exc:
            if on_error is None:
                raise
            raise on_error(exc, index) from exc
        yield SourceRow(index, f"{name}[{index}]", dict(row) if isinstance(row, dict) else row)
        index += 1
