"""Eagle3's training-time-test (TTT) loss (rows and TTT steps: :mod:`.model`).

Li et al., "EAGLE-3: Scaling up Inference Acceleration of LLMs via Training-Time Test" (2025).

Legend: B batch, S sequence length, H hidden (= target hidden), F = n_layers * H target feature
width, V target vocab, W draft vocab (= V unless ``draft_vocab_size`` reduces it), K ttt_steps (unrolled steps = tokens drafted per proposal), T a run of rows,
Hq query heads, Hk KV heads, d head_dim, N supervised rows of one step.

Loss (soft cross-entropy against the target): row t at step k is supervised iff
``t + k + 2 < S`` and ``loss_mask[t + k + 2]``; its target is
``softmax(lm_head(target_last_hidden[t + k + 1]))``; weight ``decay^k`` (0.8). The micro-batch's
loss is ``sum_k decay^k sum_rows CE / weight_sum`` with ``weight_sum`` the global batch's total
supervision weight (the protocol's ``weight``), so padding and micro-batching do not change it.

Reduced draft vocabulary: the draft's logits are over its W tokens; the soft CE is
``-sum_{d < W} p_t[d2t[d]] log p_d[d]`` with ``p_t`` the target's full-vocabulary softmax (not
renormalised): the target mass outside the draft vocabulary contributes nothing it could learn, and
the row stays in the normaliser (as DSpark's CE with a label outside the vocabulary; EAGLE-3 instead
renormalises ``p_t`` over the draft tokens and drops rows whose target argmax is outside them). The
minimiser is the same, ``p_d`` proportional to ``p_t`` on the draft tokens. Accuracy compares
``d2t[argmax p_d]`` with the target argmax over V. With the target cache's per-position logsumexp and
argmax the target side computes W logits instead of V
(:func:`deepspec.target.capture.target_draft_probs`: the same values).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from deepspec.algorithms.eagle3.model import Eagle3DraftModel
from deepspec.models.acceptance import AcceptanceCounts, chain_acceptance, is_eos
from deepspec.target.capture import STATS_MISSING, target_draft_probs


def ttt_supervision(loss_mask_BS: Tensor, steps: int, decay: float,
                    rows_BS: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(valid_KBS bool, weight_KBS float32)``: row t of step k is supervised iff ``t+k+2 < S`` and
    ``loss_mask[t+k+2]`` (and, if ``rows_BS`` is given, ``rows_BS[t]``: only sampled chains); its
    weight is ``decay**k``."""
    B, S = loss_mask_BS.shape
    lm = loss_mask_BS.bool()
    valid = torch.zeros(steps, B, S, dtype=torch.bool, device=lm.device)
    for k in range(steps):
        if k + 2 < S:
            valid[k, :, : S - k - 2] = lm[:, k + 2:]
    if rows_BS is not None:
        valid &= rows_BS.bool().to(valid.device)[None]
    w = valid.float() * (decay ** torch.arange(steps, dtype=torch.float32, device=lm.device)).view(steps, 1, 1)
    return valid, w


@dataclass
class Eagle3LossOutput:
    """``loss`` carries the graph. ``acc_K``: float32 ``[K]`` on the loss's device, the fraction of this
    micro-batch's supervised rows at step k where argmax(draft) == argmax(target) (teacher-forced
    greedy acceptance of slot k; 0 where none). ``num_supervised_K``: host ints (read by the per-step
    ``nonzero``).
    ``acceptance``: the chains' additive acceptance counts (:mod:`deepspec.models.acceptance`, one
    chain per start row); the trainer sums them over the global batch and ranks before taking the
    tau estimates."""

    loss: Tensor
    weight_sum: Tensor
    local_weight_sum: Tensor
    num_supervised_K: list[int]
    acc_K: Tensor
    acceptance: AcceptanceCounts

    @property
    def tau_estimate(self) -> float:
        return self.acceptance.tau()

    @property
    def greedy_tau_estimate(self) -> float:
        return self.acceptance.greedy_tau()

    def scalars(self) -> dict[str, Tensor]:
        """Loggable values as float64 0-d tensors on the loss's device (no host read)."""
        return {"loss": self.loss.detach().double(),
                "num_supervised": torch.full((), float(sum(self.num_supervised_K)), dtype=torch.float64,
                                             device=self.loss.device)}


def _soft_ce_chunk(hidden_NH: Tensor, target_hidden_NH: Tensor, w_N: Tensor, final_norm: nn.Module,
                   lm_w: Tensor, target_lm_w: Tensor, d2t_W: Tensor | None,
                   softcap: float | None = None, lse_N: Tensor | None = None, target_argmax_N: Tensor | None = None,
                   target_rows_WH: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted soft-CE sum of a chunk, and (detached) argmax matches and T = 1 acceptance
    probabilities ``1 - TV`` (in target id space); recomputed in backward. ``lm_w`` ``[W, H]``: the
    draft's output rows; ``target_lm_w`` ``[V, H]``: the target's; ``softcap``: the target's final-logit
    soft-capping (:func:`deepspec.target.capture.soft_cap`); ``lse_N`` / ``target_argmax_N`` /
    ``target_rows_WH``: the target cache's statistics and the target's rows ``d2t_W``
    (:func:`deepspec.target.capture.target_draft_probs`)."""
    # the norm's output dtype depends on the family (Llama's promotes to its float32 weight, Gemma's keeps its
    # input's): the product runs in the output rows' dtype either way
    logits_NW = F.linear(final_norm(hidden_NH).to(lm_w.dtype), lm_w).float()
    logp_NW = F.log_softmax(logits_NW, dim=-1)
    with torch.no_grad():
        tprob_NW, outside_N, target_arg_N = target_draft_probs(
            target_hidden_NH, target_lm_w, d2t_W, softcap, logsumexp_N=lse_N, argmax_N=target_argmax_N,
            lm_head_rows_WH=target_rows_WH)
        drafted_N = logits_NW.argmax(-1)
        if d2t_W is not None:
            drafted_N = d2t_W[drafted_N]
        match = (drafted_N == target_arg_N).float()
        # L1 over V: the draft tokens, plus the target's mass outside the draft vocabulary (none when W = V)
        l1_N = (logp_NW.exp() - tprob_NW).abs().sum(-1) + (0.0 if outside_N is None else outside_N)
        accept = (1.0 - 0.5 * l1_N).clamp(0.0, 1.0)
    ce = -(tprob_NW * logp_NW).sum(-1)
    return (w_N * ce).sum(), match, accept


def eagle3_loss(model: Eagle3DraftModel, input_ids_BS: Tensor, loss_mask_BS: Tensor, target_hidden_BSF: Tensor,
                target_last_hidden_BSH: Tensor, *, weight_sum: Tensor | float | None = None,
                autocast: Any = None, chunk_rows: int = 1024, rows_BS: Tensor | None = None,
                target_logsumexp_BS: Tensor | None = None,
                target_argmax_BS: Tensor | None = None) -> Eagle3LossOutput:
    """TTT loss of one micro-batch (module docstring). ``weight_sum``: the global batch's
    :func:`ttt_supervision` weight sum (None = this micro-batch's own). ``rows_BS``: supervise only
    the chains starting at these rows (None = every row). Only supervised rows are
    projected to the vocabulary, in checkpointed chunks of ``chunk_rows`` (memory ``chunk x V``).
    ``target_logsumexp_BS`` / ``target_argmax_BS``: the target cache's per-position statistics; with a
    reduced draft vocabulary the target side then computes W logits instead of V (same values).
    Raises ValueError when they are NaN / -1 at a supervised position."""
    c = model.config
    K = c.ttt_steps
    dev = model.fc.weight.device

    with autocast if autocast is not None else contextlib.nullcontext():
        outs = model.forward_train(input_ids_BS.to(dev), target_hidden_BSF.to(dev),
                                   rows_BS=None if rows_BS is None else rows_BS.to(dev))
    valid_KBS, w_KBS = ttt_supervision(loss_mask_BS.to(dev), K, c.step_decay, rows_BS)
    local_ws = w_KBS.sum()
    norm = local_ws if weight_sum is None else torch.as_tensor(weight_sum, dtype=torch.float32, device=dev)
    norm = norm.clamp_min(1e-12)
    loss = sum(o.sum() for o in outs) * 0.0  # keeps the graph when nothing is supervised
    tl = target_last_hidden_BSH.to(dev)
    stats = model.d2t is not None and target_logsumexp_BS is not None and target_argmax_BS is not None
    lse_BS = target_logsumexp_BS.to(dev) if stats else None
    argmax_BS = target_argmax_BS.to(dev) if stats else None
    target_rows_WH = model.lm_head.weight if stats else None  # the frozen copy of the target's rows d2t
    counts = []
    acc_K = torch.zeros(K, device=dev)
    match_KBS = torch.zeros(valid_KBS.shape, dtype=torch.bool, device=dev)
    accept_KBS = torch.zeros(valid_KBS.shape, device=dev)
    for k in range(K):
        # a host sync per step k, kept: N sizes the gathered rows and the chunks (without it every
        # B x S row would go through the vocabulary projection, padding included)
        b_N, t_N = valid_KBS[k].nonzero(as_tuple=True)
        N = int(b_N.numel())
        counts.append(N)
        if N == 0:
            continue
        h_NH = outs[k][b_N, t_N]
        th_NH = tl[b_N, t_N + k + 1]
        lse_N = lse_BS[b_N, t_N + k + 1] if stats else None
        targ_N = argmax_BS[b_N, t_N + k + 1] if stats else None
        # a host sync kept on purpose: missing statistics must stop the run where they are met, with a message
        if stats and not bool(torch.isfinite(lse_N).all() and (targ_N >= 0).all()):
            raise ValueError(STATS_MISSING.format(who="eagle3_loss", what="position"))
        w_N = w_KBS[k][b_N, t_N]
        matches, accepts = [], []
        for s in range(0, N, chunk_rows):
            e = min(N, s + chunk_rows)
            part, match, accept = checkpoint(_soft_ce_chunk, h_NH[s:e], th_NH[s:e], w_N[s:e], model.norm,
                                             model.lm_head.weight, model.target_lm_head_weight, model.d2t,
                                             model.config.final_logit_softcapping,
                                             None if lse_N is None else lse_N[s:e],
                                             None if targ_N is None else targ_N[s:e], target_rows_WH,
                                             use_reentrant=False)
            loss = loss + part / norm
            matches.append(match)
            accepts.append(accept)
        match_KBS[k][b_N, t_N] = torch.cat(matches).bool()
        accept_KBS[k][b_N, t_N] = torch.cat(accepts)
        acc_K[k] = torch.cat(matches).mean()
    # one chain per start row (b, t): its step k is slot k
    # step k of the chain at row t predicts x_{t+k+2} (ttt_supervision); an accepted EOS ends the step, no bonus
    eos_BS = is_eos(input_ids_BS.to(dev), c.eos_token_ids)
    eos_KBS = torch.zeros_like(valid_KBS)
    S = eos_BS.shape[1]
    for k in range(K):
        if k + 2 < S:
            eos_KBS[k][:, :S - k - 2] = eos_BS[:, k + 2:]
    acceptance = chain_acceptance(valid_KBS.flatten(1).T, match_KBS.flatten(1).T, accept_KBS.flatten(1).T,
                                  eos_KBS.flatten(1).T)
    return Eagle3LossOutput(loss=loss, weight_sum=norm.detach(), local_weight_sum=local_ws.detach(),
                            num_supervised_K=counts, acc_K=acc_K, acceptance=acceptance)
