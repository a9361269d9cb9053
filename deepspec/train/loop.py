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

This module holds the optimisation (optimizer, schedule) and the loop: :func:`train` sets a run up
(:func:`_set_up`, returning a :class:`_Run`) and takes its steps (:func:`_step`). The rest of a run
lives by job beside it: :mod:`~deepspec.train.distributed` (ranks, FSDP2),
:mod:`~deepspec.train.checkpoint` (resume policy, checkpoint I/O), :mod:`~deepspec.train.data` (opening
the data, batches), :mod:`~deepspec.train.heldout` (the learning curve) and :mod:`~deepspec.train.log`
(logged values, ``train_log.jsonl``, TensorBoard, ``train_loss.png``).
"""

from __future__ import annotations

import copy
import functools
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from deepspec.algorithms.protocol import DraftAlgorithm
from deepspec.algorithms.registry import get_algorithm
from deepspec.data.cache.reader import TargetCache
from deepspec.data.online import OnlineTargetFeatures
from deepspec.device import cpu_bf16_flags, is_out_of_memory, out_of_memory_error
from deepspec.models.mask_token import check_mask_token_absent
from deepspec.target.load import load_target
from deepspec.train.checkpoint import (
    load_trainer_state,
    resolve_resume,
    restore_checkpoint,
    save_checkpoint,
    warn_resume_changes,
)
from deepspec.train.config import TrainConfig
from deepspec.train.data import (
    Prefetcher,
    load_step_batches,
    micro_batch_seed,
    open_target_cache,
    open_training_data,
    resolve_train_target,
    to_device,
)
from deepspec.train.distributed import Dist, setup_distributed, shard_model
from deepspec.train.draft import build_draft, check_resume_shape, warn, warn_ignored_flags
from deepspec.train.heldout import HeldoutCurve, capture_target
from deepspec.train.log import RunLog, StepMetrics, plot_log


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


@dataclass
class _Run:
    """What the steps of a run share, made once by :func:`_set_up`. ``template``: rank 0's plain copy of a
    sharded draft (checkpoints and the held-out curve fill it with the gathered weights; None unsharded).
    ``elapsed_s``: training seconds so far (held-out evaluations not counted), carried across a resume."""

    cfg: TrainConfig
    ctx: Dist
    algorithm: DraftAlgorithm
    model: torch.nn.Module
    template: torch.nn.Module | None
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: TargetCache | OnlineTargetFeatures
    start_step: int
    log: RunLog
    heldout: HeldoutCurve | None
    elapsed_s: float = 0.0


def train(cfg: TrainConfig, *, target_model=None, tokenizer=None,
          heldout_prompts: list[tuple[str, str, list[int]]] | None = None) -> Path:
    """Train a draft on a target cache, or online (``cfg.online_data``); return the final checkpoint folder.

    One process (``deepspec train``) or one process per device under ``torchrun`` (the rank and world
    size come from its environment): each rank loads the target, takes its disjoint share of every
    step's global batch (``batch_size x grad_accum_steps x world_size`` samples,
    :func:`deepspec.train.data.rank_micro_batches`), and the draft is sharded with FSDP2
    (:func:`deepspec.train.distributed.shard_model`). The supervision-weight sum is all-reduced
    before the losses are divided, so a step's gradient is the token-weighted mean over the whole
    global batch whatever the split into ranks and micro-batches.

    In online mode the frozen target computes each micro-batch's features inside the loop
    (:class:`deepspec.data.online.OnlineTargetFeatures`, the cache writer's capture rule), so a
    run gives the same losses and weights as one on a float32 cache of the same data.

    The draft weights of a checkpoint are in ``<checkpoint>/draft`` (loadable with the algorithm's
    ``load``). Resume happens only when ``cfg.resume`` asks for it; an ``output_dir`` that already
    holds a run is refused without it, and ``"never"`` replaces that run
    (:func:`deepspec.checkpoints.clear_previous_run`).
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
            trained with another draft shape (:func:`deepspec.train.draft.check_resume_shape`),
            ``latest`` names a missing checkpoint, ``output_dir`` holds an earlier run and
            ``cfg.resume`` is None, or ``cfg.cache_dir`` is no finished target cache
            (:func:`deepspec.train.data.open_target_cache`).
        FileNotFoundError: ``cfg.cache_dir`` missing or holding no target cache.
    """
    ctx = setup_distributed(cfg.device)
    try:
        return _train(cfg, ctx, target_model=target_model, tokenizer=tokenizer, heldout_prompts=heldout_prompts)
    finally:
        if ctx.created_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, ctx: Dist, *, target_model=None, tokenizer=None, heldout_prompts=None) -> Path:
    run = _set_up(cfg, ctx, target_model=target_model, tokenizer=tokenizer, heldout_prompts=heldout_prompts)
    if isinstance(run, Path):  # the checkpoint to resume is already at max_steps
        return run
    cfg, model = run.cfg, run.model
    if run.heldout is not None and run.start_step == 0:
        _log_heldout(run, 0, None)
    model.train()
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=cfg.uses_bf16(ctx.device))
    if cfg.dtype == "bf16" and ctx.device.type == "cpu" and not cpu_bf16_flags() and ctx.is_main:
        warn("--dtype bf16 on a CPU without native bf16 dot products (no avx512_bf16 / amx_bf16 flag): "
              "autocast converts through float32, so the step gets slower, not faster; --dtype fp32 is the "
              "faster choice here")
    bar = tqdm(range(run.start_step, cfg.max_steps), desc="train", initial=run.start_step, total=cfg.max_steps,
               disable=not ctx.is_main)
    load = functools.partial(load_step_batches, run.data, cfg, rank=ctx.rank, world_size=ctx.world_size,
                             pin_memory=ctx.device.type == "cuda" and torch.cuda.is_available())
    # the next step loads while this one trains; online features stay in this thread (their target
    # forward shares the device and the target with the held-out evaluation)
    steps = Prefetcher(load, range(run.start_step, cfg.max_steps), depth=0 if cfg.online_data is not None else 1,
                       name="deepspec-train-data")
    last_ckpt = None
    try:
        for step in bar:
            row = _step(run, step, next(steps), autocast)
            if run.heldout is not None and ((step + 1) % cfg.heldout_every == 0 or step + 1 == cfg.max_steps):
                _log_heldout(run, step + 1, row)
                model.train()
            if ctx.is_main:
                run.log.add(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", tau_est=f"{row.get('tau_estimate', float('nan')):.2f}")
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.max_steps:
                last_ckpt = save_checkpoint(model, run.optimizer, run.scheduler, step=step + 1, cfg=cfg, ctx=ctx,
                                            template=run.template)
        if run.start_step < cfg.max_steps or last_ckpt is None:
            last_ckpt = save_checkpoint(model, run.optimizer, run.scheduler, step=cfg.max_steps, cfg=cfg, ctx=ctx,
                                        template=run.template)
    finally:
        steps.close()
        run.log.close()
    if ctx.is_main:
        plot_log(run.log.rows, Path(cfg.output_dir) / "train_loss.png")
    return last_ckpt


def _set_up(cfg: TrainConfig, ctx: Dist, *, target_model=None, tokenizer=None, heldout_prompts=None) -> _Run | Path:
    """A run ready for its first step: the checkpoint to resume (:func:`resolve_resume`), the target and
    the data, the draft (built, checked against the checkpoint and the data, placed or sharded), the
    optimizer and schedule (restored on resume), the run's log and the held-out curve. Returns the
    checkpoint itself when it is already at ``cfg.max_steps`` (nothing is loaded or written then).
    Raises as :func:`train` says."""
    resume_from = resolve_resume(cfg, log=ctx.is_main)
    # a wrong --cache-dir fails here, before the target loads
    cache = open_target_cache(cfg.cache_dir) if cfg.cache_dir is not None else None
    state = None if resume_from is None else load_trainer_state(resume_from, cfg)
    if state is not None and state["step"] == cfg.max_steps:
        if ctx.is_main:
            print(f"train: already complete: {resume_from} is at step {state['step']} = --max-steps; nothing "
                  "to do (raise --max-steps to train further)")
        return resume_from
    if target_model is None:
        cfg = replace(cfg, target=resolve_train_target(cfg, cache, log=print if ctx.is_main else lambda _: None))
        target_model, tokenizer = load_target(cfg.target, chat_template=cfg.chat_template)
    data = open_training_data(cfg, target_model, tokenizer)
    algorithm = get_algorithm(cfg.algorithm)
    model = build_draft(target_model, tokenizer, cfg, data.target_layer_ids, data=data)
    if resume_from is not None:
        check_resume_shape(resume_from, model, cfg)
    if ctx.is_main:
        warn_ignored_flags(cfg)
        if state is not None:
            warn_resume_changes(state, cfg, ctx.world_size)
    check_mask_token_absent(
        model.config.mask_token_id, (data.read(i, ("input_ids",))["input_ids"] for i in range(len(data)))
    )
    if ctx.device.type != "cpu" and cfg.online_data is not None:
        target_model.to(ctx.device)  # online features are computed on every rank's device
    template = None
    if ctx.sharded:
        # rank 0 keeps a plain copy to write gathered weights through the draft's own save_pretrained
        template = copy.deepcopy(model) if ctx.is_main else None
        model = shard_model(model.to(ctx.device), cfg, ctx)
    else:
        model = model.to(ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg, fused=not ctx.sharded)
    scheduler = _lr_schedule(optimizer, cfg)
    start_step = 0
    if resume_from is not None:
        start_step = restore_checkpoint(model, optimizer, scheduler, algorithm, resume_from, state)
        if ctx.is_main:
            print(f"resumed from {resume_from} at step {start_step}")
    log = RunLog.start(cfg, start_step, is_main=ctx.is_main)
    heldout = None
    if cfg.heldout_every:  # the reference target on the training device (rank 0 makes the reference)
        reference_target = capture_target(target_model, data, ctx.device if ctx.is_main else None)
        heldout = HeldoutCurve(cfg, ctx, algorithm, reference_target, tokenizer, data.target_layer_ids,
                               heldout_prompts)
    return _Run(cfg, ctx, algorithm, model, template, params, optimizer, scheduler, data, start_step, log, heldout,
                elapsed_s=log.elapsed_s)


def _step(run: _Run, step: int, loaded, autocast) -> dict:
    """Optimizer step ``step`` (0-based) on this rank's micro-batches ``loaded`` (from
    :func:`deepspec.train.data.load_step_batches`); returns the step's log row (``run.elapsed_s`` grows by
    its time). Raises the out-of-memory error of :func:`_train_out_of_memory` in place of torch's."""
    cfg, ctx, model, algorithm = run.cfg, run.ctx, run.model, run.algorithm
    t0 = time.perf_counter()
    micro = []
    num_tokens = 0
    longest = 0  # tokens of the longest sample this step (an out-of-memory message names it)
    for plan, batch, lengths in loaded:
        num_tokens += sum(lengths)
        longest = max([longest, *lengths])
        # random choices (anchors) depend only on (seed, step, slot): resume and any rank or
        # accumulation split reproduce them exactly
        generator = torch.Generator().manual_seed(micro_batch_seed(cfg.seed, step, plan.slot))
        micro.append(to_device(algorithm.prepare(model, batch, generator, cfg.options), ctx.device))
    weight_sum = sum(algorithm.weight(model, prepared) for prepared in micro).to(ctx.device, torch.float32)
    if ctx.sharded:
        dist.all_reduce(weight_sum)
    # FSDP averages gradients over ranks; each rank's loss is already its share of the global mean
    grad_scale = float(ctx.world_size)
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
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    # the rate this step uses (get_last_lr after scheduler.step() would be the next step's)
    step_lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    # the step's one host read of the device (after one all-reduce when sharded)
    totals = metrics.read(ctx, num_tokens=num_tokens, grad_norm=grad_norm)
    grad_norm = totals.pop("grad_norm")
    step_time = time.perf_counter() - t0
    run.elapsed_s += step_time
    return {
        "step": step + 1,
        "lr": step_lr,
        "grad_norm": grad_norm,
        "step_time_s": step_time,
        "elapsed_s": run.elapsed_s,
        "tok_per_s": totals["num_tokens"] / step_time,
        # loss terms add up over micro-batches and ranks; tau estimates come from pooled counts
        **totals,
    }


def _log_heldout(run: _Run, step_done: int, row: dict | None) -> None:
    """Add the held-out tau after ``step_done`` steps to ``row`` (the step's log row), or log a row of its
    own (``row`` None: step 0); rank 0 prints it."""
    result = run.heldout.evaluate(run.model, run.template)  # every rank takes part (sharded weights are gathered)
    if not run.ctx.is_main:
        return
    if row is None:
        run.log.add({"step": step_done, "elapsed_s": run.elapsed_s, **result})
    else:
        row.update(result)
    print(f"train: step {step_done}: held-out greedy tau {result['heldout_tau']:.2f} ("
          + ", ".join(f"{k[len('heldout_tau_'):]} {v:.2f}" for k, v in result.items() if k.startswith("heldout_tau_"))
          + ")", flush=True)
    if "heldout_conf_pairs" in result:
        print(f"train: step {step_done}: confidence head on {int(result['heldout_conf_pairs'])} held-out slots: "
              f"accept rate {result['heldout_conf_accept_rate']:.3f}, mean confidence raw "
              f"{result['heldout_conf_mean']:.3f} / calibrated {result['heldout_conf_mean_calibrated']:.3f}, "
              f"AUROC {result['heldout_conf_auroc']:.3f} / {result['heldout_conf_auroc_calibrated']:.3f}, "
              f"ECE {result['heldout_conf_ece']:.3f} / {result['heldout_conf_ece_calibrated']:.3f} "
              "(in-sample; saved with the draft)", flush=True)
    if run.heldout.calibration is not None:  # the last fit goes into every later checkpoint's draft folder
        for module in (run.model, run.template):
            if module is not None and hasattr(module, "confidence_calibration"):
                module.confidence_calibration = run.heldout.calibration


def _train_out_of_memory(exc: BaseException, cfg: TrainConfig, ctx: Dist, step: int,
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
