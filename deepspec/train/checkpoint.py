"""Checkpoints of a training run: when to resume (:func:`resolve_resume`, :func:`warn_resume_changes`),
writing ``checkpoint-N/`` (:func:`save_checkpoint`) and reading one back into a freshly built run
(:func:`load_trainer_state`, :func:`restore_checkpoint`). The folder layout is
:mod:`deepspec.checkpoints`'s. See docs/design/training.md, "Trainer".
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepspec.checkpoints import LATEST, TRAINER_STATE, apply_retention, latest_checkpoint, previous_run
from deepspec.train.config import TrainConfig
from deepspec.train.distributed import Dist, state_dict_options
from deepspec.train.draft import warn
from deepspec.utils import atomic_path, atomic_write_text


def resolve_resume(cfg: TrainConfig, *, log: bool = False) -> Path | None:
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


def save_checkpoint(model, optimizer, scheduler, *, step: int, cfg: TrainConfig, ctx: Dist | None = None,
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

    ctx = ctx or Dist(0, 1, 0, torch.device("cpu"))
    options = state_dict_options(cpu_offload=True)
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


def load_trainer_state(resume_from: Path, cfg: TrainConfig) -> dict[str, Any]:
    """The ``trainer_state.pt`` of the checkpoint ``resume_from`` (loaded on the CPU).

    Raises:
        ValueError: the checkpoint's step is above ``cfg.max_steps`` (names ``--max-steps`` and the fix).
    """
    state = torch.load(resume_from / TRAINER_STATE, weights_only=False, map_location="cpu")
    if state["step"] > cfg.max_steps:
        raise ValueError(
            f"train.max_steps: --max-steps {cfg.max_steps} is below the step of the checkpoint to resume, "
            f"{state['step']} ({resume_from}); pass --max-steps {state['step']} or more to continue it, or a "
            "new --output-dir (without --resume) to train from step 0"
        )
    return state


def restore_checkpoint(model: torch.nn.Module, optimizer, scheduler, algorithm, resume_from: Path,
                       state: dict[str, Any]) -> int:
    """Load the checkpoint ``resume_from`` (its ``draft/`` through ``algorithm.load``, and ``state``, its
    trainer state) into ``model`` (sharded or not; every rank calls this), ``optimizer`` and
    ``scheduler``, and restore the torch RNG state; returns the checkpoint's step."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, algorithm.load(resume_from / "draft").state_dict(), options=state_dict_options())
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"], options=state_dict_options())
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"]
