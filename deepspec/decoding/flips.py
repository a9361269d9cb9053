"""Argmax flips: how often a verify-sized target forward and a one-token forward disagree on the argmax.

Legend: P prompt length, T output positions, C chunk length (K + 1 tokens, a verify forward's size),
V vocab.

Why (docs/design/decoding.md, "Lossless, and argmax flips in bfloat16"): greedy speculative decoding is
token-identical to greedy target-only decoding only when the target's argmax at a position does not
depend on how many tokens the forward that computes it holds. In exact arithmetic it does not. In
floating point a forward over ``[anchor, d_1..d_N]`` multiplies matrices of another shape than a
one-token forward, the kernels reduce in another order, and the logits differ in their last bits;
where the top two logits are (near-)tied the argmax can flip. In float32 the differences are ~1e-6
of a logit and flips are rare to absent; in bfloat16 (8 mantissa bits; a logit of 20 is rounded to a
multiple of 0.125) near-ties are common and so are flips. A flip is not a bug in the speculative
step: the target itself gives two answers depending on the shape of the forward, and speculative
decoding picks one of them.

Measurement (:func:`chunked_argmax`): re-run the target over a target-only greedy output the way
verify steps see it: the prompt's prefill (the same call as the engine's), then the output tokens
in chunks of C through the same :func:`~deepspec.target.capture.target_forward` with a KV cache.
The argmax of the row that predicts output token ``i`` is compared with token ``i`` itself, which
the target-only run decoded from a one-token forward. Token 0 comes from the prefill in both runs
and is not counted; positions 1..T-1 are. Only greedy outputs are measured: at T > 0 a token is a
sample, not an argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepspec.target.capture import target_forward, target_logits


@dataclass(frozen=True, kw_only=True)
class ChunkPass:
    """Per output position ``i`` (0..T-1), from the forward row that predicts output token ``i``:
    the argmax id, the runner-up id and ``margin`` = top-1 minus top-2 logit (float, logit units,
    computed in float32 from the target's logits)."""

    argmax: list[int]
    second: list[int]
    margin: list[float]


@torch.inference_mode()
def chunked_argmax(target_model: Any, prompt_ids: Sequence[int], output_ids: Sequence[int], *, chunk_len: int,
                   forward_fn: Callable[..., Any] = target_forward) -> ChunkPass:
    """Re-run the target over ``prompt_ids + output_ids[:-1]`` in verify-sized chunks (see the module docstring).

    Args:
        target_model: the Hugging Face causal LM the output was decoded with (same dtype, device).
        prompt_ids: the prompt (P >= 1 ids).
        output_ids: the target-only output (T >= 1 ids).
        chunk_len: C, tokens per forward after the prefill (the verify size K + 1), >= 1.
        forward_fn: the target forward (the engine's, :func:`~deepspec.target.capture.target_forward`).

    Returns a :class:`ChunkPass` of T entries. Raises ValueError for an empty prompt or output or
    ``chunk_len < 1``.
    """
    from transformers import DynamicCache

    if not prompt_ids or not output_ids:
        raise ValueError("chunked_argmax: expected a non-empty prompt and output, received "
                         f"{len(prompt_ids)} prompt and {len(output_ids)} output ids.")
    if chunk_len < 1:
        raise ValueError(f"chunked_argmax.chunk_len: expected >= 1 (the verify size K + 1), received {chunk_len}.")
    device = next(target_model.parameters()).device

    def forward(ids: Sequence[int], start: int, cache: Any, *, compute_logits: bool) -> Any:
        ids_BT = torch.tensor([list(ids)], dtype=torch.long, device=device)
        pos_BT = torch.arange(start, start + len(ids), device=device).unsqueeze(0)
        return forward_fn(target_model, ids_BT, [], position_ids_BT=pos_BT, past_key_values=cache, use_cache=True,
                          compute_logits=compute_logits)

    # The prefill exactly as the engine runs it: logits of the last prompt position only.
    out = forward(prompt_ids, 0, DynamicCache(), compute_logits=False)
    rows = [target_logits(target_model, out.target_last_hidden_BTH[0, -1:])]
    cache, pos = out.past_key_values, len(prompt_ids)
    fed = list(output_ids[:-1])
    for start in range(0, len(fed), chunk_len):
        chunk = fed[start:start + chunk_len]
        out = forward(chunk, pos, cache, compute_logits=True)
        cache, pos = out.past_key_values, pos + len(chunk)
        rows.append(out.logits_BTV[0])
    logits_TV = torch.cat(rows).float()
    argmax_T = logits_TV.argmax(-1)  # decoding's rule (the first of tied maxima); topk may order ties otherwise
    top_T2 = logits_TV.topk(2, dim=-1)
    second_T = torch.where(top_T2.indices[:, 0] == argmax_T, top_T2.indices[:, 1], top_T2.indices[:, 0])
    return ChunkPass(argmax=argmax_T.tolist(), second=second_T.tolist(),
                     margin=(top_T2.values[:, 0] - top_T2.values[:, 1]).tolist())


def argmax_flip_positions(chunk_argmax_T: Sequence[int], decoded_ids_T: Sequence[int]) -> list[int]:
    """Positions ``i >= 1`` where the chunked forward's argmax differs from the one-token decode's token.

    Pure. Position 0 (the prefill's token in both runs) is never counted. Raises ValueError when the
    two sequences differ in length.
    """
    if len(chunk_argmax_T) != len(decoded_ids_T):
        raise ValueError(f"argmax_flip_positions: expected sequences of one length, received "
                         f"{len(chunk_argmax_T)} and {len(decoded_ids_T)}.")
    return [i for i in range(1, len(decoded_ids_T)) if int(chunk_argmax_T[i]) != int(decoded_ids_T[i])]


def first_divergence(output_ids: Sequence[int], baseline_ids: Sequence[int]) -> int | None:
    """The first position where two outputs differ (a position past the shorter one's end counts),
    or None when they are identical. Pure."""
    for i, (a, b) in enumerate(zip(output_ids, baseline_ids)):
        if a != b:
            return i
    return None if len(output_ids) == len(baseline_ids) else min(len(output_ids), len(baseline_ids))


def flip_rate(num_flips: int, num_positions: int) -> float | None:
    """Flips per 1000 compared positions (None without positions)."""
    return 1000.0 * num_flips / num_positions if num_positions else None


def divergence_record(position: int, output_ids: Sequence[int], baseline_ids: Sequence[int], chunk: ChunkPass,
                      flips: Sequence[int]) -> dict[str, Any]:
    """What a report says about one prompt whose output first differs from target-only at ``position``.

    ``baseline_margin``: the top-1 minus top-2 logit margin of the (chunked) target forward at that
    position (None past the baseline's end); ``at_argmax_flip``: the chunked pass flips there too;
    ``token_is_runner_up``: the speculative token is the target's second choice there.
    """
    inside = position < len(baseline_ids)
    token = output_ids[position] if position < len(output_ids) else None
    return {
        "position": position,
        "baseline_token": baseline_ids[position] if inside else None,
        "token": token,
        "baseline_margin": chunk.margin[position] if inside else None,
        "at_argmax_flip": position in set(flips),
        "token_is_runner_up": bool(inside and token is not None and chunk.second[position] == token),
    }
