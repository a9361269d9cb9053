"""Target feature capture: THE one function that turns a target forward into draft-model inputs.

The cache writer, online training and evaluation all call :func:`target_forward`, so the three
can never disagree on which hidden states a draft model sees (docs/design/targets.md, "Target layer
ids").

Shape legend: B batch, T tokens in this call, H target hidden size, n number of target layers
captured, F = n * H target feature size, V vocabulary size, L target depth (decoder layers).

Meaning of ``target_layer_ids`` (0-based decoder-layer indices):

* the feature of layer ``i`` is the **output of decoder layer i**, which equals Hugging Face
  ``hidden_states[i + 1]`` for ``i < L - 1``;
* ``-1`` is the embedding output, i.e. the input of decoder layer 0 (HF ``hidden_states[0]``;
  for families that scale embeddings, e.g. Gemma, this is the scaled value the layers see);
* ``L - 1`` is rejected: HF's last ``hidden_states`` entry is the *final-norm* output, not the raw
  output of the last decoder layer. Verified on transformers 5.24: ``capture_outputs`` (in
  ``transformers/utils/output_capturing.py``, ``tie_last_hidden_states=True`` for language models)
  overwrites ``hidden_states[-1]`` with ``last_hidden_state``, which is ``model.norm(...)``. So
  "layer L-1" would mean two different tensors depending on how it was captured; we refuse it.

Implementation choice: forward hooks on only the selected decoder layers (plus a forward
pre-hook on layer 0 for ``-1``) instead of ``output_hidden_states=True``. This keeps exactly the
n tensors we need alive (``output_hidden_states=True`` keeps all L + 1, i.e. ``(L+1) * B*T*H``
activations, about 7x more for 5 of 36 layers), does not depend on the transformers-version
specific tie/selection behaviour of ``hidden_states``, and works the same for every HF
decoder-only family whose base model exposes ``.layers`` and ``.norm``. The target's final
hidden state is the base model's ``last_hidden_state`` (post final norm), and logits, when asked
for, are ``lm_head(last_hidden_state)`` (soft-capped where the config says so: :func:`target_logits`),
so they are computed only when needed.

A decode loop runs thousands of one-token forwards on the same layers: :func:`capture_hooks` keeps the hooks
on for all of them, and :func:`target_forward` then reads them instead of adding and removing its own per
call (the same hooks, so the same features).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def default_target_layer_ids(num_hidden_layers: int, num_layers: int = 5) -> list[int]:
    """Evenly spaced decoder-layer ids from 1 to ``L - 3`` (both included).

    Source: docs/design/targets.md, "Target layer ids", and the upstream DFlash ``build_target_layer_ids`` (which vLLM /
    SGLang mirror, so released checkpoints agree): ``int(round(1 + k * (L - 4) / (n - 1)))`` for
    ``k = 0..n-1`` (Python's round, half to even), and ``[L // 2]`` for ``n = 1``.
    Qwen3-4B (L = 36): ``[1, 9, 17, 25, 33]``; SmolLM2-135M (L = 30): ``[1, 8, 14, 20, 27]``.

    Raises ValueError if the target is too shallow to give ``num_layers`` distinct valid ids.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers: expected >= 1, received {num_layers}")
    L = num_hidden_layers
    if num_layers == 1:
        ids = [L // 2]
    else:
        start, end = 1, L - 3
        ids = [int(round(start + k * (end - start) / (num_layers - 1))) for k in range(num_layers)]
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > L - 2:
        raise ValueError(
            f"num_hidden_layers={L}: too shallow for {num_layers} evenly spaced target layers in [1, L-3] "
            f"(got {ids}); pass target_layer_ids explicitly or ask for fewer layers"
        )
    return ids


def validate_target_layer_ids(ids: Any, num_hidden_layers: int) -> list[int]:
    """Check ``target_layer_ids`` for a depth-``num_hidden_layers`` target; return them as a list.

    Allowed: distinct ints in ``[-1, L-2]`` (``-1`` = embedding output). Order is kept as given
    (features are concatenated in that order). Raises ValueError naming the offending id for an
    empty list, a non-int, a duplicate, an id out of range, or ``L-1`` (whose HF hidden state is
    the final-norm output, see the module docstring).
    """
    L = num_hidden_layers
    try:
        ids_list = list(ids)
    except TypeError:
        raise ValueError(f"target_layer_ids: expected a list of ints, received {ids!r}") from None
    if not ids_list:
        raise ValueError("target_layer_ids: expected at least one layer id, received an empty list")
    seen: set[int] = set()
    out: list[int] = []
    for i in ids_list:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"target_layer_ids: expected ints, received {i!r} in {ids_list}")
        if i == L - 1:
            raise ValueError(
                f"target_layer_ids: {i} is the last decoder layer (L-1 for L={L}); it is not allowed because "
                f"Hugging Face's last hidden_states entry is taken after the final norm, so 'layer L-1' is "
                f"ambiguous. Use an id in [-1, {L - 2}] (default: {_default_or_hint(L)})"
            )
        if not -1 <= i <= L - 2:
            raise ValueError(
                f"target_layer_ids: {i} out of range for a target with {L} decoder layers; expected ids in "
                f"[-1, {L - 2}] (-1 = embedding output)"
            )
        if i in seen:
            raise ValueError(f"target_layer_ids: duplicate id {i} in {ids_list}; each layer may appear once")
        seen.add(i)
        out.append(i)
    return out


def _default_or_hint(L: int) -> str:
    try:
        return str(default_target_layer_ids(L))
    except ValueError:
        return "pick fewer layers"


@dataclass
class TargetOutput:
    """What a target forward gives the draft side.

    target_hidden_BTF: features of ``target_layer_ids`` concatenated on the last axis, model dtype
        (None when no layer ids were asked for).
    target_last_hidden_BTH: final-norm output (``logits = lm_head(target_last_hidden)``).
    logits_BTV: :func:`target_logits` of ``target_last_hidden_BTH`` if ``compute_logits`` else None.
    past_key_values: the KV cache after this call (the object passed in, updated), or None.
    """

    target_hidden_BTF: torch.Tensor | None
    target_last_hidden_BTH: torch.Tensor
    logits_BTV: torch.Tensor | None
    past_key_values: Any


def _base_model(model: nn.Module) -> nn.Module:
    """The decoder stack (``model.model`` for ``*ForCausalLM``), or ``model`` if already a base model."""
    if hasattr(model, "layers") and hasattr(model, "norm"):
        return model
    base = getattr(model, "model", None)
    if base is None:
        base = getattr(model, "base_model", None)
    if base is None or not hasattr(base, "layers"):
        raise ValueError(
            f"target model {type(model).__name__}: expected a Hugging Face decoder-only causal LM whose base "
            f"model (.model) has .layers; received a model without one"
        )
    return base


def _lm_head(model: nn.Module) -> nn.Module:
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"target model {type(model).__name__}: compute_logits=True needs an lm_head; none found")
    return head


def final_logit_softcap(model_or_config: Any) -> float | None:
    """The target's final-logit soft-capping constant ``c`` (``final_logit_softcapping`` of its text
    config: Gemma 2 writes 30.0; Gemma 3 None), or None when it has none."""
    cfg = getattr(model_or_config, "config", model_or_config)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    cap = getattr(cfg, "final_logit_softcapping", None)
    return float(cap) if cap else None


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2 paper, s.2; transformers' Gemma ``*ForCausalLM`` in the
    same operation order, so the values are its own), or ``logits`` unchanged when ``cap`` is None.
    Monotone: argmax and so greedy decoding are unchanged; sampling is not."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def target_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits ``[..., V]`` of final-norm hidden states ``[..., H]``: ``lm_head``, then the
    soft-capping its config asks for (:func:`soft_cap`), as the model's own forward computes them."""
    return soft_cap(_lm_head(model)(hidden), final_logit_softcap(model))


@functools.lru_cache(maxsize=None)
def _cache_kwarg(base_cls: type) -> str:
    """transformers 5.x renamed the base-model ``past_key_values`` argument to ``cache`` (with a
    deprecation shim until 5.40); pass whichever the installed version's signature names."""
    params = inspect.signature(base_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def positions_from_attention_mask(attention_mask_BS: torch.Tensor, num_new_tokens: int) -> torch.Tensor:
    """Position ids of the last ``num_new_tokens`` columns of a (past + new) attention mask.

    Position of a token = number of real (mask 1) tokens before it, so left- and right-padded
    rows get the same positions as their unpadded versions (the rule HF ``generate`` uses).
    Padding columns get position 0 (their outputs are never used). Returns long [B, T].
    """
    pos_BS = attention_mask_BS.long().cumsum(-1) - 1
    pos_BS = pos_BS.clamp(min=0)
    return pos_BS[:, -num_new_tokens:]


@torch.no_grad()
def target_forward(
    model: nn.Module,
    input_ids_BT: torch.Tensor,
    target_layer_ids: list[int],
    *,
    attention_mask_BT: torch.Tensor | None = None,
    position_ids_BT: torch.Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool = False,
    compute_logits: bool = False,
) -> TargetOutput:
    """Run the target on ``input_ids_BT`` and capture the draft-model inputs.

    Args:
        model: a HF ``*ForCausalLM`` (or its base model if ``compute_logits`` is False).
        input_ids_BT: long [B, T] (the new tokens; with a KV cache, only those not yet in it).
        target_layer_ids: validated with :func:`validate_target_layer_ids`; ``[]`` captures nothing
            (a plain forward, no hooks: ``target_hidden_BTF`` is None), for callers that need only
            the final hidden state, logits and KV cache (the target-only decoding baseline).
        attention_mask_BT: [B, past + T] 1 = real token, 0 = padding (left or right). With a KV
            cache it covers the cached tokens too (HF convention). A 4-D bool ``[B, 1, T, past + T]``
            (True = attend), or a dict of them by layer type for a model with ``config.layer_types``, is
            passed to the model as it is (a draft tree's mask, with explicit ``position_ids_BT``).
        position_ids_BT: long [B, T]. If None and ``attention_mask_BT`` is given, derived from
            the mask (:func:`positions_from_attention_mask`); if both are None, the model's own
            default (``past_len + arange(T)``).
        past_key_values: a transformers ``Cache`` (e.g. ``DynamicCache``) to read and extend.
        use_cache: create/extend a KV cache (a new ``DynamicCache`` if none is passed).
        compute_logits: also return the logits ``[B, T, V]`` (:func:`target_logits`: ``lm_head`` and any
            soft-capping).

    Returns :class:`TargetOutput` with tensors in the model's dtype and device. Runs under
    ``torch.no_grad`` (the target is frozen in every DeepSpec stage); not ``inference_mode``,
    because online training feeds these tensors into the draft's autograd graph.
    """
    base = _base_model(model)
    layers = base.layers
    L = len(layers)
    ids = validate_target_layer_ids(target_layer_ids, L) if len(target_layer_ids) else []
    T = input_ids_BT.shape[1]

    if position_ids_BT is None and attention_mask_BT is not None:
        position_ids_BT = positions_from_attention_mask(attention_mask_BT, T)

    kept = base.__dict__.get(_KEPT_HOOKS)
    if kept is not None and kept[0] == ids:  # capture_hooks: the hooks are on, their dict is filled anew
        captured, handles = kept[1], []
        captured.clear()
    else:
        captured = {}
        handles = _add_capture_hooks(layers, ids, captured)
    try:
        kwargs = {
            "input_ids": input_ids_BT,
            "attention_mask": attention_mask_BT,
            "position_ids": position_ids_BT,
            "use_cache": use_cache,
            _cache_kwarg(type(base)): past_key_values,
        }
        out = base(**kwargs)
    finally:
        for h in handles:
            h.remove()

    missing = [i for i in ids if i not in captured]
    assert not missing, f"capture hooks did not fire for layers {missing}"
    target_hidden_BTF = torch.cat([captured[i] for i in ids], dim=-1) if ids else None
    captured.clear()  # kept hooks' dict: not holding this forward's activations until the next one
    target_last_hidden_BTH = out.last_hidden_state
    # transformers >= 5.x names the output field ``cache`` (``past_key_values`` is a warning shim)
    # (read by the field the output class declares: the shim logs a deprecation warning)
    name = "cache" if "cache" in getattr(out, "__dataclass_fields__", {}) else "past_key_values"
    cache = out.get(name)
    if cache is None:
        cache = past_key_values
    logits_BTV = target_logits(model, target_last_hidden_BTH) if compute_logits else None
    return TargetOutput(
        target_hidden_BTF=target_hidden_BTF,
        target_last_hidden_BTH=target_last_hidden_BTH,
        logits_BTV=logits_BTV,
        past_key_values=cache,
    )


_KEPT_HOOKS = "_deepspec_capture_hooks"  # the base model's attribute while capture_hooks keeps its hooks on


def _add_capture_hooks(layers: Sequence[nn.Module], ids: Sequence[int], captured: dict[int, torch.Tensor]) -> list:
    """Hooks that store layer ``i``'s output (``-1``: layer 0's input) in ``captured[i]``; returns their handles."""

    def _keep_output(layer_id: int):
        def hook(module, args, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def _keep_embedding(module, args, kwargs):
        captured[-1] = args[0] if args else kwargs["hidden_states"]

    handles = []
    try:
        for i in ids:
            if i == -1:
                handles.append(layers[0].register_forward_pre_hook(_keep_embedding, with_kwargs=True))
            else:
                handles.append(layers[i].register_forward_hook(_keep_output(i)))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    return handles


@contextlib.contextmanager
def capture_hooks(model: nn.Module, target_layer_ids: Sequence[int]) -> Iterator[None]:
    """Keep the capture hooks of ``target_layer_ids`` on ``model``'s layers while the block runs: every
    :func:`target_forward` on ``model`` with these ids inside it reads them, instead of adding and removing
    its own (a decode loop's thousands of forwards; the features are the same). Calls with other ids add
    their own hooks as before. Re-entering with the same ids keeps the outer hooks; the hooks are removed on
    exit, also after an error.

    Raises ValueError for ids :func:`validate_target_layer_ids` refuses, and RuntimeError when hooks of other
    ids are kept on ``model`` already."""
    base = _base_model(model)
    ids = validate_target_layer_ids(target_layer_ids, len(base.layers))
    kept = base.__dict__.get(_KEPT_HOOKS)
    if kept is not None:
        if kept[0] != ids:
            raise RuntimeError(f"capture_hooks: hooks of layers {kept[0]} are kept on this target already; "
                               f"leave that block before keeping layers {ids}.")
        yield
        return
    captured: dict[int, torch.Tensor] = {}
    handles = _add_capture_hooks(base.layers, ids, captured)
    base.__dict__[_KEPT_HOOKS] = (ids, captured)
    try:
        yield
    finally:
        del base.__dict__[_KEPT_HOOKS]
        for h in handles:
            h.remove()


def features_from_hidden_states(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """The target features of ``target_layer_ids`` from a forward's ``output_hidden_states`` tuple.

    The capture hooks' rule (module docstring) read off Hugging Face's tuple of ``L + 1`` tensors
    ``[B, T, H]``: layer ``i``'s output is ``hidden_states[i + 1]`` and ``-1`` (the embedding output)
    is ``hidden_states[0]``; ``L - 1`` never occurs (:func:`validate_target_layer_ids` refuses it, as
    HF's last entry is the final-norm output). For a compiled forward, where hooks registered per call
    would recompile the graph (:mod:`deepspec.decoding.compiled`); equal to :func:`target_forward`'s
    features (a test checks it). Returns ``[B, T, len(ids) * H]``.
    """
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


@torch.no_grad()
def capture_sample_features(
    model: nn.Module, input_ids: Any, target_layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of one unpadded sample: the single capture rule of the cache writer and online mode.

    Every sample is run alone (batch 1, no padding, positions ``0..T-1``), so its features do not
    depend on which samples share its batch or on how much padding a batch needs: the cache path
    (capture, store, read) and online training (capture inside the training loop) see bitwise
    identical tensors for the same sample and storage dtype. Batched, padded forwards change the
    shapes of matmuls and attention reductions and with them the low-order bits.

    Args:
        model: a HF ``*ForCausalLM`` (or its base model), frozen.
        input_ids: the sample's token ids, a list of ints or an integer tensor of shape [T].
        target_layer_ids: validated with :func:`validate_target_layer_ids`.

    Returns:
        ``(target_hidden_TF, target_last_hidden_TH)`` in the model's dtype, on the model's device:
        the features ``[T, n*H]`` and the final-norm output ``[T, H]``.

    Raises:
        ValueError: an empty sample or invalid layer ids.
    """
    ids_T = torch.as_tensor(input_ids, dtype=torch.long)
    if ids_T.ndim != 1 or ids_T.numel() == 0:
        raise ValueError(f"input_ids: expected a non-empty 1-D sequence of token ids, got shape {tuple(ids_T.shape)}")
    device = next(model.parameters()).device
    out = target_forward(model, ids_T.to(device)[None, :], target_layer_ids)
    return out.target_hidden_BTF[0], out.target_last_hidden_BTH[0]


STATS_MISSING = ("{who}: target_logsumexp_BS is not finite (or target_argmax_BS is -1) at a supervised {what}; "
                 "the cache's statistics must cover every position p with loss_mask[p + 1]. Check the cache with "
                 "`deepspec cache --output-dir <cache> --verify`, and rebuild it into a new --output-dir")


@torch.no_grad()
def target_logit_stats(
    model: nn.Module, last_hidden_TH: torch.Tensor, loss_mask_T: Any, *, chunk_rows: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target distribution's normaliser and mode at the positions a training loss reads.

    Position ``p`` of a sample is read iff ``loss_mask[p + 1]`` (DSpark's slot at ``p`` and Eagle3's
    step target at ``p`` both predict token ``p + 1``). There the target logits are
    :func:`target_logits` of ``last_hidden_TH[p]`` (soft-capped where the target is), over the full
    vocabulary V; their ``logsumexp`` and ``argmax`` let a loss with a reduced draft vocabulary of W
    tokens compute the target's probabilities on those tokens from W logits,
    ``p_t[v] = exp(logit[v] - logsumexp)``, instead of V (:mod:`deepspec.algorithms.dspark.loss`).

    The logits are computed in float32 from the lm_head weight (a bfloat16 target's weight is cast), as
    the losses compute theirs from the draft's float32 copy of it.

    Args:
        model: the target (``*ForCausalLM``); its lm_head weight's device is used.
        last_hidden_TH: final-norm hidden states ``[T, H]`` as the cache stores them (pass the stored,
            rounded values, so the stats agree with logits a loss computes from the same tensor).
        loss_mask_T: ``[T]`` 0/1 (tensor or sequence).
        chunk_rows: rows per lm_head product (memory ``chunk_rows x V`` float32).

    Returns:
        ``(logsumexp_T float32, argmax_T int32)`` on the CPU; NaN and -1 at positions no loss reads.
    """
    weight = _lm_head(model).weight.float()  # as the losses compute their W logits: float32, the weight alone
    cap = final_logit_softcap(model)
    mask_T = torch.as_tensor(loss_mask_T).bool()
    T = int(last_hidden_TH.shape[0])
    if mask_T.shape != (T,):
        raise ValueError(f"loss_mask_T: expected shape ({T},), received {tuple(mask_T.shape)}")
    lse_T = torch.full((T,), float("nan"), dtype=torch.float32)
    argmax_T = torch.full((T,), -1, dtype=torch.int32)
    rows = mask_T[1:].nonzero(as_tuple=True)[0]  # p with loss_mask[p + 1]
    for s in range(0, int(rows.numel()), chunk_rows):
        r = rows[s:s + chunk_rows]
        logits = soft_cap(F.linear(last_hidden_TH[r].to(weight.device, torch.float32), weight), cap)
        lse_T[r] = torch.logsumexp(logits, dim=-1).cpu()
        argmax_T[r] = logits.argmax(-1).to(torch.int32).cpu()
    return lse_T, argmax_T


@torch.no_grad()
def target_draft_logits(
    target_last_hidden_NH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    d2t_W: torch.Tensor | None,
    softcap: float | None,
    *,
    logsumexp_N: torch.Tensor | None = None,
    argmax_N: torch.Tensor | None = None,
    lm_head_rows_WH: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The target side of :func:`target_draft_probs` before its last elementwise step: ``(logits_NW,
    logsumexp_N, outside_N, argmax_N)`` with ``p_NW = exp(logits_NW.float() - logsumexp_N[:, None])``.

    Dtypes: the matmul runs in the weight's dtype (the hidden states are cast to it), so ``logits_NW``
    is in that dtype (bf16 weights: bf16 logits, half the memory of float32 probabilities);
    soft-capping, the full-vocabulary ``logsumexp_N`` and ``outside_N`` are float32 (computed from the
    float32 view of the same logits), ``argmax_N`` int64 target ids. ``outside_N``: the target mass
    off the draft vocabulary, float32 ``[N]``; None when ``d2t_W`` is None (W = V). With
    ``logsumexp_N`` / ``argmax_N`` given and a reduced vocabulary, only the W rows ``lm_head_rows_WH``
    (gathered when None) are multiplied and the statistics are passed through (as float32 / int64).
    """
    if d2t_W is not None and logsumexp_N is not None and argmax_N is not None:
        rows = lm_head_weight_VH.index_select(0, d2t_W) if lm_head_rows_WH is None else lm_head_rows_WH
        logits_NW = F.linear(target_last_hidden_NH.to(rows.dtype), rows)
        if softcap is not None:
            logits_NW = soft_cap(logits_NW.float(), softcap).to(rows.dtype)
        lse_N = logsumexp_N.float()
        p_sum_N = torch.exp(logits_NW.float() - lse_N[:, None]).sum(-1)
        return logits_NW, lse_N, (1.0 - p_sum_N).clamp_min(0.0), argmax_N.long()
    logits_NV = F.linear(target_last_hidden_NH.to(lm_head_weight_VH.dtype), lm_head_weight_VH)
    logits32_NV = soft_cap(logits_NV.float(), softcap)
    if softcap is not None:
        logits_NV = logits32_NV.to(logits_NV.dtype)
    lse_N = torch.logsumexp(logits32_NV, dim=-1)
    argmax_N = logits32_NV.argmax(-1)
    if d2t_W is None:
        return logits_NV, lse_N, None, argmax_N
    logits_NW = logits_NV[:, d2t_W]
    p_W_sum_N = torch.exp(logits32_NV[:, d2t_W] - lse_N[:, None]).sum(-1)
    return logits_NW, lse_N, (1.0 - p_W_sum_N).clamp_min(0.0), argmax_N


def target_draft_probs(
    target_last_hidden_NH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    d2t_W: torch.Tensor | None,
    softcap: float | None,
    *,
    logsumexp_N: torch.Tensor | None = None,
    argmax_N: torch.Tensor | None = None,
    lm_head_rows_WH: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The target distribution of N positions as a draft with vocabulary ``d2t_W`` is trained on it.

    Returns ``(p_NW, outside_N, argmax_N)``: float32 target probabilities of the W draft tokens
    (``softmax`` over the full vocabulary, then the columns ``d2t_W``; all V columns when ``d2t_W`` is
    None), the target mass on the other tokens (float32 ``[N]``, None when W = V) and the target
    argmax in target ids (int64 ``[N]``). The logits matmul runs in the weight's dtype, the softmax in
    float32 (:func:`target_draft_logits`, of which this is ``exp(logits - logsumexp)``).

    With ``logsumexp_N`` / ``argmax_N`` (:func:`target_logit_stats` of the same hidden states) and a
    reduced vocabulary, only the W logits are computed (``lm_head_rows_WH``, the lm_head's rows
    ``d2t_W``; gathered when None): ``p[d] = exp(logit[d] - logsumexp)``, ``outside = 1 - sum p``
    (clamped at 0). Same values as the full path up to float rounding; V / W times fewer FLOPs.

    Args:
        target_last_hidden_NH: final-norm target hidden states, any float dtype; cast to the weight's.
        lm_head_weight_VH: the target's lm_head weight ``[V, H]``.
        d2t_W: int64 draft -> target ids, or None (W = V).
        softcap: the target's final-logit soft-capping (:func:`soft_cap`), or None.
    """
    logits_NW, lse_N, outside_N, argmax_N = target_draft_logits(
        target_last_hidden_NH, lm_head_weight_VH, d2t_W, softcap, logsumexp_N=logsumexp_N, argmax_N=argmax_N,
        lm_head_rows_WH=lm_head_rows_WH)
    return torch.exp(logits_NW.float() - lse_N[:, None]), outside_N, argmax_N
