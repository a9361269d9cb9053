"""The target cache: token ids, loss masks and target features on disk (DESIGN.md section 4).

Shape legend: N samples in a shard, M tokens in a shard (all samples concatenated), T tokens of
one sample, H target hidden size, n number of target layers, F = n * H target feature size,
U input items (prepared rows, or tokenised samples), S ``shard_size`` (input items per shard).

Format ``deepspec-target-cache/2`` (docs/semantics.md, "Target cache format, writer and reader")::

    manifest.json             written last (rank 0), atomically; its presence means "complete"
    progress-rank<r>.json     resume bookkeeping of rank r (0 without torchrun), after each shard
    shard-00000.safetensors   the samples of input items [0, S), then [S, 2S), ...

Each shard is a standard safetensors file (inspect it with ``safetensors.safe_open``) holding

    offsets              int64   [N+1]  sample j is tokens offsets[j]:offsets[j+1]
    input_ids            int32   [M]
    loss_mask            uint8   [M]
    target_hidden        dtype   [M, F] features of target_layer_ids (deepspec.target.capture)
    target_last_hidden   dtype   [M, H] final-norm output: target logits = lm_head(target_last_hidden)

with ``dtype`` the storage dtype (float32 | bfloat16 | float16). Storage ``fp8`` stores
``target_hidden`` as float8_e4m3fn (safetensors ``F8_E4M3``) plus ``target_hidden_scale`` float32
[M, n] (per token and target layer: absmax / 448), and ``target_last_hidden`` in bfloat16; the
reader dequantises ``target_hidden`` to float32. One metadata entry ``"deepspec"`` (a JSON string)
holds the shard's index, its input range, counts, refused samples and sample ids.

Writing. Every sample is captured alone (:func:`deepspec.target.capture.capture_sample_features`:
batch 1, no padding), so its features do not depend on batching, rank count or resume points
(online mode uses the same function). A shard is laid out first (header and byte offsets) and
filled sample by sample under a temporary name, then renamed (:func:`deepspec.utils.atomic_path`):
a file under a final shard name is always whole. Shard k holds the kept samples of input items
[k*S, (k+1)*S): its contents depend only on those items, the target and the settings (no
timestamps, fixed key order), so reruns, resumed runs and multi-rank runs give byte-identical
shards. Refused samples (no loss token after truncation; non-finite features) are never written
and are counted. Under ``torchrun``, rank r writes the shards k with ``k % world_size == r`` and
rank 0 writes the manifest after a barrier.

Reading: :class:`TargetCache` opens shards with ``safe_open(..., framework="pt")`` (memory
mapped) and reads one sample with ``get_slice``, so a sample read never loads a whole shard.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import struct
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepspec.data.chat import COUNT_KEYS as TURN_COUNT_KEYS
from deepspec.data.chat import (
    render_record,
    render_record_differences,
    render_training_samples,
    target_stop_token_ids,
)
from deepspec.target.capture import _base_model, capture_sample_features, validate_target_layer_ids
from deepspec.utils import atomic_path, atomic_write_json

FORMAT_VERSION = "deepspec-target-cache/2"
MANIFEST_NAME = "manifest.json"
PROGRESS_GLOB = "progress-rank*.json"
INCOMPLETE_HINT = "cache incomplete: run `deepspec cache` again to finish it"

STORAGE_DTYPES = ("float32", "bfloat16", "float16", "fp8")


def check_storage_dtype(value: object, field: str) -> str:
    """``value`` when it is one of :data:`STORAGE_DTYPES` (the cache's and online mode's feature
    dtypes); ValueError naming ``field`` and the choices otherwise."""
    if value not in STORAGE_DTYPES:
        raise ValueError(f"{field}: expected one of {', '.join(STORAGE_DTYPES)}, got {value!r}")
    return str(value)
_FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value (OCP FP8 spec, E4M3: 1.75 * 2**8)

# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec)
_ST_CODE = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}
_DTYPE_NAME = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}
_SHARD_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
_TMP_SHARD_RE = re.compile(r"^\.shard-(\d{5,})\.safetensors\..*\.tmp$")


def shard_name(index: int) -> str:
    """File name of shard ``index`` (``shard-00007.safetensors``)."""
    return f"shard-{index:05d}.safetensors"


def progress_name(rank: int) -> str:
    """File name of rank ``rank``'s resume bookkeeping (``progress-rank0.json``)."""
    return f"progress-rank{rank}.json"


def _check_storage_dtype(name: str) -> str:
    if name not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype: expected one of {list(STORAGE_DTYPES)}, received {name!r}")
    return name


def shard_tensor_dtypes(storage_dtype: str) -> dict[str, torch.dtype]:
    """The tensors of a shard and their dtypes for a storage mode (in on-disk order: item size
    decreasing, so every tensor starts aligned to its item size)."""
    _check_storage_dtype(storage_dtype)
    if storage_dtype == "fp8":
        specs = {"offsets": torch.int64, "input_ids": torch.int32, "target_hidden_scale": torch.float32,
                 "target_last_hidden": torch.bfloat16, "target_hidden": torch.float8_e4m3fn,
                 "loss_mask": torch.uint8}
    else:
        dt = _FLOAT_DTYPES[storage_dtype]
        specs = {"offsets": torch.int64, "input_ids": torch.int32, "target_hidden": dt,
                 "target_last_hidden": dt, "loss_mask": torch.uint8}
    return dict(sorted(specs.items(), key=lambda kv: -kv[1].itemsize))  # stable: ties keep this order


def cache_bytes_per_token(
    hidden_size: int, num_target_layers: int, storage_dtype: str = "bfloat16", *, layout: str = "deepspec"
) -> int:
    """Bytes one token costs in the cache (per-sample offsets, 8 bytes a sample, and headers excluded).

    ``layout="deepspec"`` (this format): 4 (int32 id) + 1 (uint8 loss mask) + features + final
    hidden state, i.e. ``5 + itemsize * H * (n + 1)`` for float32/bfloat16/float16 and
    ``5 + n*H (fp8) + 4*n (float32 scales) + 2*H (bfloat16 final hidden)`` for ``fp8``.
    ``layout="original"`` adds the original DeepSpec's per-token uint8 attention_mask (+1 byte):
    ``6 + 2*H*(n+1)`` in bfloat16 = 30,726 bytes for Qwen3-4B (H = 2560) with 5 layers
    (DESIGN.md section 4).

    Raises ValueError for an unknown storage dtype or layout.
    """
    _check_storage_dtype(storage_dtype)
    if layout not in ("deepspec", "original"):
        raise ValueError(f"layout: expected 'deepspec' or 'original', received {layout!r}")
    H, n = int(hidden_size), int(num_target_layers)
    if storage_dtype == "fp8":
        size = 4 + 1 + n * H + 4 * n + 2 * H
    else:
        size = 4 + 1 + _FLOAT_DTYPES[storage_dtype].itemsize * H * (n + 1)
    return size + (1 if layout == "original" else 0)


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# fp8 storage


def quantize_fp8(hidden_TF: torch.Tensor, num_target_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise features to float8_e4m3fn with one float32 scale per token and target layer.

    ``scale[t, l] = absmax(hidden[t, l*H:(l+1)*H]) / 448`` (1.0 where the absmax is 0), and
    ``q = round_to_nearest_even(hidden / scale)`` in e4m3 (|q| <= 448, never saturating). Error
    bounds: the widest e4m3 ulp below 448 is 32, so every element has ``|dequant - x| <= absmax /
    28`` (16 * scale); for a normal e4m3 value the error is at most 2**-4 of the value (3 mantissa
    bits). The absmax element is exact. Measured errors: docs/semantics.md.

    Args:
        hidden_TF: finite features [T, n*H], any float dtype (computed in float32).
        num_target_layers: n (F must be divisible by it).
    Returns:
        ``(q_TF float8_e4m3fn [T, F], scale_Tn float32 [T, n])``.
    """
    T, F = hidden_TF.shape
    n = int(num_target_layers)
    assert F % n == 0, f"feature size {F} not divisible by {n} layers"
    x_TnH = hidden_TF.float().reshape(T, n, F // n)
    scale_Tn = x_TnH.abs().amax(dim=-1) / FP8_E4M3_MAX
    scale_Tn = torch.where(scale_Tn > 0, scale_Tn, torch.ones_like(scale_Tn))
    q_TnH = (x_TnH / scale_Tn[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q_TnH.reshape(T, F), scale_Tn


def dequantize_fp8(q_TF: torch.Tensor, scale_Tn: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: float32 [T, F] = q * scale (per token and layer)."""
    T, F = q_TF.shape
    n = scale_Tn.shape[-1]
    return (q_TF.float().reshape(T, n, F // n) * scale_Tn.float()[..., None]).reshape(T, F)


# ----------------------------------------------------------------------------------------------
# summary


@dataclass(kw_only=True)
class CacheSummary:
    """What a cache run produced (counts cover the whole cache, also shards written earlier)."""

    out_dir: str
    num_inputs: int  # input items read (prepared rows, or tokenised samples)
    num_heldout: int  # prepared rows with "split": "heldout" (not cached)
    num_samples: int  # samples in the cache
    num_tokens: int
    num_loss_tokens: int
    num_refused_empty_mask: int  # samples not cached: no loss token (after truncation) or no tokens
    num_refused_nonfinite: int  # samples not cached: NaN/inf in their captured features
    refused_nonfinite_ids: list[str] = field(default_factory=list)
    num_truncated: int  # samples cut to max_seq_len (prefix kept)
    num_shards: int
    num_shards_reused: int  # complete shards found from an earlier run (this rank's share)
    total_bytes: int  # shard files on disk
    bytes_per_token: float
    storage_dtype: str
    # per-turn counts (deepspec.data.chat.COUNT_KEYS) and the rows with a text-only turn that does not
    # re-tokenise to its supervised span
    turns: dict[str, int] = field(default_factory=dict)
    text_retokenized: list[str] = field(default_factory=list)
    # the manifest was present and every shard passed the reuse check (size + header), so this run
    # wrote nothing; the shards' checksums were not recomputed (that is `deepspec cache --verify`)
    already_complete: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _summary_from_manifest(out: Path, m: dict[str, Any], *, num_shards_reused: int,
                           already_complete: bool = False) -> CacheSummary:
    total = sum(s["num_bytes"] for s in m["shards"])
    return CacheSummary(
        out_dir=str(out),
        num_inputs=m["num_inputs"],
        num_heldout=m["num_heldout"],
        num_samples=m["num_samples"],
        num_tokens=m["num_tokens"],
        num_loss_tokens=m["num_loss_tokens"],
        num_refused_empty_mask=m["num_refused_empty_mask"],
        num_refused_nonfinite=m["num_refused_nonfinite"],
        refused_nonfinite_ids=[r["id"] for r in m["refused"] if r["reason"] == "nonfinite"],
        num_truncated=m["num_truncated"],
        num_shards=len(m["shards"]),
        num_shards_reused=num_shards_reused,
        total_bytes=total,
        bytes_per_token=total / m["num_tokens"] if m["num_tokens"] else 0.0,
        storage_dtype=m["storage_dtype"],
        turns=dict(m.get("turns") or {}),
        text_retokenized=list(m.get("text_retokenized") or []),
        already_complete=already_complete,
    )


# ----------------------------------------------------------------------------------------------
# shard layout and writing (streamed, deterministic safetensors layout)


@dataclass
class _ShardLayout:
    header: bytes  # 8-byte little-endian length + JSON header, space-padded to 8 bytes
    starts: dict[str, int]  # absolute file offset of each tensor's data
    row_bytes: dict[str, int]  # bytes per token of each per-token tensor
    total_bytes: int


def _shard_layout(
    num_samples: int, num_tokens: int, *, storage_dtype: str, hidden_size: int, num_layers: int, metadata: str
) -> _ShardLayout:
    H, n, M = hidden_size, num_layers, num_tokens
    row_shape = {"input_ids": [], "loss_mask": [], "target_hidden": [n * H], "target_last_hidden": [H],
                 "target_hidden_scale": [n]}
    header: dict[str, Any] = {"__metadata__": {"deepspec": metadata}}
    rel: dict[str, int] = {}
    row_bytes: dict[str, int] = {}
    pos = 0
    for name, dt in shard_tensor_dtypes(storage_dtype).items():
        if name == "offsets":
            shape = [num_samples + 1]
        else:
            shape = [M, *row_shape[name]]
            row_bytes[name] = dt.itemsize * math.prod(row_shape[name])
        nbytes = dt.itemsize * math.prod(shape)
        header[name] = {"dtype": _ST_CODE[dt], "shape": shape, "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        pos += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return _ShardLayout(head, {k: len(head) + v for k, v in rel.items()}, row_bytes, len(head) + pos)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


_Sample = tuple[str, list[int], list[int]]  # (sample id, input_ids, loss_mask)
_Features = dict[str, torch.Tensor]  # storage tensors of one sample, each [T, ...] on the CPU


def storage_features(
    hidden_TF: torch.Tensor, last_TH: torch.Tensor, storage_dtype: str, num_layers: int
) -> _Features | None:
    """Captured features -> the tensors stored for one sample, or None if any value is non-finite
    (checked in the stored precision, so a float16 overflow to inf is refused too)."""
    if storage_dtype == "fp8":
        hidden = hidden_TF.detach().float().cpu()
        last = last_TH.detach().to(torch.bfloat16).cpu()
        if not (torch.isfinite(hidden).all() and torch.isfinite(last).all()):
            return None
        q, scale = quantize_fp8(hidden, num_layers)
        return {"target_hidden": q, "target_hidden_scale": scale, "target_last_hidden": last}
    dt = _FLOAT_DTYPES[storage_dtype]
    hidden = hidden_TF.detach().to(dt).cpu()
    last = last_TH.detach().to(dt).cpu()
    if not (torch.isfinite(hidden).all() and torch.isfinite(last).all()):
        return None
    return {"target_hidden": hidden, "target_last_hidden": last}


def _write_shard_file(
    path: Path,
    samples: Sequence[_Sample],
    features: Callable[[int], _Features | None],
    *,
    storage_dtype: str,
    hidden_size: int,
    num_layers: int,
    metadata: str,
    on_sample: Callable[[int], Any] | None = None,
) -> list[int]:
    """Write one shard at ``path``; ``features(j)`` gives sample j's stored tensors (None: refused).

    Returns the positions j whose features were None (their rows are left zero; the caller
    rewrites the shard without them)."""
    offsets = [0]
    for _, ids, _ in samples:
        offsets.append(offsets[-1] + len(ids))
    layout = _shard_layout(len(samples), offsets[-1], storage_dtype=storage_dtype, hidden_size=hidden_size,
                           num_layers=num_layers, metadata=metadata)
    bad: list[int] = []
    with open(path, "wb") as f:
        f.write(layout.header)
        f.truncate(layout.total_bytes)
        f.seek(layout.starts["offsets"])
        f.write(_tensor_bytes(torch.tensor(offsets, dtype=torch.int64)))
        f.seek(layout.starts["input_ids"])
        f.write(_tensor_bytes(torch.tensor([t for _, ids, _ in samples for t in ids], dtype=torch.int32)))
        f.seek(layout.starts["loss_mask"])
        f.write(_tensor_bytes(torch.tensor([m for _, _, mask in samples for m in mask], dtype=torch.uint8)))
        for j in range(len(samples)):
            tensors = features(j)
            if tensors is None:
                bad.append(j)
            else:
                for name, t in tensors.items():
                    assert t.shape[0] == offsets[j + 1] - offsets[j], (name, t.shape)
                    f.seek(layout.starts[name] + layout.row_bytes[name] * offsets[j])
                    f.write(_tensor_bytes(t))
            if on_sample is not None:
                on_sample(1)
        f.flush()
        os.fsync(f.fileno())
    return bad


def _shard_metadata(
    *, run_key: str, index: int, first_input: int, num_inputs: int, samples: Sequence[_Sample],
    num_heldout: int, num_truncated: int, refused: list[dict[str, str]], turns: Mapping[str, int],
    text_retokenized: list[str],
) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "run_key": run_key,
        "index": index,
        "first_input": first_input,
        "num_inputs": num_inputs,
        "num_samples": len(samples),
        "num_tokens": sum(len(ids) for _, ids, _ in samples),
        "num_loss_tokens": sum(sum(mask) for _, _, mask in samples),
        "num_heldout": num_heldout,
        "num_truncated": num_truncated,
        "refused": refused,
        "turns": dict(turns),
        "text_retokenized": list(text_retokenized),
        "sample_ids": [sid for sid, _, _ in samples],
    }


_ENTRY_KEYS = ("index", "first_input", "num_inputs", "num_samples", "num_tokens", "num_loss_tokens",
               "num_heldout", "num_truncated", "refused", "turns", "text_retokenized")


def _entry(final: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest / progress entry of a complete shard file."""
    e = {k: meta[k] for k in _ENTRY_KEYS}
    e.update(file=final.name, sha256=sha256_file(final), num_bytes=final.stat().st_size)
    return e


def _dumps_meta(meta: dict[str, Any]) -> str:
    return json.dumps(meta, separators=(",", ":"), ensure_ascii=True)


def _write_shard(
    final: Path,
    samples: list[_Sample],
    meta: dict[str, Any],
    model: nn.Module,
    *,
    layer_ids: list[int],
    storage_dtype: str,
    hidden_size: int,
    on_sample: Callable[[int], Any] | None,
) -> dict[str, Any]:
    """Capture ``samples`` and write shard ``final`` atomically; return its entry.

    Samples with non-finite features are refused: the first pass records them, then the shard is
    rewritten without them (the other samples' rows are copied from the first file, not captured
    again) and they are listed in the metadata as ``{"id", "reason": "nonfinite"}``."""
    n = len(layer_ids)
    kw = dict(storage_dtype=storage_dtype, hidden_size=hidden_size, num_layers=n)

    def capture(j: int) -> _Features | None:
        hidden_TF, last_TH = capture_sample_features(model, samples[j][1], layer_ids)
        return storage_features(hidden_TF, last_TH, storage_dtype, n)

    with atomic_path(final) as tmp:
        bad = _write_shard_file(tmp, samples, capture, metadata=_dumps_meta(meta), on_sample=on_sample, **kw)
        if bad:
            from safetensors import safe_open

            kept = [j for j in range(len(samples)) if j not in set(bad)]
            refused = list(meta["refused"]) + [
                {"id": samples[j][0], "reason": "nonfinite", "detail": "NaN or inf in the captured target features"}
                for j in bad
            ]
            meta = {**meta, "refused": refused}
            meta.update(_shard_metadata(
                run_key=meta["run_key"], index=meta["index"], first_input=meta["first_input"],
                num_inputs=meta["num_inputs"], samples=[samples[j] for j in kept], num_heldout=meta["num_heldout"],
                num_truncated=meta["num_truncated"], refused=refused, turns=meta["turns"],
                text_retokenized=meta["text_retokenized"]))
            fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".rewrite.tmp", dir=final.parent)
            os.close(fd)
            rewrite = Path(name)
            try:
                with safe_open(str(tmp), framework="pt") as old:
                    old_offsets = old.get_tensor("offsets").tolist()
                    names = [k for k in shard_tensor_dtypes(storage_dtype) if k.startswith("target_")]

                    def copy(i: int) -> _Features:
                        j = kept[i]
                        a, b = old_offsets[j], old_offsets[j + 1]
                        return {k: old.get_slice(k)[a:b] for k in names}

                    _write_shard_file(rewrite, [samples[j] for j in kept], copy, metadata=_dumps_meta(meta), **kw)
                os.replace(rewrite, tmp)
            finally:
                if rewrite.exists():
                    rewrite.unlink()
    _fsync_dir(final.parent)
    return _entry(final, meta)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_shard_meta(path: Path) -> dict[str, Any] | None:
    """The ``deepspec`` metadata of a shard file, or None if it is not a readable shard."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return json.loads(meta["deepspec"])
    except Exception:  # noqa: BLE001 - any unreadable file is simply "not a complete shard"
        return None


# ----------------------------------------------------------------------------------------------
# writer


def _clean_stale_temp_files(out_dir: Path, *, rank: int, world_size: int) -> None:
    """Remove temporary files a killed run left behind (``atomic_path`` names them ``.<final>.*.tmp``):
    only those of this rank's shards and files, since other ranks may be writing theirs now."""
    for p in out_dir.glob(".*.tmp"):
        if not p.is_file():
            continue
        m = _TMP_SHARD_RE.match(p.name)
        mine = (
            (m is not None and int(m.group(1)) % world_size == rank)
            or p.name.startswith(f".{progress_name(rank)}.")
            or (rank == 0 and p.name.startswith(f".{MANIFEST_NAME}."))
        )
        if mine:
            p.unlink()


def _check_settings(out: Path, run_key: str, settings: dict[str, Any]) -> None:
    for path in [out / MANIFEST_NAME, *sorted(out.glob(PROGRESS_GLOB))]:
        if not path.exists():
            continue
        old = json.loads(path.read_text(encoding="utf-8"))
        if old.get("run_key") != run_key:
            old_settings = old.get("settings", {})
            diff = {k: (old_settings.get(k), v) for k, v in settings.items() if old_settings.get(k) != v}
            raise ValueError(
                f"{path}: this folder holds a target cache built with other settings "
                f"(field: (existing, requested) = {diff}); use another output folder or delete this one"
            )


def _reusable(p: Path, e: dict[str, Any], run_key: str) -> bool:
    """Cheap check that the shard file ``p`` is the one entry ``e`` records: same size, and a
    safetensors header that parses and whose metadata names this run key, this index and the
    entry's counts. The data bytes are not hashed (caches can be tens of TB); a flipped bit in
    the tensor data is found by ``deepspec cache --verify``, not here."""
    if not (p.is_file() and p.stat().st_size == e["num_bytes"]):
        return False
    meta = _read_shard_meta(p)
    return (meta is not None and meta.get("run_key") == run_key
            and all(meta.get(k) == e.get(k) for k in _ENTRY_KEYS))


def _collect_done(out: Path, run_key: str) -> dict[int, dict[str, Any]]:
    """Complete shards of this run key: entries of the manifest and of every rank's progress file
    whose file passes :func:`_reusable` (size + header; checksums are not recomputed), plus
    final-named shards whose rename was not yet recorded (killed between rename and progress write;
    their metadata says which shard they are)."""
    done: dict[int, dict[str, Any]] = {}
    for path in [out / MANIFEST_NAME, *sorted(out.glob(PROGRESS_GLOB))]:
        if not path.exists():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("run_key") != run_key:
            continue
        for e in data.get("shards", []):
            if e["index"] not in done and _reusable(out / e["file"], e, run_key):
                done[e["index"]] = e
    for p in sorted(out.glob("shard-*.safetensors")):
        m = _SHARD_RE.match(p.name)
        if m is None or int(m.group(1)) in done:
            continue
        meta = _read_shard_meta(p)
        if meta is not None and meta.get("run_key") == run_key and meta.get("index") == int(m.group(1)):
            done[meta["index"]] = _entry(p, meta)
    return done


@dataclass
class _Item:
    """One rendered input item: its samples (None: a held-out row), the per-turn counts of
    :func:`deepspec.data.chat.render_training_samples` and, for a prepared row, its id."""

    samples: list[_Sample] | None
    turns: dict[str, int] = field(default_factory=dict)
    row_id: str = ""


_Unit = Callable[[], _Item]  # renders one input item


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


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("world_size > 1 needs an initialised torch.distributed process group (gloo)")
        dist.barrier()


def _write_cache(
    units: Iterable[_Unit], out_dir: str | os.PathLike[str], model: nn.Module, **kw: Any
) -> CacheSummary:
    """:func:`_write_cache_in` that leaves no empty output folder behind: if this run created
    ``out_dir`` and fails before writing anything in it (a bad row, a bad setting, Ctrl-C during
    the first shard), the empty folder is removed. Single process only: under torchrun another
    rank may be about to write into the folder. A folder holding anything is always kept (resume)."""
    out = Path(out_dir)
    existed = out.exists()
    try:
        return _write_cache_in(units, out, model, **kw)
    except BaseException:
        if not existed and kw.get("world_size", 1) == 1 and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


def _write_cache_in(
    units: Iterable[_Unit],
    out_dir: str | os.PathLike[str],
    model: nn.Module,
    *,
    target_layer_ids: Sequence[int],
    target_fingerprint: str,
    tokenizer_fingerprint: str,
    max_seq_len: int | None,
    shard_size: int,
    storage_dtype: str,
    chat_template: str | None,
    source_fingerprint: str | None,
    num_inputs_hint: int | None,
    progress: bool,
    rank: int,
    world_size: int,
    render: Mapping[str, Any] | None = None,
    target: str | None = None,
) -> CacheSummary:
    out = Path(out_dir)
    num_hidden_layers = len(_base_model(model).layers)
    layer_ids = validate_target_layer_ids(list(target_layer_ids), num_hidden_layers)
    _check_storage_dtype(storage_dtype)
    if shard_size < 1:
        raise ValueError(f"shard_size: expected >= 1, received {shard_size}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len: expected >= 1 or None, received {max_seq_len}")
    if not (world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(f"rank/world_size: expected 0 <= rank < world_size, received {rank}/{world_size}")
    hidden_size = int(model.config.hidden_size)
    n = len(layer_ids)
    tensors = shard_tensor_dtypes(storage_dtype)

    settings = {  # everything the bytes depend on (not the rank count: shards do not depend on it)
        "format": FORMAT_VERSION,
        "target_fingerprint": target_fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "target_layer_ids": layer_ids,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "storage_dtype": storage_dtype,
        "chat_template": chat_template,
        "max_seq_len": max_seq_len,
        "shard_size": shard_size,
        "source_fingerprint": source_fingerprint,
        # what the chat template reads (stop ids included); not the render date: the probe says if it matters
        "render": None if render is None else {k: v for k, v in render.items() if k != "render_date"},
    }
    run_key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]

    out.mkdir(parents=True, exist_ok=True)
    _clean_stale_temp_files(out, rank=rank, world_size=world_size)
    _check_settings(out, run_key, settings)
    manifest_path = out / MANIFEST_NAME
    done = _collect_done(out, run_key)
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text(encoding="utf-8"))
        if all(s["index"] in done for s in m["shards"]):
            _barrier(world_size)  # every rank takes this branch (same files), so the barrier pairs up
            return _summary_from_manifest(out, m, num_shards_reused=len(m["shards"]), already_complete=True)

    progress_path = out / progress_name(rank)
    own: dict[int, dict[str, Any]] = {}  # this rank's progress entries (kept across runs)
    if progress_path.exists():
        for e in json.loads(progress_path.read_text(encoding="utf-8")).get("shards", []):
            if done.get(e["index"]) == e:
                own[e["index"]] = e

    def save_progress() -> None:
        atomic_write_json(progress_path, {"format": FORMAT_VERSION, "run_key": run_key, "rank": rank,
                                          "settings": settings, "shards": [own[k] for k in sorted(own)]})

    bar = None
    if progress:
        from tqdm.auto import tqdm

        own_rows = None  # rows in this rank's shards
        if num_inputs_hint is not None:
            own_rows = sum(min(shard_size, num_inputs_hint - k * shard_size)
                           for k in range(rank, -(-num_inputs_hint // shard_size), world_size))
        bar = tqdm(total=own_rows, desc=f"target cache (rank {rank})" if world_size > 1 else "target cache",
                   unit="row", disable=None)
    num_reused = 0

    def flush(k: int, items: list[_Item], first: int) -> None:
        nonlocal num_reused
        samples: list[_Sample] = []
        refused: list[dict[str, str]] = []
        num_heldout = num_truncated = 0
        turns = dict.fromkeys(TURN_COUNT_KEYS, 0)
        text_retokenized: list[str] = []
        for item in items:
            for key, value in item.turns.items():
                turns[key] += value
            if item.turns.get("num_turns_text_retokenized"):
                text_retokenized.append(item.row_id)
            if item.samples is None:
                num_heldout += 1
                continue
            for s in item.samples:
                kept, truncated = keep_sample(s, max_seq_len)
                num_truncated += int(truncated)
                if kept is None:
                    refused.append({"id": str(s[0]), "reason": "empty_mask",
                                    "detail": "no loss token (after truncation to max_seq_len)"})
                else:
                    samples.append(kept)
        meta = _shard_metadata(run_key=run_key, index=k, first_input=first, num_inputs=len(items),
                               samples=samples, num_heldout=num_heldout, num_truncated=num_truncated, refused=refused,
                               turns=turns, text_retokenized=text_retokenized)
        captured = 0

        def on_sample(count: int) -> None:  # progress inside a shard; the bar counts rows once it is written
            nonlocal captured
            captured += count
            bar.set_postfix_str(f"{shard_name(k)}: {captured}/{len(samples)} samples")

        entry = _write_shard(out / shard_name(k), samples, meta, model, layer_ids=layer_ids,
                             storage_dtype=storage_dtype, hidden_size=hidden_size,
                             on_sample=on_sample if bar is not None else None)
        own[k] = entry
        save_progress()
        if bar is not None:
            bar.update(len(items))

    num_inputs = 0
    try:
        items: list[_Item] = []
        k_cur = 0
        for u, unit in enumerate(units):
            k = u // shard_size
            if k != k_cur:
                if k_cur % world_size == rank and k_cur not in done:
                    flush(k_cur, items, k_cur * shard_size)
                items, k_cur = [], k
            if k % world_size == rank:
                if k in done:
                    if u % shard_size == 0:
                        num_reused += 1
                    if bar is not None:
                        bar.update(1)
                else:
                    items.append(unit())
            num_inputs = u + 1
        if num_inputs and k_cur % world_size == rank and k_cur not in done:
            flush(k_cur, items, k_cur * shard_size)
    finally:
        if bar is not None:
            bar.close()
    num_shards = -(-num_inputs // shard_size)

    _barrier(world_size)
    if rank == 0:
        done = _collect_done(out, run_key)
        missing = [k for k in range(num_shards) if k not in done]
        if missing:
            raise RuntimeError(
                f"{out}: shards {[shard_name(k) for k in missing]} were not written (a rank failed?); "
                f"{INCOMPLETE_HINT}"
            )
        extra = sorted(p.name for p in out.glob("shard-*.safetensors")
                       if (m := _SHARD_RE.match(p.name)) is None or int(m.group(1)) >= num_shards)
        if extra:
            raise ValueError(
                f"{out}: shard files {extra} were not produced by this input (it has {num_shards} shards); "
                f"the input changed since the cache was started: use another output folder or delete this one"
            )
        shards = [done[k] for k in range(num_shards)]
        refused_all = [r for s in shards for r in s["refused"]]
        manifest = {
            "format": FORMAT_VERSION,
            "run_key": run_key,
            "settings": settings,
            "target": target,  # as named to `deepspec cache`; `deepspec train` without --target uses it
            "target_fingerprint": target_fingerprint,
            "tokenizer_fingerprint": tokenizer_fingerprint,
            "target_layer_ids": layer_ids,
            "hidden_size": hidden_size,
            "feature_size": hidden_size * n,
            "num_hidden_layers": num_hidden_layers,
            "storage_dtype": storage_dtype,
            "dtypes": {k: _DTYPE_NAME[v] for k, v in tensors.items() if k != "offsets"},
            "chat_template": chat_template,
            "max_seq_len": max_seq_len,
            "shard_size": shard_size,
            "num_inputs": num_inputs,
            "num_heldout": sum(s["num_heldout"] for s in shards),
            "num_samples": sum(s["num_samples"] for s in shards),
            "num_tokens": sum(s["num_tokens"] for s in shards),
            "num_loss_tokens": sum(s["num_loss_tokens"] for s in shards),
            "num_truncated": sum(s["num_truncated"] for s in shards),
            "num_refused_empty_mask": sum(r["reason"] == "empty_mask" for r in refused_all),
            "num_refused_nonfinite": sum(r["reason"] == "nonfinite" for r in refused_all),
            "refused": refused_all,
            "stop_token_ids": None if render is None else render["stop_token_ids"],
            "render": None if render is None else dict(render),
            "turns": {key: sum(s["turns"].get(key, 0) for s in shards) for key in TURN_COUNT_KEYS},
            "text_retokenized": [r for s in shards for r in s["text_retokenized"]],
            "bytes_per_token_estimate": cache_bytes_per_token(hidden_size, n, storage_dtype),
            "shards": shards,
        }
        atomic_write_json(manifest_path, manifest)
    _barrier(world_size)  # the other ranks return once the manifest exists
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    return _summary_from_manifest(out, manifest, num_shards_reused=num_reused)


def write_target_cache_from_samples(
    samples: Iterable[tuple[Any, Sequence[int], Sequence[int]]],
    out_dir: str | os.PathLike[str],
    model: nn.Module,
    *,
    target_layer_ids: Sequence[int],
    target_fingerprint: str,
    tokenizer_fingerprint: str,
    max_seq_len: int | None = None,
    shard_size: int = 256,
    storage_dtype: str = "bfloat16",
    chat_template: str | None = None,
    source_fingerprint: str | None = None,
    num_samples_hint: int | None = None,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> CacheSummary:
    """Write a target cache from already tokenised samples ``(id, input_ids, loss_mask)``.

    Each sample is one input item: shard k holds the kept samples among inputs [k*S, (k+1)*S)
    (S = ``shard_size``), in input order. A sample longer than ``max_seq_len`` is truncated
    (prefix kept, counted); one left without loss tokens is refused (``empty_mask``); one whose
    captured features hold NaN/inf is refused (``nonfinite``); refused samples are never
    written and are listed in the manifest. ``chat_template`` is a name or hash recorded in the
    manifest; ``source_fingerprint`` identifies the input (a resume over different input is
    refused). Rerunning on the same ``out_dir`` with the same settings resumes (or returns at
    once if the cache is complete); different settings raise ValueError.

    Multi-process: ``rank``/``world_size`` (an initialised gloo/NCCL process group is needed when
    ``world_size > 1``): every rank iterates all samples and writes the shards with
    ``k % world_size == rank``; rank 0 writes the manifest. Shards are byte-identical to a
    single-process build.

    Raises ValueError for bad settings or samples, naming the field and how to fix it.
    """
    units = ((lambda s=s: _Item([s])) for s in samples)
    return _write_cache(
        units, out_dir, model, target_layer_ids=target_layer_ids, target_fingerprint=target_fingerprint,
        tokenizer_fingerprint=tokenizer_fingerprint, max_seq_len=max_seq_len, shard_size=shard_size,
        storage_dtype=storage_dtype, chat_template=chat_template, source_fingerprint=source_fingerprint,
        num_inputs_hint=num_samples_hint, progress=progress, rank=rank, world_size=world_size,
    )


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


def write_target_cache(
    prepared_jsonl: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    model: nn.Module,
    tokenizer: Any,
    *,
    target_layer_ids: Sequence[int],
    max_seq_len: int | None,
    shard_size: int = 256,
    storage_dtype: str = "bfloat16",
    progress: bool = True,
    target_fingerprint: str | None = None,
    tokenizer_fingerprint: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    target: str | None = None,
) -> CacheSummary:
    """Build the target cache of a prepared JSONL file (rows ``{"id", "messages", ...}``).

    One input item per row: shard k holds the samples of rows [k*S, (k+1)*S) (S = ``shard_size``)
    rendered by :func:`render_prepared_row` (held-out rows are counted, not cached); rows of
    shards another rank writes, or of shards already complete, are not rendered. Otherwise as
    :func:`write_target_cache_from_samples`. Fingerprints default to
    :func:`deepspec.target.load.target_fingerprint` / ``tokenizer_fingerprint``. ``target`` names the
    target as ``deepspec cache`` was given it (``"default"`` or an absolute folder path); the manifest
    records it, and ``deepspec train`` without ``--target`` trains against it.

    Raises FileNotFoundError for a missing input, ValueError for bad settings or rows.
    """
    from deepspec.data.conversations import read_jsonl

    path = Path(prepared_jsonl)
    if not path.is_file():
        raise FileNotFoundError(f"prepared data {path} not found; run `deepspec prepare` first")
    if target_fingerprint is None or tokenizer_fingerprint is None:
        from deepspec.target import load

        target_fingerprint = target_fingerprint or load.target_fingerprint(model)
        tokenizer_fingerprint = tokenizer_fingerprint or load.tokenizer_fingerprint(tokenizer)
    stop_ids = target_stop_token_ids(model, tokenizer)
    render = check_prepared_render(path, tokenizer, stop_ids)

    def render_row(row: dict[str, Any]) -> _Item:
        counts: dict[str, int] = {}
        return _Item(render_prepared_row(tokenizer, row, stop_ids=stop_ids, counts=counts), counts, str(row.get("id")))

    def units() -> Iterator[_Unit]:
        for row in read_jsonl(path):
            yield lambda row=row: render_row(row)

    return _write_cache(
        units(), out_dir, model, target_layer_ids=target_layer_ids, target_fingerprint=target_fingerprint,
        tokenizer_fingerprint=tokenizer_fingerprint, max_seq_len=max_seq_len, shard_size=shard_size,
        storage_dtype=storage_dtype, chat_template=chat_template_id(tokenizer),
        source_fingerprint="sha256:" + sha256_file(path), num_inputs_hint=_count_lines(path),
        progress=progress, rank=rank, world_size=world_size, render=render, target=target,
    )


def check_prepared_render(prepared_jsonl: str | os.PathLike[str], tokenizer: Any,
                          stop_ids: Sequence[int]) -> dict[str, Any]:
    """The render record of prepared data as this tokenizer renders it now; refuse a difference
    with what ``deepspec prepare`` recorded (``<input>.summary.json``, ``render``).

    The record (:func:`deepspec.data.chat.render_record`) holds the chat template's hash, the
    ``chat_template_kwargs``, the stop token ids and the ids of a probe conversation: if any differs,
    the prompts rendered now are not the ones the target answered (another tokenizer or template,
    other kwargs, a template that reads today's date, another stop rule), so the supervised
    sequences would not be what the target saw. Prepared data without a summary (imported data) is
    not checked: the returned record then says ``"checked_against": null``.

    Raises:
        ValueError: naming every field that differs, both values, and the fix.
    """
    from deepspec.data.prepare import summary_path_for

    summary_path = summary_path_for(Path(prepared_jsonl))
    recorded = None
    if summary_path.is_file():
        recorded = json.loads(summary_path.read_text(encoding="utf-8")).get("render")
    kwargs = recorded.get("chat_template_kwargs") if isinstance(recorded, dict) else None
    now = render_record(tokenizer, chat_template_kwargs=kwargs, stop_ids=stop_ids)
    if isinstance(recorded, dict):
        differences = render_record_differences(recorded, now)
        if differences:
            raise ValueError(
                f"{prepared_jsonl}: the chat template renders differently now than when `deepspec prepare` wrote "
                f"it ({summary_path}): " + "; ".join(differences) + ". The cached prompts would not be the ones "
                f"the target answered. Use the target (tokenizer, template, generation_config) and --enable-thinking "
                f"the data was prepared with, or prepare the data again with this target.")
    return {**now, "checked_against": str(summary_path.name) if isinstance(recorded, dict) else None}


# ----------------------------------------------------------------------------------------------
# reader


def _load_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise FileNotFoundError(f"target cache {path} not found; build it with `deepspec cache`")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        if not any(path.glob("shard-*.safetensors")) and not any(path.glob(PROGRESS_GLOB)):
            raise FileNotFoundError(f"{path} is not a target cache (no {MANIFEST_NAME}, no shards); a target cache is "
                                    "a folder written by `deepspec cache`")
        raise RuntimeError(f"{path}: no {MANIFEST_NAME}: {INCOMPLETE_HINT}")
    manifest: dict[str, Any] = json.loads(manifest_path.read_text(encoding="utf-8"))
    fmt = manifest.get("format")
    if fmt != FORMAT_VERSION:
        old = ""
        if fmt == "deepspec-target-cache/1":
            old = " (format 1: padded-batch capture, no refusal of non-finite features)"
        raise ValueError(
            f"{manifest_path}: format {fmt!r}{old} is not readable; this DeepSpec reads {FORMAT_VERSION!r}. "
            f"Rebuild the cache with this version: `deepspec cache --input <prepared.jsonl> --output-dir <new folder>`"
        )
    return manifest


class TargetCache:
    """Read-only view of a complete target cache folder.

    ``cache[i]`` -> ``{"input_ids": int32 [T], "loss_mask": uint8 [T], "target_hidden": [T, F],
    "target_last_hidden": [T, H]}`` in the stored dtypes, except storage ``fp8`` where
    ``target_hidden`` is dequantised to float32 (``target_last_hidden`` stays bfloat16). Shards are
    opened lazily with ``safe_open`` (memory mapped) and a sample is read with ``get_slice``: only
    its rows are copied. At most ``max_open_shards`` shards are open at once (least recently used
    closed). Safe to pickle into DataLoader workers (open handles are not pickled).

    Raises FileNotFoundError if the folder does not exist or holds no cache (no manifest, no shards),
    RuntimeError if the manifest is missing beside shards (an unfinished run), ValueError for another
    format version (e.g. v1: rebuild).
    """

    FIELDS = ("input_ids", "loss_mask", "target_hidden", "target_last_hidden")

    def __init__(self, path: str | os.PathLike[str], *, max_open_shards: int = 64):
        self.path = Path(path)
        self.manifest = _load_manifest(self.path)
        self._shards = self.manifest["shards"]
        self._starts = [0]
        for s in self._shards:
            self._starts.append(self._starts[-1] + s["num_samples"])
        for s in self._shards:
            if not (self.path / s["file"]).is_file():
                raise RuntimeError(
                    f"{self.path}: shard {s['file']} listed in the manifest is missing; rerun `deepspec cache` "
                    f"with the same settings to rewrite it"
                )
        self.max_open_shards = max_open_shards
        self._handles: OrderedDict[int, Any] = OrderedDict()  # LRU of open shards (bounded fds / maps)
        self._offsets: dict[int, list[int]] = {}
        self._sample_ids: dict[int, list[str]] = {}

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        return state

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.manifest["target_layer_ids"])

    @property
    def storage_dtype(self) -> str:
        return self.manifest["storage_dtype"]

    def _open(self, k: int) -> Any:
        h = self._handles.get(k)
        if h is not None:
            self._handles.move_to_end(k)
            return h
        from safetensors import safe_open

        h = safe_open(str(self.path / self._shards[k]["file"]), framework="pt")
        self._handles[k] = h
        while len(self._handles) > self.max_open_shards:
            self._handles.popitem(last=False)
        if k not in self._offsets:
            self._offsets[k] = h.get_tensor("offsets").tolist()  # [N+1] int64, small
            n = self._shards[k]["num_samples"]
            if len(self._offsets[k]) != n + 1:
                raise RuntimeError(
                    f"{self.path / self._shards[k]['file']}: holds {len(self._offsets[k]) - 1} samples, the manifest "
                    f"says {n}; the cache folder was modified: run `deepspec cache --verify` on it"
                )
        return h

    def _locate(self, i: int) -> tuple[int, int]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for a target cache of {n} samples")
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def sample_length(self, i: int) -> int:
        """Tokens T of sample ``i``."""
        k, j = self._locate(i)
        self._open(k)
        return self._offsets[k][j + 1] - self._offsets[k][j]

    def sample_id(self, i: int) -> str:
        """Id of sample ``i`` (prepared row id + render suffix)."""
        k, j = self._locate(i)
        if k not in self._sample_ids:
            self._sample_ids[k] = json.loads(self._open(k).metadata()["deepspec"])["sample_ids"]
        return self._sample_ids[k][j]

    def read(self, i: int, fields: Sequence[str] = FIELDS) -> dict[str, torch.Tensor]:
        """Only the named fields of sample ``i`` (e.g. ``("input_ids",)`` to scan tokens cheaply)."""
        unknown = [f for f in fields if f not in self.FIELDS]
        if unknown:
            raise ValueError(f"fields: unknown {unknown}; expected a subset of {list(self.FIELDS)}")
        k, j = self._locate(int(i))
        h = self._open(k)
        a, b = self._offsets[k][j], self._offsets[k][j + 1]
        out = {}
        for name in fields:
            t = h.get_slice(name)[a:b]
            if name == "target_hidden" and t.dtype == torch.float8_e4m3fn:
                t = dequantize_fp8(t, h.get_slice("target_hidden_scale")[a:b])
            out[name] = t
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.read(i)


def check_compatible(
    manifest_or_cache: Any,
    *,
    target_fingerprint: str,
    tokenizer_fingerprint: str,
    target_layer_ids: Sequence[int],
) -> None:
    """Refuse a cache built for another target, tokenizer or layer set.

    Accepts a :class:`TargetCache` (or anything with ``.manifest``, e.g. online features) or a
    manifest dict. Raises ValueError naming the mismatching field, both values, and how to fix it.
    """
    m = manifest_or_cache.manifest if hasattr(manifest_or_cache, "manifest") else manifest_or_cache
    where = f"target cache {manifest_or_cache.path}" if hasattr(manifest_or_cache, "path") else "target cache"
    built_with = f" (--target {m['target']})" if m.get("target") else " (pass it with --target)"
    checks = [
        ("target_fingerprint", m.get("target_fingerprint"), target_fingerprint,
         "rebuild the cache with this target (`deepspec cache`) or train against the target it was built with"
         + built_with),
        ("tokenizer_fingerprint", m.get("tokenizer_fingerprint"), tokenizer_fingerprint,
         "rebuild the cache with this target's tokenizer (`deepspec cache`)"),
        ("target_layer_ids", list(m.get("target_layer_ids", [])), list(target_layer_ids),
         "rebuild the cache with these target_layer_ids, or set the draft's target_layer_ids to the cache's"),
    ]
    for field_name, have, want, fix in checks:
        if have != want:
            raise ValueError(f"{where}: {field_name} mismatch: cache has {have!r}, expected {want!r}; {fix}")


# ----------------------------------------------------------------------------------------------
# verify


@dataclass
class ShardCheck:
    """Result of verifying one shard: ``problems`` is empty when it is OK."""

    file: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _parse_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("file shorter than the 8-byte safetensors header length")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"header length {n} is implausible")
        text = f.read(n)
    if len(text) != n:
        raise ValueError("truncated safetensors header")
    return json.loads(text.decode("utf-8")), 8 + n


def _verify_shard(path: Path, entry: dict[str, Any], m: dict[str, Any], *, check_finite: bool,
                  chunk_tokens: int) -> list[str]:
    from safetensors import safe_open

    if not path.is_file():
        return ["file missing"]
    problems: list[str] = []
    size = path.stat().st_size
    if size != entry["num_bytes"]:
        problems.append(f"size {size} bytes, manifest says {entry['num_bytes']}")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        problems.append(f"sha256 {digest[:16]}... differs from the manifest's {entry['sha256'][:16]}...")
    try:
        header, data_start = _parse_header(path)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return problems + [f"safetensors header unreadable: {exc}"]
    N, M = entry["num_samples"], entry["num_tokens"]
    H, n = m["hidden_size"], len(m["target_layer_ids"])
    want_shape = {"offsets": [N + 1], "input_ids": [M], "loss_mask": [M], "target_hidden": [M, n * H],
                  "target_last_hidden": [M, H], "target_hidden_scale": [M, n]}
    want = shard_tensor_dtypes(m["storage_dtype"])
    names = [k for k in header if k != "__metadata__"]
    if sorted(names) != sorted(want):
        problems.append(f"tensors {sorted(names)}, expected {sorted(want)}")
        return problems
    pos = 0
    for name in sorted(names, key=lambda k: header[k]["data_offsets"][0]):
        info = header[name]
        if info["dtype"] != _ST_CODE[want[name]]:
            problems.append(f"{name}: dtype {info['dtype']}, expected {_ST_CODE[want[name]]}")
        if info["shape"] != want_shape[name]:
            problems.append(f"{name}: shape {info['shape']}, expected {want_shape[name]}")
        a, b = info["data_offsets"]
        if a != pos or b - a != want[name].itemsize * math.prod(info["shape"]):
            problems.append(f"{name}: data_offsets {info['data_offsets']} inconsistent (expected start {pos})")
        pos = b
    if data_start + pos != size:
        problems.append(f"data ends at byte {data_start + pos}, file has {size}")
    if problems:
        return problems
    try:
        meta = json.loads(header["__metadata__"]["deepspec"])
        for key in _ENTRY_KEYS:
            if meta.get(key) != entry.get(key):
                problems.append(f"metadata {key}={meta.get(key)!r}, manifest says {entry.get(key)!r}")
        if meta.get("run_key") != m["run_key"]:
            problems.append(f"metadata run_key {meta.get('run_key')!r} is not the manifest's {m['run_key']!r}")
        if len(meta.get("sample_ids", [])) != N:
            problems.append(f"metadata lists {len(meta.get('sample_ids', []))} sample ids, expected {N}")
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets")
            lengths = offsets[1:] - offsets[:-1]
            if int(offsets[0]) != 0 or int(offsets[-1]) != M or (N and int(lengths.min()) < 1):
                problems.append(f"offsets must rise strictly from 0 to {M}; "
                                f"got {offsets[:3].tolist()}...{int(offsets[-1])}")
            mask = f.get_tensor("loss_mask")
            if int((mask > 1).sum()):
                problems.append("loss_mask holds values other than 0/1")
            if int(mask.sum()) != entry["num_loss_tokens"]:
                problems.append(f"loss_mask sums to {int(mask.sum())}, manifest says {entry['num_loss_tokens']}")
            if check_finite:
                for name in ("target_hidden", "target_last_hidden", "target_hidden_scale"):
                    if name not in want:
                        continue
                    sl = f.get_slice(name)
                    for a in range(0, M, chunk_tokens):
                        t = sl[a:a + chunk_tokens]
                        if not bool(torch.isfinite(t.float()).all()):
                            problems.append(f"{name}: non-finite values among tokens [{a}, {min(M, a + chunk_tokens)})")
                            break
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        problems.append(f"unreadable: {type(exc).__name__}: {exc}")
    return problems


def verify_target_cache(
    path: str | os.PathLike[str], *, check_finite: bool = True, chunk_tokens: int = 4096,
    log: Callable[[str], Any] | None = print,
) -> list[ShardCheck]:
    """Check every shard of a cache against its manifest; print one OK/FAIL line per shard.

    Checks: the manifest is present and of this format; shard indices are 0..K-1; each shard
    exists, has the recorded size and sha256, its safetensors header parses, its tensors have
    the dtypes/shapes/contiguous offsets the manifest implies, its metadata agrees with the
    manifest entry, sample offsets rise from 0 to the token count, the loss mask is 0/1 with the
    recorded sum, and (``check_finite``) every feature value is finite (read ``chunk_tokens``
    tokens at a time, never a whole shard); the manifest's totals equal the sums over shards.

    Returns the per-shard results when all pass. Raises ValueError naming each broken shard and
    the fix (delete the shard file, rerun ``deepspec cache`` with the same settings: only missing
    shards are rewritten); FileNotFoundError for a missing folder or one that holds no cache (no
    manifest, no shards); ValueError for a missing manifest beside shards
    (unfinished build: rerun ``deepspec cache``) or another format version.
    """
    root = Path(path)
    try:
        m = _load_manifest(root)
    except RuntimeError as exc:  # no manifest: an unfinished build, a user-fixable state
        raise ValueError(f"verify: {exc}") from exc
    say = log or (lambda _s: None)
    results: list[ShardCheck] = []
    for k, entry in enumerate(m["shards"]):
        check = ShardCheck(entry.get("file", f"#{k}"))
        if entry.get("index") != k or entry.get("file") != shard_name(k):
            check.problems.append(f"manifest entry {k} names index {entry.get('index')} / {entry.get('file')}")
        else:
            check.problems += _verify_shard(root / entry["file"], entry, m, check_finite=check_finite,
                                            chunk_tokens=chunk_tokens)
        say(f"{check.file}: {'OK' if check.ok else 'FAIL: ' + '; '.join(check.problems)}")
        results.append(check)
    totals = []
    for key in ("num_samples", "num_tokens", "num_loss_tokens", "num_heldout", "num_truncated"):
        s = sum(e.get(key, 0) for e in m["shards"])
        if s != m.get(key):
            totals.append(f"manifest {key}={m.get(key)} but its shards add up to {s}")
    if m.get("num_inputs") is not None and sum(e.get("num_inputs", 0) for e in m["shards"]) != m["num_inputs"]:
        totals.append("manifest num_inputs does not equal the sum over shards")
    listed = {e.get("file") for e in m["shards"]}
    stray = sorted(p.name for p in root.glob("shard-*.safetensors") if p.name not in listed)
    if stray:
        totals.append(f"shard files not listed in the manifest: {stray}")
    for t in totals:
        say(f"manifest: FAIL: {t}")
    bad = [c for c in results if not c.ok]
    if bad or totals:
        lines = [f"  {c.file}: {'; '.join(c.problems)}" for c in bad] + [f"  manifest: {t}" for t in totals]
        fix = (
            f"Fix: delete the broken shard files ({', '.join(str(root / c.file) for c in bad)}) and rerun "
            f"`deepspec cache` with the same --input/--output-dir/settings: it rewrites only missing shards and "
            f"the manifest (their progress-rank*.json entries are ignored once the file is gone)."
            if bad else
            f"Fix: delete {root / MANIFEST_NAME} and rerun `deepspec cache` with the same settings to rewrite it."
        )
        raise ValueError(f"target cache {root}: verify failed ({len(bad)} of {len(results)} shards):\n"
                         + "\n".join(lines) + "\n" + fix)
    say(f"verify: {len(results)} shards OK, {m['num_samples']} samples, {m['num_tokens']} tokens")
    return results
