"""Pure verify math for speculative decoding: greedy acceptance and rejection sampling.

Legend: N number of draft tokens in the proposal, V vocab. Row ``i`` of a ``[N+1, V]`` target tensor
is the target's prediction for the position of draft token ``d_{i+1}`` (row 0 comes from the anchor,
row N is the bonus position after the last draft token).

Rules (DESIGN.md s.6; Leviathan et al. 2023 "Fast Inference from Transformers via Speculative
Decoding", Alg. 1; Chen et al. 2023 "Accelerating LLM Decoding with Speculative Sampling"):

- Greedy (temperature 0): accept ``d_i`` while it equals the target argmax; then commit the target
  argmax at the first mismatch (or the bonus argmax after the last draft).
- Temperature > 0: accept ``d_i`` with probability ``min(1, p(d_i) / q(d_i))`` using independent
  uniforms ``u_i``; the test is ``u_i * q(d_i) < p(d_i)`` (no division: ``q = 0, p > 0`` accepts,
  ``p = 0`` rejects, never NaN). The number accepted is the length of the all-accepted prefix. On
  the first rejection the replacement is sampled from ``normalise(max(0, p - q))``, falling back to
  ``p`` when that mass is 0. If all are accepted, a bonus token is sampled from the last target
  distribution.
- EOS: an accepted EOS inside the proposal ends the step there: the committed tokens stop at the
  EOS and no bonus / residual token is drawn. ``num_accepted`` then counts the accepted drafts up to
  and including the EOS.

All probabilities are fp32. Functions take tensors and return tensors or a small dataclass; no
state, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    """Outcome of one verify step.

    Attributes:
        num_accepted: accepted draft tokens (0..N); with an accepted EOS, the drafts up to and
            including it.
        committed: the tokens to append to the output, in order: the accepted drafts followed by the
            bonus / residual token (``num_accepted + 1`` tokens), or the accepted drafts up to an
            accepted EOS (``num_accepted`` tokens, no extra token).
        hit_eos: True when the last committed token is an EOS (accepted or sampled).
    """

    num_accepted: int
    committed: list[int]
    hit_eos: bool


def target_probs(logits_NV: Tensor, temperature: float) -> Tensor:
    """``softmax(logits / T)`` in fp32. ``[..., V]`` any float dtype -> fp32 ``[..., V]``.

    Raises ValueError for ``temperature <= 0`` (T = 0 is the greedy path, which uses argmax).
    """
    if not temperature > 0:
        raise ValueError(
            f"temperature: expected > 0 for sampling probabilities, received {temperature}; "
            "use the greedy path (argmax) for temperature 0."
        )
    return torch.softmax(logits_NV.float() / temperature, dim=-1)


def accepted_prefix_len(accept_N: Tensor) -> int:
    """Length of the all-True prefix of a bool ``[N]`` tensor (``[F,T,F,F] -> 0``, ``[T,T,F,T] -> 2``)."""
    if accept_N.numel() == 0:
        return 0
    return int(torch.cumprod(accept_N.to(torch.long), dim=0).sum().item())


def accept_mask(p_draft_N: Tensor, q_draft_N: Tensor, u_N: Tensor) -> Tensor:
    """Bool ``[N]``: draft ``i`` passes its own test, ``u_i * q(d_i) < p(d_i)`` (``u_i`` uniform in [0, 1)).

    Equivalent to ``u_i < min(1, p/q)`` without a division: ``q = 0, p > 0`` accepts, ``p = 0``
    rejects, ``p >= q`` always accepts. The step's accepted count is the all-True prefix of this.
    """
    return u_N * q_draft_N < p_draft_N


def residual_distribution(p_V: Tensor, q_V: Tensor) -> Tensor:
    """``normalise(max(0, p - q))`` in fp32; ``p`` itself when that mass is 0 (e.g. ``p == q``).

    The fallback keeps sampling well defined: a rejection implies ``p(d) < q(d)`` for the draft
    token, hence positive residual mass in exact arithmetic, but fp32 rounding can still zero it.
    """
    p_V = p_V.float()
    diff_V = torch.clamp_min(p_V - q_V.float(), 0.0)
    mass = diff_V.sum()
    if not bool(mass > 0):
        return p_V / p_V.sum()
    return diff_V / mass


def _sample(probs_V: Tensor, generator: torch.Generator | None) -> int:
    """One draw from an fp32 ``[V]`` distribution, on the generator's device."""
    device = generator.device if generator is not None else probs_V.device
    return int(torch.multinomial(probs_V.to(device), 1, generator=generator).item())


def _finish(drafts: list[int], num_accepted: int, extra_token: int, eos_ids: Collection[int]) -> VerifyResult:
    """Apply the EOS rule to ``drafts[:num_accepted] + [extra_token]``."""
    for i in range(num_accepted):
        if drafts[i] in eos_ids:
            return VerifyResult(num_accepted=i + 1, committed=drafts[: i + 1], hit_eos=True)
    committed = drafts[:num_accepted] + [extra_token]
    return VerifyResult(num_accepted=num_accepted, committed=committed, hit_eos=extra_token in eos_ids)


def verify_greedy(draft_ids_N: Tensor, target_logits_N1V: Tensor, *, eos_token_ids: Collection[int]) -> VerifyResult:
    """Greedy verify. ``draft_ids_N`` int ``[N]``; ``target_logits_N1V`` ``[N+1, V]`` (any float dtype)."""
    _check_shapes(draft_ids_N, target_logits_N1V)
    n = draft_ids_N.shape[0]
    target_ids_N1 = target_logits_N1V.argmax(dim=-1).to(draft_ids_N.device)
    num_accepted = accepted_prefix_len(draft_ids_N == target_ids_N1[:n])
    return _finish(draft_ids_N.tolist(), num_accepted, int(target_ids_N1[num_accepted]), eos_token_ids)


def verify_sampling(
    draft_ids_N: Tensor,
    draft_probs_NV: Tensor,
    target_probs_N1V: Tensor,
    *,
    generator: torch.Generator | None,
    eos_token_ids: Collection[int],
) -> VerifyResult:
    """Rejection-sampling verify (T > 0).

    Args:
        draft_ids_N: int ``[N]`` draft tokens.
        draft_probs_NV: fp32 ``[N, V]``: ``q_i``, the distribution each draft token was sampled from.
        target_probs_N1V: fp32 ``[N+1, V]``: ``p_i`` (already divided by T and softmaxed).
        generator: drives the uniforms and the residual / bonus draws.
    """
    _check_shapes(draft_ids_N, target_probs_N1V)
    n = draft_ids_N.shape[0]
    if draft_probs_NV is None or tuple(draft_probs_NV.shape) != (n, target_probs_N1V.shape[1]):
        raise ValueError(
            f"draft_probs_NV: expected shape ({n}, {target_probs_N1V.shape[1]}) for sampling verify, received "
            f"{None if draft_probs_NV is None else tuple(draft_probs_NV.shape)}; a proposer must return the "
            "probabilities its tokens were sampled from when temperature > 0."
        )
    p_N1V = target_probs_N1V.float()
    q_NV = draft_probs_NV.float().to(p_N1V.device)
    ids_N = draft_ids_N.to(p_N1V.device)
    rows_N = torch.arange(n, device=p_N1V.device)
    p_draft_N = p_N1V[rows_N, ids_N]
    q_draft_N = q_NV[rows_N, ids_N]
    gen_device = generator.device if generator is not None else p_N1V.device
    u_N = torch.rand(n, generator=generator, device=gen_device).to(p_N1V.device)
    num_accepted = accepted_prefix_len(accept_mask(p_draft_N, q_draft_N, u_N))
    if num_accepted < n:
        extra = _sample(residual_distribution(p_N1V[num_accepted], q_NV[num_accepted]), generator)
    else:
        extra = _sample(p_N1V[n], generator)
    return _finish(draft_ids_N.tolist(), num_accepted, extra, eos_token_ids)


def verify(
    draft_ids_N: Tensor,
    draft_probs_NV: Tensor | None,
    target_logits_N1V: Tensor,
    *,
    temperature: float,
    generator: torch.Generator | None,
    eos_token_ids: Collection[int],
) -> VerifyResult:
    """Dispatch: ``temperature == 0`` -> :func:`verify_greedy`, else :func:`verify_sampling` on
    ``softmax(target_logits / T)`` in fp32. ``N = 0`` is a plain target step (commit one token)."""
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0, received {temperature}; use 0 for greedy.")
    if temperature == 0:
        return verify_greedy(draft_ids_N, target_logits_N1V, eos_token_ids=eos_token_ids)
    if draft_probs_NV is None and draft_ids_N.shape[0] == 0:
        draft_probs_NV = target_logits_N1V.new_zeros((0, target_logits_N1V.shape[-1]), dtype=torch.float32)
    return verify_sampling(
        draft_ids_N,
        draft_probs_NV,
        target_probs(target_logits_N1V, temperature),
        generator=generator,
        eos_token_ids=eos_token_ids,
    )


def _check_shapes(draft_ids_N: Tensor, target_N1V: Tensor) -> None:
    if draft_ids_N.dim() != 1 or target_N1V.dim() != 2 or target_N1V.shape[0] != draft_ids_N.shape[0] + 1:
        raise ValueError(
            f"verify: expected draft_ids [N] and target rows [N+1, V], received {tuple(draft_ids_N.shape)} and "
            f"{tuple(target_N1V.shape)}; the target forward runs over [anchor, d_1..d_N] (N+1 positions)."
        )
