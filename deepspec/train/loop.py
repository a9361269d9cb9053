"""The draft training loop: one loop, no algorithm branches.

Legend: B sequences per micro-batch, S sequence length, A anchors per sequence, K block_size,
F target feature width, H target hidden, V vocab.

Optimisation follows the original recipe (DESIGN section 7): AdamW with fp32 master weights,
linear warmup then cosine decay to 0, gradient clipping, gradient accumulation. Loss terms are
normalised by the decay-weight sum of the *whole global batch* (every micro-batch of a step), so a
step's gradient equals that of one big batch whatever the accumulation count (DESIGN section 5).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from deepspec.data.cache import TargetCache, check_compatible
from deepspec.data.online import OnlineTargetFeatures
from deepspec.models.mask_token import check_mask_token_absent
from deepspec.models.registry import ALGORITHMS, get_algorithm
from deepspec.target.capture import default_target_layer_ids, validate_target_layer_ids
from deepspec.target.load import load_target, target_fingerprint, tokenizer_fingerprint
from deepspec.train.data import collate, micro_batch_indices
from deepspec.utils import atomic_path, atomic_write_json, atomic_write_text

TRAINER_STATE = "trainer_state.pt"
LATEST = "latest"


@dataclass(kw_only=True)
class TrainConfig:
    """Draft training settings. Defaults suit the embedded default target on a 2-core CPU."""

    output_dir: str  # folder for checkpoint-N/, latest, train_log.jsonl, train_loss.png
    # Data: exactly one of a target cache (`deepspec cache`) or, in online mode, a prepared JSONL file
    # (`deepspec prepare`) whose target features the frozen target computes inside the training loop.
    cache_dir: str | None = None  # a target cache folder (`deepspec cache`)
    online_data: str | None = None  # online mode: a prepared JSONL; the target computes the features here
    target_layer_ids: list[int] | None = None  # online: None = default spacing; cache: checked if given
    num_target_layers: int = 5  # online, when target_layer_ids is None
    max_seq_len: int = 1024  # online only (a cache records its own)
    online_feature_dtype: str = "float32"  # online only: the cache storage dtype to reproduce (or fp8)
    target: str = "default"  # "default" (the embedded SmolLM2) or a Hugging Face model folder
    algorithm: str = "dspark"  # a registered algorithm (deepspec.models.registry): dspark | dflash | ...
    num_draft_layers: int = 1  # decoder layers of the draft
    block_size: int = 7  # slots per draft block: the anchor + block_size - 1 mask slots, each proposes one token
    num_anchors: int = 32  # anchor positions sampled per sequence per step (DESIGN s.5)
    markov_rank: int = 256  # rank of the Markov head's low-rank bigram factorisation
    markov_head: str = "vanilla"  # DSpark Markov head variant: vanilla | gated | rnn
    mask_token: str | None = None  # token used as the block's mask input; None = a spare embedding row
    batch_size: int = 4  # sequences per micro-batch
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = 200  # optimizer steps
    lr: float = 6e-4  # peak learning rate (AdamW), after linear warmup, then cosine decay
    warmup_frac: float = 0.04  # fraction of max_steps spent in linear warmup
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm
    dtype: str = "fp32"  # fp32 | bf16 (autocast) for the draft's forward
    save_every: int = 0  # 0: save only at the end
    seed: int = 0  # seeds the draft init and the data order
    resume: str | None = None  # None | "auto" | a checkpoint folder

    def __post_init__(self) -> None:
        if (self.cache_dir is None) == (self.online_data is None):
            raise ValueError(
                "train.cache_dir / train.online_data: expected exactly one of them (a target cache folder, or a "
                f"prepared JSONL file for online mode), got cache_dir={self.cache_dir!r}, online_data={self.online_data!r}"
            )
        if self.online_feature_dtype not in ("float32", "bfloat16", "float16", "fp8"):
            raise ValueError(
                "train.online_feature_dtype: expected float32, bfloat16, float16 or fp8, "
                f"got {self.online_feature_dtype!r}"
            )
        positive = ("num_draft_layers", "block_size", "num_anchors", "batch_size", "grad_accum_steps", "max_steps",
                    "num_target_layers", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}: expected an integer >= 1, got {getattr(self, name)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"train.algorithm: expected one of {sorted(ALGORITHMS)}, got {self.algorithm!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"train.dtype: expected 'fp32' or 'bf16', got {self.dtype!r}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"train.warmup_frac: expected a fraction in [0, 1), got {self.warmup_frac}")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError(f"train.lr and train.grad_clip must be > 0, got {self.lr} and {self.grad_clip}")


def build_draft(target_model, tokenizer, cfg: TrainConfig, target_layer_ids: list[int]) -> torch.nn.Module:
    """A freshly initialised draft of ``cfg.algorithm`` and the shape ``cfg`` asks for, seeded by ``cfg.seed``.

    The same call with the same seed gives the same untrained draft (used as the eval control).
    """
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(cfg.seed)
        return get_algorithm(cfg.algorithm).build(target_model, tokenizer, cfg, target_layer_ids)


def _lr_schedule(optimizer, cfg: TrainConfig):
    return get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=math.ceil(cfg.warmup_frac * cfg.max_steps), num_training_steps=cfg.max_steps
    )


def _resolve_resume(cfg: TrainConfig) -> Path | None:
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        pointer = Path(cfg.output_dir) / LATEST
        return Path(cfg.output_dir) / pointer.read_text().strip() if pointer.exists() else None
    path = Path(cfg.resume)
    if not (path / TRAINER_STATE).exists():
        raise ValueError(f"train.resume: {path} is not a checkpoint folder (no {TRAINER_STATE}); pass one or 'auto'")
    return path


def save_checkpoint(model, optimizer, scheduler, *, step: int, cfg: TrainConfig) -> Path:
    """Write ``checkpoint-<step>/`` (draft safetensors + config.json + trainer state) atomically and
    point ``latest`` at it."""
    out = Path(cfg.output_dir)
    name = f"checkpoint-{step:06d}"
    with atomic_path(out / name) as tmp:
        tmp.mkdir()
        model.save_pretrained(tmp / "draft")
        torch.save(
            {
                "step": step,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "train_config": asdict(cfg),
                "torch_rng": torch.get_rng_state(),
            },
            tmp / TRAINER_STATE,
        )
    atomic_write_text(out / LATEST, name + "\n")
    return out / name


def open_training_data(cfg: TrainConfig, target_model, tokenizer) -> TargetCache | OnlineTargetFeatures:
    """The training samples: a :class:`TargetCache` (``cfg.cache_dir``) checked against this target,
    tokenizer and (if given) ``cfg.target_layer_ids``, or in online mode (``cfg.online_data``) an
    :class:`OnlineTargetFeatures` over the prepared file that computes features with ``target_model``.

    Both return the same per-sample dicts for the same data and settings (bitwise, see
    :mod:`deepspec.data.online`), so the loop below has no online branch.

    Raises:
        ValueError: a cache built for another target/tokenizer/layer set, or invalid layer ids.
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
    cache = TargetCache(cfg.cache_dir)
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


def train(cfg: TrainConfig, *, target_model=None, tokenizer=None) -> Path:
    """Train a draft on a target cache, or online (``cfg.online_data``); return the final checkpoint folder.

    In online mode the frozen target computes each micro-batch's features inside the loop
    (:class:`deepspec.data.online.OnlineTargetFeatures`, the cache writer's capture rule), so a
    run gives the same losses and weights as one on a float32 cache of the same data.

    The draft weights of a checkpoint are in ``<checkpoint>/draft`` (loadable with
    ``DSparkDraftModel.from_pretrained``). Resume happens only when ``cfg.resume`` asks for it.

    Raises:
        ValueError: the cache was built for another target/tokenizer/layer set, the mask token occurs
            in the data, or a setting is invalid.
    """
    if target_model is None:
        target_model, tokenizer = load_target(cfg.target)
    cache = open_training_data(cfg, target_model, tokenizer)
    target_layer_ids = cache.target_layer_ids
    algorithm = get_algorithm(cfg.algorithm)
    model = build_draft(target_model, tokenizer, cfg, target_layer_ids)
    check_mask_token_absent(
        model.config.mask_token_id, (cache.read(i, ("input_ids",))["input_ids"] for i in range(len(cache)))
    )

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = _lr_schedule(optimizer, cfg)
    start_step = 0
    resume_from = _resolve_resume(cfg)
    if resume_from is not None:
        state = torch.load(resume_from / TRAINER_STATE, weights_only=False)
        model.load_state_dict(algorithm.load(resume_from / "draft").state_dict())
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        start_step = state["step"]
        print(f"resumed from {resume_from} at step {start_step}")

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "train_config.json", asdict(cfg))
    log_path = out / "train_log.jsonl"
    log_rows = _read_log(log_path, upto_step=start_step)
    model.train()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    generator = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(range(start_step, cfg.max_steps), desc="train", initial=start_step, total=cfg.max_steps)
    last_ckpt = None
    for step in bar:
        t0 = time.perf_counter()
        # The anchors of step s depend only on (seed, s): resume reproduces them exactly.
        generator.manual_seed(cfg.seed * 1_000_003 + step)
        micro = []
        for m in range(cfg.grad_accum_steps):
            indices = micro_batch_indices(
                len(cache), cfg.batch_size, seed=cfg.seed, micro_step=step * cfg.grad_accum_steps + m
            )
            batch = collate([cache[i] for i in indices], indices)
            micro.append(algorithm.prepare(model, batch, generator, cfg))
        weight_sum = sum(algorithm.weight(model, prepared) for prepared in micro)
        totals: dict[str, float] = {}
        for prepared in micro:
            loss_out = algorithm.loss(model, prepared, weight_sum=weight_sum, autocast=autocast)
            loss_out.loss.backward()
            for key, value in loss_out.scalars().items():
                totals[key] = totals.get(key, 0.0) + value
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        row = {
            "step": step + 1,
            "lr": scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "step_time_s": time.perf_counter() - t0,
            **{k: v / cfg.grad_accum_steps if "tau" in k else v for k, v in totals.items()},
        }
        log_rows.append(row)
        with log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        bar.set_postfix(loss=f"{row['loss']:.3f}", tau_est=f"{row.get('tau_estimate', float('nan')):.2f}")
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.max_steps:
            last_ckpt = save_checkpoint(model, optimizer, scheduler, step=step + 1, cfg=cfg)
    if start_step < cfg.max_steps or last_ckpt is None:
        last_ckpt = save_checkpoint(model, optimizer, scheduler, step=cfg.max_steps, cfg=cfg)
    _plot_log(log_rows, out / "train_loss.png")
    return last_ckpt


def _read_log(path: Path, *, upto_step: int) -> list[dict]:
    """Rows of an earlier run's log up to ``upto_step``; the file is rewritten without later rows."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] <= upto_step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _plot_log(rows: list[dict], path: Path) -> None:
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 4))
    for key in ("loss", "ce", "l1", "confidence"):
        if key in rows[0]:
            ax_loss.plot(steps, [r[key] for r in rows], label=key)
    ax_loss.set_xlabel("step")
    ax_loss.set_title("training loss (global-batch normalised)")
    ax_loss.legend()
    if "tau_estimate" in rows[0]:
        ax_tau.plot(steps, [r["tau_estimate"] for r in rows])
    ax_tau.set_xlabel("step")
    ax_tau.set_title("training-time tau estimate")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
