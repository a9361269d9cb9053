"""The device and decoding-dtype rules: ``--device auto | cpu | cuda | cuda:N`` and ``--dtype auto |
float32 | bfloat16``, each turned into a torch object by one function every stage shares.

Device (every stage that loads a target: prepare with the local backend, cache, train, eval, serve,
the demo and the bench scripts): ``auto`` is ``cuda:LOCAL_RANK`` when CUDA is available (``LOCAL_RANK``
from torchrun, 0 otherwise), else the CPU; ``cuda`` is ``cuda:LOCAL_RANK`` and ``cuda:N`` that GPU,
both refused with a clear error where CUDA is not available or the GPU does not exist
(:func:`resolve_device`).

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
import os
import re
import warnings
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


def device_model_name(device: torch.device) -> str:
    """The processor behind ``device``: the CUDA device's name, or the CPU's ``model name`` from
    ``/proc/cpuinfo`` (Linux), else :func:`platform.processor` / the machine type. Speed figures cached
    for one processor must not be reused on another (the CPU of a machine may change between runs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


BF16_EMULATED_WARNING = (
    "bfloat16 on a CPU with no native bf16 dot products (no avx512_bf16 / amx_bf16 flag): torch converts "
    "through float32, so batched products get slower, not faster: a verify forward over 8 tokens costs about "
    "twice as many one-token steps in bfloat16 as in float32, and the prefill is several times slower "
    "(docs/results/decode-cpu-2026-11-30.md). "
    "--dtype auto picks float32 here.")


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The torch dtype for ``name`` (``auto`` / ``float32`` / ``bfloat16`` or an alias) on ``device``.

    ``auto``: see the module docstring. ``bfloat16`` asked for on a CPU without native bf16 is kept,
    with a UserWarning giving its measured cost (:data:`BF16_EMULATED_WARNING`). Raises ValueError
    for an unknown name.
    """
    name = check_dtype_name(name, "dtype")
    device = torch.device(device)
    if name == "bfloat16" and device.type == "cpu" and not cpu_bf16_flags():
        warnings.warn(BF16_EMULATED_WARNING, stacklevel=2)
    if name != "auto":
        return TORCH_DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if cpu_bf16_flags() else torch.float32
    return torch.float32


def allow_tf32() -> None:
    """Let float32 matrix products and convolutions on CUDA run on the TF32 tensor cores (inputs rounded
    to a 10-bit mantissa, float32 accumulation; about 8x the float32 rate on Hopper).

    Called by training on a CUDA device, where the float32 parts (the loss's softmaxes, the optimiser,
    a ``--dtype fp32`` forward) need no more than TF32's precision. Never by decoding: a float32 eval is
    the bit-exact reference for the lossless check, so it keeps full float32 products.
    """
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name reports record)."""
    return str(dtype).removeprefix("torch.")


def check_device_name(value: object, field: str) -> str:
    """``value`` when it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (N a GPU index); ValueError naming
    ``field`` (e.g. ``"eval.device"``) otherwise. Whether the device exists is :func:`resolve_device`'s
    check."""
    if isinstance(value, str) and (value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:[0-9]+", value)):
        return value
    raise ValueError(f"{field}: expected auto, cpu, cuda or cuda:N (N a GPU index, lower case), received {value!r} "
                     "(the --device flag); auto uses cuda:LOCAL_RANK where CUDA is available, else the CPU.")


def resolve_device(name: str, field: str = "device") -> torch.device:
    """The torch device for ``name`` (see :func:`check_device_name` and the module docstring).

    ``auto`` and ``cuda`` take ``cuda:LOCAL_RANK`` (torchrun's ``LOCAL_RANK``, 0 without torchrun), so
    each process of a multi-GPU run gets its own GPU; ``cuda:N`` takes GPU N.

    Raises:
        ValueError: an unknown name; ``cuda`` / ``cuda:N`` where CUDA is not available (a CPU-only
            torch build, or no GPU visible); a GPU index at or beyond the number visible. The message
            names ``field`` and says how to fix it.
    """
    name = check_device_name(name, field)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"{field}={name}: CUDA is not available here (torch {torch.__version__}, {build}; no GPU "
                         "visible); use --device cpu, or --device auto to use a GPU only where there is one.")
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if ":" not in name and not re.fullmatch(r"[0-9]+", local_rank):
        raise ValueError(f"{field}={name}: LOCAL_RANK={local_rank!r} is not a GPU index (torchrun sets it to 0, 1, ...); "
                         "unset it, or name the GPU: --device cuda:N.")
    index = int(name.split(":")[1]) if ":" in name else int(local_rank)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"{field}={name}: GPU {index} asked for (LOCAL_RANK {os.environ.get('LOCAL_RANK', 'unset')}), "
                         f"but {count} visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                         f"name one of cuda:0..cuda:{count - 1}, or start fewer processes per node.")
    return torch.device("cuda", index)


def cast_for_decoding(module: torch.nn.Module, dtype: torch.dtype, device: torch.device | str | None = None, *,
                      in_place: bool = False) -> torch.nn.Module:
    """``module`` itself when its floating parameters already have ``dtype`` (and sit on ``device``,
    when given); else a copy cast to ``dtype`` and moved to ``device``.

    A copy, not an in-place cast: the caller's module keeps its dtype and device (the demo trains and
    captures features in float32 on the CPU with the same target it then decodes with in bfloat16, or
    on a GPU). ``in_place=True`` casts and moves ``module`` itself (a stage's own freshly loaded
    target, which nobody else holds: no second copy of a large model in host memory).
    """
    import copy

    params = [p for p in module.parameters() if p.is_floating_point()]
    target_device = torch.device(device) if device is not None else None
    on_device = target_device is None or all(_same_device(p.device, target_device) for p in params)
    if {p.dtype for p in params} <= {dtype} and on_device:
        return module
    return (module if in_place else copy.deepcopy(module)).to(device=target_device, dtype=dtype)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name the same GPU when the current device is 0."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: torch's ``OutOfMemoryError`` (CUDA) or the CPU
    allocator's ``RuntimeError`` ("can't allocate memory")."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def out_of_memory_error(what: str, device: torch.device | str, sizes: str, fix: str,
                        exc: BaseException) -> torch.OutOfMemoryError:
    """The error to raise (``from exc``) for an allocation failure in ``what`` on ``device``.

    ``sizes`` names the shapes that did not fit (e.g. ``"batch 4 x 4,096 tokens, 512 anchors x
    block 7"``) and ``fix`` the flags that lower them; on CUDA the GPU's free and total memory are
    added. The original message's first line is kept at the end.
    """
    device = torch.device(device)
    memory = ""
    if device.type == "cuda" and torch.cuda.is_available():
        try:
            free, total = torch.cuda.mem_get_info(device)
            memory = f"; {free / 2**30:.1f} of {total / 2**30:.1f} GiB free now"
        except RuntimeError:  # the context itself may be unusable after the failure
            memory = ""
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return torch.OutOfMemoryError(f"{what}: out of memory on {device} ({sizes}{memory}); {fix}. "
                                  f"[{type(exc).__name__}: {first_line}]")
