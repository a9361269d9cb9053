"""Reading a target cache (format: :mod:`deepspec.data.cache.format`).

Shape legend: T tokens of one sample, H target hidden size, n number of target layers,
F = n * H target feature size.

:class:`TargetCache` opens shards with ``safe_open(..., framework="pt")`` (memory mapped) and
reads one sample with ``get_slice``, so a sample read never loads a whole shard.
:func:`check_compatible` refuses a cache built for another target, tokenizer or layer set.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from deepspec.data.cache.format import LOGIT_STAT_FIELDS, _load_manifest
from deepspec.data.cache.fp8 import dequantize_fp8


class TargetCache:
    """Read-only view of a complete target cache folder.

    ``cache[i]`` -> ``{"input_ids": int32 [T], "loss_mask": uint8 [T], "target_hidden": [T, F],
    "target_last_hidden": [T, H], "target_logsumexp": float32 [T], "target_argmax": int32 [T]}`` in
    the stored dtypes, except storage ``fp8`` where ``target_hidden`` is dequantised to float32
    (``target_last_hidden`` stays bfloat16; ``read(i, dequantize=False)`` keeps the fp8 payload and
    its scales). ``fields`` lists what the cache holds. Shards are
    opened lazily with ``safe_open`` (memory mapped) and a sample is read with ``get_slice``: only
    its rows are copied. At most ``max_open_shards`` shards are open at once (least recently used
    closed). Safe to pickle into DataLoader workers (open handles are not pickled).

    Raises FileNotFoundError if the folder does not exist or holds no cache (no manifest, no shards),
    RuntimeError if the manifest is missing beside shards (an unfinished run), ValueError for another
    format version (rebuild it with ``deepspec cache``).
    """

    FIELDS = ("input_ids", "loss_mask", "target_hidden", "target_last_hidden", *LOGIT_STAT_FIELDS)

    def __init__(self, path: str | os.PathLike[str], *, max_open_shards: int = 64):
        self.path = Path(path)
        self.manifest = _load_manifest(self.path)
        self.fields = self.FIELDS
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
        from safetensors import safe_open  # looked up per open, so a test's spy on safetensors applies

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

    def read(self, i: int, fields: Sequence[str] | None = None, *, dequantize: bool = True) -> dict[str, torch.Tensor]:
        """Only the named fields of sample ``i`` (e.g. ``("input_ids",)`` to scan tokens cheaply);
        None: every field this cache holds (:attr:`fields`).

        ``dequantize=False`` (storage ``fp8`` only; other storages are returned as stored either way):
        ``target_hidden`` is the stored float8_e4m3fn payload ``[T, F]`` and the dict gains
        ``target_hidden_scale`` float32 ``[T, n]``, for the trainer to dequantise on its device
        (:func:`deepspec.train.data.batch_to_device`); nothing is converted on the host.

        Raises:
            ValueError: a field this cache does not hold.
            IndexError: ``i`` out of range.
        """
        fields = self.fields if fields is None else fields
        unknown = [f for f in fields if f not in self.fields]
        if unknown:
            raise ValueError(f"fields: unknown {unknown}; expected a subset of {list(self.fields)}")
        k, j = self._locate(int(i))
        h = self._open(k)
        a, b = self._offsets[k][j], self._offsets[k][j + 1]
        out = {}
        for name in fields:
            t = h.get_slice(name)[a:b]
            if name == "target_hidden" and t.dtype == torch.float8_e4m3fn:
                scale_Tn = h.get_slice("target_hidden_scale")[a:b]
                if dequantize:
                    t = dequantize_fp8(t, scale_Tn)
                else:
                    out["target_hidden_scale"] = scale_Tn
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
         "rebuild the cache with this target's tokenizer (`deepspec cache`), or use the tokenizer it was built with"
         + built_with + (" (a target with a chat template given by --chat-template: pass the same --chat-template, "
                         "or drop --target to use the folder the cache records)"
                         if "-template-" in str(m.get("target") or "") else "")),
        ("target_layer_ids", list(m.get("target_layer_ids", [])), list(target_layer_ids),
         "rebuild the cache with these target_layer_ids, or set the draft's target_layer_ids to the cache's"),
    ]
    for field_name, have, want, fix in checks:
        if have != want:
            raise ValueError(f"{where}: {field_name} mismatch: cache has {have!r}, expected {want!r}; {fix}")
