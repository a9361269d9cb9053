"""What a GGUF file's header says about the forward pass, as a transformers config (docs/design/targets.md, "GGUF").

A GGUF file is its own config, in llama.cpp's key names (``<arch>.rope.freq_base``, ...), and llama.cpp's
forward pass is the reference for what the file means. transformers' GGUF loader maps only some of those keys
and tensors and silently drops the rest (a linear RoPE scaling, Llama 3.1's ``rope_freqs.weight``, Gemma 3's
query scale), so the converted model would be another model. Here every key in the architecture's namespace and
every tensor is either applied to the config, checked to be what the config already does, or refused by name:

- :func:`read_gguf_header`: the header's keys (decoded) and tensor names, and the small ``rope_freqs.weight``.
- :func:`gguf_config_fields`: the transformers config fields llama.cpp's forward implies (ValueError naming the
  key for what a transformers model of the family cannot do, or a key DeepSpec does not know).
- :func:`apply_gguf_header` / :func:`check_gguf_config`: set those fields on a config / check a config against
  the header: the fields, the RoPE frequencies each attention layer type gets (computed by transformers from the
  config and, independently, as llama.cpp computes them from the header) and that every GGUF tensor is a weight
  of the model.

Only the architectures of :data:`CHECKED_ARCHITECTURES` are accepted; the rules (which keys llama.cpp reads and
what they do) follow llama.cpp's ``src/llama-model.cpp`` (hyperparameter loading) and ggml's RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# GGUF architecture -> transformers model_type.
CHECKED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

# Keys of the architecture's namespace (``<arch>.`` + one of these) whose effect is applied or checked here.
_COMMON_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length",
    "rope.dimension_count", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
    "rope.scaling.attn_factor",
    # used by llama.cpp only for YaRN (refused below) / recorded only: no effect on a linear or default RoPE
    "rope.scaling.original_context_length", "rope.scaling.finetuned",
})
_ARCH_KEYS = {"llama": frozenset(), "qwen2": frozenset(), "qwen3": frozenset(),
              "gemma3": frozenset({"attention.sliding_window", "final_logit_softcapping"})}
# Namespaces outside ``<arch>.`` llama.cpp reads that do not change the forward pass (metadata, the tokenizer,
# the quantiser's notes, the reader's own counts). ``split.*`` and ``adapter.*`` are judged below.
_NEUTRAL_NAMESPACES = ("general.", "tokenizer.", "quantize.", "GGUF.")

ROPE_FREQS = "rope_freqs.weight"
_GEMMA3_SWA_PERIOD = 6  # llama.cpp: every 6th layer (index % 6 == 5) is global, the others sliding-window
_GEMMA3_SWA_THETA = 10000.0  # llama.cpp: the sliding-window layers' RoPE base, without scaling
_GEMMA3_27B_LAYERS = 62  # llama.cpp scales Gemma 3 27B's queries by 1/sqrt(n_embd / n_head), not 1/sqrt(key_length)


@dataclass
class GGUFHeader:
    """A GGUF file's header: ``arch`` (``general.architecture``), ``fields`` (every key, decoded: str, int, float
    or list; a long ``tokenizer.*`` array only as ``"<n values>"``), ``tensors`` (name -> shape as GGUF stores
    it, innermost first) and ``rope_freqs`` (the ``rope_freqs.weight`` values as float64, shape
    ``(n_rot / 2,)``, when the file holds that tensor)."""

    path: Path
    arch: str
    fields: dict[str, Any]
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    rope_freqs: np.ndarray | None = None

    def key(self, suffix: str, default: Any = None) -> Any:
        """The value of ``<arch>.<suffix>``, or ``default`` when absent."""
        return self.fields.get(f"{self.arch}.{suffix}", default)

    def refuse(self, key: str, value: Any, why: str) -> ValueError:
        """A ValueError naming the file, the GGUF key and its value, and ``why`` (which says what to do)."""
        return ValueError(f"target={str(self.path)!r}: the GGUF header's {key} = {value!r}: {why}")


def read_gguf_header(path: Path) -> GGUFHeader:
    """Read the header of GGUF file ``path`` (no weight is loaded except ``rope_freqs.weight``, a few floats).

    Raises:
        ValueError: not a readable GGUF file, or no ``general.architecture`` key.
    """
    from gguf import GGUFReader, dequantize

    try:
        reader = GGUFReader(str(path))
        fields = {name: f"<{len(f.data)} values>" if name.startswith("tokenizer.") and len(f.data) > 64
                  else f.contents() for name, f in reader.fields.items()}  # the vocabulary is not read here
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError/IndexError/struct.error on bad files
        raise ValueError(f"target={str(path)!r}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"target={str(path)!r}: the GGUF header has no general.architecture field")
    header = GGUFHeader(Path(path), arch, fields, {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors})
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            header.rope_freqs = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    return header


def _uniform(header: GGUFHeader, suffix: str, default: Any = None) -> Any:
    """``<arch>.<suffix>``, a per-layer array accepted only when all its entries are equal."""
    value = header.key(suffix, default)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise header.refuse(f"{header.arch}.{suffix}", value, "a per-layer value that differs between layers, "
                                "which a transformers model of this family cannot have; convert the model from its "
                                "Hugging Face folder and pass that folder")
        value = value[0]
    return value


def _check_keys(header: GGUFHeader) -> None:
    """Refuse, naming it, every key that could change the forward pass and is not handled here."""
    known = _COMMON_KEYS | _ARCH_KEYS[header.arch]
    prefix = header.arch + "."
    for key, value in header.fields.items():
        if key.startswith(prefix):
            if key[len(prefix):] not in known:
                raise header.refuse(key, value, f"DeepSpec does not know how this {header.arch} key changes "
                                    "llama.cpp's forward pass, so it cannot convert the file faithfully; convert the "
                                    "model from its Hugging Face folder and pass that folder")
        elif key.startswith("adapter."):
            raise header.refuse(key, value, "this is an adapter (LoRA) file, not a model; pass the model's file")
        elif key == "split.count" and int(value) > 1:
            raise header.refuse(key, value, "the model is split over several GGUF files; merge them into one "
                                "(llama.cpp's llama-gguf-split --merge) and pass that file")
        # other namespaces (general., tokenizer., quantize., split. of one file, or any other) are not read by
        # llama.cpp's forward pass


def _rope_factor(header: GGUFHeader) -> tuple[str, float]:
    """``(key, linear factor)``: llama.cpp reads ``rope.scaling.factor``, else the old ``rope.scale_linear``;
    absent or 0 means 1 (no scaling)."""
    key = "rope.scaling.factor" if header.key("rope.scaling.factor") is not None else "rope.scale_linear"
    return f"{header.arch}.{key}", float(header.key(key) or 0.0) or 1.0


def _rope_scaling(header: GGUFHeader) -> float:
    """The linear RoPE factor of the header (1.0: none); refuses a scaling transformers' linear/default types
    cannot reproduce. llama.cpp: ``rope.scaling.type`` defaults to ``linear``, the factor (``rope.scaling.factor``,
    else the old ``rope.scale_linear``; 0 means none) divides every position, ``rope.scaling.attn_factor``
    multiplies cos and sin."""
    a = header.arch
    factor_key, factor = _rope_factor(header)
    kind = header.key("rope.scaling.type", "linear")
    if factor != 1.0 and kind != "linear":
        raise header.refuse(f"{a}.rope.scaling.type", kind, f"with {factor_key} = {factor}: DeepSpec converts only "
                            "a linear RoPE scaling (a YaRN or LongRoPE scaling is not reproduced exactly from the "
                            "header); convert the model from its Hugging Face folder and pass that folder")
    attn_factor = header.key("rope.scaling.attn_factor")
    if attn_factor is not None and float(attn_factor) != 1.0:
        raise header.refuse(f"{a}.rope.scaling.attn_factor", attn_factor, "llama.cpp multiplies RoPE's cos and sin "
                            "by it, which a transformers model of this family does not do; convert the model from "
                            "its Hugging Face folder and pass that folder")
    if factor < 1.0:
        raise header.refuse(factor_key, factor, "a RoPE scaling factor below 1 is not one transformers applies")
    return factor


def _llama3_rope(header: GGUFHeader, theta: float, n_rot: int) -> dict[str, Any] | None:
    """The transformers ``llama3`` RoPE parameters that reproduce ``rope_freqs.weight`` (llama.cpp divides the
    frequency of dimension pair ``i`` by entry ``i``; its converter writes Llama 3.1's ``rope_scaling`` that way),
    or None when every entry is 1. Raises ValueError when the tensor is not of that shape.

    The llama3 rule: with ``s = (L / wavelength - low) / (high - low)`` clamped to [0, 1], the divisor is
    ``1 / ((1 - s) / factor + s)``. ``factor`` is the largest entry; ``s`` is linear in the frequency, so a line
    fitted through the entries strictly between 1 and ``factor`` (or placed between the two groups when fewer than
    two are) gives ``low`` and ``high`` for ``L`` = ``rope.scaling.original_context_length`` (else 8192: only the
    ratios matter)."""
    ff = header.rope_freqs
    bad = header.refuse(ROPE_FREQS, None if ff is None else [round(float(v), 6) for v in ff[:8]],
                        f"these RoPE frequency factors (shape {None if ff is None else ff.shape}) are not Llama 3's "
                        "smooth scaling of the head's frequencies, which is all a transformers model can apply; "
                        "convert the model from its Hugging Face folder and pass that folder")
    if ff is None or ff.shape != (n_rot // 2,) or not np.all(np.isfinite(ff)) or ff.min() < 1.0 - 1e-6:
        raise bad
    factor = float(ff.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = theta ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    u = inv_freq / (2 * math.pi)  # 1 / wavelength
    s = np.clip((factor / ff - 1.0) / (factor - 1.0), 0.0, 1.0)
    tol = 1e-5
    medium, low_group, high_group = (s > tol) & (s < 1 - tol), s <= tol, s >= 1 - tol
    if medium.sum() >= 2:
        slope, offset = np.polyfit(u[medium], s[medium], 1)
    else:
        u_lo = u[low_group].max()  # the highest frequency scaled by the full factor
        if medium.any():
            u_m, s_m = float(u[medium][0]), float(s[medium][0])
            slope = s_m / (u_m - u_lo) if u_m > u_lo else -1.0
            if high_group.any():
                slope = max(slope, (1 - s_m) / (u[high_group].min() - u_m))
            offset = s_m - slope * u_m
        elif high_group.any():
            u_hi = u[high_group].min()
            slope = 1.0 / (u_hi - u_lo) if u_hi > u_lo else -1.0
            offset = -slope * u_lo
        else:  # every entry is the factor: a plain linear scaling
            return {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    if not slope > 0 or not offset < 0:
        raise bad
    old = int(header.key("rope.scaling.original_context_length") or 8192)
    low = -offset * old / slope
    high = low + old / slope
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low), "high_freq_factor": float(high),
            "original_max_position_embeddings": old, "rope_theta": theta}


def gguf_config_fields(header: GGUFHeader) -> dict[str, Any]:
    """The transformers config fields llama.cpp's forward pass of ``header``'s model implies.

    Returns:
        ``{field: value}``: ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
        ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``, ``head_dim`` (``attention.key_length``,
        default ``embedding_length / head_count``), ``rope_parameters`` (``rope.freq_base``, default 10000; a
        linear ``rope.scaling.factor``; Llama's ``rope_freqs.weight`` as a llama3 RoPE); for Gemma 3 also
        ``sliding_window``, ``layer_types`` (llama.cpp's every-6th-layer-global pattern), per-layer-type
        ``rope_parameters`` (sliding layers: base 10000, unscaled), ``query_pre_attn_scalar`` (``key_length``;
        ``embedding_length / head_count`` for the 62-layer 27B) and ``final_logit_softcapping``.

    Raises:
        ValueError: an architecture not in :data:`CHECKED_ARCHITECTURES`, or naming the GGUF key (or tensor) and
            its value: a key DeepSpec does not know, ``attention.value_length`` or ``rope.dimension_count`` other
            than the key length, a non-linear or attention-scaled RoPE scaling, a per-layer value that differs
            between layers, a ``rope_freqs.weight`` outside Llama or not of Llama 3's shape, a Gemma 3 without
            ``attention.sliding_window``.
    """
    a = header.arch
    if a not in CHECKED_ARCHITECTURES:
        raise ValueError(f"target={str(header.path)!r}: DeepSpec converts GGUF files of the architectures "
                         f"{', '.join(CHECKED_ARCHITECTURES)} only (their headers are checked key by key against "
                         f"llama.cpp's meaning); {a!r} is not one of them. Convert the model to a Hugging Face "
                         "folder another way and pass that folder")
    _check_keys(header)
    hidden = int(header.key("embedding_length"))
    heads = int(_uniform(header, "attention.head_count"))
    kv_heads = int(_uniform(header, "attention.head_count_kv", heads))
    head_dim = int(header.key("attention.key_length", hidden // heads))
    value_dim = int(header.key("attention.value_length", hidden // heads))
    if value_dim != head_dim:
        raise header.refuse(f"{a}.attention.value_length", value_dim, f"differs from the key length {head_dim}, which "
                            "a transformers model of this family cannot have; convert the model from its Hugging Face "
                            "folder and pass that folder")
    n_rot = int(header.key("rope.dimension_count", head_dim))
    if n_rot != head_dim:
        raise header.refuse(f"{a}.rope.dimension_count", n_rot, f"RoPE on {n_rot} of the {head_dim} dimensions of a "
                            "head (a partial rotary embedding) is not converted; convert the model from its Hugging "
                            "Face folder and pass that folder")
    theta = float(header.key("rope.freq_base", 10000.0))
    factor = _rope_scaling(header)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if factor != 1.0:
        rope = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    if header.rope_freqs is not None:
        if a != "llama":
            raise header.refuse(ROPE_FREQS, "a tensor", f"llama.cpp's {a} does not read this tensor (it refuses the "
                                "file); pass a file written for this architecture")
        if factor != 1.0:
            raise header.refuse(ROPE_FREQS, "a tensor", f"together with a linear RoPE factor {factor}: two scalings at "
                                "once are not a RoPE type transformers has; convert the model from its Hugging Face "
                                "folder and pass that folder")
        rope = _llama3_rope(header, theta, n_rot) or rope
    out: dict[str, Any] = {
        "num_hidden_layers": int(header.key("block_count")), "hidden_size": hidden,
        "intermediate_size": int(_uniform(header, "feed_forward_length")), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": float(header.key("attention.layer_norm_rms_epsilon")),
        "head_dim": head_dim, "rope_parameters": rope,
    }
    if a == "gemma3":
        window = int(header.key("attention.sliding_window") or 0)
        if window <= 0:
            raise header.refuse(f"{a}.attention.sliding_window", header.key("attention.sliding_window"),
                                "a Gemma 3 without sliding-window layers is not converted; pass a Gemma 3 file "
                                "that declares its window")
        layers = out["num_hidden_layers"]
        out["sliding_window"] = window
        out["layer_types"] = ["sliding_attention" if i % _GEMMA3_SWA_PERIOD < _GEMMA3_SWA_PERIOD - 1
                              else "full_attention" for i in range(layers)]
        out["rope_parameters"] = {"full_attention": rope,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_SWA_THETA}}
        out["query_pre_attn_scalar"] = hidden // heads if layers == _GEMMA3_27B_LAYERS else head_dim
        cap = header.key("final_logit_softcapping")
        out["final_logit_softcapping"] = float(cap) if cap else None
        out["attn_logit_softcapping"] = None
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=0.0)
    return a == b


def _config_value(config: Any, name: str) -> Any:
    """``config.<name>``, with transformers' default for a ``head_dim`` the config leaves out (width / heads)."""
    value = getattr(config, name, None)
    if name == "head_dim" and value is None:
        value = config.hidden_size // config.num_attention_heads
    return value


def _rope_of(config: Any, layer_type: str | None) -> dict[str, Any]:
    params = config.rope_parameters
    params = params.get(layer_type) if layer_type else params
    return {k: v for k, v in (params or {}).items() if v is not None}


def apply_gguf_header(header: GGUFHeader, config: Any) -> Any:
    """Set on ``config`` (the transformers config read from the same GGUF file) every field of
    :func:`gguf_config_fields` that differs from it; a field already right is left as written (so the saved
    config, and the target's fingerprint, of a file that needed nothing stays as before). Returns ``config``.
    Raises what :func:`gguf_config_fields` raises."""
    for name, value in gguf_config_fields(header).items():
        if name == "rope_parameters":
            types = list(value) if config.model_type == "gemma3_text" else [None]
            current = {t: _rope_of(config, t) for t in types}
            wanted = {t: (value[t] if t else value) for t in types}
            if not all(_same(current[t], wanted[t]) for t in types):
                config.rope_parameters = value
        elif not _same(_config_value(config, name), value):
            setattr(config, name, value)
    return config


def llama_cpp_rope(header: GGUFHeader) -> dict[str | None, tuple[np.ndarray, float]]:
    """RoPE as llama.cpp (ggml's ``rope_ext``) computes it from the header, by attention layer type (None: every
    layer): ``(inverse frequencies, shape (n_rot / 2,), cos/sin multiplier)``, where the angle of dimension pair
    ``i`` at position ``p`` is ``p * freq_scale * freq_base ** (-2 i / n_rot) / rope_freqs[i]``. Written from the
    header alone, not from the config, so :func:`check_gguf_config` compares two independent computations."""
    a = header.arch
    hidden, heads = int(header.key("embedding_length")), int(_uniform(header, "attention.head_count"))
    n_rot = int(header.key("rope.dimension_count", header.key("attention.key_length", hidden // heads)))
    factor = _rope_factor(header)[1]
    attn = float(header.key("rope.scaling.attn_factor", 1.0))
    base = float(header.key("rope.freq_base", 10000.0))
    pairs = np.arange(0, n_rot, 2, dtype=np.float64) / n_rot
    inv = base ** -pairs / factor
    if header.rope_freqs is not None and a == "llama":
        inv = inv / header.rope_freqs
    if a == "gemma3":
        return {"full_attention": (inv, attn), "sliding_attention": (_GEMMA3_SWA_THETA ** -pairs, attn)}
    return {None: (inv, attn)}


def _transformers_rope(config: Any) -> dict[str | None, tuple[np.ndarray, float]]:
    """RoPE as the family's transformers rotary embedding computes it from ``config``, by layer type."""
    import importlib

    # the config class's own modeling module (configuration_x -> modeling_x) and class prefix (Gemma3TextConfig ->
    # Gemma3): the rotary embedding the converted model itself runs
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    prefix = type(config).__name__.removesuffix("Config").removesuffix("Text")
    rotary = getattr(module, prefix + "RotaryEmbedding")(config)
    if config.model_type == "gemma3_text":
        return {t: (getattr(rotary, f"{t}_inv_freq").double().numpy(), float(getattr(rotary, f"{t}_attention_scaling")))
                for t in sorted(set(config.layer_types))}
    return {None: (rotary.inv_freq.double().numpy(), float(rotary.attention_scaling))}


def check_gguf_config(header: GGUFHeader, config: Any, *, tensors: bool = True) -> None:
    """Check that a transformers ``config`` is the model ``header`` declares: every field of
    :func:`gguf_config_fields`, the RoPE of every attention layer type (:func:`llama_cpp_rope` against what the
    family's rotary embedding computes from ``config``, relative tolerance 1e-5), and (``tensors``) that every GGUF
    tensor is read into a weight of the model (``rope_freqs.weight`` is the RoPE, checked above).

    Raises:
        ValueError: naming the GGUF key (or tensor), what the header says and what the config has, and what to do.
    """
    want = gguf_config_fields(header)
    for name, value in want.items():
        if name == "rope_parameters":
            continue
        have = _config_value(config, name)
        if not _same(have, value):
            raise ValueError(f"target={str(header.path)!r}: the converted config has {name} = {have!r} where the "
                             f"GGUF header means {value!r} (llama.cpp's meaning of its {header.arch}.* keys); "
                             "DeepSpec would run another model. Delete the converted folder and convert again, or "
                             "report the file")
    ours, theirs = _transformers_rope(config), llama_cpp_rope(header)
    for layer_type, (inv, scale) in theirs.items():
        if layer_type not in ours and config.model_type == "gemma3_text":
            continue  # no layer of this type (a model shorter than the global-layer period)
        got, got_scale = ours.get(layer_type, (np.zeros(0), 0.0))
        if got.shape != inv.shape or not np.allclose(got, inv, rtol=1e-5, atol=0) or not math.isclose(
                got_scale, scale, rel_tol=1e-6):
            key = ROPE_FREQS if header.rope_freqs is not None else f"{header.arch}.rope.*"
            raise ValueError(f"target={str(header.path)!r}: the RoPE of the converted model"
                             f"{'' if layer_type is None else ' (' + layer_type + ' layers)'} differs from what the "
                             f"GGUF header's {key} gives in llama.cpp (inverse frequencies {np.round(got, 6).tolist()}"
                             f" x {got_scale} vs {np.round(inv, 6).tolist()} x {scale}); convert the model from its "
                             "Hugging Face folder and pass that folder")
    if tensors:
        unread = sorted(set(header.tensors) - set(gguf_weight_names(config, header.arch)) - {ROPE_FREQS})
        if unread:
            more = ", ..." if len(unread) > 5 else ""
            raise header.refuse(unread[0], f"a tensor of shape {header.tensors[unread[0]]}",
                                f"{len(unread)} GGUF tensor(s) ({', '.join(unread[:5])}{more}) are no weight of the "
                                f"transformers {config.model_type} model, so the converted model would run without "
                                "them; convert the model from its Hugging Face folder and pass that folder")


def gguf_weight_names(config: Any, arch: str) -> list[str]:
    """The GGUF tensor names transformers reads into a model of ``config`` (built on the meta device) from a GGUF
    file of architecture ``arch`` (``general.architecture``)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    return list(get_gguf_hf_weights_map(model, processor, model_type=arch))
