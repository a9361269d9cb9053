"""Grouped-query attention under a mask, on the CPU: a verify forward's attention without repeated key/value heads.

Legend: B batch, Q query heads, K key/value heads (Q = G K, G the group size), T new tokens, S keys, D head dim.

transformers' ``sdpa`` attention hands SDPA a grouped-query model's K key/value heads as they are
(``enable_gqa``) only where no mask is given: a one-token decode step. A forward over T >= 2 new tokens after
a cache (a speculative verify: a chain needs the causal mask offset by the cache, a draft tree its tree mask)
gets a mask, and then the key and value caches are first repeated G times (``repeat_kv``), a copy of every
layer's whole cache per forward, so the verify's cost grows with the context faster than a one-token step's.
On the CPU, SDPA takes a mask with ``enable_gqa`` on the same kernel (PyTorch >= 2.5), so the copy is waste:
with the embedded target in bfloat16 on a 2-core Xeon, a 4-token verify cost 40.8 / 43.8 / 50.2 ms at 256 /
512 / 1024 tokens of context with the repeat and 38.9 / 40.3 / 44.5 ms without it, against 36.2 / 37.7 /
40.9 ms for one token (``bench/verify_attention.py``, docs/results/verify-attention-cpu-2026-12-07/). On CUDA a
masked grouped-query SDPA falls back to the math kernel, so this is for the CPU only.

:class:`GroupedQueryVerify` (prepared once per model) swaps a CPU model's ``sdpa`` attention, inside
``with GroupedQueryVerify(model)():``, for one registered with transformers as ``deepspec_sdpa_gqa`` (its masks
made as ``sdpa``'s) that calls SDPA with the unrepeated heads and the mask, and otherwise (no mask, no groups, a
position bias or a soft cap) is ``sdpa`` itself. Each output row is the same weighted sum over the same keys, so
the attention is unchanged: the test suite checks it bit for bit against ``sdpa``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from deepspec.target.exact_rows import attention_configs, swapped_attention

GQA_SDPA = "deepspec_sdpa_gqa"


def sdpa_gqa_attention(module: torch.nn.Module, query_BQTD: torch.Tensor, key_BKSD: torch.Tensor,
                       value_BKSD: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                       scaling: float | None = None, is_causal: bool | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function for ``GQA_SDPA``: with a mask and ``module.num_key_value_groups
    > 1``, ``F.scaled_dot_product_attention(..., attn_mask=attention_mask, enable_gqa=True)`` on the K unrepeated
    key/value heads, returned as ``(out_BTQD, None)`` (contiguous, the layout ``sdpa`` returns); every other call
    (no mask, one group, a ``position_bias`` or ``softcap``) is transformers' ``sdpa`` function unchanged.
    ``attention_mask``: bool (True: attend) or additive float, broadcastable to ``[B, Q, T, S]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups <= 1 or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query_BQTD, key_BKSD, value_BKSD, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out_BQTD = F.scaled_dot_product_attention(query_BQTD, key_BKSD, value_BKSD, attn_mask=attention_mask,
                                              dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out_BQTD.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if GQA_SDPA not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_gqa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


class GroupedQueryVerify:
    """For one model: inside ``with self():`` every config of the model whose attention implementation is ``sdpa``
    reads :data:`GQA_SDPA` instead (restored on exit, also after an exception). :attr:`applies` is False, and the
    context changes nothing, where it would not help: a model off the CPU, one without grouped-query heads
    (``num_key_value_heads`` equal to ``num_attention_heads``, or unset), one whose attention is not ``sdpa``.
    Use it around cache-continuing forwards of 2 or more tokens (a verify); one-token steps already skip the
    repeat."""

    def __init__(self, model: torch.nn.Module) -> None:
        def grouped_sdpa(c: Any) -> bool:
            kv_heads = getattr(c, "num_key_value_heads", None)
            return c._attn_implementation == "sdpa" and kv_heads not in (None, getattr(c, "num_attention_heads", None))

        on_cpu = next(model.parameters()).device.type == "cpu"
        self.configs = [c for c in attention_configs(model) if grouped_sdpa(c)] if on_cpu else []
        self.applies = bool(self.configs)
        if self.applies:
            _register()

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        return swapped_attention(self.configs, [GQA_SDPA] * len(self.configs))
