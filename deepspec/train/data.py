"""Batches for draft training, read from the target cache or computed online.

Legend: B sequences per micro-batch, S padded sequence length, F = n_layers * H target features, H hidden,
n target layers.

The data order is a pure function of ``(seed, step, rank, world_size)`` (epoch permutations seeded
by ``(seed, epoch)``, concatenated, cut into global batches of ``batch_size x grad_accum_steps x
world_size`` samples), so an exact resume only needs the step counter: nothing skipped, nothing repeated.

The input path of a step: :class:`Prefetcher` reads and collates the next steps' samples in a
background thread (:func:`collate`, features in the cache's storage dtype, into pinned memory when
the batch goes to a CUDA device); the training thread moves each batch with :func:`batch_to_device`,
which converts the features to float32 (fp8: dequantises) on the device (:func:`to_device` moves what
an algorithm's ``prepare`` returns, the batch inside it included).

Opening the data: :func:`open_training_data` gives a target cache checked against the target, or in
online mode the features computed by the target (:func:`resolve_train_target` picks the target a
cache records when ``--target`` is not given).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from deepspec.algorithms.protocol import TrainBatch
from deepspec.data.cache.fp8 import dequantize_fp8
from deepspec.data.cache.reader import TargetCache, check_compatible
from deepspec.data.online import OnlineTargetFeatures
from deepspec.target.capture import default_target_layer_ids, validate_target_layer_ids
from deepspec.target.load import EMBEDDED_DEFAULT, target_fingerprint, tokenizer_fingerprint
from deepspec.train.config import TrainConfig


def epoch_order(num_samples: int, *, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch: a permutation seeded by ``(seed, epoch)``."""
    return list(_epoch_order(num_samples, seed, epoch))


@lru_cache(maxsize=4)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(num_samples, generator=generator).tolist())


def step_sample_indices(num_samples: int, global_batch: int, *, seed: int, step: int) -> list[int]:
    """The ``global_batch`` sample indices of optimizer step ``step`` (0-based): slots
    ``[step * global_batch, (step + 1) * global_batch)`` of the epoch orders concatenated.

    Every sample is seen exactly once per epoch; a step may straddle two epochs (its last slots
    then come from the next epoch's order).

    Raises:
        ValueError: no samples.
    """
    if num_samples <= 0:
        raise ValueError("the target cache holds no samples; run `deepspec cache` on non-empty prepared data")
    out: list[int] = []
    pos = step * global_batch
    while len(out) < global_batch:
        epoch, index = divmod(pos, num_samples)
        take = min(global_batch - len(out), num_samples - index)
        out.extend(_epoch_order(num_samples, seed, epoch)[index : index + take])
        pos += take
    return out


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch of one rank: its samples and the global slot of its first sample in the step."""

    slot: int  # position of indices[0] among the step's global batch (seeds the micro-batch's RNG)
    indices: list[int]


def rank_micro_batches(num_samples: int, *, batch_size: int, grad_accum_steps: int, seed: int, step: int,
                       rank: int = 0, world_size: int = 1) -> list[MicroBatchPlan]:
    """The micro-batches of ``rank`` at optimizer step ``step``: a pure function of
    ``(seed, step, rank, world_size)`` (and the sizes).

    The step's global batch is ``batch_size * grad_accum_steps * world_size`` samples
    (:func:`step_sample_indices`); rank ``r`` takes the contiguous share
    ``[r * batch_size * grad_accum_steps, (r + 1) * batch_size * grad_accum_steps)``, cut into
    ``grad_accum_steps`` micro-batches of ``batch_size``. Ranks' shares are disjoint and together
    cover the global batch, so 2 ranks x 1 micro-batch and 1 rank x 2 micro-batches see the same
    micro-batches (same samples, same slots) in the same step.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    per_rank = batch_size * grad_accum_steps
    order = step_sample_indices(num_samples, per_rank * world_size, seed=seed, step=step)
    base = rank * per_rank
    return [
        MicroBatchPlan(base + m * batch_size, order[base + m * batch_size : base + (m + 1) * batch_size])
        for m in range(grad_accum_steps)
    ]


def micro_batch_seed(seed: int, step: int, slot: int) -> int:
    """Seed of the generator a micro-batch's random choices (e.g. DSpark's anchors) are drawn with: a
    function of ``(seed, step, slot)`` only, so neither resume nor the rank/accumulation split changes them."""
    return ((seed * 1_000_003 + step) * 1_000_003 + slot) % (2**63 - 1)


def collate(samples: list[dict[str, torch.Tensor]], sample_indices: list[int], *,
            pin_memory: bool = False) -> TrainBatch:
    """Right-pad samples into a batch on the host, features in their stored dtype.

    ``samples``: dicts from :class:`deepspec.data.cache.reader.TargetCache` or
    :class:`deepspec.data.online.OnlineTargetFeatures` (``input_ids`` [T], ``loss_mask`` [T],
    ``target_hidden`` [T, F], ``target_last_hidden`` [T, H]; with ``read(..., dequantize=False)`` on
    an fp8 cache, ``target_hidden`` float8_e4m3fn plus ``target_hidden_scale`` float32 [T, n]). Ids
    and mask become int64; ``target_hidden`` / ``target_last_hidden`` / the scales keep the samples'
    dtypes (nothing is upcast here: :func:`batch_to_device` converts on the device), padded with
    zeros. Each sample's rows are copied unchanged, so a sample's tensors do not depend on its batch
    position or on its neighbours' lengths. ``target_logsumexp`` / ``target_argmax`` (the target
    cache) become float32 (NaN padded) / int64 (-1 padded) ``[B, S]`` when every sample has them,
    else None. ``pin_memory=True`` (needs CUDA) allocates every tensor in page-locked memory, so the
    host-to-device copies can run asynchronously (``non_blocking=True``).
    """
    seq_len = max(int(s["input_ids"].shape[0]) for s in samples)
    batch_size = len(samples)
    first = samples[0]
    fp8 = "target_hidden_scale" in first
    for s in samples:  # one cache, one storage dtype: a mix is a caller's bug
        assert ("target_hidden_scale" in s) == fp8 and all(
            s[k].dtype == first[k].dtype for k in ("target_hidden", "target_last_hidden")), "samples of mixed dtypes"

    def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, pin_memory=pin_memory)

    input_ids_BS = zeros(batch_size, seq_len, dtype=torch.long)
    loss_mask_BS = zeros(batch_size, seq_len, dtype=torch.long)
    target_hidden_BSF = zeros(batch_size, seq_len, first["target_hidden"].shape[-1], dtype=first["target_hidden"].dtype)
    target_last_hidden_BSH = zeros(batch_size, seq_len, first["target_last_hidden"].shape[-1],
                                   dtype=first["target_last_hidden"].dtype)
    scale_BSn = zeros(batch_size, seq_len, first["target_hidden_scale"].shape[-1], dtype=torch.float32) if fp8 else None
    stats = all("target_logsumexp" in s and "target_argmax" in s for s in samples)
    lse_BS = torch.full((batch_size, seq_len), float("nan"), pin_memory=pin_memory) if stats else None
    argmax_BS = torch.full((batch_size, seq_len), -1, dtype=torch.long, pin_memory=pin_memory) if stats else None
    for b, sample in enumerate(samples):
        length = int(sample["input_ids"].shape[0])
        input_ids_BS[b, :length] = sample["input_ids"].long()
        loss_mask_BS[b, :length] = sample["loss_mask"].long()
        target_hidden_BSF[b, :length] = sample["target_hidden"]
        target_last_hidden_BSH[b, :length] = sample["target_last_hidden"]
        if fp8:
            scale_BSn[b, :length] = sample["target_hidden_scale"]
        if stats:
            lse_BS[b, :length] = sample["target_logsumexp"].float()
            argmax_BS[b, :length] = sample["target_argmax"].long()
    return TrainBatch(input_ids_BS, loss_mask_BS, target_hidden_BSF, target_last_hidden_BSH, sample_indices,
                      lse_BS, argmax_BS, scale_BSn)


def batch_to_device(batch: TrainBatch, device: torch.device | str) -> TrainBatch:
    """``batch`` (as :func:`collate` made it) on ``device`` with float32 features.

    Every tensor moves in its stored dtype with ``non_blocking=True`` (asynchronous when the host
    tensor is pinned and ``device`` is CUDA; a plain copy otherwise). Then, on the device:
    ``target_hidden_BSF`` fp8 is dequantised (:func:`deepspec.data.cache.fp8.dequantize_fp8`, its
    ``target_hidden_scale_BSn`` then dropped to None), bfloat16/float16 features are upcast. The
    float32 upcast stays because the drafts' input projection and the losses' target-logit product
    read float32 features (under bf16 autocast their matmuls cast down themselves); done on the device
    it costs no host time and no transfer bytes. The values equal the host conversion exactly (the
    same elementwise casts and products).
    """
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    hidden_BSF, scale_BSn = move(batch.target_hidden_BSF), move(batch.target_hidden_scale_BSn)
    if scale_BSn is not None:
        hidden_BSF = dequantize_fp8(hidden_BSF, scale_BSn)
    assert hidden_BSF.dtype != torch.float8_e4m3fn, "fp8 target_hidden_BSF without target_hidden_scale_BSn"
    return dataclasses.replace(
        batch,
        input_ids_BS=move(batch.input_ids_BS),
        loss_mask_BS=move(batch.loss_mask_BS),
        target_hidden_BSF=hidden_BSF.float(),
        target_last_hidden_BSH=move(batch.target_last_hidden_BSH).float(),
        target_logsumexp_BS=move(batch.target_logsumexp_BS),
        target_argmax_BS=move(batch.target_argmax_BS),
        target_hidden_scale_BSn=None,
    )


def map_tensors(fn, obj: Any, *, batch_fn=None) -> Any:
    """``obj`` (tensors inside dataclasses, dicts, lists, tuples) with every tensor ``t`` replaced by ``fn(t)``,
    and every :class:`TrainBatch` ``b`` by ``batch_fn(b)`` when given."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if batch_fn is not None and isinstance(obj, TrainBatch):
        return batch_fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name), batch_fn=batch_fn)
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v, batch_fn=batch_fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v, batch_fn=batch_fn) for v in obj)
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` (tensors inside dataclasses, dicts, lists, tuples) with every tensor on ``device``
    (``non_blocking``: asynchronous from pinned memory), and every :class:`TrainBatch` inside moved by
    :func:`batch_to_device`: stored-dtype features converted to float32 on ``device``
    (also on the CPU)."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), obj,
                       batch_fn=lambda batch: batch_to_device(batch, device))


def load_step_batches(data: TargetCache | OnlineTargetFeatures, cfg: TrainConfig, step: int, *, rank: int,
                       world_size: int, pin_memory: bool) -> list[tuple[MicroBatchPlan, TrainBatch, list[int]]]:
    """``rank``'s micro-batches of optimizer step ``step`` (:func:`rank_micro_batches`), each with its
    plan, its batch collated on the host in the storage dtype (:func:`collate`) and its samples' lengths
    in tokens: a pure function of the step, so loading ahead changes nothing and a resume skips exactly
    the steps done."""
    plans = rank_micro_batches(len(data), batch_size=cfg.batch_size, grad_accum_steps=cfg.grad_accum_steps,
                               seed=cfg.seed, step=step, rank=rank, world_size=world_size)
    loaded = []
    for plan in plans:
        samples = [data.read(i, dequantize=False) for i in plan.indices]
        lengths = [int(sample["input_ids"].shape[0]) for sample in samples]
        loaded.append((plan, collate(samples, plan.indices, pin_memory=pin_memory), lengths))
    return loaded


def open_target_cache(cache_dir: str) -> TargetCache:
    """The :class:`TargetCache` of ``cache_dir`` (``--cache-dir``), with the errors a user can fix as one line.

    Raises:
        ValueError: ``cache_dir`` is a file (a prepared JSONL trains online: ``--online-data``), or a
            folder whose build is unfinished (no manifest beside shards: rerun ``deepspec cache``).
        FileNotFoundError: no such folder, or a folder that holds no target cache.
    """
    path = Path(cache_dir)
    if path.is_file():
        raise ValueError(f"train.cache_dir: {path} is a file, not a target cache (a folder written by "
                         f"`deepspec cache`); to train on a prepared JSONL pass --online-data {path} instead of --cache-dir, or build a "
                         f"cache from it with `deepspec cache --input {path} --output-dir CACHE_DIR`")
    try:
        return TargetCache(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"train.cache_dir: {exc}") from None
    except RuntimeError as exc:  # no manifest beside shards: an unfinished build
        raise ValueError(f"train.cache_dir: {exc}") from None


def resolve_train_target(cfg: TrainConfig, cache: TargetCache | None, *, log=print) -> str:
    """The target to train against: ``cfg.target`` when given; else the target the cache's manifest
    records (``deepspec cache --target``, saying so in one line through ``log``); else (online mode, a
    cache written before caches recorded it) the embedded default. An explicit ``--target`` that is
    not the cache's target is checked by fingerprint afterwards (:func:`open_training_data`).

    Raises:
        FileNotFoundError: the recorded target folder no longer exists (the message says to pass --target).
    """
    if cfg.target is not None:
        return cfg.target
    recorded = None if cache is None else cache.manifest.get("target")
    if recorded is None:
        return EMBEDDED_DEFAULT
    if recorded != EMBEDDED_DEFAULT and not Path(recorded).exists():
        raise FileNotFoundError(f"train.target: the target cache {cfg.cache_dir} was built with --target {recorded}, "
                                "which no longer exists; pass --target with that model folder (or its new place)")
    log(f"train: --target not given; using the target the cache records: {recorded} ({cfg.cache_dir})")
    return recorded


def open_training_data(cfg: TrainConfig, target_model, tokenizer) -> TargetCache | OnlineTargetFeatures:
    """The training samples: a :class:`TargetCache` (``cfg.cache_dir``) checked against this target,
    tokenizer and (if given) ``cfg.target_layer_ids``, or in online mode (``cfg.online_data``) an
    :class:`OnlineTargetFeatures` over the prepared file that computes features with ``target_model``.

    Both return the same features for the same data and settings (bitwise, see
    :mod:`deepspec.data.online`; the target cache adds the target-logit statistics, which a loss uses
    when present), so the training loop has no online branch.

    Raises:
        ValueError: a cache built for another target/tokenizer/layer set, invalid layer ids, or a
            ``cache_dir`` that is no finished target cache (:func:`open_target_cache`).
        FileNotFoundError: ``cache_dir`` missing or holding no target cache.
    """
    num_layers = target_model.config.num_hidden_layers
    if cfg.online_data is not None:
        layer_ids = cfg.target_layer_ids or default_target_layer_ids(num_layers, cfg.num_target_layers)
        return OnlineTargetFeatures(
            cfg.online_data,
            target_model,
            tokenizer,
            target_layer_ids=validate_target_layer_ids(layer_ids, num_layers),
            max_seq_len=cfg.max_seq_len,
            feature_dtype=cfg.online_feature_dtype,
        )
    cache = open_target_cache(cfg.cache_dir)
    layer_ids = validate_target_layer_ids(cache.manifest["target_layer_ids"], num_layers)
    if cfg.target_layer_ids is not None and list(cfg.target_layer_ids) != layer_ids:
        raise ValueError(
            f"train.target_layer_ids: {cfg.target_layer_ids} differ from the cache's {layer_ids} ({cfg.cache_dir}); "
            "omit the flag (a cache fixes its layers) or rebuild the cache with these layers"
        )
    check_compatible(
        cache,
        target_fingerprint=target_fingerprint(target_model),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        target_layer_ids=layer_ids,
    )
    return cache


_Key = TypeVar("_Key")
_Item = TypeVar("_Item")


class Prefetcher(Generic[_Key, _Item]):
    """Iterates ``load(key)`` for each key of ``keys``, in order, loading up to ``depth`` items ahead
    in a background thread while the caller works on the current one.

    The items are exactly those of ``[load(k) for k in keys]`` in that order (``load`` is called once
    per key, in order, from one thread); only when each load runs changes. ``depth=0`` runs ``load``
    in the caller's thread at each ``next`` (no thread): the same items. At most ``depth`` finished
    items wait in the queue, plus one being loaded.

    An exception raised by ``load`` is re-raised (the same object, its traceback kept) by the ``next``
    that would have returned that item; the items before it are returned first. :meth:`close` (also
    on leaving a ``with`` block, and after the last item or an error) stops the thread: the load in
    progress finishes, nothing further is loaded, waiting items are dropped, the thread is joined.
    ``next`` after close raises StopIteration.

    Raises:
        ValueError: ``depth`` < 0.
    """

    _END = object()

    def __init__(self, load: Callable[[_Key], _Item], keys: Iterable[_Key], *, depth: int = 1,
                 name: str = "deepspec-prefetch") -> None:
        if depth < 0:
            raise ValueError(f"depth: expected >= 0 items to load ahead, got {depth}")
        self._load = load
        self._keys = iter(keys)
        self._closed = False
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _put(self, entry: tuple[bool, object]) -> bool:
        """Queue ``entry``, waiting for room; False when closed meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for key in self._keys:
                if self._stop.is_set() or not self._put((True, self._load(key))):
                    return
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put((False, exc))
            return
        self._put((True, self._END))

    def __iter__(self) -> Prefetcher[_Key, _Item]:
        return self

    def __next__(self) -> _Item:
        if self._closed:
            raise StopIteration
        if self._thread is None:
            try:
                return self._load(next(self._keys))
            except BaseException:
                self.close()
                raise
        ok, value = self._queue.get()
        if not ok:
            self.close()
            raise value
        if value is self._END:
            self.close()
            raise StopIteration
        return value

    def close(self) -> None:
        """Stop loading, drop waiting items and join the thread (idempotent)."""
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        while not self._queue.empty():
            self._queue.get_nowait()

    def __enter__(self) -> Prefetcher[_Key, _Item]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
