"""Draft training settings: :class:`TrainConfig`, the fields ``deepspec train`` exposes as flags, with
their checks (each error names the field and says how to fix it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepspec.algorithms.registry import ALGORITHMS
from deepspec.data.cache.format import check_storage_dtype
from deepspec.device import check_device_name, resolve_dtype
from deepspec.eval.benchmarks import BENCHMARKS
from deepspec.models.config import draft_backbone


@dataclass(kw_only=True)
class TrainConfig:
    """Draft training settings. Defaults suit the embedded default target on a 2-core CPU."""

    # -- Data and target --
    output_dir: str  # folder for checkpoint-N/, latest, train_log.jsonl, train_loss.png
    # Data: exactly one of a target cache (`deepspec cache`) or, in online mode, a prepared JSONL file
    # (`deepspec prepare`) whose target features the frozen target computes inside the training loop.
    cache_dir: str | None = None  # a target cache folder (`deepspec cache`)
    online_data: str | None = None  # online mode: a prepared JSONL; the target computes the features here
    target_layer_ids: list[int] | None = None  # online: None = default spacing; cache: checked if given
    num_target_layers: int = 5  # online, when target_layer_ids is None
    max_seq_len: int = 1024  # online only (a cache records its own)
    online_feature_dtype: str = "float32"  # online only: the cache storage dtype to reproduce (or fp8)
    # none: the target the cache records (`deepspec cache --target`; online mode and older caches: the embedded
    # SmolLM2) | "default": the embedded SmolLM2 | a Hugging Face model folder | a GGUF file
    target: str | None = None
    # with --target: a Jinja chat template file (or a built-in name: gemma3) replacing the
    # target's (a cache records the target with its template)
    chat_template: str | None = None
    # -- Draft --
    # (the --help text is the trailing comment; tests/integration/test_train_resume.py checks that it lists every
    # algorithm of deepspec.algorithms.registry.ALGORITHMS)
    algorithm: str = "dspark"  # the drafting algorithm: dspark | dflash | eagle3 (deepspec.algorithms.registry)
    num_draft_layers: int = 1  # decoder layers of the draft
    # the draft layers' attention: qwen3 (per-head q/k RMSNorm, no bias, for any target family: the layer vLLM's
    # DSpark loader builds) | target (the target family's own) | auto (qwen3 for dspark/dflash, target for eagle3
    # and with --init-from-target)
    draft_backbone: str = "auto"
    # dspark/dflash: slots per draft block (the anchor + block_size - 1 mask slots, each proposes one token);
    # eagle3: the number of unrolled training-time-test steps (tokens proposed per step)
    block_size: int = 7
    # dflash: false = z-lab's DFlash layout (each mask slot predicts the token at its own position, the anchor
    # slot nothing: block_size - 1 tokens per block), the one vLLM's method "dflash" runs (export --format
    # vllm-dflash); true = DeepSpec's (the anchor slot proposes too, as DSpark)
    sample_from_anchor: bool = True
    num_anchors: int = 32  # anchor positions sampled per sequence per step (docs/design/training.md, "Anchors")
    markov_rank: int = 256  # rank of the DSpark Markov head's low-rank bigram factorisation (dspark only)
    markov_head: str = "vanilla"  # DSpark Markov head variant: vanilla | gated | rnn (dspark only)
    mask_token: str | None = None  # token used as the block's mask input; None = a spare embedding row
    # the draft proposes from the N target tokens most frequent among the training data's supervised
    # tokens (saved with the draft as its d2t id map; every algorithm); 0 or none = the full target vocabulary
    draft_vocab_size: int | None = None
    # dspark/dflash: start the draft's decoder layer(s) and final norm as copies of the target's last layer(s)
    init_from_target: bool = False
    # with --init-from-target: the target layers (0-based, one per draft layer) to copy; none = the last ones
    init_from_target_layers: list[int] | None = None
    # -- Loss --
    # dspark/dflash loss weights and slot decay (docs/design/training.md, "DSpark / DFlash loss");
    # none = the algorithm's own (DSpark: ce 0.1, l1 0.9,
    # confidence 1.0, gamma 4.0 as the original; DFlash: ce 1.0 only)
    ce_weight: float | None = None
    l1_weight: float | None = None
    confidence_weight: float | None = None
    loss_decay_gamma: float | None = None
    # -- Optimiser --
    batch_size: int = 4  # sequences per micro-batch
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = 200  # optimizer steps
    lr: float = 6e-4  # peak learning rate (AdamW), after linear warmup, then cosine decay
    warmup_frac: float = 0.04  # fraction of max_steps spent in linear warmup
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm
    # fp32 | bf16 (autocast) for the draft's forward (float32 / bfloat16 are accepted too) | auto (bf16 where
    # the hardware runs it fast: CUDA, a CPU with AMX / AVX512-BF16; deepspec.device.resolve_dtype)
    dtype: str = "auto"
    # DSpark/DFlash: compute the draft logits of the supervised slots one chunk at a time in the loss,
    # recomputed in backward (memory chunk x vocab instead of batch x anchors x block x vocab; each chunk's
    # output layers run once more): auto (on when those logits would exceed 256 MiB in fp32) | on | off
    chunked_head_loss: str = "auto"
    # where each process trains: auto (cuda:LOCAL_RANK when CUDA is available, else cpu) | cpu | cuda | cuda:N
    device: str = "auto"
    # -- Checkpoints --
    save_every: int = 0  # 0: save only at the end
    keep_last: int = 0  # keep the newest N checkpoint-*/ folders (never the one `latest` names); 0 = keep all
    seed: int = 0  # seeds the draft init and the data order
    # none: start from step 0 in an output_dir that holds no earlier run | auto: continue the run in output_dir
    # (its `latest`) | never: start from step 0, replacing the run in output_dir | a checkpoint folder to continue
    resume: str | None = None
    # -- Learning curve --
    # Learning curve: greedy tau on a fixed held-out prompt set (deepspec.train.heldout), at step 0, every
    # heldout_every steps and at the end; logged to train_log.jsonl, TensorBoard and train_loss.png
    heldout_every: int = 0  # held-out greedy tau every N steps (and at steps 0 and max_steps); 0 = off
    heldout_benchmarks: list[str] = dataclasses.field(default_factory=lambda: ["gsm8k", "mt-bench"])  # prompt sets
    heldout_num_prompts: int = 4  # prompts per held-out benchmark (seeded sample, first turn)
    heldout_max_new_tokens: int = 64  # output tokens per held-out prompt

    def uses_bf16(self, device: torch.device) -> bool:
        """Whether the draft's forward runs under bf16 autocast on ``device`` (``dtype`` bf16, or auto
        where :func:`deepspec.device.resolve_dtype` picks bfloat16 there)."""
        return self.dtype == "bf16" or (self.dtype == "auto" and resolve_dtype("auto", device) == torch.bfloat16)

    def __post_init__(self) -> None:
        if (self.cache_dir is None) == (self.online_data is None):
            raise ValueError(
                "train.cache_dir / train.online_data: expected exactly one of them (a target cache folder, or a "
                f"prepared JSONL file for online mode), got cache_dir={self.cache_dir!r}, online_data={self.online_data!r}"
            )
        check_storage_dtype(self.online_feature_dtype, "train.online_feature_dtype")
        positive = ("num_draft_layers", "block_size", "num_anchors", "batch_size", "grad_accum_steps", "max_steps",
                    "num_target_layers", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}: expected an integer >= 1, got {getattr(self, name)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"train.algorithm: expected one of {sorted(ALGORITHMS)}, got {self.algorithm!r}")
        if self.algorithm != "eagle3" and self.block_size < 2:
            raise ValueError(f"train.block_size: expected an integer >= 2 for {self.algorithm} (the anchor slot and at "
                             f"least one mask slot), got {self.block_size}")
        if not self.sample_from_anchor and self.algorithm != "dflash":
            raise ValueError(f"train.sample_from_anchor: false is z-lab's DFlash layout, for --algorithm dflash only, "
                             f"got it with {self.algorithm!r}; drop --sample-from-anchor false or train dflash")
        self.dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(self.dtype, self.dtype)  # the decoding spelling
        if self.dtype not in ("fp32", "bf16", "auto"):
            raise ValueError(f"train.dtype: expected 'fp32', 'bf16' or 'auto' (or 'float32' / 'bfloat16'), got "
                             f"{self.dtype!r}; auto picks bf16 where the hardware runs it fast")
        if self.chunked_head_loss not in ("auto", "on", "off"):
            raise ValueError(f"train.chunked_head_loss: expected auto, on or off, got {self.chunked_head_loss!r}")
        self.device = check_device_name(self.device, "train.device")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"train.warmup_frac: expected a fraction in [0, 1), got {self.warmup_frac}")
        if self.save_every < 0 or self.keep_last < 0:
            raise ValueError(
                f"train.save_every and train.keep_last: expected integers >= 0, got {self.save_every} and {self.keep_last}"
            )
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError(f"train.lr and train.grad_clip must be > 0, got {self.lr} and {self.grad_clip}")
        if self.heldout_every < 0:
            raise ValueError(f"train.heldout_every: expected an integer >= 0 (0 = off), got {self.heldout_every}")
        if self.heldout_num_prompts < 1 or self.heldout_max_new_tokens < 1:
            raise ValueError(f"train.heldout_num_prompts and train.heldout_max_new_tokens: expected integers >= 1, "
                             f"got {self.heldout_num_prompts} and {self.heldout_max_new_tokens}")
        if self.heldout_every and not self.heldout_benchmarks:
            raise ValueError("train.heldout_benchmarks: expected at least one benchmark name when heldout_every > 0")
        unknown = [b for b in self.heldout_benchmarks if b not in BENCHMARKS]
        if unknown:
            raise ValueError(f"train.heldout_benchmarks: {unknown} are not benchmarks; expected names among "
                             f"{sorted(BENCHMARKS)}")
        if self.draft_vocab_size == 0:
            self.draft_vocab_size = None  # 0 and None both mean the full vocabulary
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"train.draft_vocab_size: expected 0 / none (full vocabulary) or a positive number of "
                             f"draft tokens, got {self.draft_vocab_size}")
        losses = self.loss_knobs()
        if losses and self.algorithm == "eagle3":
            flags = ", ".join("--" + name.replace("_", "-") for name in losses)
            raise ValueError(f"train: {flags} set the DSpark/DFlash loss; eagle3 has its own, drop them")
        for name, value in losses.items():
            if value < 0 or (name == "loss_decay_gamma" and value == 0):
                raise ValueError(f"train.{name}: expected a value {'> 0' if name == 'loss_decay_gamma' else '>= 0'}, "
                                 f"got {value}")
        draft_backbone(self.draft_backbone, self.algorithm)  # a bad name fails here, naming the field
        if self.init_from_target_layers is not None and not self.init_from_target:
            raise ValueError(f"train.init_from_target_layers: names the target layers to copy with --init-from-target, "
                             f"got {self.init_from_target_layers} without it; add --init-from-target or drop the list")

    def loss_knobs(self) -> dict[str, float]:
        """The loss settings given (not None), as :class:`~deepspec.algorithms.dspark.config.DraftConfig` knobs."""
        names = ("ce_weight", "l1_weight", "confidence_weight", "loss_decay_gamma")
        return {n: float(getattr(self, n)) for n in names if getattr(self, n) is not None}
