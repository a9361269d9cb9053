"""The target cache: token ids, loss masks and target features on disk (DESIGN.md section 4).

Shape legend: N samples in a shard, M tokens in a shard (all samples concatenated), T tokens of
one sample, B batch, S padded batch length, H target hidden size, n number of target layers,
F = n * H target feature size.

Layout of a cache folder::

    manifest.json            written last, atomically; its presence means "complete"
    progress.json            written atomically after each shard (resume bookkeeping)
    shard-00000.safetensors  samples [0, shard_size), then [shard_size, 2*shard_size), ...

Each shard is a standard safetensors file (inspect it with ``safetensors.safe_open``) holding

    offsets             int64  [N+1]  sample j is tokens offsets[j]:offsets[j+1]
    input_ids           int32  [M]
    target_hidden       dtype  [M, F] features of target_layer_ids (deepspec.target.capture)
    target_last_hidden  dtype  [M, H] final-norm output: target logits = lm_head(target_last_hidden)
    loss_mask           uint8  [M]

and one metadata entry ``"deepspec"`` (a JSON string: shard index, first sample, sample ids,
run key). ``dtype`` is the storage dtype (float32 | bfloat16 | float16).

Writing: shards are written by this module directly in the safetensors layout (header, then each
tensor's bytes at a precomputed offset), one batch at a time, so the writer never holds more
than one batch of features in memory, and the bytes depend only on the samples, the target and
the settings (no timestamps, fixed header key order): a resumed run gives byte-identical shards.
Each shard is written under a temporary name and renamed when complete
(:func:`deepspec.utils.atomic_path`), so a file under a final shard name is always whole.
Samples are assigned to shards by index (shard k = kept samples [k*shard_size, (k+1)*shard_size),
batches never cross a shard boundary), so a rerun on the same folder keeps every complete shard
(listed in ``progress.json``, or found under its final name with the right run key) and
continues with the next one: nothing lost, nothing duplicated.

Reading: :class:`TargetCache` opens shards with ``safe_open(..., framework="pt")`` (memory
mapped) and reads one sample with ``get_slice``, so a sample read never loads a whole shard.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepspec.target.capture import _base_model, target_forward, validate_target_layer_ids
from deepspec.utils import atomic_path, atomic_write_json

FORMAT_VERSION = "deepspec-target-cache/1"
MANIFEST_NAME = "manifest.json"
PROGRESS_NAME = "progress.json"
INCOMPLETE_HINT = "cache incomplete: run `deepspec cache` again to finish it"

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec)
_ST_CODE = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _storage_dtype(name: str) -> torch.dtype:
    if name not in STORAGE_DTYPES:
        raise ValueError(
            f"storage_dtype: expected one of {sorted(STORAGE_DTYPES)}, received {name!r}"
        )
    return STORAGE_DTYPES[name]


def cache_bytes_per_token(hidden_size: int, num_target_layers: int, storage_dtype: str = "bfloat16") -> int:
    """Uncompressed bytes one token costs in the cache: 4 (int32 id) + 1 (uint8 mask) +
    itemsize * H * (n + 1) (n features + the final hidden state). Per-sample offsets (8 bytes a
    sample) and headers are not counted. Qwen3-4B (H = 2560, n = 5, bf16): 30,725 bytes."""
    itemsize = torch.empty((), dtype=_storage_dtype(storage_dtype)).element_size()
    return 4 + 1 + itemsize * hidden_size * (num_target_layers + 1)


def estimate_cache_bytes(
    num_tokens: int, hidden_size: int, num_target_layers: int, storage_dtype: str = "bfloat16"
) -> int:
    """Size estimate of a cache of ``num_tokens`` tokens (see :func:`cache_bytes_per_token`)."""
    return num_tokens * cache_bytes_per_token(hidden_size, num_target_layers, storage_dtype)


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


@dataclass(kw_only=True)
class CacheSummary:
    """What a cache run did. Counts cover the whole input (also samples in reused shards)."""

    out_dir: str
    num_samples: int  # samples in the cache
    num_tokens: int
    num_loss_tokens: int
    num_refused_empty_mask: int  # input samples not cached: loss mask all zero (or no tokens)
    num_truncated: int  # samples cut to max_seq_len by this writer
    num_shards: int
    num_shards_reused: int  # complete shards found from an earlier, interrupted run
    total_bytes: int  # shard files on disk
    bytes_per_token: float
    storage_dtype: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# shard writing (streamed, deterministic safetensors layout)


@dataclass
class _ShardLayout:
    header: bytes  # 8-byte length + JSON header, padded
    starts: dict[str, int]  # absolute file offset of each tensor's data
    total_bytes: int


def _shard_layout(
    num_samples: int, num_tokens: int, feat_dim: int, hidden_size: int, dtype: torch.dtype, metadata: str
) -> _ShardLayout:
    """Header + byte offsets of a shard. Tensor order is by decreasing item size so every tensor
    starts aligned to its item size (the data block starts 8-aligned)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    specs = [
        ("offsets", torch.int64, [num_samples + 1], 8 * (num_samples + 1)),
        ("input_ids", torch.int32, [num_tokens], 4 * num_tokens),
        ("target_hidden", dtype, [num_tokens, feat_dim], itemsize * num_tokens * feat_dim),
        ("target_last_hidden", dtype, [num_tokens, hidden_size], itemsize * num_tokens * hidden_size),
        ("loss_mask", torch.uint8, [num_tokens], num_tokens),
    ]
    header: dict[str, Any] = {"__metadata__": {"deepspec": metadata}}
    rel: dict[str, int] = {}
    pos = 0
    for name, dt, shape, nbytes in specs:
        header[name] = {"dtype": _ST_CODE[dt], "shape": shape, "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        pos += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return _ShardLayout(head, {k: len(head) + v for k, v in rel.items()}, len(head) + pos)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _write_shard(
    path: Path,
    samples: list[tuple[str, list[int], list[int]]],
    model: nn.Module,
    *,
    layer_ids: list[int],
    batch_size: int,
    dtype: torch.dtype,
    feat_dim: int,
    hidden_size: int,
    metadata: str,
    on_batch: Any = None,
) -> None:
    """Run the target over ``samples`` (in order, right-padded batches) and write one shard."""
    lengths = [len(ids) for _, ids, _ in samples]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    M = offsets[-1]
    layout = _shard_layout(len(samples), M, feat_dim, hidden_size, dtype, metadata)
    itemsize = torch.empty((), dtype=dtype).element_size()
    device = next(model.parameters()).device
    with open(path, "wb") as f:
        f.write(layout.header)
        f.truncate(layout.total_bytes)
        f.seek(layout.starts["offsets"])
        f.write(_tensor_bytes(torch.tensor(offsets, dtype=torch.int64)))
        all_ids = [t for _, ids, _ in samples for t in ids]
        f.seek(layout.starts["input_ids"])
        f.write(_tensor_bytes(torch.tensor(all_ids, dtype=torch.int32)))
        f.seek(layout.starts["loss_mask"])
        f.write(_tensor_bytes(torch.tensor([m for _, _, mask in samples for m in mask], dtype=torch.uint8)))
        for b0 in range(0, len(samples), batch_size):
            batch = samples[b0 : b0 + batch_size]
            S = max(lengths[b0 : b0 + batch_size])
            input_ids_BS = torch.zeros(len(batch), S, dtype=torch.long)
            attention_mask_BS = torch.zeros(len(batch), S, dtype=torch.long)
            for b, (_, ids, _) in enumerate(batch):
                input_ids_BS[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention_mask_BS[b, : len(ids)] = 1
            out = target_forward(
                model,
                input_ids_BS.to(device),
                layer_ids,
                attention_mask_BT=attention_mask_BS.to(device),
            )
            hidden_BSF = out.target_hidden_BTF.to(dtype).cpu()
            last_BSH = out.target_last_hidden_BTH.to(dtype).cpu()
            for b in range(len(batch)):
                j = b0 + b
                T = lengths[j]
                f.seek(layout.starts["target_hidden"] + itemsize * feat_dim * offsets[j])
                f.write(_tensor_bytes(hidden_BSF[b, :T]))
                f.seek(layout.starts["target_last_hidden"] + itemsize * hidden_size * offsets[j])
                f.write(_tensor_bytes(last_BSH[b, :T]))
            if on_batch is not None:
                on_batch(len(batch))
        f.flush()
        os.fsync(f.fileno())


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
# writer entry points


def _clean_stale_temp_files(out_dir: Path) -> None:
    """Remove temporary files a killed run left behind (atomic_path names them ``.<final>.*.tmp``)."""
    for p in out_dir.glob(".*.tmp"):
        if p.name.startswith((".shard-", f".{MANIFEST_NAME}.", f".{PROGRESS_NAME}.")) and p.is_file():
            p.unlink()


def _iter_kept(
    samples: Iterable[tuple[Any, Sequence[int], Sequence[int]]], max_seq_len: int | None, counts: dict[str, int]
) -> Iterator[tuple[str, list[int], list[int]]]:
    for sample_id, ids, mask in samples:
        ids, mask = [int(t) for t in ids], [int(m) for m in mask]
        if len(ids) != len(mask):
            raise ValueError(
                f"sample {sample_id!r}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}; "
                f"they must have equal length (re-run `deepspec prepare`)"
            )
        if any(m not in (0, 1) for m in mask):
            raise ValueError(f"sample {sample_id!r}: loss_mask must hold only 0/1 values")
        if max_seq_len is not None and len(ids) > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            counts["num_truncated"] += 1
        if not any(mask):
            counts["num_refused_empty_mask"] += 1
            continue
        yield str(sample_id), ids, mask


def write_target_cache_from_samples(
    samples: Iterable[tuple[Any, Sequence[int], Sequence[int]]],
    out_dir: str | os.PathLike[str],
    model: nn.Module,
    *,
    target_layer_ids: Sequence[int],
    target_fingerprint: str,
    tokenizer_fingerprint: str,
    max_seq_len: int | None = None,
    batch_size: int = 8,
    shard_size: int = 256,
    storage_dtype: str = "bfloat16",
    chat_template: str | None = None,
    source_fingerprint: str | None = None,
    num_samples_hint: int | None = None,
    progress: bool = True,
) -> CacheSummary:
    """Write a target cache from already tokenised samples ``(id, input_ids, loss_mask)``.

    Samples are kept in input order; those whose loss mask is all zero (after truncation to
    ``max_seq_len``) are refused and counted. ``chat_template`` is a name or hash recorded in
    the manifest; ``source_fingerprint`` identifies the input (a resume over different input
    is refused). Rerunning on the same ``out_dir`` with the same settings resumes (or returns
    at once if the manifest exists); different settings raise ValueError.

    Raises ValueError for bad settings or samples, naming the field and how to fix it.
    """
    out = Path(out_dir)
    num_hidden_layers = len(_base_model(model).layers)
    layer_ids = validate_target_layer_ids(list(target_layer_ids), num_hidden_layers)
    dtype = _storage_dtype(storage_dtype)
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, received {batch_size}")
    if shard_size < 1:
        raise ValueError(f"shard_size: expected >= 1, received {shard_size}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len: expected >= 1 or None, received {max_seq_len}")
    hidden_size = int(model.config.hidden_size)
    feat_dim = hidden_size * len(layer_ids)

    settings = {
        "format": FORMAT_VERSION,
        "target_fingerprint": target_fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "target_layer_ids": layer_ids,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "storage_dtype": storage_dtype,
        "chat_template": chat_template,
        "max_seq_len": max_seq_len,
        "batch_size": batch_size,  # batch shapes affect low-order bits; fixed for byte-identical resume
        "shard_size": shard_size,
        "source_fingerprint": source_fingerprint,
    }
    run_key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]

    out.mkdir(parents=True, exist_ok=True)
    _clean_stale_temp_files(out)
    for name in (MANIFEST_NAME, PROGRESS_NAME):
        path = out / name
        if path.exists():
            old = json.loads(path.read_text(encoding="utf-8"))
            if old.get("run_key") != run_key:
                diff = {k: (old.get("settings", {}).get(k), v) for k, v in settings.items()
                        if old.get("settings", {}).get(k) != v}
                raise ValueError(
                    f"{path}: this folder holds a target cache built with other settings "
                    f"(field: (existing, requested) = {diff}); use another output folder or delete this one"
                )
    manifest_path = out / MANIFEST_NAME
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text(encoding="utf-8"))
        return _summary_from_manifest(out, m, num_shards_reused=len(m["shards"]))

    progress_path = out / PROGRESS_NAME
    done: dict[int, dict[str, Any]] = {}
    if progress_path.exists():
        for s in json.loads(progress_path.read_text(encoding="utf-8"))["shards"]:
            shard_path = out / s["file"]
            if shard_path.is_file() and shard_path.stat().st_size == s.get("num_bytes"):
                done[s["index"]] = s

    counts = {"num_truncated": 0, "num_refused_empty_mask": 0}
    shards: list[dict[str, Any]] = []
    num_reused = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_samples_hint, desc="target cache", unit="sample")

    def save_progress() -> None:
        atomic_write_json(progress_path, {"format": FORMAT_VERSION, "run_key": run_key, "settings": settings,
                                          "shards": shards})

    try:
        chunk: list[tuple[str, list[int], list[int]]] = []
        kept = _iter_kept(samples, max_seq_len, counts)
        index = 0
        while True:
            chunk = [s for _, s in zip(range(shard_size), kept)]
            if not chunk:
                break
            first = index * shard_size
            final = out / shard_name(index)
            entry = done.get(index)
            if entry is None and final.exists():
                # renamed into place but killed before progress.json was updated: adopt if it is ours
                meta = _read_shard_meta(final)
                if meta is not None and meta.get("run_key") == run_key and meta.get("index") == index \
                        and meta.get("num_samples") == len(chunk):
                    entry = {"index": index, "file": final.name, "sha256": sha256_file(final)}
            if entry is not None and entry.get("num_samples", len(chunk)) == len(chunk):
                num_reused += 1
                if bar is not None:
                    bar.update(len(chunk))
            else:
                metadata = json.dumps(
                    {"format": FORMAT_VERSION, "run_key": run_key, "index": index, "first_sample": first,
                     "num_samples": len(chunk), "sample_ids": [sid for sid, _, _ in chunk]},
                    separators=(",", ":"),
                )
                with atomic_path(final) as tmp:
                    _write_shard(tmp, chunk, model, layer_ids=layer_ids, batch_size=batch_size, dtype=dtype,
                                 feat_dim=feat_dim, hidden_size=hidden_size, metadata=metadata,
                                 on_batch=bar.update if bar is not None else None)
                entry = {"index": index, "file": final.name, "sha256": sha256_file(final)}
            entry.update({
                "first_sample": first,
                "num_samples": len(chunk),
                "num_tokens": sum(len(ids) for _, ids, _ in chunk),
                "num_loss_tokens": sum(sum(mask) for _, _, mask in chunk),
                "num_bytes": final.stat().st_size,
            })
            shards.append(entry)
            save_progress()
            index += 1
    finally:
        if bar is not None:
            bar.close()

    # shards from an earlier run beyond the input's end would mean the input shrank
    for p in sorted(out.glob("shard-*.safetensors")):
        if p.name not in {s["file"] for s in shards}:
            raise ValueError(
                f"{p}: shard not produced by this input (the input has {len(shards)} shards); "
                f"the input changed since the cache was started: use another output folder or delete this one"
            )

    manifest = {
        "format": FORMAT_VERSION,
        "run_key": run_key,
        "settings": settings,
        "target_fingerprint": target_fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "target_layer_ids": layer_ids,
        "hidden_size": hidden_size,
        "feature_size": feat_dim,
        "num_hidden_layers": num_hidden_layers,
        "dtypes": {
            "input_ids": "int32",
            "loss_mask": "uint8",
            "target_hidden": storage_dtype,
            "target_last_hidden": storage_dtype,
        },
        "chat_template": chat_template,
        "max_seq_len": max_seq_len,
        "num_samples": sum(s["num_samples"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_loss_tokens": sum(s["num_loss_tokens"] for s in shards),
        "num_refused_empty_mask": counts["num_refused_empty_mask"],
        "num_truncated": counts["num_truncated"],
        "bytes_per_token_estimate": cache_bytes_per_token(hidden_size, len(layer_ids), storage_dtype),
        "shards": shards,
    }
    atomic_write_json(manifest_path, manifest)
    return _summary_from_manifest(out, manifest, num_shards_reused=num_reused)


def _summary_from_manifest(out: Path, m: dict[str, Any], *, num_shards_reused: int) -> CacheSummary:
    total = sum(s["num_bytes"] for s in m["shards"])
    return CacheSummary(
        out_dir=str(out),
        num_samples=m["num_samples"],
        num_tokens=m["num_tokens"],
        num_loss_tokens=m["num_loss_tokens"],
        num_refused_empty_mask=m["num_refused_empty_mask"],
        num_truncated=m["num_truncated"],
        num_shards=len(m["shards"]),
        num_shards_reused=num_shards_reused,
        total_bytes=total,
        bytes_per_token=total / m["num_tokens"] if m["num_tokens"] else 0.0,
        storage_dtype=m["dtypes"]["target_hidden"],
    )


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def write_target_cache(
    prepared_jsonl: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    model: nn.Module,
    tokenizer: Any,
    *,
    target_layer_ids: Sequence[int],
    max_seq_len: int | None,
    batch_size: int = 8,
    shard_size: int = 256,
    storage_dtype: str = "bfloat16",
    progress: bool = True,
    target_fingerprint: str | None = None,
    tokenizer_fingerprint: str | None = None,
) -> CacheSummary:
    """Build the target cache of a prepared JSONL file (rows ``{"id", "messages", ...}``).

    Each row is rendered with the tokenizer's chat template and its loss mask
    (:func:`deepspec.data.chat.render_with_loss_mask`), then passed to
    :func:`write_target_cache_from_samples` (which truncates to ``max_seq_len`` keeping the
    prefix, counts truncations, and refuses samples left without loss tokens). Fingerprints default to
    :func:`deepspec.target.load.target_fingerprint` / ``tokenizer_fingerprint``.
    """
    from deepspec.data.chat import render_with_loss_mask
    from deepspec.data.conversations import read_jsonl

    path = Path(prepared_jsonl)
    if not path.is_file():
        raise FileNotFoundError(f"prepared data {path} not found; run `deepspec prepare` first")
    if target_fingerprint is None or tokenizer_fingerprint is None:
        from deepspec.target import load

        target_fingerprint = target_fingerprint or load.target_fingerprint(model)
        tokenizer_fingerprint = tokenizer_fingerprint or load.tokenizer_fingerprint(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    template_id = None
    if template:
        text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
        template_id = "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()

    def samples() -> Iterator[tuple[str, list[int], list[int]]]:
        for row in read_jsonl(path):
            # rendered whole; the sample writer truncates (keeping the prefix, the same rule as
            # render_with_loss_mask(max_seq_len=...)) so that truncations are counted
            ids, mask = render_with_loss_mask(
                tokenizer, row["messages"], cut_turns=set(row.get("truncated_turns", ()))
            )
            yield str(row["id"]), ids, mask

    return write_target_cache_from_samples(
        samples(),
        out_dir,
        model,
        target_layer_ids=target_layer_ids,
        target_fingerprint=target_fingerprint,
        tokenizer_fingerprint=tokenizer_fingerprint,
        max_seq_len=max_seq_len,
        batch_size=batch_size,
        shard_size=shard_size,
        storage_dtype=storage_dtype,
        chat_template=template_id,
        source_fingerprint="sha256:" + sha256_file(path),
        num_samples_hint=_count_lines(path),
        progress=progress,
    )


# ----------------------------------------------------------------------------------------------
# reader


_TORCH_DTYPE = {"int32": torch.int32, "uint8": torch.uint8, **STORAGE_DTYPES}


class TargetCache:
    """Read-only view of a complete target cache folder.

    ``cache[i]`` -> ``{"input_ids": int32 [T], "loss_mask": uint8 [T], "target_hidden": [T, F],
    "target_last_hidden": [T, H]}`` in the stored dtypes. Shards are opened lazily with
    ``safe_open`` (memory mapped) and a sample is read with ``get_slice``: only its rows are
    copied. At most ``max_open_shards`` shards are open at once (least recently used closed).
    Safe to pickle into DataLoader workers (open handles are not pickled).

    Raises FileNotFoundError if the folder does not exist, RuntimeError if the manifest is
    missing (an unfinished run), ValueError for an unknown format version.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_open_shards: int = 64):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"target cache {self.path} not found; build it with `deepspec cache`")
        manifest_path = self.path / MANIFEST_NAME
        if not manifest_path.is_file():
            raise RuntimeError(f"{self.path}: no {MANIFEST_NAME}: {INCOMPLETE_HINT}")
        self.manifest: dict[str, Any] = json.loads(manifest_path.read_text(encoding="utf-8"))
        fmt = self.manifest.get("format")
        if fmt != FORMAT_VERSION:
            raise ValueError(
                f"{manifest_path}: format {fmt!r} unknown; this DeepSpec reads {FORMAT_VERSION!r}. "
                f"Rebuild the cache with this version (`deepspec cache`) or use the DeepSpec that wrote it"
            )
        self._shards = self.manifest["shards"]
        self._starts = [0]
        for s in self._shards:
            self._starts.append(self._starts[-1] + s["num_samples"])
        for s in self._shards:
            if not (self.path / s["file"]).is_file():
                raise RuntimeError(f"{self.path}: shard {s['file']} listed in the manifest is missing")
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
                    f"says {n}; the cache folder was modified: rebuild it with `deepspec cache`"
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
        k, j = self._locate(i)
        self._open(k)
        return self._offsets[k][j + 1] - self._offsets[k][j]

    def sample_id(self, i: int) -> str:
        k, j = self._locate(i)
        if k not in self._sample_ids:
            self._sample_ids[k] = json.loads(self._open(k).metadata()["deepspec"])["sample_ids"]
        return self._sample_ids[k][j]

    FIELDS = ("input_ids", "loss_mask", "target_hidden", "target_last_hidden")

    def read(self, i: int, fields: Sequence[str] = FIELDS) -> dict[str, torch.Tensor]:
        """Only the named fields of sample ``i`` (e.g. ``("input_ids",)`` to scan tokens cheaply)."""
        unknown = [f for f in fields if f not in self.FIELDS]
        if unknown:
            raise ValueError(f"fields: unknown {unknown}; expected a subset of {list(self.FIELDS)}")
        k, j = self._locate(int(i))
        h = self._open(k)
        a, b = self._offsets[k][j], self._offsets[k][j + 1]
        return {name: h.get_slice(name)[a:b] for name in fields}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.read(i)


def check_compatible(
    manifest_or_cache: TargetCache | dict[str, Any],
    *,
    target_fingerprint: str,
    tokenizer_fingerprint: str,
    target_layer_ids: Sequence[int],
) -> None:
    """Refuse a cache built for another target, tokenizer or layer set.

    Raises ValueError naming the mismatching field, both values, and how to fix it.
    """
    m = manifest_or_cache.manifest if isinstance(manifest_or_cache, TargetCache) else manifest_or_cache
    where = f"target cache {manifest_or_cache.path}" if isinstance(manifest_or_cache, TargetCache) else "target cache"
    checks = [
        ("target_fingerprint", m.get("target_fingerprint"), target_fingerprint,
         "rebuild the cache with this target (`deepspec cache`) or train against the target it was built with"),
        ("tokenizer_fingerprint", m.get("tokenizer_fingerprint"), tokenizer_fingerprint,
         "rebuild the cache with this target's tokenizer (`deepspec cache`)"),
        ("target_layer_ids", list(m.get("target_layer_ids", [])), list(target_layer_ids),
         "rebuild the cache with these target_layer_ids, or set the draft's target_layer_ids to the cache's"),
    ]
    for field, have, want, fix in checks:
        if have != want:
            raise ValueError(f"{where}: {field} mismatch: cache has {have!r}, expected {want!r}; {fix}")
