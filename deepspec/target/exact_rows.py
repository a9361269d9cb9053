"""Exact rows: a target forward over a few new tokens whose every row is, bit for bit, the row a one-token
forward computes.

Legend: B batch (1), T new tokens in the forward, Q query heads, K key/value heads, S keys (cached + new),
D head dim, I / O a linear layer's input / output features.

Why (docs/design/decoding.md, "Lossless, and argmax flips in bfloat16"): a verify forward over
``[anchor, d_1..d_N]`` and the one-token forwards of target-only decoding run other kernels on other
shapes, so the logits differ in their last bits and a near-tied argmax can flip. Two ops of a
Llama / Qwen3 decoder layer are not row-invariant on the CPU (RMSNorm, RoPE, the residual adds, the
embedding and the activations are elementwise or per-row reductions and are):

- attention: a one-token forward calls SDPA with one query, no mask, and the key/value heads
  unrepeated (``enable_gqa``); a forward over T tokens after a cache calls it with T queries, a
  causal mask and the key/value heads repeated, which takes another kernel path.
- linear layers: ``F.linear`` over T rows may sum in another order than over one row (the GEMM
  against the GEMV kernel: in float32 with MKL, every T >= 2; in bfloat16 with oneDNN, only some
  shapes: measured on an AMD EPYC with AVX512-BF16, ``F.linear`` with more than 1024 input features,
  the MLP's down projection, while the other projections and ``lm_head`` are row-invariant).

:class:`ExactRows` (prepared once per model) swaps both for the forwards run inside ``with exact(rows):``:

- attention (every decoder layer, through a transformers attention implementation registered as
  ``deepspec_exact_<name>`` beside the model's own ``<name>``, which mask creation treats as ``<name>``):
  a forward over 2 or more queries after a cache computes each query row with the model's own
  attention function as a one-token forward calls it, over the keys that row attends to (a causal
  chain: the cache and the new tokens up to itself; a draft tree's node: the keys its mask allows,
  gathered) and with the mask a one-token forward gets there (none where every key is attended).
  Forwards without a cache (a prompt's prefill) are left as they are.
- linear layers: inputs of more than ``c`` rows are computed in chunks of at most ``c`` rows, where
  ``c`` is the largest row count (<= ``max_rows``, default :data:`PROBE_ROWS`) at which this layer's
  ``F.linear`` gives every row exactly as over that row alone (tested once per weight shape, dtype, device
  and thread count: :func:`row_invariant_rows`; ``c = 1`` computes row by row). Only the layers with ``c``
  below the forward's row count are swapped, and those another context swapped (the few-row path of
  :mod:`deepspec.target.few_row_linear`), which go back to ``F.linear``. One row is ``F.linear`` as always.

Only verify forwards change: one-token forwards run the stock kernels, so target-only decoding with or
without the swap is the same decoding, and speculative decoding under it gives the target-only output
token for token. Exactness holds where the one-token forward's mask is skipped, as for full-attention
layers at batch 1 without padding; a sliding-window layer's row is computed over its window's keys
gathered, the same sum as the one-token forward's masked one, possibly in another order. The measured
cost is in ``docs/results/`` (``bench/exact_verify.py``).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

EXACT_PREFIX = "deepspec_exact_"
PROBE_ROWS = 16  # the longest chunk a linear layer is tested at by default; longer inputs go in chunks of at most this


def _cancelling_inputs(rows: int, out_features: int, in_features: int,
                       gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``x [rows, I]`` and ``W [O, I]`` whose products span 2^-20..2^20 and cancel in pairs, so that a
    sum in another order changes most outputs' last bits (random normals hide most reorderings in bf16)."""
    half = (in_features + 1) // 2

    def wide(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-10, 11, shape, generator=gen).float())

    h, w = wide(rows, half), wide(out_features, half)
    x = torch.cat([h, -h], 1)[:, :in_features]
    weight = torch.cat([w, w], 1)[:, :in_features]
    weight = weight * (1 + 1e-3 * torch.randn(weight.shape, generator=gen))
    return x, weight


@functools.cache
def _row_invariant_rows(out_features: int, in_features: int, bias: bool, dtype: torch.dtype, device: str,
                        threads: int, max_rows: int) -> int:
    gen = torch.Generator().manual_seed(0)
    x, weight = (t.to(dtype=dtype, device=device) for t in
                 _cancelling_inputs(2 * max_rows, out_features, in_features, gen))
    b = torch.randn(out_features, generator=gen).to(dtype=dtype, device=device) if bias else None
    one = torch.cat([F.linear(x[r:r + 1], weight, b) for r in range(x.shape[0])])
    for rows in range(2, max_rows + 1):
        chunked = torch.cat([F.linear(x[r:r + rows], weight, b) for r in range(0, x.shape[0], rows)])
        if not torch.equal(chunked, one):
            return rows - 1
    return max_rows


def row_invariant_rows(layer: torch.nn.Linear, max_rows: int = PROBE_ROWS) -> int:
    """The largest ``c`` in ``1..max_rows`` such that ``F.linear`` over every row count ``2..c`` gives each
    row bit for bit as ``F.linear`` over that row alone, for a layer of ``layer``'s shape, dtype, bias and
    device at the current ``torch.get_num_threads()``.

    Tested on inputs built to expose any change of summation order (:func:`_cancelling_inputs`; the
    kernels' order depends on shapes, not values), once per process for each key: up to a second per shape on
    a small CPU, mostly the backend building a kernel for each row count. Raises ValueError for ``max_rows < 1``.
    """
    if max_rows < 1:
        raise ValueError(f"exact_rows.max_rows: expected an integer >= 1, received {max_rows}.")
    w = layer.weight
    return _row_invariant_rows(layer.out_features, layer.in_features, layer.bias is not None, w.dtype, str(w.device),
                               torch.get_num_threads(), max_rows)


def exact_linear_forward(layer: torch.nn.Linear, x: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """``layer(x)`` with every row as ``F.linear`` computes it over that row alone: ``x``'s rows in chunks of
    ``chunk_rows`` (:func:`row_invariant_rows`), in one call when they are no more.

    ``x``: ``[..., I]`` in the layer's dtype; returns ``[..., O]``.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= chunk_rows:
        return F.linear(x, layer.weight, layer.bias)
    x_RI = x.reshape(rows, x.shape[-1])
    y_RO = torch.cat([F.linear(x_RI[r:r + chunk_rows], layer.weight, layer.bias) for r in range(0, rows, chunk_rows)])
    return y_RO.reshape(*x.shape[:-1], layer.out_features)


def exact_attention(inner: Any, module: torch.nn.Module, query_BQTD: torch.Tensor, key_BKSD: torch.Tensor,
                    value_BKSD: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[Any, Any]:
    """A transformers attention function over T queries whose every row is computed as a one-token forward's.

    ``inner``: the model's own attention function (``sdpa_attention_forward`` or another registered one),
    called as transformers calls it. ``query_BQTD`` [B, Q, T, D]; ``key_BKSD`` / ``value_BKSD`` [B, K, S, D]
    with the T new tokens last; ``attention_mask``: None, or a 4-D mask ``[B, 1, T, S]`` (bool, True =
    attend, or additive float, 0 = attend). T = 1, S = T (no cache: a prefill) and B > 1 go to ``inner``
    unchanged. Else row ``i`` (its own key at ``S - T + i``, the last key it attends to) is ``inner`` over
    the single query ``i`` and the keys its mask row allows (a prefix: a view; else gathered), with the mask
    row over those keys, or None where it is a bool mask attending to all of them (as transformers skips a
    one-token forward's full mask). Returns ``(attn_output [B, T, Q, D], None)`` as ``inner`` does.
    """
    B, _, T, _ = query_BQTD.shape
    S = key_BKSD.shape[2]
    if T == 1 or S == T or B != 1:
        return inner(module, query_BQTD, key_BKSD, value_BKSD, attention_mask, **kwargs)
    outs = []
    for i in range(T):
        end = S - T + i + 1
        row_S = None if attention_mask is None else attention_mask[0, 0, i, :end]
        allowed_S = None if row_S is None else (row_S if row_S.dtype == torch.bool else row_S == 0)
        if allowed_S is None or bool(allowed_S.all()):
            k, v = key_BKSD[:, :, :end], value_BKSD[:, :, :end]
            mask = None if row_S is None or row_S.dtype == torch.bool else row_S.view(1, 1, 1, end)
        else:
            idx = allowed_S.nonzero().flatten()
            k, v = key_BKSD.index_select(2, idx), value_BKSD.index_select(2, idx)
            mask = None if row_S.dtype == torch.bool else row_S.index_select(0, idx).view(1, 1, 1, -1)
        outs.append(inner(module, query_BQTD[:, :, i:i + 1], k, v, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


def _register(name: str) -> str:
    """Register ``deepspec_exact_<name>`` (attention: :func:`exact_attention` around ``name``'s function;
    masks: ``name``'s mask function) with transformers once; return it."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    exact_name = EXACT_PREFIX + name
    if exact_name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(exact_name, functools.partial(exact_attention, ALL_ATTENTION_FUNCTIONS[name]))
        if name in ALL_MASK_ATTENTION_FUNCTIONS:
            ALL_MASK_ATTENTION_FUNCTIONS.register(exact_name, ALL_MASK_ATTENTION_FUNCTIONS[name])
    return exact_name


def attention_configs(model: torch.nn.Module) -> list[Any]:
    """The distinct configs the model's modules read their attention implementation from."""
    found = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
             and hasattr(c, "_attn_implementation")}
    return list(found.values())


@contextlib.contextmanager
def swapped_attention(configs: list[Any], impls: list[str]) -> Iterator[None]:
    """Within the block each of ``configs`` reads the attention implementation at the same place in ``impls``
    (names registered with transformers' attention interface); restored on exit, also after an exception."""
    saved = [c._attn_implementation for c in configs]
    try:
        for config, impl in zip(configs, impls, strict=True):
            config._attn_implementation = impl
        yield
    finally:
        for config, impl in zip(configs, saved, strict=True):
            config._attn_implementation = impl


class ExactRows:
    """Exact-row forwards for one model (see the module docstring): prepared once, entered per forward.

    Args:
        model: a Hugging Face causal LM (or its base model) whose attention modules call the function
            registered under ``config._attn_implementation`` (``sdpa``, the default, or another registered one).
        attention / linear: False leaves that op as it is (to measure what each contributes; exactness
            needs both).
        max_rows: the most rows a linear layer's ``F.linear`` is tested at (:func:`row_invariant_rows`): give the
            longest verify usually fed (a longer one is still exact, in chunks of at most this).

    Construction tests every linear layer's shape (:func:`row_invariant_rows`; seconds for the embedded target
    at 16 rows, once per process). ``chunk_rows`` maps each linear layer's module name to its
    ``c``. Raises ValueError for an attention implementation not registered with transformers' attention
    interface (``eager`` is its built-in fallback, not registered), and for ``max_rows < 1``.
    """

    def __init__(self, model: torch.nn.Module, *, attention: bool = True, linear: bool = True,
                 max_rows: int = PROBE_ROWS) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.configs = attention_configs(model) if attention else []
        self._exact_impl = []
        for config in self.configs:
            impl = config._attn_implementation
            if not isinstance(impl, str) or impl not in ALL_ATTENTION_FUNCTIONS:
                raise ValueError(f"exact_rows: the target's attention implementation {impl!r} is not one registered "
                                 "with transformers' AttentionInterface (eager is not); load it with "
                                 "attn_implementation='sdpa' (the default).")
            self._exact_impl.append(impl if impl.startswith(EXACT_PREFIX) else _register(impl))
        named = {id(m): (name, m) for name, m in model.named_modules() if linear and isinstance(m, torch.nn.Linear)}
        self.chunk_rows = {name: row_invariant_rows(m, max_rows) for name, m in named.values()}
        self._layers = [(self.chunk_rows[name], m, types.MethodType(
            functools.partial(_chunked_forward, chunk_rows=self.chunk_rows[name]), m)) for name, m in named.values()]

    @contextlib.contextmanager
    def __call__(self, rows: int) -> Iterator[None]:
        """Within the block, forwards over ``rows`` new tokens after a cache give every row bit for bit as a
        one-token forward (``rows`` is the forward's T: it picks the linear layers to chunk; a forward over
        more rows is not exact). The model's configs and the swapped layers' ``forward`` are restored on
        exit, also after an exception. Run only cache-continuing forwards in it: a prefill's attention is
        left alone but its linear layers would be chunked (slower, and no result that matters changes).
        Not for compiled graphs (:mod:`deepspec.decoding.compiled` traces its own).
        """
        swapped = []
        try:
            for c, layer, forward in self._layers:
                # chunked where F.linear over `rows` rows is not row-invariant; a layer another context swapped
                # (the few-row path) goes back to F.linear, the kernel its rows were tested with
                if c < rows or "forward" in layer.__dict__:
                    swapped.append((layer, layer.__dict__.get("forward")))
                    layer.__dict__["forward"] = forward  # an instance attribute, as nn.Module.__setattr__ would set
            with swapped_attention(self.configs, self._exact_impl):
                yield
        finally:
            for layer, saved in swapped:
                if saved is None:
                    layer.__dict__.pop("forward", None)
                else:
                    layer.__dict__["forward"] = saved


def _chunked_forward(layer: torch.nn.Linear, x: torch.Tensor, *, chunk_rows: int) -> torch.Tensor:
    return exact_linear_forward(layer, x, chunk_rows)


def exact_target_forward(exact: ExactRows) -> Callable[..., Any]:
    """:func:`deepspec.target.capture.target_forward` (same arguments and result) running every forward over 2
    or more tokens after a non-empty cache under ``exact``: the ``forward_fn`` with which
    :func:`deepspec.decoding.flips.chunked_argmax` re-runs an output decoded with exact rows."""
    from deepspec.target.capture import target_forward

    def forward(model: Any, input_ids_BT: torch.Tensor, target_layer_ids: list[int], **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values")
        rows = input_ids_BT.shape[1]
        continues = cache is not None and int(cache.get_seq_length()) > 0
        with exact(rows) if rows > 1 and continues else contextlib.nullcontext():
            return target_forward(model, input_ids_BT, target_layer_ids, **kwargs)

    return forward
