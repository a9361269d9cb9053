"""Eagle3 (Li et al., "EAGLE-3: Scaling up Inference Acceleration of LLMs via Training-Time Test", 2025): one folder.

- :mod:`.config`: :class:`Eagle3Config` (shape from the target, ``ttt_steps``, ``step_decay``) and
  :class:`Eagle3Options`, the training options.
- :mod:`.model`: :class:`Eagle3DraftModel`, one decoder layer reading ``[embedding ; hidden]``.
- :mod:`.loss`: the training-time-test loss (soft CE against the target, decayed per step).
- :mod:`.proposer`: :class:`Eagle3Proposer`, the chain or tree drafter behind the engine's ``Proposer`` protocol.
- :mod:`.export`: the serving-engine layouts its drafts export to (vllm-eagle3, sglang-eagle3, speculators).

This module is the algorithm adapter the registry holds (:class:`Eagle3Algorithm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deepspec.algorithms.eagle3.config import (ALGORITHM_NAME, DEFAULT_NUM_CHAINS, DEFAULT_TTT_STEPS, Eagle3Options,
                                               eagle3_config_from_target)
from deepspec.algorithms.eagle3.export import FORMATS
from deepspec.algorithms.eagle3.loss import eagle3_loss, ttt_supervision
from deepspec.algorithms.eagle3.model import Eagle3DraftModel
from deepspec.algorithms.eagle3.proposer import Eagle3Proposer
from deepspec.algorithms.protocol import TrainBatch, TrainingShape
from deepspec.models.config import draft_backbone


@dataclass
class _Eagle3MicroBatch:
    batch: TrainBatch
    rows_BS: Tensor | None  # bool: chain starts supervised this step (None = all)


class Eagle3Algorithm:
    """Eagle3 behind :class:`deepspec.algorithms.protocol.DraftAlgorithm`, trained with :class:`Eagle3Options`
    (``ttt_steps`` drafted tokens per step, ``num_chains`` chains per sequence)."""

    name = ALGORITHM_NAME
    Options = Eagle3Options
    export_formats = FORMATS

    def check_options(self, options: Eagle3Options) -> None:
        if options.num_draft_layers != 1:
            raise ValueError(f"train.num_draft_layers: Eagle3 has exactly one decoder layer, received "
                             f"{options.num_draft_layers}; set num_draft_layers=1 for algorithm=eagle3.")
        if options.ttt_steps is not None and options.ttt_steps < 1:
            raise ValueError(f"train.ttt_steps: expected an integer >= 1 (none = {DEFAULT_TTT_STEPS}), got "
                             f"{options.ttt_steps}")
        if options.num_chains is not None and options.num_chains < 0:
            raise ValueError(f"train.num_chains: expected an integer >= 0 (0 = every row, none = "
                             f"{DEFAULT_NUM_CHAINS}), got {options.num_chains}")

    def ignored_options(self, options: Eagle3Options) -> tuple[str, ...]:
        return ()

    def training_shape(self, options: Eagle3Options) -> TrainingShape:
        chains = _num_chains(options)
        steps = _ttt_steps(options)
        rows = f"{chains} chains x {steps} steps" if chains else f"every row as a chain of {steps} steps"
        return TrainingShape(proposal_len=steps, rows=rows, memory_flags=("--num-chains",))

    def build(self, target_model, tokenizer, options: Eagle3Options, target_layer_ids, *, d2t=None):
        self.check_options(options)
        config = eagle3_config_from_target(target_model.config, target_layer_ids=list(target_layer_ids),
                                           ttt_steps=_ttt_steps(options),
                                           pad_token_id=getattr(tokenizer, "pad_token_id", None),
                                           eos_token_id=getattr(tokenizer, "eos_token_id", None),
                                           draft_vocab_size=None if d2t is None else int(d2t.shape[0]),
                                           backbone=draft_backbone(options.draft_backbone, "target"))
        return Eagle3DraftModel.from_target(target_model, config, d2t=d2t)

    def load(self, path):
        return Eagle3DraftModel.from_pretrained(path)

    def prepare(self, model, batch, generator, options: Eagle3Options):
        """The batch and the chains to supervise: every row when ``options.num_chains`` is 0, else up to
        ``num_chains`` chain starts per sequence, drawn uniformly without replacement among rows whose
        step-0 target is supervised (the same supervision budget as DSpark's anchors: ``num_chains``
        chains/blocks of ``ttt_steps``/``block_size`` predictions). Sampling is an unbiased estimate
        of the all-rows loss; it cuts the vocabulary projections, which dominate a CPU step."""
        num = _num_chains(options)
        if num <= 0:
            return _Eagle3MicroBatch(batch, None)
        valid0 = ttt_supervision(batch.loss_mask_BS, 1, 1.0)[0][0]  # [B, S]: step-0 target supervised
        rows = torch.zeros_like(valid0)
        for b in range(valid0.shape[0]):
            cand = valid0[b].nonzero(as_tuple=True)[0]
            if cand.numel() > num:
                cand = cand[torch.randperm(cand.numel(), generator=generator)[:num]]
            rows[b, cand] = True
        return _Eagle3MicroBatch(batch, rows)

    def weight(self, model, prepared):
        return ttt_supervision(prepared.batch.loss_mask_BS, model.config.ttt_steps, model.config.step_decay,
                               prepared.rows_BS)[1].sum()

    def loss(self, model, prepared, *, weight_sum, autocast):
        b = prepared.batch
        return eagle3_loss(model, b.input_ids_BS, b.loss_mask_BS, b.target_hidden_BSF, b.target_last_hidden_BSH,
                           weight_sum=weight_sum, autocast=autocast, rows_BS=prepared.rows_BS,
                           target_logsumexp_BS=b.target_logsumexp_BS, target_argmax_BS=b.target_argmax_BS)

    def proposer(self, model, *, confidence_threshold=None, max_positions=None, tree_width=1, num_draft_tokens=None):
        k = None if num_draft_tokens is None else min(int(model.config.ttt_steps), int(num_draft_tokens))
        return Eagle3Proposer(model, k=k, max_positions=max_positions, tree_width=tree_width)

    def owns(self, model):
        return isinstance(model, Eagle3DraftModel)


def _ttt_steps(options: Eagle3Options) -> int:
    return DEFAULT_TTT_STEPS if options.ttt_steps is None else int(options.ttt_steps)


def _num_chains(options: Eagle3Options) -> int:
    return DEFAULT_NUM_CHAINS if options.num_chains is None else int(options.num_chains)
