"""Training-time acceptance estimates, pooled over the whole global batch.

Legend: X chains (a DSpark/DFlash block, or an Eagle3 chain start row), K slots per chain.

A chain's slot ``k`` *survives* when every slot ``0..k`` is accepted. Greedy (T = 0) acceptance of
a teacher-forced slot is ``argmax(draft) == argmax(target)``; at T = 1 a slot is accepted with
probability ``1 - TV(draft, target) = 1 - L1/2`` (Leviathan et al. 2023, Thm 3.5), so a chain's
expected survival at ``k`` is the product of those probabilities up to ``k``.

The estimate of the acceptance length is the one evaluation computes (docs/design/evaluation.md, "Metrics": mean over verify
steps of the tokens a step commits: accepted drafts + 1, or the accepted drafts alone when the step ends at an
accepted EOS, which no bonus token follows), with every chain as one verify step:

    tau = 1 + sum_k  (survive_k - ended_k) / count_k

where ``survive_k`` sums the survival of the chains supervised at slot ``k``, ``count_k`` counts
them and ``ended_k`` sums the survival of those whose label at slot ``k`` is an end-of-sequence token
(an accepted EOS ends the step: the chain's own + 1 is not committed; the slots after an EOS label are
never verified, so they are not counted). Both are plain sums, so they add up over micro-batches and ranks;
the ratio is taken once, at the end of a step. (Multiplying per-slot *rates* within each micro-batch and averaging the
products over micro-batches gives a value that depends on how the chains are grouped: chains with
leading-accepted runs 3, 2, 1, 0 give 2.25 grouped as (3, 1), (2, 0) and 2.5 grouped as (3, 2),
(1, 0); pooled counts give 2.5 for any grouping.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AcceptanceCounts:
    """Additive acceptance counts of some chains: float64 ``[K]`` tensors on the device they were
    counted on (adding and packing them reads nothing on the host; :meth:`tau` / :meth:`greedy_tau` do).

    ``count_K``: chains supervised at slot k. ``greedy_survive_K``: those whose slots 0..k all match
    the target's argmax. ``survive_K``: their expected T = 1 survival (sum of products of
    ``1 - L1/2``); all zeros when the loss has no target distribution. ``greedy_ended_K`` / ``ended_K``: the
    same sums over the chains whose label at slot k is an end-of-sequence token (their step ends there, with
    no bonus token); zeros when not given.
    """

    NUM_ROWS = 5  # rows of pack()

    count_K: Tensor
    greedy_survive_K: Tensor
    survive_K: Tensor
    greedy_ended_K: Tensor | None = None
    ended_K: Tensor | None = None

    def __post_init__(self) -> None:
        if self.greedy_ended_K is None:
            self.greedy_ended_K = torch.zeros_like(self.count_K)
        if self.ended_K is None:
            self.ended_K = torch.zeros_like(self.count_K)

    @staticmethod
    def zeros(num_slots: int, device: torch.device | str | None = None) -> "AcceptanceCounts":
        z = torch.zeros(num_slots, dtype=torch.float64, device=device)
        return AcceptanceCounts(*(z.clone() for _ in range(AcceptanceCounts.NUM_ROWS)))

    def __add__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        if self.count_K.shape != other.count_K.shape:
            raise ValueError(f"AcceptanceCounts: cannot add {self.count_K.shape[0]} slots to {other.count_K.shape[0]}.")
        return AcceptanceCounts.unpack_on(self.pack() + other.pack())

    def pack(self) -> Tensor:
        """``[NUM_ROWS, K]`` float64 (count, greedy survive, survive, greedy ended, ended): one tensor to
        all-reduce."""
        return torch.stack([self.count_K, self.greedy_survive_K, self.survive_K, self.greedy_ended_K, self.ended_K])

    @staticmethod
    def unpack_on(packed: Tensor) -> "AcceptanceCounts":
        """Inverse of :meth:`pack`, on ``packed``'s device."""
        return AcceptanceCounts(*(row.clone() for row in packed.to(torch.float64).unbind(0)))

    @staticmethod
    def unpack(packed: Tensor) -> "AcceptanceCounts":
        """Inverse of :meth:`pack`, on the CPU (``[NUM_ROWS, K]``)."""
        return AcceptanceCounts.unpack_on(packed.detach().to("cpu", torch.float64))

    def greedy_tau(self) -> float:
        """Pooled greedy acceptance-length estimate (module docstring)."""
        return tau_from_counts(self.greedy_survive_K, self.count_K, self.greedy_ended_K)

    def tau(self) -> float:
        """Pooled T = 1 acceptance-length estimate (module docstring)."""
        return tau_from_counts(self.survive_K, self.count_K, self.ended_K)


def tau_from_counts(survive_K: Tensor, count_K: Tensor, ended_K: Tensor | None = None) -> float:
    """``1 + sum_k (survive_k - ended_k) / count_k`` (``ended_K`` None: zeros), stopping at the first slot no
    chain reaches (never NaN)."""
    ended = [0.0] * len(count_K) if ended_K is None else ended_K.tolist()
    tau = 1.0
    for s, n, e in zip(survive_K.tolist(), count_K.tolist(), ended):
        if n <= 0:
            break
        tau += (s - e) / n
    return tau


def chain_acceptance(valid_XK: Tensor, greedy_match_XK: Tensor, accept_prob_XK: Tensor | None,
                     eos_XK: Tensor | None = None) -> AcceptanceCounts:
    """Pure: the :class:`AcceptanceCounts` of ``X`` chains.

    Args:
        valid_XK: bool, slot k of chain x is supervised. Supervision is prefix-closed along k (a
            slot after an unsupervised one is not counted even if marked valid).
        greedy_match_XK: bool, the draft's argmax equals the target's at that slot (teacher-forced).
        accept_prob_XK: float in [0, 1], ``1 - L1/2`` per slot, or None (then ``survive_K`` is 0).
        eos_XK: bool, the label at slot k is an end-of-sequence token (None: none is). A chain that survives
            to such a slot ends its step there with no bonus token (``ended_K``), and its later slots are
            not counted (the engine never verifies past an accepted EOS).

    Returns counts summed over the chains (float64, on the inputs' device: no host read).
    """
    valid = torch.cumprod(valid_XK.bool().to(torch.int64), dim=-1).bool()
    eos = None
    if eos_XK is not None:
        eos = eos_XK.bool()
        valid = valid & ~((torch.cumsum(eos.to(torch.int64), dim=-1) - eos.to(torch.int64)) > 0)
        eos = eos & valid
    count_K = valid.sum(0).to(torch.float64)
    greedy = torch.cumprod((greedy_match_XK.bool() & valid).to(torch.int64), dim=-1)
    greedy_K = greedy.sum(0).to(torch.float64)
    if accept_prob_XK is None:
        surv_XK = None
        surv_K = torch.zeros_like(count_K)
    else:
        p = torch.where(valid, accept_prob_XK.detach().to(torch.float64), torch.zeros((), dtype=torch.float64,
                                                                                      device=valid.device))
        surv_XK = torch.cumprod(p, dim=-1)
        surv_K = surv_XK.sum(0)
    if eos is None:
        return AcceptanceCounts(count_K, greedy_K, surv_K)
    greedy_ended_K = (greedy.bool() & eos).sum(0).to(torch.float64)
    ended_K = torch.zeros_like(count_K) if surv_XK is None else (surv_XK * eos).sum(0)
    return AcceptanceCounts(count_K, greedy_K, surv_K, greedy_ended_K, ended_K)


def is_eos(token_ids: Tensor, eos_token_ids: list[int] | tuple[int, ...]) -> Tensor:
    """bool, same shape as ``token_ids`` (any integer dtype): the token is one of ``eos_token_ids`` (the draft
    config's, the ids that end a generation); all False when there are none."""
    if not eos_token_ids:
        return torch.zeros(token_ids.shape, dtype=torch.bool, device=token_ids.device)
    return torch.isin(token_ids, torch.tensor(list(eos_token_ids), dtype=token_ids.dtype, device=token_ids.device))
