"""Thin stage entry points: load the target, call the library, print where the output went.

The CLI (``deepspec.cli``) builds one of the configs below from its flags and calls the matching
``run_*_stage``; the demo (``deepspec.demo``) calls the same functions in sequence. ``deepspec eval``
has its own stage module next to the evaluation: :mod:`deepspec.eval.stage`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepspec.data.cache.format import check_storage_dtype
from deepspec.data.cache.verify import verify_target_cache
from deepspec.data.cache.writer import write_target_cache
from deepspec.data.estimate import run_estimate
from deepspec.data.prepare import PrepareConfig, run_prepare
from deepspec.device import cast_for_decoding, check_device_name, check_dtype_name, resolve_device, resolve_dtype
from deepspec.models.config import unsupported_family_note
from deepspec.serve import openai_server
from deepspec.target import load  # load.open_target, where tests stub load.load_target
from deepspec.target.capture import validate_target_layer_ids
from deepspec.target.load import load_target, recorded_target_name
from deepspec.train.loop import train
from deepspec.utils import format_bytes, torchrun_env


@dataclass(kw_only=True)
class CacheConfig:
    """``deepspec cache``: capture target features for every prepared conversation (or, with
    ``verify``, check an existing cache). Under ``torchrun`` each rank writes its share of the
    shards (rank and world size come from the ``RANK`` / ``WORLD_SIZE`` environment variables)."""

    input: str | None = None  # prepared JSONL (required unless verify)
    output_dir: str  # cache folder (a rerun with the same settings resumes, or does nothing if complete)
    target: str = "default"  # "default" (embedded SmolLM2), a Hugging Face model folder or a GGUF file
    # a Jinja chat template file replacing the target's, or a built-in name (gemma3);
    # GGUF files often carry none (docs/guide/targets.md, "Chat templates")
    chat_template: str | None = None
    target_layer_ids: list[int] | None = None  # None: evenly spaced from 1 to L-3 (docs/design/targets.md, "Target layer ids")
    num_target_layers: int = 5  # layers captured when target_layer_ids is None
    max_seq_len: int = 1024  # samples are cut to this many tokens (prefix kept, counted)
    shard_size: int = 256  # prepared rows per shard
    storage_dtype: str = "bfloat16"  # float32 | bfloat16 | float16 | fp8 (e4m3 + per-token scale)
    # where the target runs: auto (cuda:LOCAL_RANK when CUDA is available, else cpu) | cpu | cuda | cuda:N
    device: str = "auto"
    # the dtype the target runs in to compute the features: float32 | bfloat16 | auto (bfloat16 where the
    # hardware runs it fast, deepspec.device); match the eval's --dtype to train on the features decoding sees
    dtype: str = "auto"
    verify: bool = False  # only check every shard of output_dir against its manifest (no target needed)

    def __post_init__(self) -> None:
        check_storage_dtype(self.storage_dtype, "cache.storage_dtype")
        self.dtype = check_dtype_name(self.dtype, "cache.dtype")
        self.device = check_device_name(self.device, "cache.device")
        for name in ("num_target_layers", "max_seq_len", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"cache.{name}: expected an integer >= 1, got {getattr(self, name)}")
        if self.input is None and not self.verify:
            raise ValueError(
                "cache.input: required (a prepared JSONL file from `deepspec prepare`) unless --verify"
            )


def run_prepare_stage(cfg: PrepareConfig, *, target_model=None, tokenizer=None):
    if cfg.backend == "local":  # backend="openai" needs only the tokenizer
        device = resolve_device(cfg.device, "PrepareConfig.device")
        dtype = resolve_dtype(cfg.dtype, device)
        if target_model is None:
            target_model, tokenizer = load_target(cfg.target, dtype=dtype, device=device,
                                                  chat_template=cfg.chat_template)
        # a copy when the caller's target has another dtype or device
        target_model = cast_for_decoding(target_model, dtype, device)
        note = unsupported_family_note(getattr(target_model, "config", None), "prepare")
        if note:
            print(note, flush=True)
    summary = run_prepare(cfg, model=target_model, tokenizer=tokenizer)
    print(f"prepare: wrote {cfg.output}")
    if summary.kept == 0:
        raise ValueError(f"prepare: no conversation kept ({summary.read} read = skipped {summary.skipped} + failed "
                         f"{summary.failed}); each row's reason is in {summary.skipped_path}. Fix those rows or "
                         f"the settings that refused them, then run again.")
    return summary


def run_verify_cache_stage(cfg: CacheConfig) -> list:
    """``deepspec cache --verify``: check every shard of ``cfg.output_dir`` against its manifest (no
    target needed); returns the list of ShardCheck. Raises ValueError naming the first bad shard."""
    return verify_target_cache(cfg.output_dir)


def run_cache_stage(cfg: CacheConfig, *, target_model=None, tokenizer=None):
    """Build a target cache; returns its CacheSummary (``cfg.verify`` is :func:`run_verify_cache_stage`'s
    job). Under torchrun (``WORLD_SIZE`` > 1) a gloo process group is created for the barriers; each
    rank loads the target on ``cfg.device`` (``auto``: ``cuda:LOCAL_RANK`` when CUDA is available).

    Raises ValueError when ``cfg.verify`` is set, and (see below) for a cache with no sample."""
    import datetime

    if cfg.verify:
        raise ValueError("cache.verify: run_cache_stage builds a cache; run_verify_cache_stage checks one")
    rank, world_size, _ = torchrun_env()
    device = resolve_device(cfg.device, "cache.device")  # checked before any process group or model
    created_group = False
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            # long timeout: ranks may finish their shards hours apart before the final barrier
            dist.init_process_group("gloo", timeout=datetime.timedelta(days=7))
            created_group = True
    try:
        # fingerprinted as loaded (as train and eval take it), then cast to the capture dtype: in place when
        # loaded here, else a copy when the caller's target has another dtype or device
        target = load.open_target(cfg.target, chat_template=cfg.chat_template, model=target_model, tokenizer=tokenizer,
                                  dtype=resolve_dtype(cfg.dtype, device), device=device)
        target_model, tokenizer, fingerprint = target.model, target.tokenizer, target.fingerprint
        note = unsupported_family_note(target_model.config, "cache")
        if note and rank == 0:
            print(note, flush=True)
        layer_ids = cfg.target_layer_ids or target.default_layer_ids(cfg.num_target_layers)
        layer_ids = validate_target_layer_ids(layer_ids, target_model.config.num_hidden_layers)
        summary = write_target_cache(
            cfg.input,
            cfg.output_dir,
            target_model,
            tokenizer,
            target_layer_ids=layer_ids,
            max_seq_len=cfg.max_seq_len,
            shard_size=cfg.shard_size,
            storage_dtype=cfg.storage_dtype,
            target_fingerprint=fingerprint,
            rank=rank,
            world_size=world_size,
            target=recorded_target_name(cfg.target, cfg.chat_template),
        )
    finally:
        if created_group:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank == 0:
        refused = summary.num_refused_empty_mask + summary.num_refused_nonfinite
        details = (
            f"{summary.num_samples} samples, {summary.num_tokens} tokens in {summary.num_shards} shards"
            + ("" if summary.already_complete else f" ({summary.num_shards_reused} reused)")
            + f", {format_bytes(summary.total_bytes)} "
            f"({summary.bytes_per_token:.0f} bytes/token, {summary.storage_dtype}); inputs {summary.num_inputs}, "
            f"held out {summary.num_heldout}, truncated {summary.num_truncated}, refused {refused} "
            f"(no loss token {summary.num_refused_empty_mask}, non-finite features {summary.num_refused_nonfinite}"
            + (f": {summary.refused_nonfinite_ids[:10]}" if summary.refused_nonfinite_ids else "") + ")"
        )
        turns = summary.turns
        if turns:
            details += (
                f"; assistant turns supervised on the target's generated ids {turns.get('num_turns_ids', 0)} "
                f"({turns.get('num_turns_ids_not_verbatim', 0)} whose text renders to other tokens), text only "
                f"{turns.get('num_turns_text', 0)} ({turns.get('num_turns_text_retokenized', 0)} not the "
                f"tokenisation of their text"
                + (f": rows {summary.text_retokenized[:10]}, all in manifest.json text_retokenized"
                   if summary.text_retokenized else "") + ")"
            )
        if summary.already_complete:
            # a rerun checks each shard's size and header only (not its checksum), so say so
            print(
                "cache already complete (manifest.json present); nothing written. Run "
                f"`deepspec cache --output-dir {cfg.output_dir} --verify` to check every shard's checksum"
            )
            print(f"cache: {cfg.output_dir}: {details}")
        else:
            print(f"cache: wrote {cfg.output_dir}: {details}")
    if summary.num_samples == 0:
        raise ValueError(f"cache: no sample to train on in {cfg.output_dir} ({summary.num_inputs} inputs: held out "
                         f"{summary.num_heldout}, refused {summary.num_refused_empty_mask} with no loss token and "
                         f"{summary.num_refused_nonfinite} with non-finite features); check {cfg.input} "
                         f"(a prepare run that kept no conversation writes an empty file).")
    return summary


def run_serve_stage(cfg, *, target_model=None, tokenizer=None) -> None:
    """``deepspec serve``: the target behind an OpenAI-compatible API (see :mod:`deepspec.serve.openai_server`)."""
    openai_server.run_serve_stage(cfg, target_model=target_model, tokenizer=tokenizer)


def run_estimate_stage(cfg):
    """``deepspec estimate``: print the cache size table (see :mod:`deepspec.data.estimate`)."""
    return run_estimate(cfg)


def run_train_stage(cfg, *, target_model=None, tokenizer=None) -> Path:
    checkpoint = train(cfg, target_model=target_model, tokenizer=tokenizer)
    if torchrun_env()[0] == 0:
        print(f"train: final checkpoint {checkpoint}")
    return checkpoint
