"""The ``fp8`` storage mode: target features as float8_e4m3fn with one float32 scale per token
and target layer (the shard tensors ``target_hidden`` and ``target_hidden_scale``,
:mod:`deepspec.data.cache.format`).

Shape legend: T tokens, n number of target layers, H target hidden size, F = n * H target feature size.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value (OCP FP8 spec, E4M3: 1.75 * 2**8)


def quantize_fp8(hidden_TF: torch.Tensor, num_target_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise features to float8_e4m3fn with one float32 scale per token and target layer.

    ``scale[t, l] = absmax(hidden[t, l*H:(l+1)*H]) / 448`` (1.0 where the absmax is 0), and
    ``q = round_to_nearest_even(hidden / scale)`` in e4m3 (|q| <= 448, never saturating). Error
    bounds: the widest e4m3 ulp below 448 is 32, so every element has ``|dequant - x| <= absmax /
    28`` (16 * scale); for a normal e4m3 value the error is at most 2**-4 of the value (3 mantissa
    bits). The absmax element is exact. Measured errors: docs/design/cache.md, "Cache size and fp8 storage".

    Args:
        hidden_TF: finite features [T, n*H], any float dtype (computed in float32).
        num_target_layers: n (F must be divisible by it).
    Returns:
        ``(q_TF float8_e4m3fn [T, F], scale_Tn float32 [T, n])``.
    """
    T, F = hidden_TF.shape
    n = int(num_target_layers)
    assert F % n == 0, f"feature size {F} not divisible by {n} layers"
    x_TnH = hidden_TF.float().reshape(T, n, F // n)
    scale_Tn = x_TnH.abs().amax(dim=-1) / FP8_E4M3_MAX
    scale_Tn = torch.where(scale_Tn > 0, scale_Tn, torch.ones_like(scale_Tn))
    q_TnH = (x_TnH / scale_Tn[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q_TnH.reshape(T, F), scale_Tn


def dequantize_fp8(q_TF: torch.Tensor, scale_Tn: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: float32 ``[..., F] = q * scale`` (per token and layer), on the
    device ``q`` is on.

    Args:
        q_TF: float8_e4m3fn ``[..., F]`` (one sample ``[T, F]``, or a padded batch ``[B, S, F]``).
        scale_Tn: float32 ``[..., n]``, the same leading shape; ``F`` divisible by ``n``.
    Returns:
        float32 ``[..., F]``. Each element is one float32 product of two exactly converted values, so
        a batch dequantised at once has the bits of its samples dequantised one by one (padding with
        ``q = 0`` stays 0).
    """
    *lead, F = q_TF.shape
    n = scale_Tn.shape[-1]
    assert list(scale_Tn.shape[:-1]) == lead and F % n == 0, (tuple(q_TF.shape), tuple(scale_Tn.shape))
    return (q_TF.float().reshape(*lead, n, F // n) * scale_Tn.float()[..., None]).reshape(*lead, F)
