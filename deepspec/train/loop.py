"""The draft training loop: one loop, no algorithm branches.

Legend: B sequences per micro-batch, S sequence length, A anchors per sequence, K block_size,
F target feature width, H target hidden, V vocab.

Optimisation follows the original recipe (DESIGN section 7): AdamW with fp32 master weights,
linear warmup then cosine decay to 0, gradient clipping, gradient accumulation. Loss terms are
normalised by the decay-weight sum of the *whole global batch* (every micro-batch of a step), so a
step's gradient equals that of one big batch whatever the accumulation count (DESIGN section 5).

Scaling: launched by ``torchrun --nproc-per-node N -m deepspec.cli train ...`` every rank takes a
disjoint share of each step's global batch (``batch_size x grad_accum_steps x N`` samples), the
draft is sharded with FSDP2 (``fully_shard``; gloo on CPU, NCCL on CUDA) and the supervision weight
sum is all-reduced, so N ranks compute the same step as one process over the same global batch.
Checkpoints hold the full (gathered) weights and optimizer state, written by rank 0 alone, so a
run resumes exactly for the same global batch and ``max_steps``, also on another number of ranks
(a resume checks the draft's shape and warns about what makes it inexact). See docs/design/training.md,
"Trainer".
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from deepspec.algorithms.protocol import TrainBatch
from deepspec.algorithms.registry import get_algorithm
from deepspec.checkpoints import (LATEST, RUN_LOG, TRAINER_STATE, apply_retention, clear_previous_run,
                                  latest_checkpoint, previous_run)
from deepspec.data.cache.reader import TargetCache, check_compatible
from deepspec.data.chat import render_prompt, target_stop_token_ids
from deepspec.data.online import OnlineTargetFeatures
from deepspec.device import (
    allow_tf32,
    cast_for_decoding,
    cpu_bf16_flags,
    is_out_of_memory,
    out_of_memory_error,
    resolve_device,
)
from deepspec.eval.benchmarks import load_benchmark
from deepspec.models.acceptance import AcceptanceCounts
from deepspec.models.mask_token import check_mask_token_absent
from deepspec.target.capture import default_target_layer_ids, validate_target_layer_ids
from deepspec.target.load import EMBEDDED_DEFAULT, load_target, target_fingerprint, tokenizer_fingerprint
from deepspec.train.config import TrainConfig
from deepspec.train.data import (
    MicroBatchPlan,
    Prefetcher,
    batch_to_device,
    collate,
    micro_batch_seed,
    rank_micro_batches,
)
from deepspec.train.draft import build_draft, check_resume_shape, warn, warn_ignored_flags
from deepspec.train.heldout import (
    REFERENCE_NAME,
    heldout_tau,
    load_or_make_reference,
    make_reference,
    reference_key,
)
from deepspec.utils import atomic_path, atomic_write_json, atomic_write_text, pyplot, save_png, torchrun_env

def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, *, fused: bool = True) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``cfg.lr`` and ``cfg.weight_decay``, betas (0.9, 0.95)
    (docs/design/training.md, "Optimiser and schedule").

    ``fused``: torch's one-kernel implementation where the parameters' device has it (CPU and CUDA):
    the same update rule, up to float rounding. On a 2-core CPU it steps the demo's 8.9M-parameter
    DSpark draft in about a quarter of the time of the default per-tensor loop, which took a third of
    a training step (``python bench/train.py`` measures both side by side). FSDP2's sharded (DTensor)
    parameters pass ``fused=False`` and keep the default implementation.
    """
    devices = {p.device.type for p in params}
    use_fused = fused and bool(params) and devices <= {"cpu", "cuda"}
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                             fused=True if use_fused else None)


def _lr_schedule(optimizer, cfg: TrainConfig):
    return get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=math.ceil(cfg.warmup_frac * cfg.max_steps), num_training_steps=cfg.max_steps
    )


def _resolve_resume(cfg: TrainConfig, *, log: bool = False) -> Path | None:
    """The checkpoint folder to resume from: None without ``cfg.resume``, with ``"never"``, or with
    ``"auto"`` when ``output_dir`` has no ``latest`` pointer (``log``: say so).

    Raises:
        ValueError: no ``cfg.resume`` while ``output_dir`` holds an earlier run (:func:`previous_run`;
            names ``--resume auto`` / ``--resume never``), a ``latest`` naming a missing checkpoint, or a
            path that is not a checkpoint folder.
    """
    if cfg.resume is None:
        found = previous_run(cfg.output_dir)
        if found:
            shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
            raise ValueError(
                f"train.output_dir: {cfg.output_dir} already holds a training run ({shown}); pass --resume auto to "
                "continue it, --resume never to start over from step 0 (replacing it), or pass another --output-dir"
            )
        return None
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        path = latest_checkpoint(cfg.output_dir)
        if path is None:
            if log:
                print(f"resume: no checkpoint in {cfg.output_dir}; starting from step 0")
            return None
        pointer = Path(cfg.output_dir) / LATEST
        if not (path / TRAINER_STATE).exists():
            raise ValueError(
                f"train.resume: {pointer} names {path.name}, but {path / TRAINER_STATE} does not exist; point "
                f"`latest` at an existing checkpoint-*/ folder, pass --resume with a checkpoint folder, or delete "
                f"`latest` to start from step 0"
            )
        return path
    path = Path(cfg.resume)
    if not (path / TRAINER_STATE).exists():
        raise ValueError(f"train.resume: {path} is not a checkpoint folder (no {TRAINER_STATE}); pass one, 'auto' or "
                         "'never'")
    return path


def warn_resume_changes(state: dict[str, Any], cfg: TrainConfig, world_size: int) -> list[str]:
    """Warn (stderr) about settings that make a resume inexact; returns the messages.

    A resume reproduces the uninterrupted run only with the same ``max_steps`` and warmup (the cosine
    schedule is rebuilt from the new values at the restored step) and the same global batch
    ``batch_size x grad_accum_steps x ranks`` (the data order and anchors are cut by global batch).
    The peak ``lr`` and ``weight_decay`` are restored with the optimizer and scheduler state, so new
    values of those flags do not apply. Checkpoints without ``train_config`` warn about nothing.
    """
    old = state.get("train_config") or {}
    messages = []
    if old:
        if old["max_steps"] != cfg.max_steps:
            messages.append(f"the checkpoint was trained with max_steps={old['max_steps']}; the learning-rate "
                            f"schedule now spans {cfg.max_steps} steps")
        if old["warmup_frac"] != cfg.warmup_frac:
            messages.append(f"the checkpoint was trained with warmup_frac={old['warmup_frac']}; the learning-rate "
                            f"warmup now spans {math.ceil(cfg.warmup_frac * cfg.max_steps)} steps")
        for name in ("lr", "weight_decay"):
            if old[name] != getattr(cfg, name):
                messages.append(f"the checkpoint was trained with {name}={old[name]}; resume keeps it (restored "
                                f"with the optimizer state), {name}={getattr(cfg, name)} is ignored")
        old_world = state.get("world_size", 1)
        old_global = old["batch_size"] * old["grad_accum_steps"] * old_world
        new_global = cfg.batch_size * cfg.grad_accum_steps * world_size
        if old_global != new_global:
            messages.append(
                f"global batch was {old['batch_size']} x {old['grad_accum_steps']} x {old_world} = {old_global}, "
                f"now {cfg.batch_size} x {cfg.grad_accum_steps} x {world_size} = {new_global}; keep batch_size x "
                "grad_accum_steps x ranks equal to continue exactly"
            )
    for message in messages:
        warn(message)
    return messages


@dataclass
class _Dist:
    """This process's place in the run: rank/world from torchrun's environment (0/1 without it)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    created_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


def _setup_distributed(device_name: str = "auto") -> _Dist:
    """Read ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (set by torchrun) and place this process on
    :func:`deepspec.device.resolve_device` of ``device_name`` (``auto``: ``cuda:LOCAL_RANK`` when CUDA
    is available, else the CPU); with a world of more than one process, create the default process
    group (NCCL on CUDA, gloo on the CPU). Raises ValueError for a device that is not there."""
    rank, world_size, local_rank = torchrun_env()
    device = resolve_device(device_name, "train.device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        allow_tf32()
    created = False
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        created = True
    return _Dist(rank, world_size, local_rank, device, created)


def _shard_model(model: torch.nn.Module, cfg: TrainConfig, ctx: _Dist) -> torch.nn.Module:
    """FSDP2 (``fully_shard``) over a 1-D mesh of all ranks.

    Units: each module the model lists in ``fsdp_units()`` (optional; modules whose parameters are
    used only inside their own ``forward``, e.g. decoder layers that compute everything in their
    forward), then the root, which holds every remaining trainable parameter. The DSpark/DFlash drafts
    list none today: their ``forward_train`` calls ``layer.self_attn.context_kv`` outside the layer's
    forward, which per-layer units would run on still-sharded weights; the draft is a few layers, so
    one unit costs one all-gather of the trainable weights per forward.

    Frozen parameters (the target's embedding and lm_head copies) are *ignored* by FSDP: replicated and
    unsharded on every rank (no gradient, so sharding them would only add all-gathers; a loss may call
    ``model.lm_head`` outside the forward). Trainable parameters keep fp32 master shards; with
    ``dtype="bf16"`` the all-gathered compute copies are bf16 and gradients are reduced in fp32.
    ``forward_train`` is registered so FSDP's unshard/reshard hooks run for it as for ``forward``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.uses_bf16(ctx.device)
        else MixedPrecisionPolicy()
    )
    frozen = {p for p in model.parameters() if not p.requires_grad}
    units = model.fsdp_units() if callable(getattr(model, "fsdp_units", None)) else []
    for unit in units:
        ignored = {p for p in unit.parameters() if p in frozen}
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, ignored_params=frozen or None)
    for method in ("forward_train",):
        if callable(getattr(model, method, None)):
            # wrapped inside FSDP's hooks: FSDP2 warns about every output that is a view (an in-place op
            # on one would skip its pre-backward all-gather); forward_train returns small views (the
            # drafts' hidden_BAKD, confidence_logits_BAK), cloned here so the warning does not fire
            setattr(model, method, _without_view_outputs(getattr(model, method)))
            register_fsdp_forward_method(model, method)
    return model


def _without_view_outputs(method):
    """``method`` returning its outputs with every tensor that is a view (``_base`` set) cloned (a copy of
    that tensor only; gradients flow through the clone). Views in the drafts' outputs are small: hidden
    states and confidence logits, not the vocabulary logits."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        return _map_tensors(lambda t: t.clone() if t._base is not None else t, method(*args, **kwargs))

    return wrapped


def _map_tensors(fn, obj: Any, *, batch_fn=None) -> Any:
    """``obj`` (tensors inside dataclasses, dicts, lists, tuples) with every tensor ``t`` replaced by ``fn(t)``,
    and every :class:`TrainBatch` ``b`` by ``batch_fn(b)`` when given."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if batch_fn is not None and isinstance(obj, TrainBatch):
        return batch_fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _map_tensors(fn, getattr(obj, f.name), batch_fn=batch_fn)
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return {k: _map_tensors(fn, v, batch_fn=batch_fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, v, batch_fn=batch_fn) for v in obj)
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` (tensors inside dataclasses, dicts, lists, tuples) with every tensor on ``device``
    (``non_blocking``: asynchronous from pinned memory), and every :class:`TrainBatch` inside moved by
    :func:`deepspec.train.data.batch_to_device`: stored-dtype features converted to float32 on ``device``
    (also on the CPU)."""
    return _map_tensors(lambda t: t.to(device, non_blocking=True), obj,
                        batch_fn=lambda batch: batch_to_device(batch, device))


def _state_dict_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def save_checkpoint(model, optimizer, scheduler, *, step: int, cfg: TrainConfig, ctx: _Dist | None = None,
                    template: torch.nn.Module | None = None) -> Path:
    """Write ``checkpoint-<step>/`` (``draft/`` safetensors + config.json, ``trainer_state.pt``) and point
    ``latest`` at it, both atomically; then apply the ``keep_last`` retention.

    Every rank must call this (the full, unsharded model and optimizer state dicts are gathered with
    collectives); only rank 0 writes. ``template``: a plain (unsharded) copy of the draft that rank 0
    fills with the gathered weights to call its ``save_pretrained`` (None: ``model`` is unsharded).
    The optimizer state is keyed by parameter name (``get_optimizer_state_dict``), so a checkpoint
    written by N ranks resumes on M ranks.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    ctx = ctx or _Dist(0, 1, 0, torch.device("cpu"))
    options = _state_dict_options(cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    out = Path(cfg.output_dir)
    name = f"checkpoint-{step:06d}"
    if ctx.is_main:
        draft = model
        if template is not None:
            template.load_state_dict(model_sd)
            draft = template
        with atomic_path(out / name) as tmp:
            tmp.mkdir()
            draft.save_pretrained(tmp / "draft")
            torch.save(
                {
                    "step": step,
                    "optimizer": optim_sd,
                    "scheduler": scheduler.state_dict(),
                    "train_config": asdict(cfg),
                    "world_size": ctx.world_size,
                    "device": str(ctx.device),
                    "torch_rng": torch.get_rng_state(),
                },
                tmp / TRAINER_STATE,
            )
        atomic_write_text(out / LATEST, name + "\n")
        apply_retention(out, cfg.keep_last)
    if ctx.sharded:
        dist.barrier()
    return out / name


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
    :mod:`deepspec.data.online`; a format-3 cache adds the target-logit statistics, which a loss uses
    when present), so the loop below has no online branch.

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


def train(cfg: TrainConfig, *, target_model=None, tokenizer=None,
          heldout_prompts: list[tuple[str, str, list[int]]] | None = None) -> Path:
    """Train a draft on a target cache, or online (``cfg.online_data``); return the final checkpoint folder.

    One process (``deepspec train``) or one process per device under ``torchrun`` (the rank and world
    size come from its environment): each rank loads the target, takes its disjoint share of every
    step's global batch (``batch_size x grad_accum_steps x world_size`` samples,
    :func:`deepspec.train.data.rank_micro_batches`), and the draft is sharded with FSDP2
    (:func:`_shard_model`). The supervision-weight sum is all-reduced before the losses are divided,
    so a step's gradient is the token-weighted mean over the whole global batch whatever the split
    into ranks and micro-batches.

    In online mode the frozen target computes each micro-batch's features inside the loop
    (:class:`deepspec.data.online.OnlineTargetFeatures`, the cache writer's capture rule), so a
    run gives the same losses and weights as one on a float32 cache of the same data.

    The draft weights of a checkpoint are in ``<checkpoint>/draft`` (loadable with the algorithm's
    ``load``). Resume happens only when ``cfg.resume`` asks for it; an ``output_dir`` that already
    holds a run is refused without it, and ``"never"`` replaces that run (:func:`clear_previous_run`).
    Rank 0 alone writes checkpoints, ``train_log.jsonl``, ``train_loss.png`` and the TensorBoard
    events (``<output_dir>/tensorboard``).

    Resuming a checkpoint already at ``cfg.max_steps`` does nothing and returns that checkpoint.

    With ``cfg.heldout_every`` the draft's greedy tau on a fixed held-out prompt set
    (:mod:`deepspec.train.heldout`; ``heldout_prompts`` = ``(benchmark, id, prompt ids)`` triples,
    default: ``cfg.heldout_num_prompts`` first-turn prompts of each of ``cfg.heldout_benchmarks``) is
    logged at step 0, every ``heldout_every`` steps and at the end: the learning curve. Its time is
    not counted in ``step_time_s`` / ``elapsed_s``.

    Raises:
        ValueError: the cache was built for another target/tokenizer/layer set, the mask token occurs
            in the data, a setting is invalid, the checkpoint to resume is past ``cfg.max_steps`` or was
            trained with another draft shape (:func:`check_resume_shape`), ``latest`` names a
            missing checkpoint, ``output_dir`` holds an earlier run and ``cfg.resume`` is None, or
            ``cfg.cache_dir`` is no finished target cache (:func:`open_target_cache`).
        FileNotFoundError: ``cfg.cache_dir`` missing or holding no target cache.
    """
    ctx = _setup_distributed(cfg.device)
    try:
        return _train(cfg, ctx, target_model=target_model, tokenizer=tokenizer, heldout_prompts=heldout_prompts)
    finally:
        if ctx.created_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, ctx: _Dist, *, target_model=None, tokenizer=None, heldout_prompts=None) -> Path:
    resume_from = _resolve_resume(cfg, log=ctx.is_main)
    # a wrong --cache-dir fails here, before the target loads
    cache = open_target_cache(cfg.cache_dir) if cfg.cache_dir is not None else None
    state = None
    if resume_from is not None:
        state = torch.load(resume_from / TRAINER_STATE, weights_only=False, map_location="cpu")
        if state["step"] > cfg.max_steps:
            raise ValueError(
                f"train.max_steps: --max-steps {cfg.max_steps} is below the step of the checkpoint to resume, "
                f"{state['step']} ({resume_from}); pass --max-steps {state['step']} or more to continue it, or a "
                "new --output-dir (without --resume) to train from step 0"
            )
        if state["step"] == cfg.max_steps:
            if ctx.is_main:
                print(f"train: already complete: {resume_from} is at step {state['step']} = --max-steps; nothing "
                      "to do (raise --max-steps to train further)")
            return resume_from
    if target_model is None:
        cfg = replace(cfg, target=resolve_train_target(cfg, cache, log=print if ctx.is_main else lambda _: None))
        target_model, tokenizer = load_target(cfg.target, chat_template=cfg.chat_template)
    cache = open_training_data(cfg, target_model, tokenizer)
    target_layer_ids = cache.target_layer_ids
    algorithm = get_algorithm(cfg.algorithm)
    options = cfg.options  # the algorithm's own settings (prepare reads them)
    model = build_draft(target_model, tokenizer, cfg, target_layer_ids, data=cache)
    if resume_from is not None:
        check_resume_shape(resume_from, model, cfg)
    if ctx.is_main:
        warn_ignored_flags(cfg)
        if state is not None:
            warn_resume_changes(state, cfg, ctx.world_size)
    check_mask_token_absent(
        model.config.mask_token_id, (cache.read(i, ("input_ids",))["input_ids"] for i in range(len(cache)))
    )
    if ctx.device.type != "cpu" and cfg.online_data is not None:
        target_model.to(ctx.device)  # online features are computed on every rank's device
    template = None
    if ctx.sharded:
        # rank 0 keeps a plain copy to write gathered weights through the draft's own save_pretrained
        template = copy.deepcopy(model) if ctx.is_main else None
        model = _shard_model(model.to(ctx.device), cfg, ctx)
    else:
        model = model.to(ctx.device)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg, fused=not ctx.sharded)
    scheduler = _lr_schedule(optimizer, cfg)
    start_step = 0
    if resume_from is not None:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(model, algorithm.load(resume_from / "draft").state_dict(),
                             options=_state_dict_options())
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"], options=_state_dict_options())
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        start_step = state["step"]
        if ctx.is_main:
            print(f"resumed from {resume_from} at step {start_step}")

    out = Path(cfg.output_dir)
    log_path = out / RUN_LOG
    log_rows: list[dict] = []
    writer = None
    if ctx.is_main:
        from torch.utils.tensorboard import SummaryWriter

        if cfg.resume == "never" and clear_previous_run(out):
            print(f"train: --resume never: removed the earlier run in {out}; starting from step 0")
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "train_config.json", asdict(cfg))
        log_rows = _read_log(log_path, upto_step=start_step)
        # purge_step drops events an earlier run logged after the resume point (they are replayed)
        writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)
    heldout = None
    if cfg.heldout_every:  # the reference target on the training device (rank 0 makes the reference)
        reference_target = _capture_target(target_model, cache, ctx.device if ctx.is_main else None)
        heldout = _HeldoutCurve(cfg, ctx, algorithm, reference_target, tokenizer, target_layer_ids, heldout_prompts)
    elapsed_s = next((r["elapsed_s"] for r in reversed(log_rows) if "elapsed_s" in r), 0.0)

    def log_row(row: dict) -> None:
        log_rows.append(row)
        with log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "step":
                writer.add_scalar(f"{'heldout' if key.startswith('heldout') else 'train'}/{key}", value, row["step"])

    def evaluate_heldout(step_done: int, row: dict | None) -> None:
        """Add the held-out tau to ``row`` (the step's log row), or log a row of its own (step 0)."""
        result = heldout.evaluate(model, template)  # every rank takes part (sharded weights are gathered)
        if not ctx.is_main:
            return
        if row is None:
            log_row({"step": step_done, "elapsed_s": elapsed_s, **result})
        else:
            row.update(result)
        print(f"train: step {step_done}: held-out greedy tau {result['heldout_tau']:.2f} ("
              + ", ".join(f"{k[len('heldout_tau_'):]} {v:.2f}" for k, v in result.items() if k != "heldout_tau")
              + ")", flush=True)

    if heldout is not None and start_step == 0:
        evaluate_heldout(0, None)
    model.train()
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=cfg.uses_bf16(ctx.device))
    if cfg.dtype == "bf16" and ctx.device.type == "cpu" and not cpu_bf16_flags() and ctx.is_main:
        warn("--dtype bf16 on a CPU without native bf16 dot products (no avx512_bf16 / amx_bf16 flag): "
              "autocast converts through float32, so the step gets slower, not faster; --dtype fp32 is the "
              "faster choice here")
    # FSDP averages gradients over ranks; each rank's loss is already its share of the global mean
    grad_scale = float(ctx.world_size)
    bar = tqdm(range(start_step, cfg.max_steps), desc="train", initial=start_step, total=cfg.max_steps,
               disable=not ctx.is_main)
    pin_memory = ctx.device.type == "cuda" and torch.cuda.is_available()

    def load_step(step: int) -> list[tuple[MicroBatchPlan, TrainBatch, list[int]]]:
        """This rank's micro-batches of ``step``, collated on the host in the storage dtype (a pure
        function of the step, so loading ahead changes nothing and a resume skips exactly the steps done)."""
        plans = rank_micro_batches(len(cache), batch_size=cfg.batch_size, grad_accum_steps=cfg.grad_accum_steps,
                                   seed=cfg.seed, step=step, rank=ctx.rank, world_size=ctx.world_size)
        loaded = []
        for plan in plans:
            samples = [cache.read(i, dequantize=False) for i in plan.indices]
            lengths = [int(sample["input_ids"].shape[0]) for sample in samples]
            loaded.append((plan, collate(samples, plan.indices, pin_memory=pin_memory), lengths))
        return loaded

    # the next step loads while this one trains; online features stay in this thread (their target
    # forward shares the device and the target with the held-out evaluation)
    steps = Prefetcher(load_step, range(start_step, cfg.max_steps), depth=0 if cfg.online_data is not None else 1,
                       name="deepspec-train-data")
    last_ckpt = None
    try:
        for step in bar:
            t0 = time.perf_counter()
            micro = []
            num_tokens = 0
            longest = 0  # tokens of the longest sample this step (an out-of-memory message names it)
            for plan, batch, lengths in next(steps):
                num_tokens += sum(lengths)
                longest = max([longest, *lengths])
                # random choices (anchors) depend only on (seed, step, slot): resume and any rank or
                # accumulation split reproduce them exactly
                generator = torch.Generator().manual_seed(micro_batch_seed(cfg.seed, step, plan.slot))
                micro.append(to_device(algorithm.prepare(model, batch, generator, options), ctx.device))
            weight_sum = sum(algorithm.weight(model, prepared) for prepared in micro).to(ctx.device, torch.float32)
            if ctx.sharded:
                dist.all_reduce(weight_sum)
            metrics = StepMetrics(ctx.device)
            for prepared in micro:
                try:
                    loss_out = algorithm.loss(model, prepared, weight_sum=weight_sum, autocast=autocast)
                    (loss_out.loss * grad_scale if ctx.sharded else loss_out.loss).backward()
                except RuntimeError as exc:  # torch.OutOfMemoryError is one
                    if not is_out_of_memory(exc):
                        raise
                    raise _train_out_of_memory(exc, cfg, ctx, step + 1, longest) from exc
                metrics.add(loss_out)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
                grad_norm = grad_norm.full_tensor()
            # the rate this step uses (get_last_lr after scheduler.step() would be the next step's)
            step_lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            # the step's one host read of the device (after one all-reduce when sharded)
            totals = metrics.read(ctx, num_tokens=num_tokens, grad_norm=grad_norm)
            grad_norm = totals.pop("grad_norm")
            step_time = time.perf_counter() - t0
            elapsed_s += step_time
            row = {
                "step": step + 1,
                "lr": step_lr,
                "grad_norm": grad_norm,
                "step_time_s": step_time,
                "elapsed_s": elapsed_s,
                "tok_per_s": totals["num_tokens"] / step_time,
                # loss terms add up over micro-batches and ranks; tau estimates come from pooled counts
                **totals,
            }
            if heldout is not None and ((step + 1) % cfg.heldout_every == 0 or step + 1 == cfg.max_steps):
                evaluate_heldout(step + 1, row)
                model.train()
            if ctx.is_main:
                log_row(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", tau_est=f"{row.get('tau_estimate', float('nan')):.2f}")
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.max_steps:
                last_ckpt = save_checkpoint(model, optimizer, scheduler, step=step + 1, cfg=cfg, ctx=ctx,
                                            template=template)
        if start_step < cfg.max_steps or last_ckpt is None:
            last_ckpt = save_checkpoint(model, optimizer, scheduler, step=cfg.max_steps, cfg=cfg, ctx=ctx,
                                        template=template)
    finally:
        steps.close()
        if writer is not None:
            writer.close()
    if ctx.is_main:
        _plot_log(log_rows, out / "train_loss.png")
    return last_ckpt


def _train_out_of_memory(exc: BaseException, cfg: TrainConfig, ctx: _Dist, step: int,
                         longest: int) -> torch.OutOfMemoryError:
    """The out-of-memory error of a training step: the sizes of the micro-batch and the flags that lower them."""
    shape = get_algorithm(cfg.algorithm).training_shape(cfg.options)
    vocab = f"draft vocabulary {cfg.draft_vocab_size}" if cfg.draft_vocab_size else "the full vocabulary"
    sizes = (f"step {step}, a micro-batch of {cfg.batch_size} sequences of up to {longest} tokens, {shape.rows} each, "
             f"{vocab}, {cfg.num_draft_layers} draft layer(s), {'bf16' if cfg.uses_bf16(ctx.device) else 'fp32'}")
    fix = ("lower " + ", ".join(("--batch-size (raise --grad-accum-steps to keep the global batch)",
                                 *shape.memory_flags)) + " or --draft-vocab-size, or train with "
           + " or ".join(("--dtype bf16", *shape.memory_fixes))
           + "; samples are cut at --max-seq-len online, at `deepspec cache --max-seq-len` in a cache")
    return out_of_memory_error("train", ctx.device, sizes, fix, exc)


def _capture_target(target_model: torch.nn.Module, data, device: torch.device | None = None) -> torch.nn.Module:
    """The target as it ran when the training features were captured, on ``device`` (None: where it is):
    cast to a cache's capture dtype (``deepspec cache --dtype bfloat16``), else in its own dtype (float32
    caches, online mode); ``target_model`` itself when nothing changes, else a copy. The learning curve's
    reference is made with it, so the held-out features and greedy outputs come from the same target
    forward as the features the draft trains on, on the training device (a GPU, not the host)."""
    capture_dtype = ((getattr(data, "manifest", None) or {}).get("capture") or {}).get("dtype")
    dtype = getattr(torch, capture_dtype) if capture_dtype else next(target_model.parameters()).dtype
    return cast_for_decoding(target_model, dtype, device)


class _HeldoutCurve:
    """The learning curve's held-out set: the reference (target greedy outputs + features, made once
    on rank 0 and kept in ``<output_dir>/heldout_reference.pt``) and its evaluation."""

    def __init__(self, cfg: TrainConfig, ctx: _Dist, algorithm, target_model, tokenizer, target_layer_ids,
                 prompts: list[tuple[str, str, list[int]]] | None) -> None:
        self.cfg, self.ctx, self.algorithm = cfg, ctx, algorithm
        self.max_positions = int(target_model.config.max_position_embeddings)
        self.eos = target_stop_token_ids(target_model, tokenizer)  # the engine's stop rule
        self.refs = []
        if not ctx.is_main:
            return
        if prompts is None:
            prompts = heldout_prompt_ids(cfg.heldout_benchmarks, cfg.heldout_num_prompts, tokenizer)
        key = reference_key(prompts, target_fingerprint=target_fingerprint(target_model),
                            target_layer_ids=target_layer_ids, max_new_tokens=cfg.heldout_max_new_tokens,
                            block_size=algorithm.training_shape(cfg.options).proposal_len, eos_token_ids=self.eos)
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)

        def make():
            print(f"train: learning curve: the target answers {len(prompts)} held-out prompts once (up to "
                  f"{cfg.heldout_max_new_tokens} tokens each; --heldout-every 0 turns the curve off)", flush=True)
            return make_reference(target_model, prompts, target_layer_ids, self.eos,
                                  max_new_tokens=cfg.heldout_max_new_tokens,
                                  block_size=algorithm.training_shape(cfg.options).proposal_len)

        self.refs = load_or_make_reference(Path(cfg.output_dir) / REFERENCE_NAME, key, make)

    def evaluate(self, model: torch.nn.Module, template: torch.nn.Module | None) -> dict[str, float]:
        """Greedy held-out tau of the current weights (rank 0; other ranks only help gather: ``{}``)."""
        draft = model
        if self.ctx.sharded:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            state = get_model_state_dict(model, options=_state_dict_options(cpu_offload=True))
            if not self.ctx.is_main:
                return {}
            template.load_state_dict(state)
            draft = template
        proposer = self.algorithm.proposer(draft, max_positions=self.max_positions)
        device = next(draft.parameters()).device
        return heldout_tau(proposer, self.refs, max_new_tokens=self.cfg.heldout_max_new_tokens,
                           eos_token_ids=self.eos, device=device)


def heldout_prompt_ids(benchmarks: list[str], num_prompts: int, tokenizer) -> list[tuple[str, str, list[int]]]:
    """``(benchmark, prompt id, prompt ids)`` of the first turn of ``num_prompts`` prompts per
    benchmark: the same seeded sample ``deepspec eval`` takes (its default seed), rendered with the
    one prompt rule (:func:`deepspec.data.chat.render_prompt`)."""
    return [(name, p.id, render_prompt(tokenizer, p.messages))
            for name in benchmarks for p in load_benchmark(name, max_samples=num_prompts)]


class StepMetrics:
    """A step's logged sums, kept on the device until the step is logged.

    :meth:`add` sums each micro-batch's ``scalars()`` (0-d tensors, float64 on ``device``; plain
    floats are accepted) and its acceptance counts without reading the device. :meth:`read` packs the
    sums, the pooled acceptance counts and ``grad_norm`` into one tensor, all-reduces it once across
    ranks (sums; ``grad_norm`` is already global and is taken as is) and reads it on the host once:
    the step's only device sync besides the losses' own (``nonzero`` in the DSpark loss).

    float64 sums in micro-batch order: the same values as summing the scalars as Python floats.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.totals: dict[str, torch.Tensor] = {}
        self.acceptance: AcceptanceCounts | None = None
        self.num_added = 0

    def add(self, loss_out) -> None:
        """Add one micro-batch's ``loss_out.scalars()`` and ``loss_out.acceptance`` (no host read)."""
        for key, value in loss_out.scalars().items():
            value = torch.as_tensor(value, dtype=torch.float64, device=self.device)
            self.totals[key] = value if key not in self.totals else self.totals[key] + value
        if loss_out.acceptance is not None:
            a = loss_out.acceptance
            self.acceptance = a if self.acceptance is None else self.acceptance + a
        self.num_added += 1

    def read(self, ctx: _Dist, *, num_tokens: int, grad_norm: torch.Tensor | float | None = None) -> dict[str, float]:
        """The step's logged values (summed over micro-batches and ranks) as floats: the scalars,
        ``num_tokens``, the pooled tau estimates (``tau_estimate`` (T = 1), ``greedy_tau_estimate``, the
        greedy prefix survival ``accept_rate_prefix_k`` per slot; none when the loss gives no counts,
        which every rank must then do alike) and ``grad_norm`` when given. One all-reduce, one host read."""
        keys = sorted(self.totals)
        parts = [torch.stack([self.totals[k] for k in keys]) if keys else torch.zeros(0, dtype=torch.float64,
                                                                                      device=self.device),
                 torch.full((1,), float(num_tokens), dtype=torch.float64, device=self.device)]
        K = 0
        if self.acceptance is not None:
            packed_3K = self.acceptance.pack().to(self.device, torch.float64)
            K = packed_3K.shape[1]
            parts.append(packed_3K.flatten())
        summed = torch.cat(parts)
        if ctx.sharded:
            dist.all_reduce(summed)
        if grad_norm is not None:
            summed = torch.cat([summed, torch.as_tensor(grad_norm, device=self.device).to(torch.float64).view(1)])
        host = summed.tolist()  # the host read
        out = dict(zip(keys, host[:len(keys)]))
        out["num_tokens"] = host[len(keys)]
        if K:
            pooled = AcceptanceCounts.unpack(torch.tensor(host[len(keys) + 1:len(keys) + 1 + 3 * K],
                                                          dtype=torch.float64).view(3, K))
            out["tau_estimate"], out["greedy_tau_estimate"] = pooled.tau(), pooled.greedy_tau()
            for k, (s, n) in enumerate(zip(pooled.greedy_survive_K.tolist(), pooled.count_K.tolist())):
                out[f"accept_rate_prefix_{k + 1}"] = s / n if n > 0 else 0.0
        if grad_norm is not None:
            out["grad_norm"] = host[-1]
        return out


def _read_log(path: Path, *, upto_step: int) -> list[dict]:
    """Rows of an earlier run's log up to ``upto_step``; the file is rewritten without later rows."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] <= upto_step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _ema(values: list[float], alpha: float = 0.9) -> list[float]:
    """Exponential moving average (bias-corrected, so the first points are not pulled to 0)."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = alpha * acc + (1 - alpha) * v
        weight = alpha * weight + (1 - alpha)
        out.append(acc / weight)
    return out


def _plot_log(rows: list[dict], path: Path) -> None:
    """``train_loss.png``: loss terms (log scale), the training tau estimates and, when logged, the
    held-out greedy tau (the learning curve). Noisy per-step series are drawn faint with their
    exponential moving average on top."""
    if not rows:
        return
    plt = pyplot()

    heldout = [r for r in rows if "heldout_tau" in r]
    fig, axes = plt.subplots(1, 3 if heldout else 2, figsize=(15 if heldout else 10, 4))
    ax_loss, ax_tau = axes[0], axes[1]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def series(ax, key: str, color: str, label: str) -> None:
        pts = [(r["step"], r[key]) for r in rows if key in r and r[key] == r[key] and r[key] > 0]
        if not pts:
            return
        steps, values = zip(*pts)
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, _ema(list(values)), color=color, label=f"{label} (EMA 0.9)")

    for i, key in enumerate(("loss", "ce", "l1", "confidence")):
        series(ax_loss, key, colors[i], key)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (global-batch weighted mean, log scale)")
    ax_loss.set_title("training loss")
    ax_loss.legend(fontsize=8)
    for i, (key, label) in enumerate((("greedy_tau_estimate", "greedy (T=0)"), ("tau_estimate", "T=1"))):
        series(ax_tau, key, colors[i], label)
    ax_tau.set_xlabel("step")
    ax_tau.set_ylabel("tau estimate (accepted + 1, teacher-forced)")
    ax_tau.set_title("training-time tau estimates")
    ax_tau.legend(fontsize=8)
    if heldout:
        ax = axes[2]
        steps = [r["step"] for r in heldout]
        ax.plot(steps, [r["heldout_tau"] for r in heldout], "o-", color="black", label="all prompts")
        for i, key in enumerate(sorted({k for r in heldout for k in r if k.startswith("heldout_tau_")})):
            ax.plot(steps, [r.get(key, float("nan")) for r in heldout], ".--", color=colors[i % len(colors)],
                    label=key[len("heldout_tau_"):])
        minutes = heldout[-1].get("elapsed_s", 0.0) / 60
        ax.set_xlabel(f"step ({minutes:.1f} training minutes at step {steps[-1]})")
        ax.set_ylabel("held-out greedy tau (accepted + 1 per step)")
        ax.set_title("learning curve (held-out prompts)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
