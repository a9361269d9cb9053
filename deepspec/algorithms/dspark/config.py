"""Typed configuration of a DSpark / DFlash draft model (:class:`DraftConfig`), derived from the target's config,
and the training options ``deepspec train --algorithm dspark | dflash`` builds it from (:class:`DSparkOptions`).

The shape fields are the target's (:class:`~deepspec.models.config.TargetShapeConfig`); only
``num_draft_layers``, ``target_layer_ids``, ``mask_token_id``, ``block_size`` and the head / loss knobs
are chosen.

DFlash is the same config with ``use_markov_head=False, use_confidence_head=False`` and loss
weights ``ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0`` (see :func:`dflash_knobs`).

Block layout (``sample_from_anchor``). A block is ``[anchor, mask x (K-1)]`` at positions
``a .. a+K-1`` either way. DeepSpec's and the original's layout (True, vLLM's DSpark
``sample_from_anchor``): slot ``k`` predicts ``x_{a+k+1}``, so a block proposes K tokens. z-lab's DFlash
layout (False, what vLLM's ``method: dflash`` runs): slot ``k`` predicts the token at its own position
``x_{a+k}``, the anchor slot predicts nothing, so a block proposes K-1 tokens (vLLM's
``num_speculative_tokens`` = K-1). Both are the same model; only which slot reads out which label
differs (:attr:`DraftConfig.num_draft_slots`, :attr:`DraftConfig.first_draft_slot`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from deepspec.algorithms.protocol import DraftOptions, option
from deepspec.models.config import TargetShapeConfig, config_error, config_from_dict, target_shape_fields


# DSpark Markov head variants (DeepSpec's ``markov_head_type``; see deepspec.algorithms.dspark.model):
#   vanilla: bias_k = W2 W1[prev_k]
#   gated:   bias_k = W2 (sigmoid(gate_proj([h_k ; W1[prev_k]])) * W1[prev_k])
#   rnn:     s_k = g * s_{k-1} + (1 - g) * tanh(c), bias_k = W2 tanh(o) with
#            [g_raw ; c ; o] = joint_proj([s_{k-1} ; W1[prev_k] ; h_k]), g = sigmoid(g_raw), s_0 = 0
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


# The confidence head's training labels (DraftConfig.confidence_label; deepspec.algorithms.dspark.loss):
#   greedy: 1[draft argmax == target argmax] at slot k, supervised only where slots 1..k-1 matched (T = 0 verify)
#   tv:     1 - TV(draft, target) at slot k, weighted by prod_{j<k} (1 - TV_j) (T > 0 rejection sampling)
CONFIDENCE_LABELS = ("greedy", "tv")


# Architectures written into the draft checkpoint's config.json (original naming).
ARCHITECTURES = {
    "llama": "LlamaDSparkModel",
    "qwen3": "Qwen3DSparkModel",
    "qwen2": "Qwen2DSparkModel",
    "mistral": "MistralDSparkModel",
    # The original has Qwen3DSparkModel and Gemma4DSparkModel only; Gemma 3 gets the same pattern (the
    # original's Gemma 4 class cannot read it: Gemma 4 layers differ).
    "gemma3_text": "Gemma3DSparkModel",
}


_LOSS = "sets the DSpark / DFlash loss"
_MARKOV = "has no Markov head (only dspark has one)"
_INIT = "copies the target's layers into a DSpark / DFlash draft"


@dataclass(kw_only=True)
class DSparkOptions(DraftOptions):
    """DSpark's and DFlash's training options (``deepspec train --algorithm dspark | dflash``; the shared draft
    settings come from :class:`~deepspec.algorithms.protocol.DraftOptions`). Another algorithm ignores the
    block, anchor, head and mask-token settings with a warning (a recipe gives them to every algorithm it
    trains) and refuses the layout, init and loss settings (:func:`~deepspec.algorithms.protocol.option`)."""

    # -- DSpark and DFlash --
    # slots per draft block (the anchor + block_size - 1 mask slots, each proposes one token); dspark and dflash
    # only (eagle3's tokens per step are its --ttt-steps; it ignores --block-size with a warning)
    block_size: int = option(7, elsewhere="has no draft blocks (only dspark and dflash have them)")
    # dflash: false = z-lab's DFlash layout (each mask slot predicts the token at its own position, the anchor
    # slot nothing: block_size - 1 tokens per block), the one vLLM's method "dflash" runs (export --format
    # vllm-dflash); true = DeepSpec's (the anchor slot proposes too, as DSpark)
    sample_from_anchor: bool = option(True, elsewhere="false is z-lab's DFlash layout, for --algorithm dflash only",
                                      refused_elsewhere=True)
    # anchor positions sampled per sequence per step (docs/design/training.md, "Anchors")
    num_anchors: int = option(32, elsewhere="samples no anchors (only dspark and dflash do)")
    # DSpark Markov head variant: vanilla | gated | rnn (dspark only)
    markov_head: str = option("vanilla", elsewhere=_MARKOV)
    # rank of the DSpark Markov head's low-rank bigram factorisation (dspark only)
    markov_rank: int = option(256, elsewhere=_MARKOV)
    # token used as the block's mask input; None = a spare embedding row
    mask_token: str | None = option(None, elsewhere="has no mask token (only dspark and dflash have one)")
    # start the draft's decoder layer(s) and final norm as copies of the target's last layer(s)
    init_from_target: bool = option(False, elsewhere=_INIT, refused_elsewhere=True)
    # with --init-from-target: the target layers (0-based, one per draft layer) to copy; none = the last ones
    init_from_target_layers: list[int] | None = option(None, elsewhere=_INIT, refused_elsewhere=True)
    # the loss weights and slot decay (docs/design/training.md, "DSpark / DFlash loss"); none = the algorithm's
    # own (DSpark: ce 0.1, l1 0.9, confidence 1.0, gamma 4.0 as the original; DFlash: ce 1.0 only)
    ce_weight: float | None = option(None, elsewhere=_LOSS, refused_elsewhere=True)
    l1_weight: float | None = option(None, elsewhere=_LOSS, refused_elsewhere=True)
    confidence_weight: float | None = option(None, elsewhere=_LOSS, refused_elsewhere=True)
    loss_decay_gamma: float | None = option(None, elsewhere=_LOSS, refused_elsewhere=True)
    # the confidence head's training label (docs/design/training.md, "DSpark / DFlash loss"): greedy (slot k's draft
    # argmax equals the target's, trained only where slots 1..k-1 matched: the T = 0 verify rule) | tv (1 - TV
    # distance, weighted by the chance that slots 1..k-1 were accepted: the T > 0 rule); none = greedy
    confidence_label: str | None = option(None, elsewhere=_LOSS, refused_elsewhere=True)
    # compute the draft logits of the supervised slots one chunk at a time in the loss, recomputed in backward
    # (memory chunk x vocab instead of batch x anchors x block x vocab; each chunk's output layers run once more):
    # auto (on when those logits would exceed 256 MiB in fp32) | on | off
    chunked_head_loss: str = option("auto", elsewhere="computes no DSpark / DFlash block logits to chunk")


def loss_knobs(options: DSparkOptions) -> dict[str, float]:
    """The loss settings ``options`` gives (not None), as :class:`DraftConfig` knobs."""
    names = ("ce_weight", "l1_weight", "confidence_weight", "loss_decay_gamma")
    return {n: float(getattr(options, n)) for n in names if getattr(options, n) is not None}


def _err(field_name: str, expected: str, received: Any, fix: str) -> ValueError:
    return config_error(field_name, expected, received, fix, "DraftConfig")


@dataclass(kw_only=True)
class DraftConfig(TargetShapeConfig):
    """All shape and algorithm fields of a draft model (DSpark, or DFlash with the heads off).

    Shape fields mirror the target (:class:`TargetShapeConfig`, see :func:`draft_config_from_target`).
    Validated in ``__post_init__``; errors are ``ValueError`` naming field, expected, received, fix.
    """

    # Loss knobs (training only) and markov_head_type (drafts saved before it existed are "vanilla").
    OPTIONAL_ON_LOAD: ClassVar[tuple[str, ...]] = TargetShapeConfig.OPTIONAL_ON_LOAD + (
        "markov_head_type", "loss_decay_gamma", "ce_weight", "l1_weight", "confidence_weight", "sample_from_anchor",
        "confidence_label", "confidence_head_with_markov")

    # --- draft knobs ---
    num_draft_layers: int
    block_size: int = 7
    mask_token_id: int
    markov_rank: int = 256
    markov_head_type: str = "vanilla"  # one of MARKOV_HEAD_TYPES
    use_markov_head: bool = True
    use_confidence_head: bool = True
    # the confidence head reads [hidden ; markov_w1[prev]] (True, the released DSpark drafts) or the hidden state
    # alone (False); without a Markov head it reads the hidden state alone either way. The original's key of the
    # same name (deepspec/modeling/dspark/qwen3/modeling.py)
    confidence_head_with_markov: bool = True
    # True: slot k predicts x_{a+k+1} (K drafts per block); False: z-lab's DFlash layout, slot k predicts
    # x_{a+k} (K-1 drafts, the anchor slot reads out nothing): see the module docstring
    sample_from_anchor: bool = True
    # --- loss (docs/design/training.md, "DSpark / DFlash loss") ---
    loss_decay_gamma: float = 4.0
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    # what the confidence head is trained towards: one of CONFIDENCE_LABELS (the verify rule it predicts)
    confidence_label: str = "greedy"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_draft_layers", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise _err(name, "a positive integer", v, "Check the knob.")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise _err("mask_token_id", f"an id in [0, {self.vocab_size})", self.mask_token_id,
                       "Use a reserved special token (SmolLM2: <repo_name> = 3) or a spare embedding row.")
        if self.pad_token_id is not None and self.mask_token_id == self.pad_token_id:
            raise _err("mask_token_id", f"!= pad_token_id ({self.pad_token_id})", self.mask_token_id,
                       "Never fall back to pad; use a reserved token absent from the data (docs/design/draft-models.md).")
        if self.mask_token_id in self.eos_token_ids:
            raise _err("mask_token_id", f"not an eos id ({self.eos_token_ids})", self.mask_token_id,
                       "Never fall back to eos; use a reserved token absent from the data (docs/design/draft-models.md).")
        if self.block_size < 2:
            raise _err("block_size", ">= 2", self.block_size, "The original uses 7.")
        if self.use_markov_head and (not isinstance(self.markov_rank, int) or self.markov_rank <= 0):
            raise _err("markov_rank", "a positive integer when use_markov_head", self.markov_rank,
                       "Set markov_rank=256 or use_markov_head=False.")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise _err("markov_head_type", f"one of {MARKOV_HEAD_TYPES}", self.markov_head_type,
                       "Use 'vanilla' (the default), 'gated' or 'rnn' (train --markov-head).")
        if self.loss_decay_gamma <= 0:
            raise _err("loss_decay_gamma", "> 0", self.loss_decay_gamma, "The original uses 4.0.")
        for name in ("ce_weight", "l1_weight", "confidence_weight"):
            if getattr(self, name) < 0:
                raise _err(name, ">= 0", getattr(self, name), "Loss weights are non-negative.")
        if self.confidence_weight > 0 and not self.use_confidence_head:
            raise _err("confidence_weight", "0 when use_confidence_head=False", self.confidence_weight,
                       "Set confidence_weight=0.0 or enable the confidence head.")
        if self.confidence_label not in CONFIDENCE_LABELS:
            raise _err("confidence_label", f"one of {CONFIDENCE_LABELS}", self.confidence_label,
                       "Use 'greedy' (T = 0 verify, the default) or 'tv' (T > 0; train --confidence-label).")
        if self.ce_weight + self.l1_weight + self.confidence_weight <= 0:
            raise _err("ce_weight", "a positive total loss weight", 0.0, "Set ce_weight=1.0 (DFlash).")
        if not isinstance(self.confidence_head_with_markov, bool):
            raise _err("confidence_head_with_markov", "true or false", self.confidence_head_with_markov,
                       "Fix config.json.")
        if not isinstance(self.sample_from_anchor, bool):
            raise _err("sample_from_anchor", "true or false", self.sample_from_anchor, "Fix config.json.")
        if not self.sample_from_anchor and (self.use_markov_head or self.use_confidence_head):
            raise _err("sample_from_anchor", "true for a draft with a Markov or confidence head (z-lab's "
                       "own-position layout is DFlash's, which has neither)", self.sample_from_anchor,
                       "Train --algorithm dflash for that layout, or keep sample_from_anchor true.")

    # ------------------------------------------------------------------ derived
    @property
    def first_draft_slot(self) -> int:
        """The first block slot that proposes a token: 0 (``sample_from_anchor``), else 1."""
        return 0 if self.sample_from_anchor else 1

    @property
    def num_draft_slots(self) -> int:
        """Tokens a block proposes (the proposal length and the supervised slots per block):
        ``block_size``, or ``block_size - 1`` in z-lab's layout. Draft slot ``j`` is block slot
        ``first_draft_slot + j`` and predicts ``x_{a+j+1}`` in both layouts."""
        return self.block_size - self.first_draft_slot

    @property
    def markov_dim(self) -> int:
        """Width of W1[prev] fed to the confidence head: 0 without a Markov head or with
        ``confidence_head_with_markov`` false (the head then reads the hidden state alone)."""
        return self.markov_rank if self.use_markov_head and self.confidence_head_with_markov else 0

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.family]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        """Inverse of :meth:`to_dict` (:func:`config_from_dict`: unknown keys and missing forward-pass
        keys raise ValueError naming them)."""
        return config_from_dict(cls, d)

    @property
    def num_decoder_layers(self) -> int:
        return self.num_draft_layers


def dflash_knobs() -> dict[str, Any]:
    """Knobs turning a DSpark config into DFlash: no heads, CE loss only (docs/design/draft-models.md)."""
    return dict(use_markov_head=False, use_confidence_head=False,
                ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0)


def draft_config_from_target(
    target_config: Any,
    *,
    num_draft_layers: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    block_size: int = 7,
    markov_rank: int = 256,
    markov_head_type: str = "vanilla",
    use_markov_head: bool = True,
    use_confidence_head: bool = True,
    pad_token_id: int | None = None,
    eos_token_ids: list[int] | int | None = None,
    eos_token_id: list[int] | int | None = None,
    backbone: str = "target",
    **knobs: Any,
) -> DraftConfig:
    """Derive a :class:`DraftConfig` from a transformers target config (docs/design/draft-models.md, "Draft shape
    and backbone").

    Args:
        target_config: the target's ``PretrainedConfig`` (or anything with the same attributes).
            Family from ``model_type`` (:data:`deepspec.models.config.SUPPORTED_FAMILIES`).
        markov_head_type: DSpark Markov head variant, one of :data:`MARKOV_HEAD_TYPES`.
        pad_token_id / eos_token_ids: ids the mask token must differ from (tokenizer's; defaults
            to the target config's ``pad_token_id`` / ``eos_token_id``). ``eos_token_id`` (int or
            list, tokenizer spelling) is accepted too; both are merged.
        backbone: the draft layers' attention, ``"target"`` (the family's) or ``"qwen3"`` (q/k norm, no
            bias, for any family; :func:`deepspec.models.config.target_shape_fields`).
        **knobs: any other DraftConfig field (loss weights, gamma, ...). Unknown -> ValueError.
    Raises:
        ValueError: unsupported family, missing config fields, or any DraftConfig validation error.
    """
    known = {f.name for f in dataclasses.fields(DraftConfig)}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise ValueError(f"draft_config_from_target: unknown knobs {unknown}; expected DraftConfig fields. "
                         "Fix the spelling.")
    return DraftConfig(
        **target_shape_fields(target_config, target_layer_ids=target_layer_ids, pad_token_id=pad_token_id,
                              eos_token_ids=eos_token_ids, eos_token_id=eos_token_id, backbone=backbone),
        num_draft_layers=num_draft_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        use_markov_head=use_markov_head,
        use_confidence_head=use_confidence_head,
        **knobs,
    )
