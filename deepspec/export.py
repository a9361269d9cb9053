"""``deepspec export``: a trained draft in the layout a serving engine loads.

Formats (docs/export.md has each one's keys, weight names and sources):

- ``vllm-eagle3``: vLLM's EAGLE-3 drafter (``method: eagle3``). A draft without q/k norm becomes
  ``LlamaForCausalLMEagle3``, one with q/k norm (a Qwen3 target, or ``--draft-backbone qwen3``)
  ``Qwen3ForCausalLM`` (vLLM's Qwen3 EAGLE-3 head). vLLM reads ``eagle_aux_hidden_state_layer_ids`` as hidden-state
  indices (``hidden_states[i]``, 0 = the embeddings), so DeepSpec's layer ids (the output of decoder
  layer ``i`` = ``hidden_states[i + 1]``, docs/design/targets.md, "Target layer ids") are written plus one.
- ``sglang-eagle3``: SGLang's ``LlamaForCausalLMEagle3``. SGLang adds one to
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` itself, so DeepSpec's ids are written as they are.
  SGLang drops weights it does not know without a word, so a draft with q/k norm is refused.
- ``vllm-dspark``: vLLM's ``Qwen3DSparkModel`` (``method: dspark``, ``sample_from_anchor``: the
  anchor slot and each mask slot propose the next token, as DeepSpec's DSpark and DFlash do). A DFlash
  draft is written as a DSpark draft whose Markov head is zero (rank 1), which leaves its logits
  unchanged. vLLM builds Qwen3 layers with q/k RMSNorm whatever the target, so a draft without q/k norm
  (``train --draft-backbone target`` for a Llama, Qwen2 or Mistral target) is refused: an RMSNorm of
  weight 1 still normalises. DSpark and DFlash drafts have Qwen3-style layers by default.
- ``speculators``: the vllm-project/speculators layout (``speculators_model_type`` ``eagle3`` or
  ``dspark``, the draft's layer config under ``transformer_layer_config``, and
  ``speculators_config`` naming the verifier, i.e. the target, and the number of speculative
  tokens), which vLLM serves with ``vllm serve DIR`` alone. The weights are the vLLM formats'. Eagle3
  drafts keep vLLM's hidden-state layer ids (DeepSpec's + 1) under ``eagle_aux_hidden_state_layer_ids``;
  DSpark and DFlash drafts write ``aux_hidden_state_layer_ids`` = DeepSpec's + 1 (vLLM subtracts one).
- ``vllm-dflash``: vLLM's ``DFlashDraftModel`` (``method: dflash``, z-lab's layout): a block
  ``[bonus, mask x K]`` whose mask slots predict the token at their own position. DFlash drafts
  trained in that layout (``train --algorithm dflash --sample-from-anchor false``) export to it, with
  ``num_speculative_tokens`` = block_size - 1; a draft that proposes from the anchor slot on
  (DeepSpec's DSpark and default DFlash, the layout vLLM calls DSpark) is refused, naming
  ``vllm-dspark``, which carries it, and the other way round.

Common rules: weight names without a ``model.`` prefix; the target's embedding is never shipped (every
engine shares the target's); ``lm_head`` and ``d2t`` (int64 offsets, ``target id = i + d2t[i]``) are
shipped only for a reduced draft vocabulary; every expected tensor is checked by name and shape before
anything is written, because these loaders do not report a missing weight (it would be served as
uninitialised memory). The folder is written under a temporary name and renamed when complete, and
``config.json`` records the draft's DeepSpec config and target fingerprint under ``deepspec``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepspec.algorithms.registry import load_draft
from deepspec.checkpoints import draft_folder
from deepspec.models.config import family_rules
from deepspec.models.vocab import d2t_to_offsets
from deepspec.utils import atomic_path

FORMATS = ("vllm-eagle3", "sglang-eagle3", "vllm-dspark", "speculators", "vllm-dflash")
WEIGHTS_NAME = "model.safetensors"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True)
class ExportConfig:
    """What to export, where, and in which engine's layout."""

    draft: str  # a training run (its latest checkpoint), a checkpoint folder or its draft/ folder
    format: str  # vllm-eagle3 | sglang-eagle3 | vllm-dspark | vllm-dflash (z-lab layout drafts) | speculators
    output_dir: str  # the export folder (config.json, model.safetensors)
    dtype: str = "bfloat16"  # weight dtype written: float32 | bfloat16 | float16 (engines cast to theirs)
    overwrite: bool = False  # replace an existing output_dir
    # speculators only: the target the draft serves with, written as speculators_config.verifier.name_or_path:
    # "default" (the embedded SmolLM2's converted folder), a model folder (checked against the draft) or a hub id
    verifier: str | None = None

    def __post_init__(self) -> None:
        if not str(self.output_dir).strip() or Path(self.output_dir).resolve() == Path.cwd().resolve():
            raise ValueError(f"export.output_dir: expected a folder of its own for the export, got "
                             f"{self.output_dir!r}; name a new folder such as exports/my-draft")
        if self.format not in FORMATS:
            raise ValueError(f"export.format: expected one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"export.dtype: expected one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.format == "speculators" and not self.verifier:
            raise ValueError("export.verifier: the speculators format names the target it serves with; pass --verifier "
                             "default (the embedded SmolLM2), a model folder or a hub id (org/name)")
        if self.format != "speculators" and self.verifier:
            raise ValueError(f"export.verifier: only the speculators format names its target; {self.format} takes the "
                             "target on the engine's command line, so drop --verifier")


class ExportError(ValueError):
    """The draft cannot be expressed in the asked format (the message names the format's limit)."""


# ----------------------------------------------------------------------------------------------- configs


def _backbone(c: Any, *, model_type: str, num_layers: int) -> dict[str, Any]:
    """The Hugging Face decoder keys every engine reads for the draft's layers."""
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


def _vocab_keys(c: Any) -> dict[str, Any]:
    return {} if c.draft_vocab_size is None else {"draft_vocab_size": c.draft_vocab_size}


def _deepspec_record(algorithm: str, c: Any, source: Path) -> dict[str, Any]:
    return {"algorithm": algorithm, "source": str(source), "target_fingerprint": c.target_fingerprint,
            "target_layer_ids": list(c.target_layer_ids), "config": c.to_dict()}


def _eagle3_config(c: Any, fmt: str) -> dict[str, Any]:
    if fmt == "sglang-eagle3" and c.qk_norm:
        raise ExportError("sglang-eagle3: SGLang's EAGLE-3 head (LlamaForCausalLMEagle3) has no q/k norm and skips "
                          "weights it does not know without an error, so this draft (q/k norm, a "
                          f"{c.family} target) would load and mispredict; export it as vllm-eagle3, or for a "
                          "target without q/k norm train it with --draft-backbone target")
    qwen3_head = fmt == "vllm-eagle3" and c.qk_norm  # vLLM's Qwen3 EAGLE-3 head, whatever the target family
    out = _backbone(c, model_type="qwen3" if qwen3_head else "llama", num_layers=1)
    out["architectures"] = ["Qwen3ForCausalLM" if qwen3_head else "LlamaForCausalLMEagle3"]
    n = len(c.target_layer_ids)
    out.update(_vocab_keys(c), target_hidden_size=c.target_hidden_size, num_aux_hidden_states=n)
    if fmt == "vllm-eagle3":
        # vLLM: hidden_states indices (DeepSpec id i = the output of layer i = hidden_states[i + 1])
        out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in c.target_layer_ids]
        out["norm_before_residual"] = False  # the residual is the fused feature itself, as DeepSpec trains
    else:
        # SGLang captures the output of layer id + 1 - 1: DeepSpec's own convention (sglang qwen3.py / llama.py)
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.target_layer_ids)}
    return out


def _dspark_config(c: Any, algorithm: str, markov_rank: int, confidence_with_markov: bool | None) -> dict[str, Any]:
    if not c.qk_norm:
        raise ExportError(f"vllm-dspark: vLLM's Qwen3DSparkModel builds Qwen3 layers with q/k RMSNorm; this draft's "
                          f"layers ({c.family} target, --draft-backbone target) have none, and an RMSNorm of weight "
                          "1 still normalises, so the engine would compute another draft. Train the draft with "
                          "--draft-backbone qwen3 (the default for dspark and dflash) to export it")
    if getattr(c, "markov_head_type", "vanilla") != "vanilla" and algorithm == "dspark":
        raise ExportError(f"vllm-dspark: vLLM implements only the vanilla Markov head; this draft's is "
                          f"{c.markov_head_type!r}")
    out = _backbone(c, model_type="qwen3", num_layers=c.num_draft_layers)
    out["architectures"] = ["Qwen3DSparkModel"]
    out.update(_vocab_keys(c), target_hidden_size=c.target_hidden_size, block_size=c.block_size,
               num_target_layers=c.target_num_hidden_layers,
               # DeepSpec's ids are the output of layer i; vLLM adds one to dflash_config ids itself
               dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
               mask_token_id=c.mask_token_id, sample_from_anchor=True,
               markov_rank=markov_rank, markov_head_type="vanilla",
               enable_confidence_head=confidence_with_markov is not None,
               confidence_head_with_markov=bool(confidence_with_markov))
    return out


def _dflash_config(c: Any) -> dict[str, Any]:
    """vLLM's ``DFlashDraftModel`` config (``model_executor/models/qwen3_dflash.py``): Qwen3 layers, the
    block [bonus, mask x (block_size - 1)], its ``dflash_config`` (mask token, DeepSpec's layer ids:
    vLLM adds one)."""
    if not c.qk_norm:
        raise ExportError(f"vllm-dflash: vLLM's DFlashDraftModel builds Qwen3 layers with q/k RMSNorm; this draft's "
                          f"layers ({c.family} target, --draft-backbone target) have none. Train the draft with "
                          "--draft-backbone qwen3 (the default for dflash) to export it")
    out = _backbone(c, model_type="qwen3", num_layers=c.num_draft_layers)
    out["architectures"] = ["DFlashDraftModel"]
    out.update(_vocab_keys(c), target_hidden_size=c.target_hidden_size, block_size=c.block_size,
               num_target_layers=c.target_num_hidden_layers,
               dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)})
    return out


def _verifier(name: str, c: Any) -> dict[str, Any]:
    """speculators_config.verifier for ``--verifier NAME``: ``default`` (the embedded target's converted
    folder), a GGUF target (its converted folder) or a local folder, which must hold a config.json of the
    draft's target shape; ``org/name`` is a hub id, written as given. A local path is written absolute,
    so the export serves on this machine (or where the same path holds the target)."""
    import re

    from deepspec.target.load import resolve_target_dir

    folder = Path(name).expanduser()
    if name == "default" or folder.is_file() or (folder.is_dir() and not (folder / "config.json").exists()
                                                 and any(folder.glob("*.gguf"))):
        folder = resolve_target_dir(name)  # the embedded default, or a GGUF target's converted folder
    elif not folder.exists():
        if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) and not name.startswith(("./", "../")):
            return {"name_or_path": name, "architectures": []}
        raise ExportError(f"export.verifier: {name!r} is neither an existing model folder nor a hub id (org/name); "
                          "name the target the draft was trained for")
    try:
        target = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"export.verifier: {folder} has no readable config.json ({exc}); name the target's model "
                          "folder, default (the embedded SmolLM2) or a hub id") from exc
    want = {"hidden_size": c.target_hidden_size, "num_hidden_layers": c.target_num_hidden_layers,
            "vocab_size": c.vocab_size}
    got = {k: target.get(k, target.get("text_config", {}).get(k)) for k in want}
    if got != want:
        raise ExportError(f"export.verifier: {folder} has {got}; the draft was made for a target with {want}. Name the "
                          "target the draft was trained for")
    return {"name_or_path": str(folder.resolve()), "architectures": list(target.get("architectures") or [])}


def _speculators_config(base: dict[str, Any], c: Any, algorithm: str, verifier: dict[str, Any],
                        num_tokens: int) -> dict[str, Any]:
    """The speculators-layout config.json from a vLLM format's ``base`` config (vllm-eagle3 or vllm-dspark):
    the decoder keys move under ``transformer_layer_config``; the algorithm keys stay at the top."""
    layer_keys = set(_backbone(c, model_type="", num_layers=1))
    layer = {k: v for k, v in base.items() if k in layer_keys}
    top = {k: v for k, v in base.items() if k not in layer_keys and k != "architectures"}
    if algorithm == "eagle3":
        kind = "eagle3"
        layer["num_aux_hidden_states"] = top.pop("num_aux_hidden_states")  # vLLM sizes fc from the layer config
        architectures = ["Eagle3Speculator"]
    else:
        kind = "dspark"
        # vLLM's speculators reader: target_layer_ids = aux - 1 (DeepSpec's ids name the output of layer i)
        top["aux_hidden_state_layer_ids"] = [i + 1 for i in top.pop("dflash_config")["target_layer_ids"]]
        architectures = list(base["architectures"])  # Qwen3DSparkModel: the loader vLLM keeps
    return {
        "architectures": architectures, "speculators_model_type": kind, "transformer_layer_config": layer, **top,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
    }


# ----------------------------------------------------------------------------------------------- weights


def _eagle3_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"]}
    out.update({"layers.0." + k[len("midlayer."):]: v for k, v in state.items() if k.startswith("midlayer.")})
    return out


def _dspark_weights(state: dict[str, torch.Tensor], c: Any) -> tuple[dict[str, torch.Tensor], int, bool | None]:
    """(weights, markov rank, confidence head reads the Markov vector: True/False, or None without one)."""
    keep = ("fc.", "hidden_norm.", "norm.", "layers.", "markov_head.", "confidence_head.")
    out = {k: v for k, v in state.items() if k.startswith(keep)}
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


def expected_tensors(fmt: str, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``fmt``'s loader needs, from the exported ``config`` alone (the
    engines' loader code, docs/export.md). Used to check an export before it is written."""
    H, I = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    V = config["vocab_size"]
    Vd = config.get("draft_vocab_size", V)
    n = config.get("num_aux_hidden_states") or len(config["dflash_config"]["target_layer_ids"])
    qk_norm = config["model_type"] == "qwen3"
    eagle3 = fmt.endswith("eagle3")
    width_in = 2 * H if eagle3 else H
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, n * config["target_hidden_size"]), "norm.weight": (H,)}
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
        if qk_norm:
            out.update({p + "self_attn.q_norm.weight": (config["head_dim"],),
                        p + "self_attn.k_norm.weight": (config["head_dim"],)})
        if eagle3:
            out[p + "hidden_norm.weight"] = (H,)
    if not eagle3:
        out["hidden_norm.weight"] = (H,)
    if fmt == "vllm-dspark":
        r = config["markov_rank"]
        out.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (Vd, r)})
        if config["enable_confidence_head"]:
            out.update({"confidence_head.proj.weight": (1, H + (r if config["confidence_head_with_markov"] else 0)),
                        "confidence_head.proj.bias": (1,)})
    if Vd != V:
        out.update({"lm_head.weight": (Vd, H), "d2t": (Vd,)})
    return out


def check_export(fmt: str, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Raise :class:`ExportError` unless ``weights`` holds exactly :func:`expected_tensors` (names and shapes)."""
    expected = expected_tensors(fmt, config)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if tuple(weights[k].shape) != expected[k])
    if missing or extra or wrong:
        details = "; ".join(part for part in (
            f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else "",
            "wrong shapes " + ", ".join(f"{k} {tuple(weights[k].shape)} (expected {expected[k]})" for k in wrong)
            if wrong else "") if part)
        raise ExportError(f"{fmt}: the export does not match what the engine loads ({details}); nothing was written")


def build_export(draft_path: str | Path, fmt: str, *, dtype: torch.dtype = torch.bfloat16,
                 verifier: str | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """``(config.json dict, weights, serve hint)`` of the draft at ``draft_path`` in format ``fmt``.

    Weights are cast to ``dtype`` (``d2t`` stays int64, as offsets). ``verifier``: the target named in a
    ``speculators`` export (:class:`ExportConfig`; default: the embedded target). Nothing is written.

    Raises:
        ExportError: the draft cannot be expressed in ``fmt`` (the message names the limit).
        FileNotFoundError / ValueError: no readable draft at ``draft_path``.
    """
    folder = draft_folder(draft_path)
    algorithm, model = load_draft(folder)
    c = model.config
    if family_rules(c.family).embed_scale:
        raise ExportError(f"{fmt}: this draft is for a {c.family} target, whose RMSNorms are (1 + w) and whose token "
                          "embeddings are scaled by sqrt(hidden); the engines' draft layers (Qwen3 / Llama RMSNorm, "
                          "unscaled embeddings) would load it and compute another draft. Gemma drafts run in "
                          "DeepSpec's own engine (deepspec eval / serve --draft); no export format carries them yet")
    if fmt != "speculators":
        config, weights, hint = _engine_layout(fmt, algorithm, model, dtype)
    else:  # the vLLM layout of the algorithm, restructured
        layout = "vllm-eagle3" if algorithm == "eagle3" else "vllm-dspark"
        try:
            config, weights, _ = _engine_layout(layout, algorithm, model, dtype)
        except ExportError as exc:
            raise ExportError(f"speculators (the weights and keys of {exc})") from exc
        k = c.ttt_steps if algorithm == "eagle3" else c.block_size
        config = _speculators_config(config, c, algorithm, _verifier(verifier or "default", c), k)
        hint = "vllm serve DIR  (the target is the config's speculators_config.verifier)"
    config["deepspec"] = _deepspec_record(algorithm, c, folder)
    return config, weights, hint


def _engine_layout(fmt: str, algorithm: str, model: Any, dtype: torch.dtype
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """``(config, checked weights, serve hint)`` of ``model`` in one of the engines' own formats."""
    c = model.config
    state = model.state_dict()
    if fmt == "vllm-dflash":
        if algorithm == "eagle3":
            raise ExportError("vllm-dflash: the draft is an eagle3 draft; use --format vllm-eagle3 or sglang-eagle3")
        if c.sample_from_anchor:
            raise ExportError(
                "vllm-dflash: vLLM's DFlash method (z-lab's layout) reads a block [bonus, mask x K] whose mask slots "
                f"predict their own position; this {algorithm} draft proposes from the anchor slot on (each slot "
                "predicts the next token), which is vLLM's DSpark layout. Use --format vllm-dspark, or train a DFlash "
                "draft with --sample-from-anchor false for this format")
        config = _dflash_config(c)
        weights = {k: v for k, v in state.items() if k.startswith(("fc.", "hidden_norm.", "norm.", "layers."))}
        hint = (f"vllm serve TARGET --speculative-config '{{\"method\": \"dflash\", \"model\": \"DIR\", "
                f"\"num_speculative_tokens\": {c.num_draft_slots}}}'")
    elif fmt.endswith("eagle3"):
        if algorithm != "eagle3":
            raise ExportError(f"{fmt}: the draft is a {algorithm} draft; EAGLE-3 formats take eagle3 drafts "
                              "(use --format vllm-dspark for dspark and dflash)")
        config = _eagle3_config(c, fmt)
        weights = _eagle3_weights(state)
        k = c.ttt_steps
        hint = (f"vllm serve TARGET --speculative-config '{{\"method\": \"eagle3\", \"model\": \"DIR\", "
                f"\"num_speculative_tokens\": {k}}}'" if fmt == "vllm-eagle3" else
                f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path DIR --speculative-num-steps {k} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {k + 1}")
    else:
        if algorithm not in ("dspark", "dflash"):
            raise ExportError(f"{fmt}: the draft is a {algorithm} draft; vllm-dspark takes dspark and dflash drafts "
                              "(use --format vllm-eagle3 or sglang-eagle3 for eagle3)")
        if not c.sample_from_anchor:
            raise ExportError(f"{fmt}: this DFlash draft has z-lab's layout (sample_from_anchor false: each mask slot "
                              "predicts its own position), and vLLM's DSpark reads the anchor slot's prediction too; "
                              "export it with --format vllm-dflash")
        weights, rank, confidence = _dspark_weights(state, c)
        config = _dspark_config(c, algorithm, rank, confidence)
        hint = (f"vllm serve TARGET --speculative-config '{{\"method\": \"dspark\", \"model\": \"DIR\", "
                f"\"num_speculative_tokens\": {c.block_size}}}'")
    if c.draft_vocab_size is not None:
        weights["lm_head.weight"] = state["lm_head.weight"]
        weights["d2t"] = d2t_to_offsets(model.d2t)
    weights = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in weights.items()}
    check_export(fmt, config, weights)
    return config, weights, hint


def _is_export(folder: Path) -> bool:
    """True for a folder this command wrote: exactly config.json (with its ``deepspec`` record) and the weights."""
    try:
        names = {p.name for p in folder.iterdir()}
        record = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("deepspec")
    except (OSError, ValueError, AttributeError):
        return False
    return names == {"config.json", WEIGHTS_NAME} and isinstance(record, dict)


def _check_output_dir(out: Path, cfg: ExportConfig) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"export.output_dir: {out} is a file; name a folder")
    if any(parent.exists() and not parent.is_dir() for parent in out.parents):
        raise ValueError(f"export.output_dir: a parent of {out} is a file; name a folder elsewhere")
    if out.exists():
        if not cfg.overwrite:
            raise ValueError(f"export.output_dir: {out} exists; pass --overwrite to replace an earlier export, or "
                             "choose another folder")
        if not _is_export(out):
            raise ValueError(f"export.output_dir: {out} exists and is not an earlier `deepspec export` (only "
                             "config.json with a deepspec record and model.safetensors); --overwrite replaces "
                             "only those, so choose another folder")


def _readable_by_all(folder: Path) -> None:
    """Exports are read by serving engines, often as another user: files 0644, the folder 0755, less the
    umask (safetensors writes its file readable by its owner only)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o755 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o644 & ~umask)


def run_export(cfg: ExportConfig) -> Path:
    """Write the export folder (``config.json`` + ``model.safetensors``) atomically; return its path.

    Raises:
        ExportError: the format cannot express the draft (before anything is written).
        ValueError: ``output_dir`` is a file, or exists while ``overwrite`` is false;
            ``--overwrite`` replaces only an earlier export (config.json with a ``deepspec`` record and
            the weights, nothing else).
    """
    out = Path(cfg.output_dir)
    _check_output_dir(out, cfg)
    config, weights, hint = build_export(cfg.draft, cfg.format, dtype=_DTYPES[cfg.dtype], verifier=cfg.verifier)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        _readable_by_all(tmp)
    print(f"export: {cfg.format} draft ({config['deepspec']['algorithm']}, {len(weights)} tensors, {cfg.dtype}) -> {out}")
    print("serve it with: " + hint.replace("DIR", str(out)))
    return out
