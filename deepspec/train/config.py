"""Draft training settings: :class:`TrainConfig`, the fields ``deepspec train`` exposes as flags, with
their checks (each error names the field and says how to fix it).

:class:`TrainConfig` is the shared settings (:class:`TrainSettings`) plus the union of the registered
algorithms' options (each algorithm's ``Options`` dataclass, a
:class:`~deepspec.algorithms.protocol.DraftOptions`), built from the registry by :func:`train_config_class`:
a new algorithm's options become flags, recipe keys and ``train_config.json`` keys without a line here. The
chosen algorithm reads its own options (:attr:`TrainSettings.options`) and checks them; another algorithm's
option set away from its default is ignored with a warning, or refused, as its field says
(:func:`deepspec.algorithms.protocol.option`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from deepspec.algorithms.protocol import OPTION_ELSEWHERE, OPTION_REFUSED_ELSEWHERE, DraftOptions
from deepspec.algorithms.registry import (ALGORITHMS, DEFAULT_ALGORITHM, get_algorithm, option_classes,
                                          option_owners)
from deepspec.config import _show_default  # a value as the CLI spells it
from deepspec.data.cache.format import check_storage_dtype
from deepspec.device import check_device_name, resolve_dtype
from deepspec.eval.benchmarks import BENCHMARKS
from deepspec.models.config import draft_backbone


@dataclass(kw_only=True)
class TrainSettings:
    """The training settings every algorithm shares: the base of :class:`TrainConfig`, which adds the
    algorithms' options (and with them :class:`~deepspec.algorithms.protocol.DraftOptions`' shared draft
    settings, which the checks here read). Defaults suit the embedded default target on a 2-core CPU."""

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
    # algorithm of deepspec.algorithms.registry.ALGORITHMS; each algorithm's own options follow, in its section)
    algorithm: str = DEFAULT_ALGORITHM  # the drafting algorithm: dspark | dflash | eagle3 (deepspec.algorithms.registry)
    # the draft proposes from the N target tokens most frequent among the training data's supervised
    # tokens (saved with the draft as its d2t id map; every algorithm); 0 or none = the full target vocabulary
    draft_vocab_size: int | None = None
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
        positive = ("num_draft_layers", "batch_size", "grad_accum_steps", "max_steps", "num_target_layers", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}: expected an integer >= 1, got {getattr(self, name)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"train.algorithm: expected one of {sorted(ALGORITHMS)}, got {self.algorithm!r}")
        self.dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(self.dtype, self.dtype)  # the decoding spelling
        if self.dtype not in ("fp32", "bf16", "auto"):
            raise ValueError(f"train.dtype: expected 'fp32', 'bf16' or 'auto' (or 'float32' / 'bfloat16'), got "
                             f"{self.dtype!r}; auto picks bf16 where the hardware runs it fast")
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
        draft_backbone(self.draft_backbone, "qwen3")  # a bad name fails here, naming the field
        algorithm = get_algorithm(self.algorithm)
        missing = [f.name for f in dataclasses.fields(algorithm.Options) if not hasattr(self, f.name)]
        if missing:
            raise ValueError(f"train.algorithm: {self.algorithm}'s options {missing} are not fields of this "
                             f"{type(self).__name__} (registered after it was built); build the config with "
                             "deepspec.train.config.train_config_class()")
        own = self._own_flags()
        for field, _ in self.foreign_options(refused=True):
            raise ValueError(f"train.{field.name}: {field.metadata[OPTION_ELSEWHERE]}; {self.algorithm} has its own "
                             f"options{f' ({own})' if own else ''}: drop --{_flag(field.name)}")
        algorithm.check_options(self.options)

    @property
    def options(self) -> DraftOptions:
        """The chosen algorithm's options: an instance of its ``Options`` holding these settings' values."""
        cls = get_algorithm(self.algorithm).Options
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    def foreign_options(self, *, refused: bool) -> list[tuple[dataclasses.Field, Any]]:
        """``(field, value)`` of each option of another algorithm (not of the chosen one's ``Options``) set away
        from its default, among those its field refuses (``refused``) or ignores with a warning."""
        owners = option_owners()
        own = {f.name for f in dataclasses.fields(get_algorithm(self.algorithm).Options)}
        return [(f, getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name in owners and f.name not in own and OPTION_ELSEWHERE in f.metadata
                and bool(f.metadata.get(OPTION_REFUSED_ELSEWHERE)) == refused and _given(self, f)]

    def ignored_option_warnings(self) -> list[str]:
        """The warnings for options set away from their defaults that the chosen algorithm does not read: its own
        options its configuration ignores (``ignored_options``), then other algorithms' (``--FLAG VALUE is
        ignored: a <algorithm> draft <why>``)."""
        algorithm = get_algorithm(self.algorithm)
        fields = {f.name: f for f in dataclasses.fields(self)}
        ignored = [(fields[name], getattr(self, name)) for name in algorithm.ignored_options(self.options)
                   if _given(self, fields[name])]
        return [f"--{_flag(f.name)} {_show_default(value)} is ignored: a {self.algorithm} draft "
                f"{f.metadata[OPTION_ELSEWHERE]}" for f, value in ignored + self.foreign_options(refused=False)]

    def _own_flags(self) -> str:
        shared = {f.name for f in dataclasses.fields(DraftOptions)}
        return ", ".join(f"--{_flag(f.name)}" for f in dataclasses.fields(get_algorithm(self.algorithm).Options)
                         if f.name not in shared)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _default(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _given(cfg: Any, field: dataclasses.Field) -> bool:
    return getattr(cfg, field.name) != _default(field)


_CLASSES: dict[tuple[type, ...], type] = {}


def train_config_class() -> type[TrainSettings]:
    """The training config class for the algorithms registered now: :class:`TrainSettings` and every
    registered ``Options`` class (:func:`deepspec.algorithms.registry.option_classes`) as one keyword-only
    dataclass, the shared fields first (``--help`` reads each field's comment and section from its class's
    source). :data:`TrainConfig` is the one for the registry as imported; the CLI asks again, so an algorithm
    registered later (a test's) gets its flags.

    Raises:
        TypeError: an option named like a shared setting, two algorithms declaring one option with another
            type or default, or an ``Options`` class with a ``__post_init__`` (options are data; the
            algorithm's ``check_options`` checks them).
    """
    options = tuple(option_classes())
    if options not in _CLASSES:
        shared = {f.name for f in dataclasses.fields(TrainSettings)}
        seen: dict[str, tuple[type, dataclasses.Field]] = {}
        for cls in options:
            if "__post_init__" in vars(cls):
                raise TypeError(f"{cls.__qualname__}: an algorithm's options define no __post_init__ (check them in "
                                "its check_options)")
            for f in dataclasses.fields(cls):
                if f.name in shared:
                    raise TypeError(f"{cls.__qualname__}.{f.name}: a shared training setting has this name")
                first = seen.setdefault(f.name, (cls, f))
                if first[1] is not f and (str(first[1].type), _default(first[1])) != (str(f.type), _default(f)):
                    raise TypeError(f"{cls.__qualname__}.{f.name} and {first[0].__qualname__}.{f.name}: one flag, "
                                    "declared with another type or default")
        namespace = {"__module__": __name__, "__qualname__": "TrainConfig",
                     "__doc__": "Draft training settings: the shared ones (TrainSettings) and every registered "
                                "algorithm's options. Defaults suit the embedded default target on a 2-core CPU."}
        # the options' bases after TrainSettings in field order: reversed, since fields follow the reversed MRO
        _CLASSES[options] = dataclass(kw_only=True)(type("TrainConfig", (*reversed(options), TrainSettings),
                                                         namespace))
    return _CLASSES[options]


TrainConfig = train_config_class()
