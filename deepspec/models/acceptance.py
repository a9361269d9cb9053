"""Training-time acceptance estimates, pooled over the whole global batch.

Legend: X chains (a DSpark/DFlash block, or an Eagle3 chain start row), K slots per chain.

A chain's slot ``k`` *survives* when every slot ``0..k`` is accepted. Greedy (T = 0) acceptance of
a teacher-forced slot is ``argmax(draft) == argmax(target)``; at T = 1 a slot is accepted with
probability ``1 - TV(draft, target) = 1 - L1/2`` (Leviathan et al. 2023, Thm 3.5), so a chain's
expected survival at ``k`` is the product of those probabilities up to ``k``.

The estimate of the acceptance length is the one evaluation computes (docs/design/evaluation.md, "Metrics": mean over verify
steps of accepted drafts + 1), with every chain as one verify step:

    tau = 1 + sum_k  survive_k / count_k

where ``survive_k`` sums the survival of the chains supervised at slot ``k`` and ``count_k`` counts
them. Both are plain sums, so they add up over micro-batches and ranks; the ratio is taken once,
at the end of a step. (Multiplying per-slot *rates* within each micro-batch and averaging the
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
    ``1 - L1/2``); all zeros when the loss has no target distribution.
    """

    count_K: Tensor
    greedy_survive_K: Tensor
    survive_K: Tensor

    @staticmethod
    def zeros(num_slots: int, device: torch.device | str | None = None) -> "AcceptanceCounts":
        z = torch.zeros(num_slots, dtype=torch.float64, device=device)
        return AcceptanceCounts(z.clone(), z.clone(), z.clone())

    def __add__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        if self.count_K.shape != other.count_K.shape:
            raise ValueError(f"AcceptanceCounts: cannot add {self.count_K.shape[0]} slots to {other.count_K.shape[0]}.")
        return AcceptanceCounts(self.count_K + other.count_K, self.greedy_survive_K + other.greedy_survive_K,
                                self.survive_K + other.survive_K)

    def pack(self) -> Tensor:
        """``[3, K]`` float64 (count, greedy survive, survive): one tensor to all-reduce."""
        return torch.stack([self.count_K, self.greedy_survive_K, self.survive_K])

    @staticmethod
    def unpack(packed_3K: Tensor) -> "AcceptanceCounts":
        p = packed_3K.detach().to("cpu", torch.float64)
        return AcceptanceCounts(p[0].clone(), p[1].clone(), p[2].clone())

    def greedy_tau(self) -> float:
        """Pooled greedy acceptance-length estimate (module docstring)."""
        return tau_from_counts(self.greedy_survive_K, self.count_K)

    def tau(self) -> float:
        """Pooled T = 1 acceptance-length estimate (module docstring)."""
        return tau_from_counts(self.survive_K, self.count_K)


def tau_from_counts(survive_K: Tensor, count_K: Tensor) -> float:
    """``1 + sum_k survive_k / count_k``, stopping at the first slot no chain reaches (never NaN)."""
    tau = 1.0
    for s, n in zip(survive_K.tolist(), count_K.tolist()):
        if n <= 0:
            break
        tau += s / n
    return tau


def chain_acceptance(valid_XK: Tensor, greedy_match_XK: Tensor, accept_prob_XK: Tensor | None) -> AcceptanceCounts:
    """Pure: the :class:`AcceptanceCounts` of ``X`` chains.

    Args:
        valid_XK: bool, slot k of chain x is supervised. Supervision is prefix-closed along k (a
            slot after an unsupervised one is not counted even if marked valid).
        greedy_match_XK: bool, the draft's argmax equals the target's at that slot (teacher-forced).
        accept_prob_XK: float in [0, 1], ``1 - L1/2`` per slot, or None (then ``survive_K`` is 0).

    Returns counts summed over the chains (float64, on the inputs' device: no host read).
    """
    valid = torch.cumprod(valid_XK.bool().to(torch.int64), dim=-1).bool()
    count_K = valid.sum(0).to(torch.float64)
    greedy = torch.cumprod((greedy_match_XK.bool() & valid).to(torch.int64), dim=-1)
    greedy_K = greedy.sum(0).to(torch.float64)
    if accept_prob_XK is None:
        surv_K = torch.zeros_like(count_K)
    else:
        p = torch.where(valid, accept_prob_XK.detach().to(torch.float64), torch.zeros((), dtype=torch.float64,
                                                                                      device=valid.device))
        surv_K = torch.cumprod(p, dim=-1).sum(0)
    return AcceptanceCounts(count_K, greedy_K, surv_K)
