"""The serving-engine layouts Eagle3 drafts export to (:data:`FORMATS`; docs/export.md).

- ``vllm-eagle3``: vLLM's EAGLE-3 drafter (``method: eagle3``). A draft without q/k norm becomes
  ``LlamaForCausalLMEagle3``, one with q/k norm (a Qwen3 target, or ``--draft-backbone qwen3``) ``Qwen3ForCausalLM``
  (vLLM's Qwen3 EAGLE-3 head). vLLM reads ``eagle_aux_hidden_state_layer_ids`` as hidden-state indices
  (``hidden_states[i]``, 0 = the embeddings), so DeepSpec's layer ids (the output of decoder layer ``i`` =
  ``hidden_states[i + 1]``, docs/design/targets.md, "Target layer ids") are written plus one.
- ``sglang-eagle3``: SGLang's ``LlamaForCausalLMEagle3``. SGLang adds one to
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` itself, so DeepSpec's ids are written as they are. SGLang
  drops weights it does not know without a word, so a draft with q/k norm is refused.
- ``speculators``: ``vllm-eagle3`` in the vllm-project/speculators layout (``speculators_model_type: eagle3``,
  ``Eagle3Speculator``), ``num_aux_hidden_states`` with the decoder keys (vLLM sizes ``fc`` from them).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspec.models.engine_layout import (ExportError, ExportFormat, decoder_keys, decoder_tensors,
                                           speculators_format, vocab_keys)


def _eagle3_config(c: Any, fmt: str) -> dict[str, Any]:
    if fmt == "sglang-eagle3" and c.qk_norm:
        raise ExportError("sglang-eagle3: SGLang's EAGLE-3 head (LlamaForCausalLMEagle3) has no q/k norm and skips "
                          "weights it does not know without an error, so this draft (q/k norm, a "
                          f"{c.family} target) would load and mispredict; export it as vllm-eagle3, or for a "
                          "target without q/k norm train it with --draft-backbone target")
    qwen3_head = fmt == "vllm-eagle3" and c.qk_norm  # vLLM's Qwen3 EAGLE-3 head, whatever the target family
    out = decoder_keys(c, model_type="qwen3" if qwen3_head else "llama", num_layers=1)
    out["architectures"] = ["Qwen3ForCausalLM" if qwen3_head else "LlamaForCausalLMEagle3"]
    n = len(c.target_layer_ids)
    out.update(vocab_keys(c), target_hidden_size=c.target_hidden_size, num_aux_hidden_states=n)
    if fmt == "vllm-eagle3":
        # vLLM: hidden_states indices (DeepSpec id i = the output of layer i = hidden_states[i + 1])
        out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in c.target_layer_ids]
        out["norm_before_residual"] = False  # the residual is the fused feature itself, as DeepSpec trains
    else:
        # SGLang captures the output of layer id + 1 - 1: DeepSpec's own convention (sglang qwen3.py / llama.py)
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.target_layer_ids)}
    return out


def _eagle3_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"]}
    out.update({"layers.0." + k[len("midlayer."):]: v for k, v in state.items() if k.startswith("midlayer.")})
    return out


def _writer(fmt: str):
    def write(model: Any, *, algorithm: str, verifier: Any = None
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
        c = model.config
        config = _eagle3_config(c, fmt)
        k = c.ttt_steps
        hint = (f"vllm serve TARGET --speculative-config '{{\"method\": \"eagle3\", \"model\": \"DIR\", "
                f"\"num_speculative_tokens\": {k}}}'" if fmt == "vllm-eagle3" else
                f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path DIR --speculative-num-steps {k} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {k + 1}")
        return config, _eagle3_weights(model.state_dict()), hint

    return write


def _expected(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The decoder's tensors; each layer's q/k/v read ``[embedding ; hidden]`` (2H) and it has its own
    ``hidden_norm``."""
    H = config["hidden_size"]
    out = decoder_tensors(config, num_features=config["num_aux_hidden_states"], width_in=2 * H)
    out.update({f"layers.{i}.hidden_norm.weight": (H,) for i in range(config["num_hidden_layers"])})
    return out


def _speculators_keys(layer: dict[str, Any], top: dict[str, Any]) -> list[str]:
    layer["num_aux_hidden_states"] = top.pop("num_aux_hidden_states")  # vLLM sizes fc from the layer config
    return ["Eagle3Speculator"]


VLLM_EAGLE3 = ExportFormat(write=_writer("vllm-eagle3"), expected=_expected)

# format name -> layout (the registry reads Eagle3Algorithm.export_formats)
FORMATS: dict[str, ExportFormat] = {
    "vllm-eagle3": VLLM_EAGLE3,
    "sglang-eagle3": ExportFormat(write=_writer("sglang-eagle3"), expected=_expected),
    "speculators": speculators_format(VLLM_EAGLE3, kind="eagle3", num_tokens=lambda c: c.ttt_steps,
                                      adapt=_speculators_keys),
}
