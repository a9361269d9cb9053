"""The decoding dtype: one rule that turns ``--dtype auto | float32 | bfloat16`` into a torch dtype.

Used by every stage that *decodes* with the target (``deepspec eval``, ``bench/decode.py``,
``deepspec prepare`` with the local backend, the demo's prepare and eval). The target cache and
training keep their own dtype settings (``cache --storage-dtype``, ``train --dtype``): features a
draft is trained on are captured in float32 whatever the decoding dtype is.

Names: ``float32`` and ``bfloat16`` (torch's names, as the cache's ``storage_dtype`` spells them);
``fp32`` / ``bf16`` (the spelling of ``train --dtype``) are accepted as aliases and normalised, so
configs, reports and JSON always carry the canonical name.

``auto`` is bfloat16 where bf16 matmuls are fast, else float32:
- CUDA: bfloat16 when ``torch.cuda.is_bf16_supported()`` (Ampere and later), else float32;
- CPU: bfloat16 when the CPU has native bf16 dot products, AVX512-BF16 or AMX-BF16 (from
  ``/proc/cpuinfo`` flags ``avx512_bf16`` / ``amx_bf16``, or torch's own
  ``torch.backends.cpu.get_cpu_capability()`` naming them); else float32. Without them torch
  emulates bf16 matmuls through fp32 conversions, which buys little or nothing.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def check_dtype_name(value: object, field: str) -> str:
    """The canonical name (``auto``, ``float32`` or ``bfloat16``) of a ``--dtype`` value.

    ``fp32`` / ``bf16`` map to ``float32`` / ``bfloat16``. Raises ValueError naming ``field``
    (e.g. ``"eval.dtype"``) for anything else.
    """
    name = DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in DTYPE_CHOICES:
        raise ValueError(f"{field}: expected one of {', '.join(DTYPE_CHOICES)} (or the aliases fp32, bf16), "
                         f"received {value!r}; use auto to pick bfloat16 where the hardware runs it fast.")
    return name


@functools.cache
def cpu_bf16_flags() -> tuple[str, ...]:
    """The native bf16 CPU features found (subset of :data:`CPU_BF16_FLAGS`); ``()`` when none.

    Read from the first ``flags`` line of ``/proc/cpuinfo`` (Linux), and from
    ``torch.backends.cpu.get_cpu_capability()`` (e.g. ``"AVX512_BF16"``, ``"AMX_BF16"`` on builds that
    report them). Cached: the CPU does not change under a running process.
    """
    found: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("flags"):
                found.update(f for f in line.split(":", 1)[1].split() if f in CPU_BF16_FLAGS)
                break
    except OSError:
        pass
    capability = str(torch.backends.cpu.get_cpu_capability()).lower()
    found.update(f for f in CPU_BF16_FLAGS if f in capability)
    return tuple(sorted(found))


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The torch dtype for ``name`` (``auto`` / ``float32`` / ``bfloat16`` or an alias) on ``device``.

    ``auto``: see the module docstring. Raises ValueError for an unknown name.
    """
    name = check_dtype_name(name, "dtype")
    if name != "auto":
        return TORCH_DTYPES[name]
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if cpu_bf16_flags() else torch.float32
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name reports record)."""
    return str(dtype).removeprefix("torch.")


def decoding_device() -> torch.device:
    """Where decoding runs: CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cast_for_decoding(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` itself when its floating parameters already have ``dtype``; else a cast copy.

    A copy, not an in-place cast: the caller's module keeps its dtype (the demo trains and captures
    features in float32 with the same target it then decodes with in bfloat16).
    """
    import copy

    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if dtypes <= {dtype}:
        return module
    return copy.deepcopy(module).to(dtype)
