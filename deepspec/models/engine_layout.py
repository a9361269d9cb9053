"""The pieces every serving-engine layout of a draft shares (``deepspec export``, docs/export.md): the export
contract an algorithm declares its formats with (:class:`ExportFormat`), the Hugging Face decoder keys and
decoder tensors every engine reads, and the vllm-project/speculators restructuring of a vLLM layout.

An algorithm says which formats carry its drafts (its ``export_formats``: format name -> :class:`ExportFormat`,
built from these pieces); :mod:`deepspec.export` keeps the rules every format follows (reduced-vocabulary id maps,
the weight dtype, the tensor check, the ``deepspec`` record, atomic writes) and dispatches through the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from deepspec.models.vocab import is_reduced_vocab

# the speculators layout: the decoder keys go under this key (vllm-project/speculators)
SPECULATORS_LAYER_KEY = "transformer_layer_config"


class ExportError(ValueError):
    """The draft cannot be expressed in the asked format (the message names the format's limit)."""


@dataclass(frozen=True)
class ExportFormat:
    """One serving engine's layout that carries an algorithm's drafts (``deepspec export --format NAME``).

    ``write(model, *, algorithm, verifier)`` returns ``(config, weights, hint)``: the ``config.json`` keys, the
    draft's tensors under the engine's names (the id maps of a reduced vocabulary, ``lm_head`` and ``d2t``, are
    added by :mod:`deepspec.export`), and how to serve the folder (``DIR`` stands for it); ``algorithm`` is the
    registered name of the draft's algorithm; ``verifier``, for a format that ``names_verifier`` (else None), a
    function returning the ``speculators_config.verifier`` record of ``export --verifier`` (resolving it may
    raise, so a format calls it after its own checks). It raises :class:`ExportError` when the format cannot
    express the draft. ``expected(config)`` is every tensor (name -> shape) the engine's loader reads, besides the
    id maps, from the written ``config`` alone: the export is checked against it before anything is written,
    because these loaders do not report a missing weight.
    """

    write: Callable[..., tuple[dict[str, Any], dict[str, Tensor], str]]
    expected: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    names_verifier: bool = False  # the layout names the target it serves with (export --verifier)


def decoder_keys(c: Any, *, model_type: str, num_layers: int) -> dict[str, Any]:
    """The Hugging Face decoder keys every engine reads for the draft's layers, from a draft config ``c``
    (:class:`~deepspec.models.config.TargetShapeConfig`).

    Raises:
        ExportError: attention biases on some projections only (the engines take one ``attention_bias``), or MLP
            biases (the engines' draft layers have none).
    """
    if c.qkv_bias != c.o_bias:
        raise ExportError(f"the draft's attention has q/k/v bias {c.qkv_bias} but o_proj bias {c.o_bias}; the "
                          "engines' layers take one attention_bias for all four projections")
    if c.mlp_bias:
        raise ExportError("the draft's MLP has biases; the engines' draft layers have none")
    return {
        "model_type": model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_parameters.get("rope_theta"),
        "rope_parameters": dict(c.rope_parameters),
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": bool(c.qkv_bias),
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "pad_token_id": c.pad_token_id,
        "eos_token_id": list(c.eos_token_ids) if c.eos_token_ids else None,
    }


def vocab_keys(c: Any) -> dict[str, Any]:
    """``{"draft_vocab_size": N}`` for a draft with a reduced vocabulary (N < V,
    :func:`~deepspec.models.vocab.is_reduced_vocab`), else nothing: a draft vocabulary of all V tokens is written
    as the full one (SGLang shares the target's ``lm_head`` exactly when the key is absent)."""
    return {"draft_vocab_size": c.draft_vocab_size} if is_reduced_vocab(c.vocab_size, c.draft_vocab_size) else {}


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """An exported ``config`` with the speculators layout's nested decoder keys back at the top (a vLLM or SGLang
    config is returned as it is), so one ``expected`` function reads both."""
    return {**config, **config.get(SPECULATORS_LAYER_KEY, {})}


def decoder_tensors(config: dict[str, Any], *, num_features: int, width_in: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors every engine's draft reads, from an exported ``config`` (:func:`flat_config`
    first for a nested one): ``fc`` (``num_features`` target features of ``target_hidden_size`` into the hidden
    width), the final ``norm`` and each decoder layer's attention, MLP and norms, whose q/k/v projections read
    ``width_in`` inputs (with the biases ``attention_bias`` asks for, and q/k norms for a ``qwen3`` decoder)."""
    H, I = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, num_features * config["target_hidden_size"]),
                                       "norm.weight": (H,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, width_in), p + "self_attn.k_proj.weight": (kv, width_in),
                    p + "self_attn.v_proj.weight": (kv, width_in), p + "self_attn.o_proj.weight": (H, q),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
        if config["attention_bias"]:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (H,)})
        if config["model_type"] == "qwen3":
            out.update({p + "self_attn.q_norm.weight": (config["head_dim"],),
                        p + "self_attn.k_norm.weight": (config["head_dim"],)})
    return out


def speculators_format(base: ExportFormat, *, kind: str, num_tokens: Callable[[Any], int],
                       adapt: Callable[[dict[str, Any], dict[str, Any]], list[str] | None]) -> ExportFormat:
    """The vllm-project/speculators layout of a vLLM format ``base`` (which ``vllm serve DIR`` serves alone): the
    weights are ``base``'s; its decoder keys (:func:`decoder_keys`) move under ``transformer_layer_config``, the
    algorithm's keys stay at the top, and ``speculators_config`` names ``kind`` (``speculators_model_type``), the
    verifier (the target) and ``num_tokens(draft config)`` speculative tokens.

    ``adapt(layer, top)`` moves the keys the algorithm's speculators reader wants elsewhere (in place) and returns
    the ``architectures`` to write, or None to keep ``base``'s. ``expected`` is ``base``'s, read through
    :func:`flat_config`. A limit of ``base`` is raised as ``speculators (the weights and keys of ...)``.
    """

    def write(model: nn.Module, *, algorithm: str, verifier: Callable[[], dict[str, Any]]
              ) -> tuple[dict[str, Any], dict[str, Tensor], str]:
        c = model.config
        try:
            config, weights, _ = base.write(model, algorithm=algorithm, verifier=None)
        except ExportError as exc:
            raise ExportError(f"speculators (the weights and keys of {exc})") from exc
        target = verifier()
        layer_names = set(decoder_keys(c, model_type="", num_layers=1))
        layer = {k: v for k, v in config.items() if k in layer_names}
        top = {k: v for k, v in config.items() if k not in layer_names and k != "architectures"}
        architectures = adapt(layer, top) or list(config["architectures"])
        out = {
            "architectures": architectures, "speculators_model_type": kind, SPECULATORS_LAYER_KEY: layer, **top,
            "speculators_config": {
                "algorithm": kind,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_tokens(c),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": target,
            },
        }
        return out, weights, "vllm serve DIR  (the target is the config's speculators_config.verifier)"

    return ExportFormat(write=write, expected=lambda config: base.expected(flat_config(config)), names_verifier=True)
