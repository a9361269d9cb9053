"""Linear layers over a few rows on the CPU: the verify forward's matrix products at the cost of a GEMV.

A decoding step multiplies every weight matrix of the target by 1 row (a target-only step) or by
``N + 1`` rows (a verify step over ``[anchor, d_1..d_N]``). Both are bound by reading the weights
from memory, so the ``N + 1``-row product should cost about what the 1-row one does. With the MKL
build of torch on x86 CPUs without native bf16 (AVX2, float32), ``F.linear`` over 2-8 rows takes well
over its 1-row time (the row-major GEMM path), while the same product computed as ``(W @ x^T)^T``
takes about the 1-row time, and a whole forward of the target over up to 4 new tokens costs about a
one-token forward (``python bench/decode.py`` measures the
effect on a whole speculative step, side by side: ``--few-row-linear on,off``).

:func:`few_row_linear` swaps the ``forward`` of every ``torch.nn.Linear`` inside the given modules
for one that computes inputs of at most ``max_rows`` rows as ``(W @ x^T)^T`` and leaves every larger
input (prefill, batched generation, training) to ``F.linear``, and restores them on exit.

Numerics: the product is the same sum in another order, so results may differ from ``F.linear`` in
the last bits (float32: about 1e-6 relative). Target-only and speculative decoding both run under the
same swap, so the lossless check (speculative output identical to target-only output) compares like
with like; argmax flips between a one-token and a verify forward are measured by
:mod:`deepspec.decoding.flips` as before.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

FEW_ROW_CHOICES = ("auto", "on", "off")
DEFAULT_MAX_ROWS = 16  # a verify over 1 anchor + up to 15 drafts; prefills and batches are longer


def check_few_row_mode(value: object, field: str) -> str:
    """``value`` when it is one of :data:`FEW_ROW_CHOICES`; ValueError naming ``field`` otherwise."""
    if value not in FEW_ROW_CHOICES:
        raise ValueError(f"{field}: expected one of {', '.join(FEW_ROW_CHOICES)}, received {value!r}; auto uses "
                         "the few-row path for float32 models on the CPU.")
    return str(value)


def few_row_linear_applies(mode: str, model: torch.nn.Module) -> bool:
    """Whether ``mode`` (``auto`` | ``on`` | ``off``) swaps the linear layers of ``model``.

    ``auto``: on for a model whose parameters are float32 on the CPU (where the measurement in the
    module docstring was made); off on CUDA and in bfloat16, whose kernels need no help.
    Raises ValueError for another mode.
    """
    mode = check_few_row_mode(mode, "few_row_linear")
    if mode != "auto":
        return mode == "on"
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu" and param.dtype == torch.float32


def few_row_forward(layer: torch.nn.Linear, x: torch.Tensor, max_rows: int) -> torch.Tensor:
    """``layer(x)``, as ``(W @ x^T)^T`` when ``x`` has 2 to ``max_rows`` rows, else ``F.linear`` (one
    row is a matrix-vector product either way, and ``F.linear`` takes the GEMV kernel for it).

    ``x``: ``[..., in_features]`` in the layer's dtype; returns a contiguous ``[..., out_features]``.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows < 2 or rows > max_rows:
        return F.linear(x, layer.weight, layer.bias)
    y_RO = torch.mm(layer.weight, x.reshape(rows, x.shape[-1]).t()).t()
    if layer.bias is not None:
        y_RO = y_RO + layer.bias
    return y_RO.contiguous().reshape(*x.shape[:-1], layer.out_features)


@contextlib.contextmanager
def few_row_linear(*modules: torch.nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> Iterator[int]:
    """Within the block, every ``torch.nn.Linear`` inside ``modules`` computes few-row inputs as
    ``(W @ x^T)^T`` (see the module docstring); yields the number of layers swapped.

    Layers shared by several modules (a draft's frozen ``lm_head`` is the target's) are swapped once.
    The original ``forward`` of each layer is restored on exit, also after an exception. Raises
    ValueError for ``max_rows < 1``.
    """
    if max_rows < 1:
        raise ValueError(f"few_row_linear.max_rows: expected an integer >= 1, received {max_rows}.")
    layers = {id(m): m for module in modules for m in module.modules() if isinstance(m, torch.nn.Linear)}
    saved = {key: layer.__dict__.get("forward") for key, layer in layers.items()}
    try:
        for layer in layers.values():
            layer.forward = types.MethodType(lambda self, x: few_row_forward(self, x, max_rows), layer)
        yield len(layers)
    finally:
        for key, layer in layers.items():
            if saved[key] is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = saved[key]
