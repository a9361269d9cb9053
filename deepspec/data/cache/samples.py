"""Prepared rows -> training samples: the one rule of the cache writer, online mode
(:mod:`deepspec.data.online`) and ``deepspec estimate`` (:mod:`deepspec.data.estimate`).

A sample is ``(sample_id, input_ids, loss_mask)``. A prepared row (written by ``deepspec prepare``)
is rendered by :func:`deepspec.data.chat.render_training_samples` (:func:`render_prepared_row`;
held-out rows give no sample); each sample is then cut to ``max_seq_len`` keeping the prefix and
refused if no loss token is left (:func:`keep_sample`). :func:`check_prepared_render` refuses
prepared data that the tokenizer no longer renders as ``deepspec prepare`` recorded, and
:func:`chat_template_id` names a chat template by its hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from deepspec.data.chat import COUNT_KEYS as TURN_COUNT_KEYS
from deepspec.data.chat import render_record, render_record_differences, render_training_samples
from deepspec.data.prepare import summary_path_for

_Sample = tuple[str, list[int], list[int]]  # (sample id, input_ids, loss_mask)


def keep_sample(
    sample: _Sample, max_seq_len: int | None
) -> tuple[_Sample | None, bool]:
    """(kept sample or None if its loss mask is empty, truncated?) -- the rule online mode shares."""
    sid, ids, mask = sample
    ids, mask = [int(t) for t in ids], [int(m) for m in mask]
    if len(ids) != len(mask):
        raise ValueError(
            f"sample {sid!r}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}; "
            f"they must have equal length (re-run `deepspec prepare`)"
        )
    if any(m not in (0, 1) for m in mask):
        raise ValueError(f"sample {sid!r}: loss_mask must hold only 0/1 values")
    truncated = max_seq_len is not None and len(ids) > max_seq_len
    if truncated:
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    if not any(mask):
        return None, truncated
    return (str(sid), ids, mask), truncated


def render_prepared_row(tokenizer: Any, row: dict[str, Any], *, stop_ids: Sequence[int] | None = None,
                        counts: dict[str, int] | None = None) -> list[_Sample] | None:
    """The training samples ``(sample_id, input_ids, loss_mask)`` of one prepared row, or None for
    a held-out row (``"split": "heldout"``).

    Rendered only through :func:`deepspec.data.chat.render_training_samples` with the row's
    ``truncated_turns``, ``chat_template_kwargs`` and ``generated_ids`` (each regenerated turn is
    supervised on exactly the ids the target generated; rows without the field are text only) and
    ``stop_ids`` (the target's stop rule); sample id = ``row["id"] + suffix``. Not truncated here
    (the writer truncates to ``max_seq_len`` and counts it). ``counts`` gains the per-turn counts
    (:data:`deepspec.data.chat.COUNT_KEYS`) of rendered rows.

    Raises ValueError for a row without ``id``/``messages`` or one that does not render.
    """
    if "id" not in row or "messages" not in row:
        raise ValueError(f"prepared row: expected the keys 'id' and 'messages', got {sorted(row)}; "
                         f"pass a file written by `deepspec prepare`")
    if row.get("split") == "heldout":
        return None
    try:
        rendered = render_training_samples(
            tokenizer, row["messages"], cut_turns=row.get("truncated_turns", []),
            chat_template_kwargs=row.get("chat_template_kwargs"), generated_ids=row.get("generated_ids"),
            stop_ids=stop_ids, counts=counts,
        )
    except ValueError as exc:
        raise ValueError(f"prepared row {row['id']!r}: {exc}") from exc
    return [(str(row["id"]) + s.suffix, list(s.input_ids), list(s.loss_mask)) for s in rendered]


def iter_prepared_samples(
    rows: Iterable[Mapping[str, Any]], tokenizer: Any, *, max_seq_len: int | None, counts: dict[str, int] | None = None,
    stop_ids: Sequence[int] | None = None,
) -> Iterator[tuple[str, list[int], list[int]]]:
    """Kept training samples ``(sample_id, input_ids, loss_mask)`` of prepared rows, in row order.

    The cache writer's rule (also used by online mode and ``deepspec estimate``): each row is rendered by
    :func:`render_prepared_row` (held-out rows skipped; the row's ``truncated_turns``,
    ``chat_template_kwargs`` and ``generated_ids`` and ``stop_ids`` passed to
    ``render_training_samples``; sample id = ``row["id"] + suffix``), then each sample is truncated
    to ``max_seq_len`` keeping the prefix and refused if no loss token is left (:func:`keep_sample`).
    ``counts`` (optional, updated in place) gains ``num_rows``, ``num_heldout``, ``num_truncated``,
    ``num_refused_empty_mask``, the per-turn counts of :data:`deepspec.data.chat.COUNT_KEYS` and
    ``text_retokenized`` (the ids of rows with a text-only turn that does not re-tokenise to its
    supervised span).

    Raises:
        ValueError: a row without ``id``/``messages``, a rendering error (template drift, ...), or a
            sample whose ids and mask differ in length.
    """
    counts = {} if counts is None else counts
    for key in ("num_rows", "num_heldout", "num_truncated", "num_refused_empty_mask", *TURN_COUNT_KEYS):
        counts.setdefault(key, 0)
    counts.setdefault("text_retokenized", [])
    for row in rows:
        counts["num_rows"] += 1
        before = counts["num_turns_text_retokenized"]
        samples = render_prepared_row(tokenizer, dict(row), stop_ids=stop_ids, counts=counts)
        if counts["num_turns_text_retokenized"] > before:
            counts["text_retokenized"].append(str(row["id"]))
        if samples is None:
            counts["num_heldout"] += 1
            continue
        for sample in samples:
            kept, truncated = keep_sample(sample, max_seq_len)
            counts["num_truncated"] += int(truncated)
            if kept is None:
                counts["num_refused_empty_mask"] += 1
            else:
                yield kept


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def chat_template_id(tokenizer: Any) -> str | None:
    """``"sha256:<hex>"`` of the tokenizer's chat template (None without one)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_resumed_render(prepared_jsonl: str | os.PathLike[str], summary_path: Path, recorded: dict[str, Any],
                          resumed: Any, num_resumed: int) -> None:
    """Refuse prepared data whose rows were rendered in two ways: a prepare resumed from a journal records
    the render of the resumed rows (``resumed_render``), which must equal the rest's (the date included,
    for a template that reads it); a resumed file without that record was written before prepare checked
    the render on resume, which a template that reads today's date makes unsafe."""
    if not num_resumed:
        return
    fix = (f"Prepare the data again in one run (delete {prepared_jsonl} and its side files), or on one day for "
           f"a template that prints the date.")
    if isinstance(resumed, dict):
        lines = render_record_differences(resumed, recorded)
        if resumed.get("render_date") != recorded.get("render_date"):
            lines.append(f"render_date: resumed rows {resumed.get('render_date')!r}, the rest "
                         f"{recorded.get('render_date')!r}")
        if lines:
            raise ValueError(f"{prepared_jsonl}: {num_resumed} rows resumed from an interrupted prepare were "
                             f"rendered differently from the rest ({summary_path}: " + "; ".join(lines)
                             + f"); their answers belong to prompts the target was not given. {fix}")
    elif "strftime_now" in (recorded.get("template_variables") or []):
        raise ValueError(
            f"{prepared_jsonl}: {num_resumed} rows were resumed from an interrupted prepare that did not record "
            f"their render ({summary_path} has no resumed_render), and the chat template reads strftime_now "
            f"(today's date): rows of the interrupted run may pair answers with prompts of another day. {fix}")


def check_prepared_render(prepared_jsonl: str | os.PathLike[str], tokenizer: Any,
                          stop_ids: Sequence[int]) -> dict[str, Any]:
    """The render record of prepared data as this tokenizer renders it now; refuse a difference
    with what ``deepspec prepare`` recorded (``<input>.summary.json``, ``render``).

    The record (:func:`deepspec.data.chat.render_record`) holds the chat template's hash, the
    ``chat_template_kwargs``, the stop token ids and the ids of a probe conversation: if any differs,
    the prompts rendered now are not the ones the target answered (another tokenizer or template,
    other kwargs, a template that reads today's date, another stop rule), so the supervised
    sequences would not be what the target saw. Rows resumed from an interrupted prepare must have been
    rendered as the rest (:func:`_check_resumed_render`). Prepared data without a summary (imported
    data) is not checked: the returned record then says ``"checked_against": null``.

    Raises:
        ValueError: naming every field that differs, both values, and the fix.
    """
    summary_path = summary_path_for(Path(prepared_jsonl))
    recorded = resumed = None
    num_resumed = 0
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        recorded, resumed = summary.get("render"), summary.get("resumed_render")
        counts = summary.get("summary")
        num_resumed = counts.get("num_resumed", 0) if isinstance(counts, dict) else 0
    kwargs = recorded.get("chat_template_kwargs") if isinstance(recorded, dict) else None
    now = render_record(tokenizer, chat_template_kwargs=kwargs, stop_ids=stop_ids)
    if isinstance(recorded, dict):
        _check_resumed_render(prepared_jsonl, summary_path, recorded, resumed, num_resumed)
        differences = render_record_differences(recorded, now)
        if differences:
            raise ValueError(
                f"{prepared_jsonl}: the chat template renders differently now than when `deepspec prepare` wrote "
                f"it ({summary_path}): " + "; ".join(differences) + ". The cached prompts would not be the ones "
                f"the target answered. Use the target (tokenizer, template, generation_config) and --enable-thinking "
                f"the data was prepared with, or prepare the data again with this target.")
    return {**now, "checked_against": str(summary_path.name) if isinstance(recorded, dict) else None}
