"""The checkpoint layout of a training run, which training writes and eval, serve, export and the
demo read: ``output_dir/checkpoint-<step>/`` (``draft/`` + ``trainer_state.pt``), the ``latest``
pointer naming the newest one, the run log beside them, and the retention that deletes old ones.

Every deletion renames the path to a hidden name first, so a crash never leaves a half-deleted
checkpoint under its final name.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

TRAINER_STATE = "trainer_state.pt"
LATEST = "latest"

RUN_LOG = "train_log.jsonl"
# what a run writes into output_dir besides checkpoint-*/ (--resume never replaces them; the held-out
# reference stays: it is keyed by its prompts and target, and reused only when they match)
_RUN_FILES = (LATEST, RUN_LOG, "train_config.json", "train_loss.png", "tensorboard")


def previous_run(output_dir: str | Path) -> list[str]:
    """The names in ``output_dir`` that show an earlier training run there (``latest``,
    ``checkpoint-*/`` folders, ``train_log.jsonl``), sorted; [] when the folder is missing or holds none."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name in (LATEST, RUN_LOG) or _checkpoint_step(p) is not None)


def clear_previous_run(output_dir: str | Path) -> list[Path]:
    """Delete what an earlier run wrote into ``output_dir`` (``checkpoint-*/``, ``latest``, the log,
    config, plot and TensorBoard events) for ``--resume never``; returns the deleted paths (each
    renamed to a hidden name before it is removed, as :func:`apply_retention` does)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    doomed = sorted(p for p in out.iterdir() if p.name in _RUN_FILES or _checkpoint_step(p) is not None)
    for path in doomed:
        _delete(path)
    return doomed


def _checkpoint_step(path: Path) -> int | None:
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(match.group(1)) if match and path.is_dir() else None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint folder a training run's ``latest`` pointer names (``run_dir/checkpoint-N``; it
    may be absent if someone deleted it), or None when the run has no pointer yet."""
    pointer = Path(run_dir) / LATEST
    return Path(run_dir) / pointer.read_text().strip() if pointer.is_file() else None


def apply_retention(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest (highest-step) ``checkpoint-*/`` folders of
    ``output_dir``, never the one ``latest`` names; ``keep_last`` 0 keeps everything. A folder is
    renamed to a hidden name before it is removed, so a crash never leaves a half-deleted
    checkpoint under its final name. Returns the deleted folders."""
    if keep_last <= 0:
        return []
    out = Path(output_dir)
    latest = getattr(latest_checkpoint(out), "name", None)
    found = sorted((step, p) for p in out.iterdir() if (step := _checkpoint_step(p)) is not None)
    doomed = [p for _, p in found[:-keep_last] if p.name != latest]
    for path in doomed:
        _delete(path)
    return doomed


def _delete(path: Path) -> None:
    """Remove a file or folder, renamed to a hidden ``.name.deleting`` first, so a crash never leaves
    a half-deleted checkpoint under its final name."""
    trash = path.with_name(f".{path.name}.deleting")
    os.replace(path, trash)
    if trash.is_dir():
        shutil.rmtree(trash)
    else:
        trash.unlink()


def draft_folder(path: str | Path) -> Path:
    """Accept a training run folder (its ``latest`` checkpoint), a checkpoint folder (``checkpoint-N/``)
    or the draft folder inside it."""
    path = Path(path)
    if not (path / "draft").exists() and latest_checkpoint(path) is not None:
        path = latest_checkpoint(path)
    if (path / "draft" / "config.json").exists():
        return path / "draft"
    if (path / "config.json").exists():
        return path
    raise FileNotFoundError(
        f"draft: no draft found at {path} (looked for {path / 'config.json'} and {path / 'draft' / 'config.json'}); "
        "pass a folder written by `deepspec train`"
    )
