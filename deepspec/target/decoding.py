"""Pinned decoding: every setting DeepSpec decodes with is explicit, so a checkpoint's
``generation_config.json`` never changes what the target generates.

Shape legend: B batch, T prompt positions (left padded), N new tokens.

Why: a target folder may ship sampling defaults (Qwen3: ``do_sample``, ``temperature 0.6``,
``top_k 20``, ``top_p 0.95``; others ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_p``,
``suppress_tokens``, ...). transformers' ``generate()`` fills every field a passed
``GenerationConfig`` leaves ``None`` from ``model.generation_config`` (transformers 5.24,
``GenerationMixin._prepare_generation_config``), so "greedy" becomes greedy with the checkpoint's
repetition penalty. vLLM and SGLang likewise apply the checkpoint's defaults to every request field
the client does not send. DeepSpec therefore

- decodes locally through :func:`pinned_generate`: the model's own ``generation_config`` is replaced
  by transformers' global defaults for the duration of the call, and the passed config sets every
  setting DeepSpec relies on (:data:`NEUTRAL_SETTINGS` + temperature / top-k / top-p / stop ids);
- sends every setting explicitly to OpenAI-compatible servers (:func:`openai_request_fields`);
- records what it decoded with (:func:`decoding_record`), including the checkpoint settings it
  ignored, in the prepared data's summary and in the eval report.

The decoding rule (docs/design/decoding.md, "Sampling and verify"): greedy (``temperature == 0``) or
``softmax(logits / temperature)`` after top-k then top-p (:func:`sampling_probs`, for the target
and every draft alike); nothing else touches the logits.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How the next token is chosen, for the target and the draft alike.

    Attributes:
        temperature: 0 = greedy (argmax; ``top_k`` / ``top_p`` then have no effect); > 0 = sample
            from ``softmax(logits / temperature)`` after the filters below.
        top_k: 0 = off; else keep the ``top_k`` most likely tokens. Ties at the boundary: every
            token whose logit equals the ``top_k``-th largest is kept too (so more than ``top_k``
            tokens survive only on exact ties; no tie is broken by token id). Same rule as
            transformers' ``TopKLogitsWarper`` and vLLM.
        top_p: 1.0 = off; else nucleus filtering (Holtzman et al. 2020), applied after top-k: keep
            the smallest set of most likely tokens whose probability mass is ``>= top_p`` (always
            at least the most likely token); tokens tied with the least likely kept token are kept
            too.

    Raises ValueError (naming the field) for a negative or non-finite ``temperature``, a negative
    or non-integer ``top_k``, or ``top_p`` outside ``(0, 1]``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature: expected a finite number >= 0 (0 = greedy), received {t!r}.")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"SamplingParams.top_k: expected an integer >= 0 (0 = off), received {k!r}.")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"SamplingParams.top_p: expected a number in (0, 1] (1.0 = off), received {p!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

def greedy_tokens(logits_XV: Tensor) -> Tensor:
    """The greedy choice of every row: int64 ``[...]``, the index of the first of tied maxima of logits
    ``[..., V]`` (any float dtype), as ``argmax``.

    On the CPU, bfloat16 and float16 logits are compared in float32: the conversion is exact, so every
    maximum and tie is the same, and torch's reduced-precision argmax there is several times slower than
    the conversion and a float32 argmax together (a cost every decoding step pays, once per row)."""
    if logits_XV.device.type == "cpu" and logits_XV.dtype in (torch.bfloat16, torch.float16):
        logits_XV = logits_XV.float()
    return logits_XV.argmax(dim=-1)


def sampling_probs(logits_XV: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a token is sampled from: fp32 ``[..., V]`` from logits ``[..., V]`` (any float dtype).

    ``softmax(logits / T)`` computed in fp32, then top-k (on the logits), then top-p (on the
    top-k-renormalised probabilities), renormalised; filtered tokens have probability exactly 0.
    Tie rules: see :class:`SamplingParams`. Every row keeps at least its most likely token, so
    every row sums to 1 and holds no NaN (for finite logits). Temperature, top-k and top-p are each
    sampling from an adjusted distribution (Leviathan et al. 2023, s.2.2 "standardized sampling"),
    so rejection sampling stays lossless when the draft's ``q`` and the target's ``p`` both come
    from this function with the same params.

    Raises ValueError when ``params.greedy`` (temperature 0 is the argmax path, not a distribution).
    """
    if params.greedy:
        raise ValueError(
            "temperature: expected > 0 for sampling probabilities, received 0; use the greedy path (argmax) "
            "for temperature 0."
        )
    scaled_XV = logits_XV.float() / params.temperature
    v = scaled_XV.shape[-1]
    if 0 < params.top_k < v:
        kth_X1 = torch.topk(scaled_XV, params.top_k, dim=-1).values[..., -1:]
        scaled_XV = scaled_XV.masked_fill(scaled_XV < kth_X1, float("-inf"))
    probs_XV = torch.softmax(scaled_XV, dim=-1)
    if params.top_p < 1.0:
        sorted_XV = torch.sort(probs_XV, dim=-1, descending=True).values
        # keep sorted token j while the mass strictly before it is < top_p: the smallest prefix with
        # mass >= top_p (j = 0 is always kept); its last probability is the threshold.
        mass_before_XV = torch.cumsum(sorted_XV, dim=-1) - sorted_XV
        num_kept_X1 = (mass_before_XV < params.top_p).sum(dim=-1, keepdim=True)
        threshold_X1 = sorted_XV.gather(-1, num_kept_X1 - 1)
        probs_XV = probs_XV.masked_fill(probs_XV < threshold_X1, 0.0)
        probs_XV = probs_XV / probs_XV.sum(dim=-1, keepdim=True)
    return probs_XV


# Logit processors DeepSpec never uses, pinned to their neutral value (the names are transformers'
# GenerationConfig fields and, for the penalties, the OpenAI / vLLM / SGLang request fields).
NEUTRAL_SETTINGS: dict[str, Any] = {
    "num_beams": 1,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "no_repeat_ngram_size": 0,
    "min_new_tokens": 0,
}
# Fields of a checkpoint's generation_config that do not change the tokens chosen (ids, cache and
# output switches); everything else it sets is reported as ignored.
_NOT_DECODING = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "use_cache",
                 "transformers_version", "_from_model_config", "output_attentions", "output_hidden_states",
                 "output_scores", "output_logits", "return_dict_in_generate", "cache_implementation"}
# Top-k "off" in vLLM and SGLang requests (both accept -1; transformers and DeepSpec use 0).
OPENAI_TOP_K_OFF = -1


def decoding_record(*, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                    stop_token_ids: Sequence[int], checkpoint_generation_config: Any = None) -> dict[str, Any]:
    """The decoding settings of a run, every one explicit (for summaries and reports).

    Args:
        max_new_tokens: per answer.
        temperature: 0 = greedy (``top_k`` / ``top_p`` then unused).
        top_k: 0 = off. top_p: 1.0 = off.
        stop_token_ids: the stop rule's ids (:func:`deepspec.data.chat.stop_token_ids`).
        checkpoint_generation_config: the target's ``generation_config`` (a transformers
            ``GenerationConfig``, a dict, or None); its decoding fields are listed under
            ``checkpoint_settings_ignored`` so a reader sees what DeepSpec overrode.

    Returns:
        ``{"do_sample", "temperature", "top_k", "top_p", **NEUTRAL_SETTINGS, "max_new_tokens",
        "stop_token_ids", "checkpoint_settings_ignored"}``.
    """
    return {"do_sample": temperature > 0, "temperature": float(temperature), "top_k": int(top_k),
            "top_p": float(top_p), **NEUTRAL_SETTINGS, "max_new_tokens": int(max_new_tokens),
            "stop_token_ids": sorted(int(t) for t in stop_token_ids),
            "checkpoint_settings_ignored": checkpoint_decoding_settings(checkpoint_generation_config)}


def checkpoint_decoding_settings(generation_config: Any) -> dict[str, Any]:
    """The decoding fields a checkpoint's generation config sets (those :func:`pinned_generate`
    overrides): its non-default entries minus token ids and output switches."""
    if generation_config is None:
        return {}
    if isinstance(generation_config, dict):
        d = dict(generation_config)
    else:
        d = generation_config.to_diff_dict() if hasattr(generation_config, "to_diff_dict") else {}
    return {k: v for k, v in sorted(d.items()) if k not in _NOT_DECODING and v is not None}


def hf_generation_config(*, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                         stop_token_ids: Sequence[int], pad_token_id: int) -> Any:
    """A transformers ``GenerationConfig`` with every setting DeepSpec decodes with set explicitly:
    greedy, or temperature + top-k + top-p, and the penalties at their neutral values. The
    sampling-only filters are set only when sampling (transformers warns about them in greedy
    mode, where it never applies them); :func:`pinned_generate` keeps the checkpoint from filling
    anything left unset."""
    from transformers import GenerationConfig

    settings: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens), "do_sample": temperature > 0, "num_beams": 1,
        "repetition_penalty": NEUTRAL_SETTINGS["repetition_penalty"], "encoder_repetition_penalty": 1.0,
        "no_repeat_ngram_size": NEUTRAL_SETTINGS["no_repeat_ngram_size"],
        "min_new_tokens": NEUTRAL_SETTINGS["min_new_tokens"], "num_return_sequences": 1,
        "eos_token_id": [int(t) for t in stop_token_ids], "pad_token_id": int(pad_token_id),
    }
    if temperature > 0:
        settings.update(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                        min_p=NEUTRAL_SETTINGS["min_p"], typical_p=NEUTRAL_SETTINGS["typical_p"],
                        epsilon_cutoff=0.0, eta_cutoff=0.0)
    return GenerationConfig(**settings)


@contextlib.contextmanager
def _without_checkpoint_defaults(model: Any) -> Iterator[None]:
    """Replace ``model.generation_config`` by transformers' global defaults for the duration of the
    block, so ``generate()`` can fill nothing from the checkpoint (restored afterwards)."""
    from transformers import GenerationConfig

    missing = object()
    saved = getattr(model, "generation_config", missing)
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        if saved is missing:
            del model.generation_config
        else:
            model.generation_config = saved


def _contiguous(module: Any, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:])


@contextlib.contextmanager
def _contiguous_output_layer_input(model: Any) -> Iterator[None]:
    """Make the output layer's input contiguous for the duration of the block.

    Why: at the prefill ``generate()`` computes logits of the last prompt position only, as
    ``lm_head(hidden_BTH[:, -1:, :])``: a non-contiguous ``[B, 1, H]`` view. ``torch.matmul`` does not
    fold a non-contiguous 3-D input into one ``[B, H] @ [H, V]`` product; it takes ``bmm``, which
    expands the ``[V, H]`` weight to ``[B, H, V]`` and copies it. On a CPU that product costs many times
    the one over a contiguous input (hundreds of times in bfloat16), as much as the rest of a batched
    generation (docs/results/prepare-bf16-cpu-2026-12-02/). One-token decoding
    steps already pass contiguous ``[B, 1, H]`` inputs, so only the prefill changes.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(_contiguous)
    try:
        yield
    finally:
        handle.remove()


def pinned_generate(model: Any, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, *,
                    max_new_tokens: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    stop_token_ids: Sequence[int], pad_token_id: int) -> torch.Tensor:
    """``model.generate`` with every decoding setting explicit and none read from the checkpoint.

    The output layer gets a contiguous input at the prefill (:func:`_contiguous_output_layer_input`:
    transformers' ``[B, 1, H]`` slice otherwise makes ``torch.matmul`` copy the ``[V, H]`` weight B times).

    Args:
        model: a transformers causal LM.
        input_ids_BT, attention_mask_BT: long tensors on the model's device (left padded).
        max_new_tokens: N. temperature: 0 = greedy; top_k: 0 = off; top_p: 1.0 = off.
        stop_token_ids: generation of a row stops after any of them (the one stop rule).
        pad_token_id: fills rows that stopped early.

    Returns:
        ``[B, T + N']`` long (N' <= N), prompt included, as ``generate()`` returns it. Sampling
        uses the global torch RNG (seed it before the call).
    """
    gen_cfg = hf_generation_config(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id)
    with torch.inference_mode(), _without_checkpoint_defaults(model), _contiguous_output_layer_input(model):
        return model.generate(input_ids=input_ids_BT, attention_mask=attention_mask_BT, generation_config=gen_cfg)


def openai_request_fields(*, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                          seed: int | None, stop_token_ids: Sequence[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat-completions request fields that pin decoding on vLLM / SGLang / ``deepspec serve``.

    Returns ``(kwargs, extra_body)``: standard OpenAI fields (``max_tokens``, ``temperature``,
    ``top_p``, ``presence_penalty``, ``frequency_penalty``, ``seed`` when given) and the vLLM/SGLang
    extensions (``top_k`` (-1 = off), ``min_p``, ``repetition_penalty``, ``stop_token_ids``), all
    explicit, so a server applies none of the checkpoint's defaults.
    """
    kwargs: dict[str, Any] = {"max_tokens": int(max_new_tokens), "temperature": float(temperature),
                              "top_p": float(top_p), "presence_penalty": NEUTRAL_SETTINGS["presence_penalty"],
                              "frequency_penalty": NEUTRAL_SETTINGS["frequency_penalty"]}
    if seed is not None:
        kwargs["seed"] = int(seed)
    extra = {"top_k": int(top_k) if top_k > 0 else OPENAI_TOP_K_OFF, "min_p": NEUTRAL_SETTINGS["min_p"],
             "repetition_penalty": NEUTRAL_SETTINGS["repetition_penalty"],
             "stop_token_ids": sorted(int(t) for t in stop_token_ids)}
    return kwargs, extra
