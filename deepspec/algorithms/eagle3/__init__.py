"""Eagle3 (Li et al., "EAGLE-3: Scaling up Inference Acceleration of LLMs via Training-Time Test", 2025): one folder.

- :mod:`.config`: :class:`Eagle3Config` (shape from the target, ``ttt_steps``, ``step_decay``).
- :mod:`.model`: :class:`Eagle3DraftModel`, one decoder layer reading ``[embedding ; hidden]``.
- :mod:`.loss`: the training-time-test loss (soft CE against the target, decayed per step).
- :mod:`.proposer`: :class:`Eagle3Proposer`, the chain or tree drafter behind the engine's ``Proposer`` protocol.

This module is the algorithm adapter the registry holds (:class:`Eagle3Algorithm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deepspec.algorithms.eagle3.config import ALGORITHM_NAME, eagle3_config_from_target
from deepspec.algorithms.eagle3.loss import eagle3_loss, ttt_supervision
from deepspec.algorithms.eagle3.model import Eagle3DraftModel
from deepspec.algorithms.eagle3.proposer import Eagle3Proposer
from deepspec.algorithms.protocol import TrainBatch
from deepspec.models.config import draft_backbone


@dataclass
class _Eagle3MicroBatch:
    batch: TrainBatch
    rows_BS: Tensor | None  # bool: chain starts supervised this step (None = all)


class Eagle3Algorithm:
    """Eagle3 behind :class:`deepspec.algorithms.protocol.DraftAlgorithm`. ``ttt_steps`` comes from
    ``cfg.ttt_steps`` when the trainer's config has it, else ``cfg.block_size`` (the same number of
    drafted tokens per step as DSpark/DFlash, 7 by default)."""

    name = ALGORITHM_NAME

    def build(self, target_model, tokenizer, cfg, target_layer_ids, *, d2t=None):
        if getattr(cfg, "init_from_target", False):
            raise ValueError("train.init_from_target: Eagle3's decoder layer cannot start as a copy of a target layer: "
                             "its q/k/v projections read [embedding ; hidden] (2H inputs, the target's read H), and a "
                             "partial copy would be a different recipe; received init_from_target=True for "
                             "algorithm=eagle3. Drop --init-from-target for eagle3.")
        if getattr(cfg, "num_draft_layers", 1) != 1:
            raise ValueError(f"train.num_draft_layers: Eagle3 has exactly one decoder layer, received "
                             f"{cfg.num_draft_layers}; set num_draft_layers=1 for algorithm=eagle3.")
        steps = getattr(cfg, "ttt_steps", None) or cfg.block_size
        config = eagle3_config_from_target(target_model.config, target_layer_ids=list(target_layer_ids),
                                           ttt_steps=int(steps), pad_token_id=getattr(tokenizer, "pad_token_id", None),
                                           eos_token_id=getattr(tokenizer, "eos_token_id", None),
                                           draft_vocab_size=None if d2t is None else int(d2t.shape[0]),
                                           backbone=draft_backbone(getattr(cfg, "draft_backbone", "auto"), self.name))
        return Eagle3DraftModel.from_target(target_model, config, d2t=d2t)

    def load(self, path):
        return Eagle3DraftModel.from_pretrained(path)

    def prepare(self, model, batch, generator, cfg):
        """The batch and the chains to supervise: every row when ``cfg.num_anchors`` is 0, else up to
        ``num_anchors`` chain starts per sequence, drawn uniformly without replacement among rows whose
        step-0 target is supervised (the same supervision budget as DSpark's anchors: ``num_anchors``
        chains/blocks of ``ttt_steps``/``block_size`` predictions). Sampling is an unbiased estimate
        of the all-rows loss; it cuts the vocabulary projections, which dominate a CPU step."""
        num = int(getattr(cfg, "num_anchors", 0) or 0)
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
