"""Small shared helpers: the DeepSpec home folder, atomic file writes, token-id lists.

Every file DeepSpec produces is written under a temporary name in the same folder and renamed
into place when complete, so an interrupted stage never leaves a half-written file under its
final name (``os.replace`` is atomic on POSIX within one filesystem).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def token_id_list(value: Any) -> list[int]:
    """A config's token id field (``eos_token_id``: None, an int, or a list of ints) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def format_bytes(num_bytes: int | float) -> str:
    """A byte count in binary (IEC) units, one decimal: ``"37.0 MiB"``, ``"34.5 TiB"``, ``"512 B"``.

    Every size DeepSpec prints (cache summary, ``deepspec estimate``, the demo) uses this one rule,
    so sizes compare directly: 1 KiB = 1,024 bytes, 1 MiB = 2**20, ..., 1 PiB = 2**50.
    """
    for unit, power in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 2**power:
            return f"{num_bytes / 2**power:,.1f} {unit}"
    return f"{int(num_bytes)} B"


def deepspec_home() -> Path:
    """Return the DeepSpec cache folder: ``$DEEPSPEC_HOME``, else ``$XDG_CACHE_HOME/deepspec``,
    else ``~/.cache/deepspec``. The folder is created if missing."""
    env = os.environ.get("DEEPSPEC_HOME")
    if env:
        home = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        home = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "deepspec"
    home.mkdir(parents=True, exist_ok=True)
    return home


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it to ``final`` if the block succeeds.

    On an exception the temporary file (or folder) is removed and ``final`` is left untouched.
    Works for files and for folders (the caller creates whichever it needs at the yielded path).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.unlink()
    try:
        yield tmp
        if final.is_dir() and tmp.is_dir():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (headless machines, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | os.PathLike[str], *, dpi: int = 100) -> None:
    """Write matplotlib figure ``fig`` as a PNG at ``path`` atomically (:func:`atomic_path`) and close it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    pyplot().close(fig)


def atomic_write_text(final: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``final`` atomically."""
    with atomic_path(final) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(final: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``final`` atomically."""
    atomic_write_text(final, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def torchrun_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``); ``(0, 1, 0)`` outside torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


MIN_CACHE_LEN = 256  # the shortest static KV cache allocated (positions)


def cache_len_bucket(num_positions: int) -> int:
    """The static cache length allocated for ``num_positions`` positions: the next power of two, at
    least :data:`MIN_CACHE_LEN` (few lengths, so few compilations). Raises ValueError below 1."""
    if num_positions < 1:
        raise ValueError(f"num_positions: expected >= 1, received {num_positions}")
    return max(MIN_CACHE_LEN, 1 << (int(num_positions) - 1).bit_length())
