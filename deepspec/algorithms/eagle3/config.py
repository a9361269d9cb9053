"""Typed configuration of an Eagle3 draft (:class:`Eagle3Config`), derived from the target's config, and the
training options ``deepspec train --algorithm eagle3`` builds it from (:class:`Eagle3Options`).

The shape fields are the target's (:class:`~deepspec.models.config.TargetShapeConfig`, as for DSpark);
the knobs are the training-time-test steps and their loss decay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from deepspec.algorithms.protocol import DraftOptions, option
from deepspec.models.config import TargetShapeConfig, config_from_dict, target_shape_fields

ALGORITHM_NAME = "eagle3"
DEFAULT_TTT_STEPS = 7  # the original's
DEFAULT_NUM_CHAINS = 32  # the supervision budget of DSpark's default anchors (32 blocks of 7)


@dataclass(kw_only=True)
class Eagle3Options(DraftOptions):
    """Eagle3's training options (``deepspec train --algorithm eagle3``; the shared draft settings come from
    :class:`~deepspec.algorithms.protocol.DraftOptions`). Eagle3 ignores DSpark's block, anchor, head and
    mask-token flags with a warning and refuses its layout, loss and ``--init-from-target`` flags: its decoder
    layer's q/k/v projections read ``[embedding ; hidden]`` (2H inputs, the target's read H), so it cannot start
    as a copy of a target layer. Eagle3 read ``--block-size`` and ``--num-anchors`` before it had these options."""

    # -- Eagle3 --
    # unrolled training-time-test steps = tokens drafted per proposal; none = 7 (the original's). eagle3 only
    # (dspark's and dflash's are --block-size, which eagle3 ignores with a warning)
    ttt_steps: int | None = option(None, elsewhere="has no training-time-test steps (only eagle3 unrolls them)")
    # chain starts supervised per sequence per step, drawn among the supervised rows (the supervision budget of
    # --num-anchors for dspark, which eagle3 ignores with a warning); 0 = every row; none = 32
    num_chains: int | None = option(None, elsewhere="has no training-time-test chains (only eagle3 samples them)")


@dataclass(kw_only=True)
class Eagle3Config(TargetShapeConfig):
    """Shape (copied from the target, as for DSpark: :class:`TargetShapeConfig`) and TTT knobs of an
    Eagle3 draft."""

    ttt_steps: int = 7  # unrolled training steps = tokens drafted per proposal
    step_decay: float = 0.8  # weight of TTT step k is step_decay ** k

    # step_decay is a loss weight (training only); see config_from_dict.
    OPTIONAL_ON_LOAD: ClassVar[tuple[str, ...]] = TargetShapeConfig.OPTIONAL_ON_LOAD + ("step_decay",)

    # Eagle3 has no mask token. The trainer checks ``config.mask_token_id`` against the data; -1 never
    # occurs there, so the check is a no-op for Eagle3.
    mask_token_id: int = dataclasses.field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()  # the shape fields (family, heads, layer ids, ...)
        if not isinstance(self.ttt_steps, int) or isinstance(self.ttt_steps, bool) or self.ttt_steps < 1:
            raise ValueError(f"Eagle3Config.ttt_steps: expected an integer >= 1, received {self.ttt_steps!r}. "
                             "The original uses 7.")
        if not 0.0 < self.step_decay <= 1.0:
            raise ValueError(f"Eagle3Config.step_decay: expected a value in (0, 1], received {self.step_decay!r}. "
                             "The original uses 0.8.")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("mask_token_id")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        """Inverse of :meth:`to_dict` (:func:`~deepspec.models.config.config_from_dict`: unknown keys
        and missing forward-pass keys raise ValueError naming them)."""
        return config_from_dict(cls, d)


def eagle3_config_from_target(target_config: Any, *, target_layer_ids: list[int], ttt_steps: int = 7,
                              step_decay: float = 0.8, pad_token_id: int | None = None,
                              eos_token_id: list[int] | int | None = None,
                              draft_vocab_size: int | None = None, backbone: str = "target") -> Eagle3Config:
    """Derive an :class:`Eagle3Config` from a transformers target config (same family and ``backbone``
    rules as DSpark's :func:`deepspec.algorithms.dspark.config.draft_config_from_target`)."""
    return Eagle3Config(**target_shape_fields(target_config, target_layer_ids=target_layer_ids,
                                              pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                                              backbone=backbone),
                        ttt_steps=ttt_steps, step_decay=step_decay, draft_vocab_size=draft_vocab_size)
