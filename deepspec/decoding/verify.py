"""Pure verify math for speculative decoding: sampling filters, greedy acceptance, rejection sampling.

Legend: N number of draft tokens in a proposal, V vocab. Row ``i`` of a ``[N+1, V]`` target tensor is the target's prediction for the
position of draft token ``d_{i+1}`` (row 0 comes from the anchor, row N is the bonus position after
the last draft token).

Rules (docs/design/decoding.md, "Sampling and verify"; Leviathan et al. 2023 "Fast Inference from Transformers via Speculative
Decoding", Alg. 1 and Appendix A.1; Chen et al. 2023 "Accelerating Large Language Model Decoding
with Speculative Sampling", Alg. 2):

- Sampling distribution (:func:`~deepspec.target.decoding.sampling_probs`): ``softmax(logits / T)``
  in fp32, then top-k, then top-p, renormalised. The draft's ``q`` and the target's ``p`` go through
  the same filters, so speculative output follows exactly the distribution the target-only baseline
  samples from.
- Greedy (temperature 0): accept ``d_i`` while it equals the target argmax; then commit the target
  argmax at the first mismatch (or the bonus argmax after the last draft). Top-k / top-p do not
  change the argmax and are ignored.
- Temperature > 0: accept ``d_i`` with probability ``min(1, p(d_i) / q(d_i))`` using independent
  uniforms ``u_i``; the test is ``u_i * q(d_i) < p(d_i)`` (no division: ``q = 0, p > 0`` accepts,
  ``p = 0`` rejects, never NaN). The number accepted is the length of the all-accepted prefix. On
  the first rejection the replacement is sampled from ``normalise(max(0, p - q))``, falling back to
  ``p`` when that mass is 0. If all are accepted, a bonus token is sampled from the last target
  distribution.
- A draft tree (:func:`verify_tree`): walk from the anchor to an accepted child while there is one
  (greedy: the child holding the target's argmax; T > 0: SpecInfer's multi-step speculative sampling,
  the rule above applied to a node's children in turn on the residual); one more token is committed
  where the walk stops.
- EOS: an accepted EOS inside the proposal ends the step there: the committed tokens stop at the
  EOS and no bonus / residual token is drawn. ``num_accepted`` then counts the accepted drafts up to
  and including the EOS.

Generator use (what makes results reproducible): a
T > 0 step draws ``torch.rand(N)`` (the uniforms) and then exactly one ``torch.multinomial`` draw
(residual or bonus), both from the step's generator; a T > 0 tree step draws one uniform per child
it tests and one ``torch.multinomial`` where it stops; a greedy step draws nothing.

All probabilities are fp32. Functions take tensors and return tensors or a small dataclass; no
state, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# the one sampling rule and the distribution it samples from (both re-exported here)
from deepspec.target.decoding import SamplingParams, greedy_tokens, sampling_probs

GREEDY = SamplingParams()  # temperature 0: the argmax path


# ----------------------------------------------------------------------------- acceptance rules
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


def accepted_prefix_len(accept_N: Tensor) -> int:
    """Length of the all-True prefix of a bool ``[N]`` tensor (``[F,T,F,F] -> 0``, ``[T,T,F,T] -> 2``)."""
    if accept_N.numel() == 0:
        return 0
    return int(accepted_prefix_lens(accept_N).item())


def accepted_prefix_lens(accept_XN: Tensor) -> Tensor:
    """int64 ``[...]``: the all-True prefix length of each row of a bool ``[..., N]`` tensor."""
    return torch.cumprod(accept_XN.to(torch.long), dim=-1).sum(dim=-1)


def accept_mask(p_draft_N: Tensor, q_draft_N: Tensor, u_N: Tensor) -> Tensor:
    """Bool, same shape as the inputs: draft ``i`` passes its own test ``u_i * q(d_i) < p(d_i)``
    (``u_i`` uniform in [0, 1)); any shape, elementwise.

    Equivalent to ``u_i < min(1, p/q)`` without a division: ``q = 0, p > 0`` accepts, ``p = 0``
    rejects, ``p >= q`` always accepts. The step's accepted count is the all-True prefix of this
    (Leviathan et al. 2023, Alg. 1).
    """
    return u_N * q_draft_N < p_draft_N


def residual_distribution(p_V: Tensor, q_V: Tensor) -> Tensor:
    """``normalise(max(0, p - q))`` in fp32 ``[V]``; ``p`` itself when that mass is 0 (e.g. ``p == q``).

    The fallback keeps sampling well defined: a rejection implies ``p(d) < q(d)`` for the draft
    token, hence positive residual mass in exact arithmetic, but fp32 rounding can still zero it.
    (Leviathan et al. 2023, Alg. 1 and Theorem 3.5; Chen et al. 2023, Alg. 2.)
    """
    p_V = p_V.float()
    diff_V = torch.clamp_min(p_V - q_V.float(), 0.0)
    mass = diff_V.sum()
    if not bool(mass > 0):
        return p_V / p_V.sum()
    return diff_V / mass


def _uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """``n`` uniforms in [0, 1) drawn on the generator's device, returned on ``device``."""
    gen_device = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, device=gen_device).to(device)


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


def _extra_token(p_N1V: Tensor, q_NV: Tensor, num_accepted: int, generator: torch.Generator | None) -> int:
    """The token after the accepted prefix at T > 0: residual at a rejection, bonus after all N."""
    n = q_NV.shape[0]
    if num_accepted < n:
        return _sample(residual_distribution(p_N1V[num_accepted], q_NV[num_accepted]), generator)
    return _sample(p_N1V[n], generator)


# ----------------------------------------------------------------------------- one step
def verify_greedy(draft_ids_N: Tensor, target_logits_N1V: Tensor, *, eos_token_ids: Collection[int]) -> VerifyResult:
    """Greedy verify. ``draft_ids_N`` int ``[N]``; ``target_logits_N1V`` ``[N+1, V]`` (any float dtype).

    Raises ValueError on mismatched shapes."""
    _check_shapes(draft_ids_N, target_logits_N1V)
    n = draft_ids_N.shape[0]
    target_ids_N1 = greedy_tokens(target_logits_N1V).to(draft_ids_N.device)
    num_accepted = accepted_prefix_len(draft_ids_N == target_ids_N1[:n])
    return _finish(draft_ids_N.tolist(), num_accepted, int(target_ids_N1[num_accepted]), eos_token_ids)


def verify_tree(draft_ids_N: Tensor, parents_N: Sequence[int], target_logits_N1V: Tensor, *,
                draft_probs_NV: Tensor | None = None, sampling: SamplingParams = GREEDY,
                generator: torch.Generator | None = None,
                eos_token_ids: Collection[int]) -> tuple[VerifyResult, list[int]]:
    """Verify a draft tree (:attr:`~deepspec.algorithms.protocol.Proposal.parents_N`) by walking it.

    Row 0 of ``target_logits_N1V`` ``[N+1, V]`` is the anchor's prediction, row ``i + 1`` node ``i``'s
    (the target forward ran over ``[anchor, d_1..d_N]`` with a tree mask: every node sees the context,
    the anchor and its own ancestors only). The walk starts at the anchor, moves to an accepted child
    while there is one, and commits one more token where it stops; the EOS rule is
    :func:`verify_greedy`'s. Siblings have distinct tokens (:class:`~deepspec.algorithms.protocol.DraftTree`).

    - Greedy (``sampling`` temperature 0, the default): the accepted child is the one holding the
      target's argmax, so the walk accepts the longest path the target agrees with (SpecInfer, Miao
      et al. 2024, s.4), then commits the argmax. On a chain it equals :func:`verify_greedy`.
    - Temperature > 0: SpecInfer's multi-step speculative sampling (s.4.2). At a node, with ``p`` the
      target's ``sampling_probs`` of its row, the children are tested in order: child ``c``, drawn
      from ``q_c`` (row ``c`` of ``draft_probs_NV``; ``None``: every node a point mass on its token,
      i.e. chosen, not sampled), is accepted when ``u * q_c(c) < p(c)`` (one uniform each), else ``p``
      becomes ``normalise(max(0, p - q_c))`` and the next child is tested; when none is accepted, one
      token is drawn from the last ``p``. This is rejection sampling repeated on the residual, so
      every committed token follows the target's distribution given the tokens before it (lossless)
      provided each sampled child was drawn from its ``q_c`` after its elder siblings were fixed.
      A chosen child is accepted with probability ``p(c)`` of the residual it meets; on a chain of
      sampled nodes this is :func:`verify_sampling`'s rule.

    Args:
        draft_ids_N: int ``[N]`` node tokens; parents_N: ``N`` parents (-1: the anchor; parents first).
        target_logits_N1V: ``[N+1, V]`` (any float dtype).
        draft_probs_NV: fp32 ``[N, V]`` or None (T > 0 only; read per tested child).
        sampling, generator: as :func:`verify`; at T > 0 one uniform per child tested and one
            ``torch.multinomial`` where the walk stops.

    Returns ``(result, path)``: ``path`` the accepted nodes in order (``len(path) == num_accepted``).
    Raises ValueError on mismatched shapes or a ``sampling`` that is not a SamplingParams.
    """
    _check_shapes(draft_ids_N, target_logits_N1V)
    n = draft_ids_N.shape[0]
    if len(parents_N) != n:
        raise ValueError(f"verify_tree: expected one parent per draft token ({n}), received {len(parents_N)}.")
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling: expected a SamplingParams, received {type(sampling).__name__}.")
    tokens = draft_ids_N.tolist()
    path: list[int] = []
    node = -1  # the anchor
    if sampling.greedy:
        target_ids = greedy_tokens(target_logits_N1V).tolist()
        by_token = {(int(p), t): i for i, (p, t) in enumerate(zip(parents_N, tokens))}
        while (child := by_token.get((node, target_ids[node + 1]))) is not None:
            path.append(child)
            node = child
            if tokens[child] in eos_token_ids:
                break
        extra = target_ids[node + 1]
    else:
        if draft_probs_NV is not None:
            _check_draft_probs(draft_probs_NV, n, target_logits_N1V.shape[1])
        children: dict[int, list[int]] = {}  # each node's children, in the order they are tested
        for i, p in enumerate(parents_N):
            children.setdefault(int(p), []).append(i)
        while True:
            p_V = sampling_probs(target_logits_N1V[node + 1], sampling)
            accepted = None
            for child in children.get(node, ()):
                t = tokens[child]
                q_V = (draft_probs_NV[child].to(p_V.device).float() if draft_probs_NV is not None
                       else torch.zeros_like(p_V).index_fill_(0, torch.tensor([t], device=p_V.device), 1.0))
                u = _uniforms(1, generator, p_V.device)
                if bool(accept_mask(p_V[t:t + 1], q_V[t:t + 1], u)[0]):
                    accepted = child
                    break
                p_V = residual_distribution(p_V, q_V)
            if accepted is None:
                extra = _sample(p_V, generator)
                break
            path.append(accepted)
            node = accepted
            if tokens[accepted] in eos_token_ids:
                extra = tokens[accepted]  # unused: the EOS rule stops at the accepted EOS
                break
    accepted_tokens = [tokens[i] for i in path]
    return _finish(accepted_tokens, len(path), extra, eos_token_ids), path


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
        target_probs_N1V: fp32 ``[N+1, V]``: ``p_i`` (already filtered: :func:`sampling_probs`).
        generator: draws ``torch.rand(N)`` (the uniforms), then one residual / bonus token.

    Raises ValueError on mismatched shapes or a missing ``draft_probs_NV``.
    """
    _check_shapes(draft_ids_N, target_probs_N1V)
    n = draft_ids_N.shape[0]
    _check_draft_probs(draft_probs_NV, n, target_probs_N1V.shape[1])
    p_N1V = target_probs_N1V.float()
    q_NV = draft_probs_NV.float().to(p_N1V.device)
    ids_N1 = draft_ids_N.to(p_N1V.device)[:, None]
    p_draft_N = p_N1V[:n].gather(1, ids_N1)[:, 0]
    q_draft_N = q_NV.gather(1, ids_N1)[:, 0]
    u_N = _uniforms(n, generator, p_N1V.device)
    num_accepted = accepted_prefix_len(accept_mask(p_draft_N, q_draft_N, u_N))
    extra = _extra_token(p_N1V, q_NV, num_accepted, generator)
    return _finish(draft_ids_N.tolist(), num_accepted, extra, eos_token_ids)


def verify(
    draft_ids_N: Tensor,
    draft_probs_NV: Tensor | None,
    target_logits_N1V: Tensor,
    *,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    eos_token_ids: Collection[int],
) -> VerifyResult:
    """One verify step.

    Args:
        draft_ids_N: int ``[N]`` draft tokens ``d_1..d_N`` (``N = 0``: a plain target step, one token).
        draft_probs_NV: fp32 ``[N, V]``, the draft's ``q`` (:func:`sampling_probs` of the draft
            logits with the same ``sampling``); required at T > 0 when ``N > 0``, ignored when greedy.
        target_logits_N1V: ``[N+1, V]`` (any float dtype), the target forward over ``[anchor, d_1..d_N]``.
        sampling: greedy -> :func:`verify_greedy`; else :func:`verify_sampling` with
            ``p = sampling_probs(target_logits_N1V, sampling)``.
        generator: drives the T > 0 draws (see the module docstring); unused when greedy.
        eos_token_ids: tokens that end generation (the EOS rule).

    Raises ValueError on mismatched shapes or a missing ``draft_probs_NV`` at T > 0.
    """
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling: expected a SamplingParams, received {type(sampling).__name__}.")
    if sampling.greedy:
        return verify_greedy(draft_ids_N, target_logits_N1V, eos_token_ids=eos_token_ids)
    if draft_probs_NV is None and draft_ids_N.shape[0] == 0:
        draft_probs_NV = target_logits_N1V.new_zeros((0, target_logits_N1V.shape[-1]), dtype=torch.float32)
    return verify_sampling(
        draft_ids_N,
        draft_probs_NV,
        sampling_probs(target_logits_N1V, sampling),
        generator=generator,
        eos_token_ids=eos_token_ids,
    )


# ----------------------------------------------------------------------------- checks
def _check_shapes(draft_ids_N: Tensor, target_N1V: Tensor) -> None:
    if draft_ids_N.dim() != 1 or target_N1V.dim() != 2 or target_N1V.shape[0] != draft_ids_N.shape[0] + 1:
        raise ValueError(
            f"verify: expected draft_ids [N] and target rows [N+1, V], received {tuple(draft_ids_N.shape)} and "
            f"{tuple(target_N1V.shape)}; the target forward runs over [anchor, d_1..d_N] (N+1 positions)."
        )


def _check_draft_probs(draft_probs_NV: Tensor | None, n: int, v: int) -> None:
    if draft_probs_NV is None or tuple(draft_probs_NV.shape) != (n, v):
        raise ValueError(
            f"draft_probs_NV: expected shape ({n}, {v}) for sampling verify, received "
            f"{None if draft_probs_NV is None else tuple(draft_probs_NV.shape)}; a proposer must return the "
            "probabilities its tokens were sampled from when temperature > 0."
        )
