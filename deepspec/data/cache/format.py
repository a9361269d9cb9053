"""The target cache's on-disk format: ``deepspec-target-cache/3`` (docs/design/cache.md, "Cache format").

Shape legend: N samples in a shard, M tokens in a shard (all samples concatenated), T tokens of
one sample, H target hidden size, n number of target layers, F = n * H target feature size,
S ``shard_size`` (input items per shard).

A cache folder (docs/design/cache.md, "Cache format")::

    manifest.json             written last (rank 0), atomically; its presence means "complete"
    progress-rank<r>.json     resume bookkeeping of rank r (0 without torchrun), after each shard
    shard-00000.safetensors   the samples of input items [0, S), then [S, 2S), ...

Each shard is a standard safetensors file (inspect it with ``safetensors.safe_open``) holding

    offsets              int64   [N+1]  sample j is tokens offsets[j]:offsets[j+1]
    input_ids            int32   [M]
    loss_mask            uint8   [M]
    target_hidden        dtype   [M, F] features of target_layer_ids (deepspec.target.capture)
    target_last_hidden   dtype   [M, H] final-norm output: target logits = lm_head(target_last_hidden)
    target_logsumexp     float32 [M]    logsumexp of those logits over the full vocabulary, at positions p
                                        with loss_mask[p + 1] (the ones a loss reads); NaN elsewhere
    target_argmax        int32   [M]    their argmax there; -1 elsewhere

The last two (:func:`deepspec.target.capture.target_logit_stats`, computed from the *stored*
``target_last_hidden``) let a draft with a reduced vocabulary of W tokens get the target's
probabilities on its tokens from W logits instead of V (the losses' largest product). Online mode
has none: its losses compute the full-vocabulary logits (same values).

with ``dtype`` the storage dtype (float32 | bfloat16 | float16). Storage ``fp8`` stores
``target_hidden`` as float8_e4m3fn (safetensors ``F8_E4M3``) plus ``target_hidden_scale`` float32
[M, n] (per token and target layer: absmax / 448, :mod:`deepspec.data.cache.fp8`), and
``target_last_hidden`` in bfloat16; the reader dequantises ``target_hidden`` to float32. One
metadata entry ``"deepspec"`` (a JSON string) holds the shard's index, its input range, counts,
refused samples and sample ids.

This module holds what the writer, the reader and the verifier share: the names and patterns of
the files, the storage dtypes, the tensors of a shard and their byte layout, the stored form of
one sample's features (:func:`storage_features`, also online mode's), the manifest's shard-entry
keys, reading the manifest, and :class:`CacheSummary` (a cache run's counts, from its manifest).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepspec.data.cache.fp8 import quantize_fp8

FORMAT_VERSION = "deepspec-target-cache/3"
LOGIT_STAT_FIELDS = ("target_logsumexp", "target_argmax")
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
    specs.update({"target_logsumexp": torch.float32, "target_argmax": torch.int32})
    return dict(sorted(specs.items(), key=lambda kv: -kv[1].itemsize))  # stable: ties keep this order


def cache_bytes_per_token(
    hidden_size: int, num_target_layers: int, storage_dtype: str = "bfloat16", *, layout: str = "deepspec"
) -> int:
    """Bytes one token costs in the cache (per-sample offsets, 8 bytes a sample, and headers excluded).

    ``layout="deepspec"`` (this format): 4 (int32 id) + 1 (uint8 loss mask) + features + final
    hidden state + 8 (float32 logsumexp, int32 argmax), i.e. ``13 + itemsize * H * (n + 1)`` for
    float32/bfloat16/float16 and ``13 + n*H (fp8) + 4*n (float32 scales) + 2*H (bfloat16 final
    hidden)`` for ``fp8``. ``layout="original"``: ids, the loss mask, the original DeepSpec's
    per-token uint8 attention_mask and the features, without the logit statistics:
    ``6 + 2*H*(n+1)`` in bfloat16 = 30,726 bytes for Qwen3-4B (H = 2560) with 5 layers
    (docs/design/cache.md, "Cache size and fp8 storage").

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
    return size + (1 if layout == "original" else 4 + 4)


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


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
    format: str = FORMAT_VERSION  # the manifest's "format"

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
        format=m["format"],
    )


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
                 "target_hidden_scale": [n], "target_logsumexp": [], "target_argmax": []}
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


_ENTRY_KEYS = ("index", "first_input", "num_inputs", "num_samples", "num_tokens", "num_loss_tokens",
               "num_heldout", "num_truncated", "refused", "turns", "text_retokenized")


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
        elif fmt == "deepspec-target-cache/2":
            old = f" (format 2: shards without {' / '.join(LOGIT_STAT_FIELDS)})"
        raise ValueError(
            f"{manifest_path}: \"format\": {fmt!r}{old} is not readable; this DeepSpec reads {FORMAT_VERSION!r}. "
            f"Rebuild the cache with this version: `deepspec cache --input <prepared.jsonl> --output-dir <new folder>`"
        )
    return manifest
