"""What every draft's config copies from its target, and the draft folder's files.

A draft is a small stack of decoder layers with the target's shape (same width, heads, KV heads,
head dim, MLP, RoPE, norm eps) conditioned on concatenated target features (docs/design/draft-models.md, "Draft shape and
backbone"). Their
attention is either the target family's own (``backbone="target"``: q/k norm for Qwen3, q/k/v biases
for Qwen2) or Qwen3-style for any family (``backbone="qwen3"``: per-head q/k RMSNorm, no biases), the
layer vLLM's and SGLang's DFlash / DSpark loaders build whatever the target is (:data:`BACKBONES`).
:class:`TargetShapeConfig` holds everything shape-related, copied from the target config
(:func:`target_shape_fields`); each algorithm's config adds its own knobs
(:class:`deepspec.algorithms.dspark.config.DraftConfig`, :class:`deepspec.algorithms.eagle3.config.Eagle3Config`).
:func:`config_from_dict` reads a saved config back; :func:`save_draft_folder` writes a draft folder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from deepspec.target.capture import final_logit_softcap
from deepspec.utils import atomic_path, token_id_list

WEIGHTS_NAME = "model.safetensors"  # a draft folder's weights (every algorithm, and the original's layout)
CONFIG_NAME = "config.json"  # a draft folder's config


def save_draft_folder(out_dir: Any, state: dict[str, Any], config: dict[str, Any],
                      extra_json: dict[str, Any] | None = None) -> Any:
    """Write a draft folder, ``WEIGHTS_NAME`` (safetensors; each tensor made contiguous on the CPU),
    ``CONFIG_NAME`` (``config`` as JSON) and each ``extra_json`` entry (file name -> JSON-able object, e.g. a
    confidence calibration), atomically: the folder appears only when complete. Returns ``out_dir`` as a ``Path``."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name, obj in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    return out_dir

# the draft's decoder-layer attention: the target family's own, or Qwen3-style (q/k norm, no bias) for any family
BACKBONES = ("target", "qwen3")


def draft_backbone(name: str, auto: str) -> str:
    """The backbone ``train --draft-backbone NAME`` gives a draft: ``auto`` stands for the algorithm's own
    choice, the argument ``auto`` (DSpark / DFlash: ``qwen3``, the layer vLLM's ``Qwen3DSparkModel`` builds, so
    the draft exports to vLLM for any target family, docs/export.md, except with ``--init-from-target``, whose
    copy of the target's layers needs the family's own layer; Eagle3: ``target``, whose engine heads exist for
    Llama layers too, and SGLang's has no q/k norm). Raises ValueError naming ``train.draft_backbone``."""
    if name == "auto":
        return auto
    if name not in BACKBONES:
        raise ValueError(f"train.draft_backbone: expected auto, {' or '.join(BACKBONES)}, got {name!r}")
    return name


@dataclass(frozen=True)
class FamilyRules:
    """What differs between target families for a draft (all read by :func:`target_shape_fields` and the
    draft models).

    ``module`` / ``config_class`` / ``prefix``: the transformers modeling module, config class and class
    prefix whose RMSNorm, MLP, rotary embedding and ``apply_rotary_pos_emb`` the draft layers use (so
    Gemma's norm is its own ``(1 + w)`` RMSNorm, initialised at w = 0). ``qk_norm``: the family's own
    attention has per-head q/k RMSNorm (Qwen3, Gemma 3). ``act_key``: the config key of the MLP
    activation (Gemma: ``hidden_activation``). ``embed_scale``: token embeddings are multiplied by
    sqrt(hidden_size) before the first layer (Gemma, ``Gemma3TextScaledWordEmbedding``), so the draft
    embeds its own tokens the same way. ``rope_layer_type``: the family keeps one RoPE set per attention
    type (Gemma 3: ``rope_parameters = {"sliding_attention": ..., "full_attention": ...}``); the draft's
    layers attend to the whole context, so they take this type's (the global layers' RoPE).
    ``layer_copyable``: a target decoder layer computes what a draft layer of the same tensors computes,
    so ``--init-from-target`` may copy it (not Gemma 3: its layers have four norms, pre/post attention
    and pre/post MLP, and scale queries by ``query_pre_attn_scalar``).
    """

    module: str
    config_class: str
    prefix: str
    qk_norm: bool = False
    act_key: str = "hidden_act"
    embed_scale: bool = False
    rope_layer_type: str | None = None
    layer_copyable: bool = True


# model_type -> rules. Gemma 4 (gemma4_text) needs more than these rules (per-layer head_dim, per-layer
# input embeddings, KV-shared layers, proportional RoPE) and is not listed.
_FAMILIES: dict[str, FamilyRules] = {
    "llama": FamilyRules("transformers.models.llama.modeling_llama", "LlamaConfig", "Llama"),
    "qwen3": FamilyRules("transformers.models.qwen3.modeling_qwen3", "Qwen3Config", "Qwen3", qk_norm=True),
    "qwen2": FamilyRules("transformers.models.qwen2.modeling_qwen2", "Qwen2Config", "Qwen2"),
    "mistral": FamilyRules("transformers.models.mistral.modeling_mistral", "MistralConfig", "Mistral"),
    "gemma3_text": FamilyRules("transformers.models.gemma3.modeling_gemma3", "Gemma3TextConfig", "Gemma3",
                               qk_norm=True, act_key="hidden_activation", embed_scale=True,
                               rope_layer_type="full_attention", layer_copyable=False),
}
SUPPORTED_FAMILIES = tuple(_FAMILIES)


def family_rules(family: str) -> FamilyRules:
    """The :class:`FamilyRules` of ``family`` (a target ``model_type``); KeyError when unsupported."""
    return _FAMILIES[family]


class _LayerTypeRotary(nn.Module):
    """A family rotary embedding that keeps one RoPE per attention type (Gemma 3), called as every other
    family's: ``(x, position_ids) -> (cos, sin)`` for ``layer_type``."""

    def __init__(self, inner: nn.Module, layer_type: str):
        super().__init__()
        self.inner, self.layer_type = inner, layer_type

    def forward(self, x: Any, position_ids: Any) -> Any:
        return self.inner(x, position_ids, self.layer_type)


def unsupported_family_note(target_config: Any, stage: str) -> str | None:
    """A warning for ``stage`` (prepare, cache) when no draft can be built for the target's family, so
    that the user learns it before hours of regeneration and capture, not at ``train``; None when
    the family (``target_config.model_type``) is one of :data:`SUPPORTED_FAMILIES` or not recorded."""
    family = getattr(target_config, "model_type", None)
    if family is None or family in _FAMILIES:  # no config to judge (a stand-in model), or a family we draft for
        return None
    return (f"{stage}: warning: the target's model_type {family!r} is not a family DeepSpec builds drafts for "
            f"({', '.join(SUPPORTED_FAMILIES)}): this stage works, but `deepspec train` will refuse it.")


def config_error(field_name: str, expected: str, received: Any, fix: str, cls: str) -> ValueError:
    """The ValueError of a config field: ``<cls>.<field>: expected ..., received ... <fix>``."""
    return ValueError(f"{cls}.{field_name}: expected {expected}, received {received!r}. {fix}")


def config_from_dict(cls: Any, d: dict[str, Any]) -> Any:
    """Build a draft config dataclass from a saved ``config.json`` dict, with no field dropped or guessed.

    Unknown keys are refused (a typo, or a field of a newer DeepSpec, would otherwise be dropped), and
    so are missing keys, except those in ``cls.OPTIONAL_ON_LOAD`` (fields that do not change the
    forward pass, e.g. loss weights and the target fingerprint, or whose default is the behaviour of
    drafts saved before the field existed). A draft whose config misses ``target_layer_ids`` or
    ``rms_norm_eps`` would otherwise fail with a raw ``TypeError`` or, worse, load with a default and
    propose with another forward pass.

    Raises:
        ValueError: naming the unknown or missing keys and the fix.
    """
    name = cls.__name__
    if not isinstance(d, dict):
        raise ValueError(f"{name}.from_dict: expected a dict (the draft config of config.json), received "
                         f"{type(d).__name__}.")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    known = {f.name for f in fields}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{name}.from_dict: unknown keys {unknown}; expected a subset of {sorted(known)}. "
                         "Remove them or upgrade DeepSpec.")
    missing = sorted(f.name for f in fields if f.name not in d and f.name not in cls.OPTIONAL_ON_LOAD)
    if missing:
        raise ValueError(f"{name}.from_dict: missing keys {missing}; they change the draft's forward pass, so "
                         "DeepSpec does not guess them. Add them to the draft's config.json (the values the draft "
                         "was trained with) or re-save the draft with this DeepSpec.")
    return cls(**d)


@dataclass(kw_only=True)
class TargetShapeConfig:
    """The fields every draft copies from its target (family, backbone shape, RoPE, target layers, special
    ids), their validation, and what derives from them (family classes, a transformers config).

    ``hidden_size`` must equal the target hidden size because ``embed_tokens`` / ``lm_head`` are copied
    from the target. Validated in ``__post_init__``; errors are ``ValueError`` naming
    ``<ConfigClass>.<field>``, expected, received, and the fix. Derive one with :func:`target_shape_fields`.

    The target a draft is made for is recorded by ``family``, ``target_num_hidden_layers``,
    ``target_hidden_size``, ``vocab_size`` and ``target_fingerprint``
    (:func:`deepspec.target.load.target_fingerprint` of the target whose embedding and lm_head the
    draft copied; set by ``from_target``; None in drafts saved before it was recorded). Evaluation
    checks them against the target (:func:`deepspec.algorithms.registry.check_draft_target`).
    """

    # Keys a saved config may lack (config_from_dict): they do not change the forward pass.
    OPTIONAL_ON_LOAD: ClassVar[tuple[str, ...]] = ("pad_token_id", "eos_token_ids", "target_fingerprint",
                                                   "draft_vocab_size", "embed_scale",
                                                   "final_logit_softcapping")

    # --- family and backbone shape (copied from the target) ---
    family: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int
    vocab_size: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # --- target conditioning ---
    target_hidden_size: int
    target_num_hidden_layers: int
    target_layer_ids: list[int]
    # token embeddings times this before the first layer (Gemma: sqrt(hidden_size)); the target's rule
    embed_scale: float = 1.0
    # the target's final-logit soft-capping (Gemma 2: 30.0; None: none): the training loss scores the
    # target distribution with it (deepspec.target.capture.soft_cap); the draft's own logits are uncapped
    final_logit_softcapping: float | None = None
    pad_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    target_fingerprint: str | None = None  # content hash of the target the draft was made for (metadata)
    # --- output vocabulary ---
    # None: the draft proposes from the full target vocabulary. N: from N target tokens only (the
    # model's ``d2t`` buffer maps draft id -> target id; deepspec.models.vocab).
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        cls = type(self).__name__
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.eos_token_ids = [int(i) for i in self.eos_token_ids]
        self.rope_parameters = dict(self.rope_parameters)
        if self.family not in _FAMILIES:
            raise config_error("family", f"one of {SUPPORTED_FAMILIES}", self.family,
                               "Use a target whose config.model_type is a supported family.", cls)
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings", "vocab_size",
                     "target_hidden_size", "target_num_hidden_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise config_error(name, "a positive integer", v, "Check the target config / the knob.", cls)
        if self.num_attention_heads % self.num_key_value_heads:
            raise config_error("num_key_value_heads", f"a divisor of num_attention_heads={self.num_attention_heads}",
                               self.num_key_value_heads, "Copy both from the target config.", cls)
        if self.hidden_size != self.target_hidden_size:
            raise config_error("hidden_size", f"== target_hidden_size ({self.target_hidden_size}); embed_tokens and "
                               "lm_head are copied from the target", self.hidden_size,
                               "Build the config from the target config (target_shape_fields).", cls)
        if "rope_theta" not in self.rope_parameters:
            raise config_error("rope_parameters", "a dict with 'rope_theta' (transformers>=5 layout)",
                               self.rope_parameters, "Copy target_config.rope_parameters.", cls)
        self.rope_parameters.setdefault("rope_type", "default")
        if not self.target_layer_ids:
            raise config_error("target_layer_ids", "a non-empty list of decoder-layer ids", self.target_layer_ids,
                               "Use deepspec.target.capture.default_target_layer_ids(num_hidden_layers).", cls)
        L = self.target_num_hidden_layers
        for i in self.target_layer_ids:
            if i != -1 and not 0 <= i < L - 1:
                raise config_error("target_layer_ids",
                                   f"ids in {{-1}} U [0, {L - 2}] (L-1={L - 1} is post-norm, rejected)",
                                   self.target_layer_ids, "Pick layers strictly below the last decoder layer.", cls)
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise config_error("target_layer_ids", "distinct ids", self.target_layer_ids, "Remove duplicates.", cls)
        from transformers.activations import ACT2FN

        if self.hidden_act not in ACT2FN:
            raise config_error("hidden_act", "an activation transformers knows (e.g. silu, gelu_pytorch_tanh)",
                               self.hidden_act, f"Copy the target config's {_FAMILIES[self.family].act_key}.", cls)
        if isinstance(self.embed_scale, bool) or not isinstance(self.embed_scale, (int, float)) \
                or not 0 < self.embed_scale < float("inf"):
            raise config_error("embed_scale", "a positive number (1.0, or sqrt(hidden_size) for Gemma)",
                               self.embed_scale, "Build the config from the target config (target_shape_fields).", cls)
        self.embed_scale = float(self.embed_scale)
        cap = self.final_logit_softcapping
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise config_error("final_logit_softcapping", "None or a positive number (the target config's)", cap,
                               "Build the config from the target config (target_shape_fields).", cls)
        n = self.draft_vocab_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.vocab_size):
            raise config_error("draft_vocab_size",
                               f"None (full vocabulary) or an integer in [1, vocab_size={self.vocab_size}]",
                               n, "Pick a smaller draft vocabulary (train --draft-vocab-size), or None.", cls)

    @property
    def output_vocab_size(self) -> int:
        """Width of the draft's logits: ``draft_vocab_size`` (N) when reduced, else ``vocab_size`` (V)."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def feature_width(self) -> int:
        """F = n_layers * H, the width of the concatenated target features."""
        return len(self.target_layer_ids) * self.target_hidden_size

    @property
    def num_decoder_layers(self) -> int:
        """Decoder layers of the draft (what :meth:`to_hf_config` describes); 1 unless a subclass says."""
        return 1

    def family_module(self):
        """The transformers modeling module of this family (source of RMSNorm/MLP/RoPE blocks)."""
        import importlib

        return importlib.import_module(_FAMILIES[self.family].module)

    def family_class(self, suffix: str):
        """E.g. ``family_class("RMSNorm")`` -> ``LlamaRMSNorm`` for the llama family."""
        return getattr(self.family_module(), _FAMILIES[self.family].prefix + suffix)

    def rotary_embedding(self, hf_config: Any = None) -> nn.Module:
        """The family's rotary embedding for the draft layers (``hf_config`` defaults to
        :meth:`to_hf_config`): a module ``(x, position_ids [B, T]) -> (cos, sin)`` each ``[B, T, d]``,
        transformers' own code, so RoPE scaling is the target's exactly (Gemma 3: its global layers')."""
        rotary = self.family_class("RotaryEmbedding")(hf_config or self.to_hf_config())
        layer_type = _FAMILIES[self.family].rope_layer_type
        return rotary if layer_type is None else _LayerTypeRotary(rotary, layer_type)

    def to_hf_config(self):
        """A transformers config of the target family describing the draft layers (used to build
        the library's RMSNorm / MLP / rotary embedding; never a full model)."""
        import importlib

        rules = _FAMILIES[self.family]
        cfg_mod = importlib.import_module(rules.module.replace("modeling_", "configuration_"))
        rope = dict(self.rope_parameters)
        kwargs = dict(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope if rules.rope_layer_type is None else {rules.rope_layer_type: rope},
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            num_hidden_layers=self.num_decoder_layers,
        )
        kwargs[rules.act_key] = self.hidden_act
        if rules.rope_layer_type is not None:  # every draft layer attends to the whole context
            kwargs["layer_types"] = [rules.rope_layer_type] * self.num_decoder_layers
        if self.family in ("llama",):
            kwargs["mlp_bias"] = self.mlp_bias
            kwargs["attention_bias"] = self.qkv_bias
        return getattr(cfg_mod, rules.config_class)(**kwargs)


def target_shape_fields(
    target_config: Any,
    *,
    target_layer_ids: list[int],
    pad_token_id: int | None = None,
    eos_token_ids: list[int] | int | None = None,
    eos_token_id: list[int] | int | None = None,
    backbone: str = "target",
) -> dict[str, Any]:
    """The :class:`TargetShapeConfig` fields of a draft for ``target_config`` (docs/design/draft-models.md,
    "Draft shape and backbone").

    Args:
        target_config: the target's ``PretrainedConfig`` (or anything with the same attributes).
            Family from ``model_type`` (:data:`SUPPORTED_FAMILIES`: llama, qwen3, qwen2, mistral,
            gemma3_text); its :class:`FamilyRules` say where the activation and RoPE are read from and
            whether embeddings are scaled.
        target_layer_ids: the target layers whose features the draft reads.
        pad_token_id / eos_token_ids: the tokenizer's ids (default: the target config's
            ``pad_token_id`` / ``eos_token_id``). ``eos_token_id`` (int or list, tokenizer spelling) is
            accepted too; both are merged.
        backbone: ``"target"``: the family's own attention (q/k norm for Qwen3 and Gemma 3, q/k/v bias for Qwen2,
            ``attention_bias`` / ``mlp_bias`` as the config says); ``"qwen3"``: Qwen3-style for any
            family, per-head q/k RMSNorm and no biases (:data:`BACKBONES`).

    Raises:
        ValueError: an unsupported family or backbone.
    """
    if backbone not in BACKBONES:
        raise ValueError(f"backbone: expected one of {BACKBONES}, received {backbone!r}")
    family = getattr(target_config, "model_type", None)
    if family not in _FAMILIES:
        raise ValueError(f"target_config.model_type: expected one of {SUPPORTED_FAMILIES}, received {family!r}. "
                         "DeepSpec builds drafts for these families only.")
    H = int(target_config.hidden_size)
    n_heads = int(target_config.num_attention_heads)
    n_kv = int(getattr(target_config, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(target_config, "head_dim", None) or H // n_heads)
    rules = _FAMILIES[family]
    rope = getattr(target_config, "rope_parameters", None)
    if rope is not None and rules.rope_layer_type is not None and rules.rope_layer_type in rope:
        rope = rope[rules.rope_layer_type]  # one RoPE per attention type: the global layers'
    if rope is None:  # older layout
        rope = {"rope_type": "default", "rope_theta": float(getattr(target_config, "rope_theta", 10000.0))}
        if getattr(target_config, "rope_scaling", None):
            rope.update(target_config.rope_scaling)
            rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    attn_bias = bool(getattr(target_config, "attention_bias", False))
    if backbone == "qwen3":
        qkv_bias = o_bias = mlp_bias = False
        qk_norm = True
    else:
        qkv_bias, o_bias = (True, False) if family == "qwen2" else (attn_bias, attn_bias)
        mlp_bias = bool(getattr(target_config, "mlp_bias", False))
        qk_norm = rules.qk_norm
    if pad_token_id is None:
        pad_token_id = getattr(target_config, "pad_token_id", None)
    eos_all = token_id_list(eos_token_ids) + token_id_list(eos_token_id)
    if not eos_all:
        eos_all = token_id_list(getattr(target_config, "eos_token_id", None))
    return dict(
        family=family,
        hidden_size=H,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=int(target_config.intermediate_size),
        hidden_act=str(getattr(target_config, rules.act_key, None) or "silu"),
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        max_position_embeddings=int(target_config.max_position_embeddings),
        vocab_size=int(target_config.vocab_size),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        target_hidden_size=H,
        target_num_hidden_layers=int(target_config.num_hidden_layers),
        target_layer_ids=list(target_layer_ids),
        embed_scale=float(H) ** 0.5 if rules.embed_scale else 1.0,
        final_logit_softcapping=final_logit_softcap(target_config),
        pad_token_id=None if pad_token_id is None else int(pad_token_id),
        eos_token_ids=sorted(set(eos_all)),
    )
