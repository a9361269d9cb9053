"""The serving-engine layouts DSpark and DFlash drafts export to (:data:`FORMATS`; docs/export.md).

- ``vllm-dspark``: vLLM's ``Qwen3DSparkModel`` (``method: dspark``, ``sample_from_anchor``: the anchor slot and
  each mask slot propose the next token, as DeepSpec's DSpark and DFlash do). A DFlash draft is written as a
  DSpark draft whose Markov head is zero (rank 1), which leaves its logits unchanged. vLLM builds Qwen3 layers
  with q/k RMSNorm whatever the target, so a draft without q/k norm (``train --draft-backbone target`` for a
  Llama, Qwen2 or Mistral target) is refused: an RMSNorm of weight 1 still normalises.
- ``vllm-dflash``: vLLM's ``DFlashDraftModel`` (``method: dflash``, z-lab's layout): a block ``[bonus, mask x K]``
  whose mask slots predict the token at their own position. DFlash drafts trained in that layout (``train
  --algorithm dflash --sample-from-anchor false``) export to it, with ``num_speculative_tokens`` = block_size - 1;
  a draft that proposes from the anchor slot on is refused, naming ``vllm-dspark``, and the other way round.
- ``speculators``: ``vllm-dspark`` in the vllm-project/speculators layout (``speculators_model_type: dspark``),
  with ``aux_hidden_state_layer_ids`` = DeepSpec's layer ids + 1 (vLLM's reader subtracts one).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspec.models.engine_layout import (ExportError, ExportFormat, decoder_tensors, decoder_keys,
                                           speculators_format, vocab_keys)

_LAYER_PREFIXES = ("fc.", "hidden_norm.", "norm.", "layers.")


def _qk_norm_needed(c: Any, fmt: str, loader: str, why: str) -> None:
    """vLLM's DSpark and DFlash loaders build Qwen3 layers with q/k RMSNorm, whatever the target."""
    if not c.qk_norm:
        raise ExportError(f"{fmt}: vLLM's {loader} builds Qwen3 layers with q/k RMSNorm; this draft's layers "
                          f"({c.family} target, --draft-backbone target) have none{why}")


def _dspark_weights(state: dict[str, torch.Tensor], c: Any) -> tuple[dict[str, torch.Tensor], int, bool | None]:
    """(weights, markov rank, confidence head reads the Markov vector: True/False, or None without one)."""
    out = {k: v for k, v in state.items() if k.startswith((*_LAYER_PREFIXES, "markov_head.", "confidence_head."))}
    if "markov_head.markov_w1.weight" in out:
        rank = int(out["markov_head.markov_w1.weight"].shape[1])
    else:  # DFlash: a zero Markov head of rank 1 adds nothing to the logits
        rank = 1
        out["markov_head.markov_w1.weight"] = torch.zeros(c.vocab_size, 1)
        out["markov_head.markov_w2.weight"] = torch.zeros(c.output_vocab_size, 1)
    confidence = None
    if "confidence_head.proj.weight" in out:
        confidence = int(out["confidence_head.proj.weight"].shape[1]) == c.hidden_size + rank
    return out, rank, confidence


def _write_vllm_dspark(model: Any, *, algorithm: str, verifier: Any = None
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    c = model.config
    if not c.sample_from_anchor:
        raise ExportError("vllm-dspark: this DFlash draft has z-lab's layout (sample_from_anchor false: each mask "
                          "slot predicts its own position), and vLLM's DSpark reads the anchor slot's prediction "
                          "too; export it with --format vllm-dflash")
    weights, rank, confidence = _dspark_weights(model.state_dict(), c)
    _qk_norm_needed(c, "vllm-dspark", "Qwen3DSparkModel",
                    ", and an RMSNorm of weight 1 still normalises, so the engine would compute another draft. Train "
                    "the draft with --draft-backbone qwen3 (the default for dspark and dflash) to export it")
    if c.use_markov_head and c.markov_head_type != "vanilla":
        raise ExportError(f"vllm-dspark: vLLM implements only the vanilla Markov head; this draft's is "
                          f"{c.markov_head_type!r}")
    config = decoder_keys(c, model_type="qwen3", num_layers=c.num_draft_layers)
    config["architectures"] = ["Qwen3DSparkModel"]
    config.update(vocab_keys(c), target_hidden_size=c.target_hidden_size, block_size=c.block_size,
                  num_target_layers=c.target_num_hidden_layers,
                  # DeepSpec's ids are the output of layer i; vLLM adds one to dflash_config ids itself
                  dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
                  mask_token_id=c.mask_token_id, sample_from_anchor=True,
                  markov_rank=rank, markov_head_type="vanilla",
                  enable_confidence_head=confidence is not None,
                  confidence_head_with_markov=bool(confidence))
    hint = (f"vllm serve TARGET --speculative-config '{{\"method\": \"dspark\", \"model\": \"DIR\", "
            f"\"num_speculative_tokens\": {c.block_size}}}'")
    return config, weights, hint


def _write_vllm_dflash(model: Any, *, algorithm: str, verifier: Any = None
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """vLLM's ``DFlashDraftModel`` config (``model_executor/models/qwen3_dflash.py``): Qwen3 layers, the
    block [bonus, mask x (block_size - 1)], its ``dflash_config`` (mask token, DeepSpec's layer ids:
    vLLM adds one)."""
    c = model.config
    if c.sample_from_anchor:
        raise ExportError(
            "vllm-dflash: vLLM's DFlash method (z-lab's layout) reads a block [bonus, mask x K] whose mask slots "
            f"predict their own position; this {algorithm} draft proposes from the anchor slot on (each slot "
            "predicts the next token), which is vLLM's DSpark layout. Use --format vllm-dspark, or train a DFlash "
            "draft with --sample-from-anchor false for this format")
    _qk_norm_needed(c, "vllm-dflash", "DFlashDraftModel",
                    ". Train the draft with --draft-backbone qwen3 (the default for dflash) to export it")
    config = decoder_keys(c, model_type="qwen3", num_layers=c.num_draft_layers)
    config["architectures"] = ["DFlashDraftModel"]
    config.update(vocab_keys(c), target_hidden_size=c.target_hidden_size, block_size=c.block_size,
                  num_target_layers=c.target_num_hidden_layers,
                  dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)})
    weights = {k: v for k, v in model.state_dict().items() if k.startswith(_LAYER_PREFIXES)}
    hint = (f"vllm serve TARGET --speculative-config '{{\"method\": \"dflash\", \"model\": \"DIR\", "
            f"\"num_speculative_tokens\": {c.num_draft_slots}}}'")
    return config, weights, hint


def _expected_layers(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The decoder's tensors and the feature norm (the target layers: ``dflash_config``, or the speculators
    layout's ``aux_hidden_state_layer_ids``)."""
    ids = (config["dflash_config"]["target_layer_ids"] if "dflash_config" in config
           else config["aux_hidden_state_layer_ids"])
    out = decoder_tensors(config, num_features=len(ids), width_in=config["hidden_size"])
    out["hidden_norm.weight"] = (config["hidden_size"],)
    return out


def _expected_vllm_dspark(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    out = _expected_layers(config)
    V, H, r = config["vocab_size"], config["hidden_size"], config["markov_rank"]
    out.update({"markov_head.markov_w1.weight": (V, r),
                "markov_head.markov_w2.weight": (config.get("draft_vocab_size", V), r)})
    if config["enable_confidence_head"]:
        out.update({"confidence_head.proj.weight": (1, H + (r if config["confidence_head_with_markov"] else 0)),
                    "confidence_head.proj.bias": (1,)})
    return out


def _speculators_keys(layer: dict[str, Any], top: dict[str, Any]) -> None:
    # vLLM's speculators reader: target_layer_ids = aux - 1 (DeepSpec's ids name the output of layer i)
    top["aux_hidden_state_layer_ids"] = [i + 1 for i in top.pop("dflash_config")["target_layer_ids"]]
    # the architectures stay Qwen3DSparkModel: the loader vLLM keeps


VLLM_DSPARK = ExportFormat(write=_write_vllm_dspark, expected=_expected_vllm_dspark)

# format name -> layout (the registry reads DSparkAlgorithm.export_formats)
FORMATS: dict[str, ExportFormat] = {
    "vllm-dspark": VLLM_DSPARK,
    "vllm-dflash": ExportFormat(write=_write_vllm_dflash, expected=_expected_layers),
    "speculators": speculators_format(VLLM_DSPARK, kind="dspark", num_tokens=lambda c: c.block_size,
                                      adapt=_speculators_keys),
}
