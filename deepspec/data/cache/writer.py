"""Writing a target cache (format: :mod:`deepspec.data.cache.format`; docs/design/cache.md, "Cache writer").

Shape legend: U input items (prepared rows, or tokenised samples), S ``shard_size`` (input items
per shard), T tokens of one sample.

Every sample is captured alone (:func:`deepspec.target.capture.capture_sample_features`:
batch 1, no padding), so its features do not depend on batching, rank count or resume points
(online mode uses the same function). A shard is laid out first (header and byte offsets) and
filled sample by sample under a temporary name, then renamed (:func:`deepspec.utils.atomic_path`):
a file under a final shard name is always whole. Shard k holds the kept samples of input items
[k*S, (k+1)*S): its contents depend only on those items, the target and the settings (no
timestamps, fixed key order), so reruns, resumed runs and multi-rank runs give byte-identical
shards. Refused samples (no loss token after truncation; non-finite features) are never written
and are counted. Under ``torchrun``, rank r writes the shards k with ``k % world_size == r`` and
rank 0 writes the manifest after a barrier.

A rerun with the same settings resumes: each rank's ``progress-rank<r>.json`` and final-named
shards found on disk tell which shards are complete (checked by size and header, not rehashed).
Prepared rows become samples by :mod:`deepspec.data.cache.samples`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepspec.data.cache.format import (
    _DTYPE_NAME,
    _ENTRY_KEYS,
    _SHARD_RE,
    _TMP_SHARD_RE,
    FORMAT_VERSION,
    INCOMPLETE_HINT,
    MANIFEST_NAME,
    PROGRESS_GLOB,
    CacheSummary,
    _check_storage_dtype,
    _Features,
    _shard_layout,
    _summary_from_manifest,
    cache_bytes_per_token,
    progress_name,
    sha256_file,
    shard_name,
    shard_tensor_dtypes,
    storage_features,
)
from deepspec.data.cache.samples import (
    _count_lines,
    _Sample,
    chat_template_id,
    check_prepared_render,
    keep_sample,
    render_prepared_row,
)
from deepspec.data.chat import COUNT_KEYS as TURN_COUNT_KEYS
from deepspec.data.chat import target_stop_token_ids
from deepspec.data.conversations import read_jsonl
from deepspec.device import dtype_name
from deepspec.target import load
from deepspec.target.capture import (
    _base_model,
    capture_sample_features,
    target_logit_stats,
    validate_target_layer_ids,
)
from deepspec.utils import atomic_path, atomic_write_json


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


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
        stored = storage_features(hidden_TF, last_TH, storage_dtype, n)
        if stored is not None:  # from the stored (rounded) final hidden state, as a loss reads it
            stored["target_logsumexp"], stored["target_argmax"] = target_logit_stats(
                model, stored["target_last_hidden"], samples[j][2])
        return stored

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


def _run_key(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _check_settings(out: Path, run_key: str, settings: dict[str, Any]) -> None:
    for path in [out / MANIFEST_NAME, *sorted(out.glob(PROGRESS_GLOB))]:
        if not path.exists():
            continue
        old = json.loads(path.read_text(encoding="utf-8"))
        if old.get("run_key") != run_key:
            old_settings = old.get("settings", {})
            if old.get("format") != FORMAT_VERSION:
                raise ValueError(
                    f"{path}: this folder holds a target cache of \"format\": {old.get('format')!r}, and this "
                    f"DeepSpec reads and writes {FORMAT_VERSION!r}: run `deepspec cache` again into a new "
                    "--output-dir (or delete this folder)")
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


@dataclass
class _Build:
    """One cache build's fixed inputs (checked by :func:`_start_build`): the output folder, the target,
    the settings the bytes depend on (``settings``, hashed to ``run_key``) and what the manifest records."""

    out: Path
    model: nn.Module
    layer_ids: list[int]
    hidden_size: int
    num_hidden_layers: int
    storage_dtype: str
    capture_dtype: str
    max_seq_len: int | None
    shard_size: int
    settings: dict[str, Any]
    run_key: str
    rank: int
    world_size: int
    target_fingerprint: str
    tokenizer_fingerprint: str
    chat_template: str | None
    render: Mapping[str, Any] | None
    target: str | None


def _start_build(out: Path, model: nn.Module, *, target_layer_ids: Sequence[int], target_fingerprint: str,
                 tokenizer_fingerprint: str, max_seq_len: int | None, shard_size: int, storage_dtype: str,
                 chat_template: str | None, source_fingerprint: str | None, rank: int, world_size: int,
                 render: Mapping[str, Any] | None = None, target: str | None = None) -> _Build:
    """The :class:`_Build` of these arguments. Raises ValueError for a bad setting (names the field)."""
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
    capture_dtype = dtype_name(next(model.parameters()).dtype)

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
        # the features depend on the dtype the target ran in; float32 caches keep the key they always had
        **({"capture_dtype": capture_dtype} if capture_dtype != "float32" else {}),
    }
    return _Build(out, model, layer_ids, hidden_size, num_hidden_layers, storage_dtype, capture_dtype, max_seq_len,
                  shard_size, settings, _run_key(settings), rank, world_size, target_fingerprint,
                  tokenizer_fingerprint, chat_template, render, target)


def _write_cache_in(
    units: Iterable[_Unit],
    out_dir: str | os.PathLike[str],
    model: nn.Module,
    *,
    num_inputs_hint: int | None,
    progress: bool,
    **settings: Any,
) -> CacheSummary:
    """Build the cache (module docstring): check the settings (:func:`_start_build`), return at once
    when the folder holds the complete cache, else write this rank's missing shards
    (:func:`_write_own_shards`) and, on rank 0, the manifest (:func:`_write_manifest`)."""
    b = _start_build(Path(out_dir), model, **settings)
    out, world_size = b.out, b.world_size
    out.mkdir(parents=True, exist_ok=True)
    _clean_stale_temp_files(out, rank=b.rank, world_size=world_size)
    _check_settings(out, b.run_key, b.settings)
    manifest_path = out / MANIFEST_NAME
    done = _collect_done(out, b.run_key)
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text(encoding="utf-8"))
        if all(s["index"] in done for s in m["shards"]):
            _barrier(world_size)  # every rank takes this branch (same files), so the barrier pairs up
            return _summary_from_manifest(out, m, num_shards_reused=len(m["shards"]), already_complete=True)

    num_inputs, num_reused = _write_own_shards(b, units, done, num_inputs_hint=num_inputs_hint, progress=progress)
    _barrier(world_size)
    if b.rank == 0:
        _write_manifest(b, num_inputs)
    _barrier(world_size)  # the other ranks return once the manifest exists
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    return _summary_from_manifest(out, manifest, num_shards_reused=num_reused)


def _progress_bar(b: _Build, num_inputs_hint: int | None, progress: bool):
    """The rows bar of this rank (its total: the rows of its shards, when the input size is known); None
    without ``progress``."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    own_rows = None  # rows in this rank's shards
    if num_inputs_hint is not None:
        own_rows = sum(min(b.shard_size, num_inputs_hint - k * b.shard_size)
                       for k in range(b.rank, -(-num_inputs_hint // b.shard_size), b.world_size))
    return tqdm(total=own_rows, desc=f"target cache (rank {b.rank})" if b.world_size > 1 else "target cache",
                unit="row", disable=None)


def _write_own_shards(b: _Build, units: Iterable[_Unit], done: dict[int, dict[str, Any]], *,
                      num_inputs_hint: int | None, progress: bool) -> tuple[int, int]:
    """Render and write the shards of this rank (``k % world_size == rank``) that ``done`` lacks, recording
    each in ``progress-rank<r>.json`` once written; returns the number of input items and the number of
    this rank's shards reused."""
    progress_path = b.out / progress_name(b.rank)
    own: dict[int, dict[str, Any]] = {}  # this rank's progress entries (kept across runs)
    if progress_path.exists():
        for e in json.loads(progress_path.read_text(encoding="utf-8")).get("shards", []):
            if done.get(e["index"]) == e:
                own[e["index"]] = e
    bar = _progress_bar(b, num_inputs_hint, progress)
    num_reused = 0

    def flush(k: int, items: list[_Item], first: int) -> None:
        samples, meta = _shard_contents(b, k, items, first)
        captured = 0

        def on_sample(count: int) -> None:  # progress inside a shard; the bar counts rows once it is written
            nonlocal captured
            captured += count
            bar.set_postfix_str(f"{shard_name(k)}: {captured}/{len(samples)} samples")

        own[k] = _write_shard(b.out / shard_name(k), samples, meta, b.model, layer_ids=b.layer_ids,
                              storage_dtype=b.storage_dtype, hidden_size=b.hidden_size,
                              on_sample=on_sample if bar is not None else None)
        atomic_write_json(progress_path, {"format": FORMAT_VERSION, "run_key": b.run_key, "rank": b.rank,
                                          "settings": b.settings, "shards": [own[k] for k in sorted(own)]})
        if bar is not None:
            bar.update(len(items))

    num_inputs = 0
    shard_size, rank, world_size = b.shard_size, b.rank, b.world_size
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
    return num_inputs, num_reused


def _shard_contents(b: _Build, k: int, items: list[_Item], first: int) -> tuple[list[_Sample], dict[str, Any]]:
    """The samples shard ``k`` keeps of its input ``items`` (the first is input ``first``; truncated to
    ``max_seq_len``, those left without a loss token refused) and the shard's metadata."""
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
            kept, truncated = keep_sample(s, b.max_seq_len)
            num_truncated += int(truncated)
            if kept is None:
                refused.append({"id": str(s[0]), "reason": "empty_mask",
                                "detail": "no loss token (after truncation to max_seq_len)"})
            else:
                samples.append(kept)
    meta = _shard_metadata(run_key=b.run_key, index=k, first_input=first, num_inputs=len(items),
                           samples=samples, num_heldout=num_heldout, num_truncated=num_truncated, refused=refused,
                           turns=turns, text_retokenized=text_retokenized)
    return samples, meta


def _write_manifest(b: _Build, num_inputs: int) -> None:
    """Rank 0, after every rank wrote its shards: check that the shards of ``num_inputs`` items are all
    there and no others, and write the manifest.

    Raises:
        RuntimeError: a shard is missing (a rank failed).
        ValueError: a shard file beyond this input's shards (the input changed since the cache was started).
    """
    out = b.out
    num_shards = -(-num_inputs // b.shard_size)
    done = _collect_done(out, b.run_key)
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
    render, hidden_size, n = b.render, b.hidden_size, len(b.layer_ids)
    manifest = {
        "format": FORMAT_VERSION,
        "run_key": b.run_key,
        "settings": b.settings,
        "target": b.target,  # as named to `deepspec cache`; `deepspec train` without --target uses it
        "target_fingerprint": b.target_fingerprint,
        "tokenizer_fingerprint": b.tokenizer_fingerprint,
        "target_layer_ids": b.layer_ids,
        "hidden_size": hidden_size,
        "feature_size": hidden_size * n,
        "num_hidden_layers": b.num_hidden_layers,
        "storage_dtype": b.storage_dtype,
        "dtypes": {k: _DTYPE_NAME[v] for k, v in shard_tensor_dtypes(b.storage_dtype).items() if k != "offsets"},
        "chat_template": b.chat_template,
        "max_seq_len": b.max_seq_len,
        "shard_size": b.shard_size,
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
        "bytes_per_token_estimate": cache_bytes_per_token(hidden_size, n, b.storage_dtype),
        # where the target ran (informational, not a setting the bytes are keyed on; the device type only,
        # so the manifest does not depend on the rank count or on which GPU rank 0 had)
        "capture": {"device": next(b.model.parameters()).device.type, "dtype": b.capture_dtype},
        "shards": shards,
    }
    atomic_write_json(out / MANIFEST_NAME, manifest)


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
    path = Path(prepared_jsonl)
    if not path.is_file():
        raise FileNotFoundError(f"prepared data {path} not found; run `deepspec prepare` first")
    if target_fingerprint is None or tokenizer_fingerprint is None:
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
