"""DSpark, and DFlash as its configuration without heads (docs/design/draft-models.md): one folder.

- :mod:`.config`: :class:`DraftConfig` (shape from the target, block / head / loss knobs),
  :func:`dflash_knobs`, the knobs that make it DFlash, and :class:`DSparkOptions`, the training options.
- :mod:`.model`: :class:`DSparkDraftModel`, the block-parallel drafter with its Markov and confidence heads.
- :mod:`.loss`: the DSpark / DFlash training loss (CE + L1 + confidence, slot-decayed weights).
- :mod:`.proposer`: :class:`DSparkProposer`, the drafter behind the engine's ``Proposer`` protocol.
- :mod:`.original`: drafts in the original DeepSpec checkpoint layout (detect, load, write).
- :mod:`.export`: the serving-engine layouts its drafts export to (vllm-dspark, vllm-dflash, speculators).

This module is the algorithm adapter the registry holds (:class:`DSparkAlgorithm`, registered twice:
``dspark`` with heads, ``dflash`` without); it reuses the shared pieces of :mod:`deepspec.models`
(anchors, mask, mask token, target-layer init).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepspec.algorithms.dspark.config import (CONFIDENCE_LABELS, DraftConfig, DSparkOptions, dflash_knobs,
                                               draft_config_from_target, loss_knobs)
from deepspec.algorithms.dspark.export import FORMATS
from deepspec.algorithms.dspark.loss import compute_dtype, dspark_loss, supervision_weights
from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.dspark.proposer import DSparkProposer
from deepspec.algorithms.protocol import TrainBatch, TrainingShape
from deepspec.models.anchors import sample_anchors
from deepspec.models.config import draft_backbone
from deepspec.models.mask_token import choose_mask_token_id
from deepspec.models.target_init import init_layers_from_target


@dataclass
class _BlockMicroBatch:
    batch: TrainBatch
    anchor_pos_BA: torch.Tensor
    block_valid_BA: torch.Tensor
    defer_logits: bool = False  # draft logits per chunk of slots in the loss (chunked_head_loss)


# ``chunked_head_loss = "auto"`` defers the draft logits when all blocks' float32 logits would take more
CHUNKED_HEAD_LOSS_AUTO_BYTES = 256 * 2**20


def defer_head_logits(setting: str, batch_size: int, num_anchors: int, num_slots: int, vocab: int) -> bool:
    """Whether a micro-batch computes its draft logits per chunk of slots in the loss (recomputed in
    backward) instead of as one ``[B, A, K, W]`` tensor: ``setting`` ``on`` | ``off`` | ``auto`` (on when
    that tensor in float32 exceeds :data:`CHUNKED_HEAD_LOSS_AUTO_BYTES`). Raises ValueError otherwise."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"train.chunked_head_loss: expected auto, on or off, got {setting!r}")
    if setting == "auto":
        return batch_size * num_anchors * num_slots * vocab * 4 > CHUNKED_HEAD_LOSS_AUTO_BYTES
    return setting == "on"


class DSparkAlgorithm:
    """DSpark (DSpark paper): block-parallel drafter with Markov and confidence heads. With
    ``heads=False`` it is DFlash: the same backbone, CE loss only."""

    Options = DSparkOptions
    export_formats = FORMATS

    def __init__(self, name: str, *, heads: bool) -> None:
        self.name = name
        self.heads = heads

    def check_options(self, options: DSparkOptions) -> None:
        for field in ("block_size", "num_anchors"):
            if getattr(options, field) < 1:
                raise ValueError(f"train.{field}: expected an integer >= 1, got {getattr(options, field)}")
        if options.block_size < 2:
            raise ValueError(f"train.block_size: expected an integer >= 2 for {self.name} (the anchor slot and at "
                             f"least one mask slot), got {options.block_size}")
        if not options.sample_from_anchor and self.heads:
            raise ValueError(f"train.sample_from_anchor: false is z-lab's DFlash layout, for --algorithm dflash only, "
                             f"got it with {self.name!r}; drop --sample-from-anchor false or train dflash")
        if options.chunked_head_loss not in ("auto", "on", "off"):
            raise ValueError(f"train.chunked_head_loss: expected auto, on or off, got {options.chunked_head_loss!r}")
        for name, value in loss_knobs(options).items():
            if value < 0 or (name == "loss_decay_gamma" and value == 0):
                raise ValueError(f"train.{name}: expected a value {'> 0' if name == 'loss_decay_gamma' else '>= 0'}, "
                                 f"got {value}")
        if options.confidence_label is not None and options.confidence_label not in CONFIDENCE_LABELS:
            raise ValueError(f"train.confidence_label: expected one of {CONFIDENCE_LABELS}, got "
                             f"{options.confidence_label!r}")
        if options.init_from_target_layers is not None and not options.init_from_target:
            raise ValueError(f"train.init_from_target_layers: names the target layers to copy with "
                             f"--init-from-target, got {options.init_from_target_layers} without it; add "
                             "--init-from-target or drop the list")

    def ignored_options(self, options: DSparkOptions) -> tuple[str, ...]:
        # DFlash has no Markov or confidence head
        return () if self.heads else ("markov_head", "markov_rank", "confidence_label")

    def training_shape(self, options: DSparkOptions) -> TrainingShape:
        return TrainingShape(
            proposal_len=options.block_size, rows=f"{options.num_anchors} anchors x block {options.block_size}",
            memory_flags=("--num-anchors",),
            memory_fixes=() if options.chunked_head_loss == "on" else (
                "--chunked-head-loss on (the draft logits per chunk of slots)",))

    def draft_config(self, target_config, num_embeddings: int, tokenizer, options: DSparkOptions, target_layer_ids, *,
                     draft_vocab_size: int | None = None) -> DraftConfig:
        """The draft's config from the target's config alone (no weights: a recipe builds it on the meta
        device); ``num_embeddings`` = rows of the target's input embedding (for the mask token)."""
        mask_token_id = choose_mask_token_id(tokenizer, num_embeddings, options.mask_token)
        return draft_config_from_target(
            target_config,
            num_draft_layers=options.num_draft_layers,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            block_size=options.block_size,
            markov_rank=options.markov_rank,
            markov_head_type=options.markov_head,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            draft_vocab_size=draft_vocab_size,
            # a copy of the target's layers needs the family's own layer; else the one vLLM's loader builds
            backbone=draft_backbone(options.draft_backbone, "target" if options.init_from_target else "qwen3"),
            sample_from_anchor=options.sample_from_anchor,
            **({} if options.confidence_label is None else {"confidence_label": options.confidence_label}),
            # the algorithm's own knobs, then the loss settings given to train over them
            **{**({} if self.heads else dflash_knobs()), **loss_knobs(options)},
        )

    def build(self, target_model, tokenizer, options: DSparkOptions, target_layer_ids, *, d2t=None):
        self.check_options(options)
        draft_config = self.draft_config(target_model.config, target_model.get_input_embeddings().num_embeddings,
                                         tokenizer, options, target_layer_ids,
                                         draft_vocab_size=None if d2t is None else int(d2t.shape[0]))
        model = DSparkDraftModel.from_target(target_model, draft_config, d2t=d2t)
        if options.init_from_target:
            init_layers_from_target(model, target_model, options.init_from_target_layers)
        return model

    def load(self, path):
        return DSparkDraftModel.from_pretrained(path)

    def prepare(self, model, batch, generator, options: DSparkOptions):
        anchor_pos_BA, block_valid_BA = sample_anchors(batch.loss_mask_BS, options.num_anchors, generator)
        c = model.config
        defer = defer_head_logits(options.chunked_head_loss, anchor_pos_BA.shape[0], options.num_anchors,
                                  c.num_draft_slots, c.output_vocab_size)
        return _BlockMicroBatch(batch, anchor_pos_BA, block_valid_BA, defer)

    def weight(self, model, prepared):
        return supervision_weights(
            prepared.batch.loss_mask_BS, prepared.anchor_pos_BA, prepared.block_valid_BA, model.config
        )[1].sum()

    def loss(self, model, prepared, *, weight_sum, autocast):
        b = prepared.batch
        with autocast:
            output = model.forward_train(b.input_ids_BS, b.target_hidden_BSF, prepared.anchor_pos_BA,
                                         prepared.block_valid_BA, defer_logits=prepared.defer_logits)
        # the frozen target lm_head in the compute dtype, cast once for the run (not per chunk or call)
        cdt = compute_dtype(autocast, model.lm_head.weight)
        return dspark_loss(output, b.input_ids_BS, b.loss_mask_BS, prepared.anchor_pos_BA, prepared.block_valid_BA,
                           b.target_last_hidden_BSH, model.frozen_as(model.target_lm_head_weight, cdt), model.config,
                           weight_sum=weight_sum, d2t_W=model.d2t, target_logsumexp_BS=b.target_logsumexp_BS,
                           target_argmax_BS=b.target_argmax_BS,
                           lm_head_rows_WH=None if model.d2t is None else model.frozen_as(model.lm_head.weight, cdt),
                           autocast=autocast)

    def proposer(self, model, *, confidence_threshold=None, max_positions=None, tree_width=1, num_draft_tokens=None):
        return DSparkProposer(model, confidence_threshold=confidence_threshold, max_positions=max_positions,
                              tree_width=tree_width, num_draft_tokens=num_draft_tokens)

    def owns(self, model):
        return isinstance(model, DSparkDraftModel) and (
            self.heads == (model.config.use_markov_head or model.config.use_confidence_head))
