"""``deepspec cache --verify``: every shard of a target cache checked against its manifest.

Shape legend (as in :mod:`deepspec.data.cache.format`): N samples in a shard, M tokens in a shard,
H target hidden size, n number of target layers.

Each shard's size and sha256, its safetensors header (tensors, dtypes, shapes, contiguous
offsets), its metadata, sample offsets, loss mask and (optionally) the finiteness of every
feature value are checked, reading feature tensors a chunk of tokens at a time; then the
manifest's totals against its shards.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepspec.data.cache.format import (
    _ENTRY_KEYS,
    _ST_CODE,
    MANIFEST_NAME,
    _load_manifest,
    sha256_file,
    shard_name,
    shard_tensor_dtypes,
)


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
                  "target_last_hidden": [M, H], "target_hidden_scale": [M, n], "target_logsumexp": [M],
                  "target_argmax": [M]}
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
            if check_finite and "target_logsumexp" in want:
                # finite (and an argmax >= 0) exactly where a loss reads: loss_mask[p + 1] within p's sample
                read = torch.zeros(M, dtype=torch.bool)
                read[:-1] = mask[1:].bool()
                read[offsets[1:] - 1] = False
                lse, arg = f.get_tensor("target_logsumexp"), f.get_tensor("target_argmax")
                if not (torch.equal(torch.isfinite(lse), read) and torch.equal(arg >= 0, read)):
                    problems.append("target_logsumexp / target_argmax: not finite (>= 0) exactly at the positions p "
                                    "with loss_mask[p + 1] in their sample")
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
