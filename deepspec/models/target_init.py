"""Start a DSpark / DFlash draft's decoder layers as copies of the target's (``train --init-from-target``).

A DSpark / DFlash draft layer has exactly the target's decoder-layer shapes (docs/design/draft-models.md, "Draft
shape and backbone"): ``self_attn.{q,k,v,o}_proj`` (+ biases where the family has them, + ``self_attn.{q,k}_norm``
for Qwen3), ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, under the
same names. So a target layer's tensors copy into a draft layer one for one. The draft's final
``norm`` becomes a copy of the target's final norm (``model.norm``). Nothing else changes: ``fc``,
``hidden_norm`` and the heads keep their initialisation.
"""

from __future__ import annotations

import torch
from torch import nn

from deepspec.models.config import family_rules


def default_init_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target's last ``num_draft_layers`` layers, in order: draft layer ``j`` <- target layer
    ``L - num_draft_layers + j``."""
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def init_layers_from_target(draft: nn.Module, target_model: nn.Module,
                            layer_ids: list[int] | None = None) -> list[int]:
    """Copy target decoder layers into the draft's layers (in place, in the draft's dtype); return the
    target layer ids used.

    Draft layer ``j`` (``draft.layers[j]``) <- target layer ``layer_ids[j]`` (0-based index into the
    target's decoder layers, ``target_model.get_decoder().layers``); ``layer_ids`` defaults to the
    target's last ``len(draft.layers)`` layers (:func:`default_init_layers`: for a 30-layer target and
    one draft layer, target layer 29). Every tensor of the draft layer (``state_dict`` key) is
    replaced by the target layer's tensor of the same name, bit for bit up to the dtype cast; then the
    draft's ``norm`` <- the target's final norm.

    Raises:
        ValueError: ``train.init_from_target_layers`` of the wrong length or out of range; a target
            layer that lacks one of the draft layer's tensors, has one the draft's lacks (a Qwen3-style
            draft layer, ``--draft-backbone qwen3``, on a target without q/k norm or with biases), or has
            it in another shape (another family or width: the message names the tensor and both shapes);
            a family whose layers compute something else than the draft's (Gemma 3, ``FamilyRules.layer_copyable``).
    """
    family = draft.config.family
    if not family_rules(family).layer_copyable:
        raise ValueError(f"train.init_from_target: a {family} target's decoder layers have four norms (before and "
                         "after attention and MLP) and their own query scaling, while a draft layer has two norms, so "
                         "a copy would compute another layer; drop --init-from-target (random initialisation)")
    decoder = target_model.get_decoder()
    target_layers = decoder.layers
    L, n = len(target_layers), len(draft.layers)
    ids = default_init_layers(L, n) if layer_ids is None else [int(i) for i in layer_ids]
    if len(ids) != n:
        raise ValueError(f"train.init_from_target_layers: expected {n} target layer ids (one per draft layer, "
                         f"--num-draft-layers {n}), received {ids}. Name one target layer per draft layer, or omit "
                         "the flag (the last ones).")
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        raise ValueError(f"train.init_from_target_layers: expected ids in [0, {L}) (the target has {L} decoder "
                         f"layers), received {ids}. Use 0-based layer indices.")
    pairs = [(draft.layers[j], target_layers[i], f"draft layers.{j} <- target layers.{i}") for j, i in enumerate(ids)]
    pairs.append((draft.norm, decoder.norm, "draft norm <- target norm"))
    for dst, src, what in pairs:  # check everything before changing anything
        _check_tensors(dst, src, what)
    with torch.no_grad():
        for dst, src, _ in pairs:
            src_state = src.state_dict()
            for name, tensor in dst.state_dict().items():  # state_dict tensors share storage with the parameters
                tensor.copy_(src_state[name].to(tensor.dtype))
    return ids


def _check_tensors(dst: nn.Module, src: nn.Module, what: str) -> None:
    src_state = src.state_dict()
    extra = sorted(set(src_state) - set(dst.state_dict()))
    if extra:  # e.g. Qwen2's q/k/v biases under a Qwen3-style draft layer: a copy without them is another layer
        raise ValueError(f"train.init_from_target: {what}: the target's layer has tensors the draft's lacks "
                         f"({extra}), so a copy would compute another layer; add --draft-backbone target (the "
                         "target family's own layer) to start from the target's layers")
    for name, tensor in dst.state_dict().items():
        if name not in src_state and name.endswith(("q_norm.weight", "k_norm.weight")):
            raise ValueError(f"train.init_from_target: {what}: the draft's layers have Qwen3-style q/k norms and the "
                             f"target's have none, so a copy would compute another layer; add --draft-backbone "
                             "target (the target family's own layer) to start from the target's layers")
        if name not in src_state:
            raise ValueError(f"train.init_from_target: {what}: the target has no tensor {name!r} (it has "
                             f"{sorted(src_state)}); expected a target of the draft's family. Drop --init-from-target.")
        if src_state[name].shape != tensor.shape:
            raise ValueError(f"train.init_from_target: {what}: {name!r} has shape {tuple(src_state[name].shape)} in "
                             f"the target, expected {tuple(tensor.shape)} (the draft's). The draft was not derived "
                             "from this target's config; drop --init-from-target.")
