"""Drafts saved in the original DeepSpec layout (``Qwen3DSparkModel``): detect, load, write.

The original (github.com/deepseek-ai/DeepSpec, ``deepspec/modeling/dspark/qwen3/{config,modeling}.py``,
``deepspec/modeling/dspark/markov_head.py``, ``deepspec/trainer/ckpt_manager.py``) saves a draft with
transformers' ``save_pretrained``:

* ``config.json``: a deep copy of the *target's* config (``model_type`` ``qwen3``, its shape keys,
  ``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling``, ``eos_token_id``, ...) with
  ``architectures = ["Qwen3DSparkModel"]``, ``num_hidden_layers`` = the draft's layer count,
  ``num_target_layers`` = the target's, and the draft keys ``block_size``, ``target_layer_ids``,
  ``mask_token_id``, ``num_anchors`` (training only), ``layer_types`` (all ``full_attention``),
  ``tie_word_embeddings = false``, ``enable_confidence_head``, ``confidence_head_with_markov`` (when
  the confidence head is on), ``markov_rank`` (0 = no Markov head) and ``markov_head_type`` (when
  ``markov_rank > 0``: ``vanilla`` | ``gated`` | ``rnn``). The original's DFlash is the same model with
  ``markov_rank = 0`` and ``enable_confidence_head = false``.
* ``model.safetensors`` (or shards + ``model.safetensors.index.json``): the model's full state dict,
  no prefix: ``embed_tokens.weight``, ``fc.weight``, ``hidden_norm.weight``,
  ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.self_attn.{q,k}_norm.weight``,
  ``layers.N.mlp.{gate,up,down}_proj.weight``, ``layers.N.{input,post_attention}_layernorm.weight``,
  ``norm.weight``, ``lm_head.weight``, ``markov_head.markov_w1.weight`` (Embedding V x r),
  ``markov_head.markov_w2.weight`` (Linear r -> V), ``markov_head.gate_proj.{weight,bias}`` (gated),
  ``markov_head.joint_proj.{weight,bias}`` (rnn), ``confidence_head.proj.{weight,bias}``.

These are exactly :class:`~deepspec.algorithms.dspark.model.DSparkDraftModel`'s parameter names
(docs/design/draft-models.md, "Checkpoints in the original layout"),
so loading is a checked rename-free copy. A ``model.`` or ``_orig_mod.`` (torch.compile) prefix on
every key is stripped. ``embed_tokens`` / ``lm_head`` are frozen copies of the target's: when a
checkpoint omits them they are taken from ``target_model``. ``LlamaDSparkModel`` / ``Qwen2DSparkModel``
/ ``MistralDSparkModel`` / ``Gemma3DSparkModel`` (same layout, DeepSpec's other families; see
:data:`deepspec.algorithms.dspark.config.ARCHITECTURES`) are accepted too; the original only has Qwen3 (and
Gemma4, whose targets DeepSpec does not support). A Gemma 3 draft's config names its activation
``hidden_activation``, as Gemma's configs do.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from deepspec.algorithms.dspark.config import ARCHITECTURES, MARKOV_HEAD_TYPES, DraftConfig, dflash_knobs
from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.models.config import CONFIG_NAME, WEIGHTS_NAME, family_rules, save_draft_folder, target_shape_fields


WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
ORIGINAL_ARCHITECTURE = "Qwen3DSparkModel"
_FAMILY_OF_ARCHITECTURE = {arch: family for family, arch in ARCHITECTURES.items()}
_ARCH_SUFFIX = "DSparkModel"
# Knobs of variants we know of but cannot reproduce (a checkpoint using them would load into a
# different forward, silently lowering acceptance): refuse when set.
_UNSUPPORTED_FLAGS = ("enable_d2_feature",)
_EMBEDDINGS = ("embed_tokens.weight", "lm_head.weight")
# Non-persistent buffers in transformers, recomputed from the config; tolerated if a checkpoint has them.
_DERIVED_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


def _read_config(folder: Path) -> dict[str, Any] | None:
    path = folder / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _architectures(cfg: dict[str, Any]) -> list[str]:
    archs = cfg.get("architectures")
    if isinstance(archs, str):
        return [archs]
    return [str(a) for a in archs] if isinstance(archs, list) else []


def is_original_layout(folder: str | Path) -> bool:
    """Whether ``folder/config.json`` is an original-layout DSpark draft's: an ``architectures`` entry
    ending in ``DSparkModel`` and none of the keys DeepSpec's own ``save_pretrained`` writes
    (``draft_config``, ``deepspec_algorithm``). Never raises; unreadable configs give False."""
    cfg = _read_config(Path(folder))
    if cfg is None or "draft_config" in cfg or "deepspec_algorithm" in cfg:
        return False
    return any(a.endswith(_ARCH_SUFFIX) for a in _architectures(cfg))


# ----------------------------------------------------------------------------------------------- config


def _cfg_error(source: str, key: str, expected: str, received: Any, fix: str) -> ValueError:
    return ValueError(f"{source}: key {key!r}: expected {expected}, received {received!r}. {fix}")


def _family(cfg: dict[str, Any], source: str) -> str:
    archs = [a for a in _architectures(cfg) if a.endswith(_ARCH_SUFFIX)]
    known = sorted(_FAMILY_OF_ARCHITECTURE)
    if len(archs) != 1 or archs[0] not in _FAMILY_OF_ARCHITECTURE:
        raise _cfg_error(source, "architectures", f"exactly one of {known} (the original writes "
                         f"[{ORIGINAL_ARCHITECTURE!r}])", cfg.get("architectures"),
                         "DeepSpec loads DSpark drafts of the llama, qwen2, qwen3, mistral and gemma3_text "
                         "families only (the original's Gemma4DSparkModel is not supported: Gemma 4 targets are not).")
    family = _FAMILY_OF_ARCHITECTURE[archs[0]]
    model_type = cfg.get("model_type", family)
    if model_type != family:
        raise _cfg_error(source, "model_type", f"{family!r} (the target family of {archs[0]})", model_type,
                         "The original copies the target's config, so model_type is the target's; fix the file.")
    return family


def _int(cfg: dict[str, Any], key: str, source: str, *, minimum: int = 0, fix: str = "") -> int:
    if key not in cfg or cfg[key] is None:
        raise _cfg_error(source, key, "a value (missing)", None,
                         fix or "The original writes it into config.json; add it by hand if the file was edited.")
    v = cfg[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise _cfg_error(source, key, f"an integer >= {minimum}", v, fix or "Fix config.json.")
    return v


# DraftConfig field -> the original config.json key it is read from: the fields that change the draft's forward
# and are copies of the target's (the original deep-copies the target's config), compared with the target's
_TARGET_COPIED_FIELDS = (
    ("family", "model_type"), ("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"),
    ("target_num_hidden_layers", "num_target_layers"), ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
    ("intermediate_size", "intermediate_size"), ("hidden_act", "hidden_act"), ("rms_norm_eps", "rms_norm_eps"),
    ("rope_parameters", "rope_parameters"), ("max_position_embeddings", "max_position_embeddings"),
    ("qkv_bias", "attention_bias"), ("o_bias", "attention_bias"), ("mlp_bias", "mlp_bias"),
    ("qk_norm", "model_type"), ("embed_scale", "model_type"), ("final_logit_softcapping", "final_logit_softcapping"),
)


def _rope_key(rope: dict[str, Any]) -> dict[str, Any]:
    """RoPE parameters compared by value: None entries dropped, numbers as floats (1e6 == 1000000)."""
    return {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in rope.items() if v is not None}


def _check_against_target(shape: dict[str, Any], target_config: Any, source: str) -> None:
    """Raise naming the first field of :data:`_TARGET_COPIED_FIELDS` where the draft's ``shape`` (the
    :func:`target_shape_fields` of its config.json) differs from ``target_config``'s: each changes the draft's
    forward (the RoPE it applies at target positions, its layers' shape, norms and activation), and the original
    copies them all from the target it trains for, so a difference is another target or an edited file."""
    tgt = target_shape_fields(target_config, target_layer_ids=shape["target_layer_ids"])
    for key, cfg_key in _TARGET_COPIED_FIELDS:
        have, want = shape[key], tgt[key]
        if key == "rope_parameters":
            have, want = _rope_key(have), _rope_key(want)
        if have != want:
            raise _cfg_error(source, cfg_key, f"{want!r} (the target's)", have,
                             "The draft's forward depends on it and the original copies it from the target it was "
                             "trained for: pass that target, or restore the target's value in config.json.")


def _check_full_attention(cfg: dict[str, Any], family: str, num_draft_layers: int, source: str) -> None:
    """Raise unless every draft layer attends to the whole context, as DeepSpec's DSpark layers do.

    ``layer_types`` (the original writes it, all ``full_attention``) decides when present. Without it
    transformers derives the layers' attention from the window keys the original copies
    from the target: ``use_sliding_window`` with ``sliding_window`` (Qwen2 / Qwen3: layers from
    ``max_window_layers`` on), ``sliding_window`` alone (Mistral: every layer; Gemma 3: its pattern), so a
    window set there is refused rather than read as full attention.
    """
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise _cfg_error(source, "layer_types", "a list with an entry per draft layer", layer_types,
                             "The original writes ['full_attention'] * num_hidden_layers.")
        if any(t != "full_attention" for t in layer_types):
            raise _cfg_error(source, "layer_types", "only 'full_attention' (as the original writes)", layer_types,
                             "Sliding-window draft layers are not supported; evaluate this draft with the "
                             "original code.")
        if family != "mistral":  # Mistral's layers read sliding_window whatever layer_types says
            return
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        key, windowed = "use_sliding_window", bool(cfg.get("use_sliding_window")) and window is not None
    else:
        key, windowed = "sliding_window", family in ("mistral", "gemma3_text") and window is not None
    if windowed:
        raise _cfg_error(source, key, "no sliding window (DeepSpec's draft layers attend to the whole context)",
                         cfg.get(key), f"config.json sets sliding_window={window!r}"
                         + ("" if family == "mistral" else " without layer_types")
                         + ", so transformers would build windowed draft layers. If the draft was trained with "
                         "full attention, set " + ("sliding_window to null" if family == "mistral" else
                                                   f"layer_types to ['full_attention'] * {num_draft_layers}")
                         + "; otherwise evaluate it with the original code.")


def draft_config_from_original(cfg: dict[str, Any], *, target_config: Any = None,
                               source: str = CONFIG_NAME) -> DraftConfig:
    """Map an original-layout ``config.json`` (dict) to a :class:`DraftConfig`.

    Mapping: family <- ``architectures`` (+ ``model_type``); the shape fields via
    :func:`~deepspec.models.config.target_shape_fields` on the config with ``num_hidden_layers`` set to
    ``num_target_layers``; ``num_draft_layers`` <- ``num_hidden_layers``; ``block_size``,
    ``target_layer_ids``, ``mask_token_id`` as is; ``use_markov_head`` <- ``markov_rank > 0``;
    ``markov_rank``, ``markov_head_type``; ``use_confidence_head`` <- ``enable_confidence_head``;
    ``confidence_head_with_markov`` as is (false: the head reads the hidden state alone);
    ``target_fingerprint`` <- DeepSpec's own key of that name when present (the original has none). Loss
    weights are not in the file (training config): DSpark defaults, ``confidence_weight = 0`` without a
    confidence head, :func:`~deepspec.algorithms.dspark.config.dflash_knobs` without both heads.

    Args:
        target_config: the target's config; when given, the draft must fit it (``hidden_size``,
            ``vocab_size``, ``num_target_layers``, family), and it supplies ``num_target_layers`` if absent.
        source: the file name used in error messages.

    Raises:
        ValueError: a missing or invalid key, an unsupported variant (unknown ``markov_head_type``,
            sliding-window layers, by ``layer_types`` or by a window without it: :func:`_check_full_attention`;
            a confidence head reading Markov features without a Markov head, a pruned draft vocabulary), or
            a field that changes the draft's forward and differs from ``target_config``'s (the shape, norms,
            activation, biases and RoPE: :func:`_check_against_target`); the message names the key and says
            how to fix it.
    """
    family = _family(cfg, source)
    for flag in _UNSUPPORTED_FLAGS:
        if cfg.get(flag):
            raise _cfg_error(source, flag, "false or absent", cfg[flag],
                             "This variant of the original changes the draft's forward; DeepSpec does not "
                             "implement it. Evaluate this checkpoint with the original code.")
    num_draft_layers = _int(cfg, "num_hidden_layers", source, minimum=1)
    if "num_target_layers" not in cfg and target_config is not None:
        num_target_layers = int(target_config.num_hidden_layers)
    else:
        num_target_layers = _int(cfg, "num_target_layers", source, minimum=1,
                                 fix="Set it to the target's num_hidden_layers (the original writes it), or "
                                     "pass the target so it can be taken from there.")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "max_position_embeddings",
                "block_size", "mask_token_id"):
        _int(cfg, key, source, minimum=1 if key != "mask_token_id" else 0)
    for key in (family_rules(family).act_key, "rms_norm_eps"):  # the forward pass depends on them: never defaulted
        if cfg.get(key) is None:
            raise _cfg_error(source, key, "a value (missing)", None,
                             "The original copies it from the target's config; copy it from there.")
    if not isinstance(cfg.get("target_layer_ids"), list) or not cfg["target_layer_ids"]:
        raise _cfg_error(source, "target_layer_ids", "a non-empty list of target layer ids",
                         cfg.get("target_layer_ids"), "The original writes it (e.g. [1, 9, 17, 25, 33]).")
    if "rope_parameters" not in cfg and "rope_theta" not in cfg:
        raise _cfg_error(source, "rope_parameters", "a dict with 'rope_theta' (or the older 'rope_theta' key)",
                         None, "Copy the target config's RoPE keys into config.json.")
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab not in (None, cfg["vocab_size"]):
        raise _cfg_error(source, "draft_vocab_size", f"absent or == vocab_size ({cfg['vocab_size']})", draft_vocab,
                         "Pruned draft vocabularies are not supported; use a full-vocabulary draft.")
    _check_full_attention(cfg, family, num_draft_layers, source)

    markov_rank = _int(cfg, "markov_rank", source, minimum=0,
                       fix="Set markov_rank (0 = no Markov head, the original's DFlash; 256 = DSpark).")
    use_markov = markov_rank > 0
    markov_head_type = "vanilla"
    if use_markov:
        if "markov_head_type" not in cfg:
            raise _cfg_error(source, "markov_head_type", f"one of {MARKOV_HEAD_TYPES} when markov_rank > 0", None,
                             "The original requires it; add 'markov_head_type': 'vanilla'.")
        markov_head_type = str(cfg["markov_head_type"]).lower()  # the original lower-cases it too
        if markov_head_type not in MARKOV_HEAD_TYPES:
            raise _cfg_error(source, "markov_head_type", f"one of {MARKOV_HEAD_TYPES}", cfg["markov_head_type"],
                             "DeepSpec implements the original's vanilla, gated and rnn heads only.")
    if "enable_confidence_head" not in cfg:
        raise _cfg_error(source, "enable_confidence_head", "true or false", None,
                         "The original requires it; add 'enable_confidence_head': false for a draft without one.")
    use_conf = bool(cfg["enable_confidence_head"])
    if use_conf:
        if "confidence_head_with_markov" not in cfg:
            raise _cfg_error(source, "confidence_head_with_markov", "true or false when enable_confidence_head",
                             None, "The original requires it; add it (true for the released DSpark drafts).")
        with_markov = bool(cfg["confidence_head_with_markov"])
        if with_markov and not use_markov:
            raise _cfg_error(source, "confidence_head_with_markov", "false when markov_rank is 0 (the head reads "
                             "[hidden ; markov_w1[prev]], and there is no markov_w1)", with_markov,
                             "The original requires a Markov head (markov_rank > 0) for it; set it false.")
    else:
        with_markov = True  # no confidence head: the field does not matter; DeepSpec's default

    ns = SimpleNamespace(**{k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "model_type")},
                         num_hidden_layers=num_target_layers, model_type=family)
    shape = target_shape_fields(ns, target_layer_ids=[int(i) for i in cfg["target_layer_ids"]])
    if target_config is not None:
        _check_against_target(shape, target_config, source)
    # loss weights (not in the file): DFlash's without heads, no confidence term without that head
    knobs = dflash_knobs() if not (use_markov or use_conf) else {} if use_conf else {"confidence_weight": 0.0}
    knobs.update(use_markov_head=use_markov, use_confidence_head=use_conf)
    try:
        return DraftConfig(**shape, num_draft_layers=num_draft_layers, block_size=int(cfg["block_size"]),
                           mask_token_id=int(cfg["mask_token_id"]), markov_rank=markov_rank if use_markov else 256,
                           markov_head_type=markov_head_type, target_fingerprint=cfg.get("target_fingerprint"),
                           confidence_head_with_markov=with_markov, **knobs)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def original_config_dict(config: DraftConfig, *, num_anchors: int = 512) -> dict[str, Any]:
    """The original-layout ``config.json`` of a draft with ``config`` (inverse of
    :func:`draft_config_from_original`; ``num_anchors`` is a training knob the original requires)."""
    c = config
    if c.qk_norm != family_rules(c.family).qk_norm:
        raise ValueError(f"original layout: the original builds the draft's layers from model_type {c.family!r} "
                         f"(q/k norm for qwen3 and gemma3_text only), and this draft's "
                         f"{'have' if c.qk_norm else 'lack'} it "
                         "(--draft-backbone); train with --draft-backbone target to write this layout, or keep "
                         "DeepSpec's own layout")
    cfg: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": c.family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_target_layers": c.target_num_hidden_layers,
        "num_hidden_layers": c.num_draft_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        family_rules(c.family).act_key: c.hidden_act,  # hidden_act (Gemma: hidden_activation)
        "attention_dropout": 0.0,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": dict(c.rope_parameters),
        "max_position_embeddings": c.max_position_embeddings,
        "layer_types": ["full_attention"] * c.num_draft_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "pad_token_id": c.pad_token_id,
        "eos_token_id": (None if not c.eos_token_ids else c.eos_token_ids[0] if len(c.eos_token_ids) == 1
                         else list(c.eos_token_ids)),
        "block_size": c.block_size,
        "target_layer_ids": list(c.target_layer_ids),
        "mask_token_id": c.mask_token_id,
        "num_anchors": int(num_anchors),
        "enable_confidence_head": c.use_confidence_head,
        "markov_rank": c.markov_rank if c.use_markov_head else 0,
    }
    if c.family != "qwen2":  # Qwen2's biases are fixed by the family (q/k/v yes, o no)
        cfg["attention_bias"] = c.qkv_bias
    if c.family == "llama":
        cfg["mlp_bias"] = c.mlp_bias
    if c.final_logit_softcapping is not None:  # a key of the target's config the original copies (Gemma 2)
        cfg["final_logit_softcapping"] = c.final_logit_softcapping
    if c.use_confidence_head:
        cfg["confidence_head_with_markov"] = c.use_markov_head and c.confidence_head_with_markov
    if c.use_markov_head:
        cfg["markov_head_type"] = c.markov_head_type
    if c.target_fingerprint is not None:  # DeepSpec's own key (the original ignores it): the target it was made for
        cfg["target_fingerprint"] = c.target_fingerprint
    return cfg


# ----------------------------------------------------------------------------------------------- weights


def _load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (folder / WEIGHTS_NAME).is_file():
        return load_file(str(folder / WEIGHTS_NAME))
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"{index}: shard {shard!r} is missing from {folder}.")
            state.update(load_file(str(folder / shard)))
        return state
    raise FileNotFoundError(f"{folder}: expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} (safetensors, as the "
                            "original's save_pretrained writes); convert other weight formats to safetensors first.")


def _strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    if state and all(k.startswith("model.") for k in state):
        state = {k.removeprefix("model."): v for k, v in state.items()}
    return state


def _fill(model: DSparkDraftModel, state: dict[str, torch.Tensor], target_model: nn.Module | None,
          tie_word_embeddings: bool, source: str) -> None:
    own = model.state_dict()
    layer_ids = sorted({int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))})
    n = model.config.num_draft_layers
    if layer_ids != list(range(n)):
        raise ValueError(f"{source}: config.json num_hidden_layers={n} (draft layers 0..{n - 1}) but the weights "
                         f"hold layers {layer_ids}. Fix num_hidden_layers or use the matching weights.")
    if tie_word_embeddings and "lm_head.weight" not in state and "embed_tokens.weight" in state:
        state = dict(state, **{"lm_head.weight": state["embed_tokens.weight"]})
    from_target = [k for k in _EMBEDDINGS if k not in state]
    if from_target:
        if target_model is None:
            raise ValueError(f"{source}: the checkpoint has no {from_target} (frozen copies of the target's "
                             "embedding / lm_head). Pass the target (load_draft(path, target_model=...); "
                             "`deepspec eval --target` does) so they are copied from it.")
        target_state = {"embed_tokens.weight": target_model.get_input_embeddings().weight,
                        "lm_head.weight": target_model.get_output_embeddings().weight}
        state = dict(state, **{k: target_state[k].detach() for k in from_target})
    state = {k: v for k, v in state.items() if k not in _DERIVED_BUFFERS}
    own = {k: v for k, v in own.items() if k not in _DERIVED_BUFFERS}
    unused = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    if unused or missing:
        raise ValueError(f"{source}: the weights do not match the config: tensors not used by the draft {unused}; "
                         f"draft parameters with no tensor {missing}. Check markov_rank / markov_head_type / "
                         "enable_confidence_head / attention_bias in config.json against the weights.")
    wrong = [f"{k}: expected {tuple(own[k].shape)}, received {tuple(v.shape)}"
             for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        raise ValueError(f"{source}: tensor shapes do not match config.json: {wrong}"
                         + (" (taken from the target: the draft was trained for another target)"
                            if any(w.split(':')[0] in from_target for w in wrong) else "")
                         + ". Check hidden_size, head_dim, num_key_value_heads, intermediate_size, vocab_size, "
                           "target_layer_ids, markov_rank, confidence_head_with_markov.")
    model.load_state_dict(state, strict=False)  # all non-derived keys verified above


def load_original_dspark(folder: str | Path, *, target_model: nn.Module | None = None,
                         device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DSparkDraftModel:
    """A :class:`DSparkDraftModel` from an original-layout folder (``config.json`` + safetensors).

    Strict: every tensor of the checkpoint is used and every draft parameter is filled, with shapes
    equal. ``embed_tokens`` / ``lm_head`` come from the checkpoint when present (the original saves
    them), else from ``target_model`` (copied, frozen).

    Args:
        target_model: the target (a transformers causal LM); optional unless the checkpoint omits
            ``embed_tokens`` / ``lm_head``; when given, the config must fit it.
        device / dtype: where and in what dtype the draft lives (default: fp32 on CPU, as
            ``DSparkDraftModel.from_pretrained``).

    Raises:
        FileNotFoundError: no ``config.json`` / safetensors weights.
        ValueError: not an original-layout draft, or a config / weight mismatch (the message names the
            key or tensor and the fix).
    """
    folder = Path(folder)
    source = str(folder / CONFIG_NAME)
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{source}: not found; pass a folder holding the draft's config.json and weights.")
    cfg = _read_config(folder)
    if cfg is None:
        raise ValueError(f"{source}: not a JSON object; pass an original DeepSpec draft folder.")
    if not is_original_layout(folder):
        raise _cfg_error(source, "architectures", f"an original DSpark draft's (e.g. [{ORIGINAL_ARCHITECTURE!r}])",
                         cfg.get("architectures"), "Pass a folder written by the original DeepSpec trainer.")
    config = draft_config_from_original(
        cfg, target_config=None if target_model is None else target_model.config, source=source)
    model = DSparkDraftModel(config)
    _fill(model, _strip_prefixes(_load_tensors(folder)), target_model, bool(cfg.get("tie_word_embeddings")), source)
    model.freeze_embeddings()
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)


def save_original_dspark(model: DSparkDraftModel, folder: str | Path, *, include_embeddings: bool = True,
                         num_anchors: int = 512) -> Path:
    """Write ``model`` in the original layout (``config.json`` + ``model.safetensors``), atomically.

    ``include_embeddings=False`` leaves out ``embed_tokens`` / ``lm_head`` (loading then needs the
    target). Tensors keep the model's dtype.
    """

    if not isinstance(model, DSparkDraftModel):
        raise ValueError(f"save_original_dspark.model: expected a DSparkDraftModel, received {type(model).__name__}.")
    if model.config.draft_vocab_size is not None:
        raise ValueError(f"save_original_dspark.model: expected a full-vocabulary draft (the original layout has no "
                         f"draft -> target id map), received draft_vocab_size={model.config.draft_vocab_size}. Save it "
                         "with model.save_pretrained (DeepSpec's layout keeps d2t), or train without --draft-vocab-size.")
    if not model.config.sample_from_anchor:
        raise ValueError("save_original_dspark.model: the original's drafts propose from the anchor slot on; this "
                         "draft has z-lab's DFlash layout (sample_from_anchor false: each mask slot predicts its own "
                         "position), which the original would read as another draft. Export it with --format "
                         "vllm-dflash, or keep DeepSpec's layout.")
    state = {k: v for k, v in model.state_dict().items()
             if k not in _DERIVED_BUFFERS and (include_embeddings or k not in _EMBEDDINGS)}
    cfg = original_config_dict(model.config, num_anchors=num_anchors)
    cfg["dtype"] = str(model.fc.weight.dtype).removeprefix("torch.")
    return save_draft_folder(folder, state, cfg)
