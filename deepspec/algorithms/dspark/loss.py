"""DSpark / DFlash training loss (docs/design/training.md, "DSpark / DFlash loss"; DSpark paper, loss section).

Legend: B batch, S sequence length, A anchors, K block_size, V target vocab, W draft vocab (the
width of the draft logits: V, or N = ``draft_vocab_size`` with a reduced vocabulary), H target
hidden, N number of valid (supervised) slots in the batch, C a chunk of slots.

Draft slot ``k`` of the block anchored at ``a`` predicts token ``x_{a+k+1}`` (K here is the block's
``num_draft_slots``: ``block_size``, or ``block_size - 1`` in z-lab's DFlash layout, whose mask slot
``k + 1`` predicts the token at its own position ``a+k+1``: the same label, so one rule serves both).
It is *valid* iff the block is valid, ``a+k+1 < S`` and ``loss_mask[a+k+1]``, followed by a
cumulative product along ``k`` (supervision stops at the first invalid slot). Weight ``w_k = exp(-k / gamma)``.

Per valid slot:
  CE   = -log softmax(draft)[x_{a+k+1}]
  L1   = || softmax(draft) - softmax(target logits) ||_1   (= 2 * total variation; target logits =
         lm_head(target_last_hidden[a+k]), soft-capped when the target is: config.final_logit_softcapping)
  conf = r_k * BCE-with-logits(confidence_logit, y_k), label y_k and reach weight r_k by
         ``config.confidence_label`` (:func:`confidence_targets`), both detached:
         greedy (T = 0 verify): y_k = 1[draft argmax == target argmax at k], r_k = prod_{j<k} y_j (0/1:
                 slots after the block's first teacher-forced mismatch are not supervised);
         tv (T > 0 verify):     y_k = 1 - L1_k/2 (the T = 1 acceptance probability), r_k = prod_{j<k} y_j.
         The head predicts slot k's acceptance *given slots 1..k-1 were accepted* (the event the eval's
         calibration pairs measure, :mod:`deepspec.eval.metrics`), so a slot counts as much as its
         earlier slots are accepted. The original (DSpark paper) trains every valid slot towards 1 - L1/2.
Each term = sum(w * term) / weight_sum, ``weight_sum`` being the sum of ``w`` over the valid slots of
the whole *global* batch (the trainer computes it with :func:`supervision_weights` before the
backward passes; ``None`` = this batch's own sum). Total = ce_w*CE + l1_w*L1 + conf_w*conf.

Only the N valid slots are materialised as ``[N, W]``; the target logits are computed in chunks of
slots from ``target_last_hidden`` gathered at the slot positions (never ``[B, S, V]``). With deferred
draft logits (``forward_train(..., defer_logits=True)``, the trainer's ``chunked_head_loss``) the draft
logits too exist one chunk at a time, recomputed in backward: for a Qwen3-4B-shaped draft (W 151,936)
with 512 anchors x 7 slots the ``[A, K, W]`` logits alone are 2.2 GB in float32. With a reduced
vocabulary and the target cache's per-position logsumexp and argmax, only the W target logits of the
draft tokens are computed (:func:`deepspec.target.capture.target_draft_logits`): the same values.

Dtypes and what backward recomputes. The target side (lm_head matmul of the slots' target hidden
states) runs once per chunk in the forward, under no_grad, outside ``torch.utils.checkpoint``: its
matmul in the compute dtype (the autocast dtype when the draft's forward ran under one, else the
weight's: float32, TF32 where CUDA allows it), with the frozen lm_head passed in that dtype (the
trainer passes a copy made once, ``frozen_as``; never a per-chunk cast); its softmax (logsumexp,
target mass off a reduced vocabulary) in float32. Its logits ``[N, W]`` are kept in the compute dtype
until backward (bf16: 2 bytes per slot and draft token), where the probabilities are rebuilt
elementwise (``exp(logit - logsumexp)``, float32) without a second matmul. The draft log-softmax, L1,
CE and confidence terms are float32.

Reduced draft vocabulary (``d2t_W``: draft id -> target id, :mod:`deepspec.models.vocab`). The draft
distribution ``p_d`` lives on the W draft tokens and is 0 on every other target token, so in target
id space:
  CE   = -log p_d[t2d(label)] when the label is in the draft vocabulary; 0 when it is not. Such a slot
         stays supervised (its weight stays in ``weight_sum`` and in the cumulative product): it is a
         miss the draft cannot avoid. EAGLE-3 / SpecForge do the same with positions whose target
         argmax is outside the draft vocabulary: zeroed in the numerator, kept in the mean.
  L1   = sum_{d < W} |p_d[d] - p_t[d2t[d]]| + sum_{v not in d2t} p_t[v]   (never a [N, V] draft tensor)
  accept / top1 diagnostics compare ``d2t[argmax p_d]`` with the target argmax over V.
With ``d2t`` the identity (W = V) every term equals the full-vocabulary one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from deepspec.algorithms.dspark.config import DraftConfig
from deepspec.models.acceptance import AcceptanceCounts, chain_acceptance, is_eos
from deepspec.models.vocab import t2d_table
from deepspec.target.capture import STATS_MISSING, target_draft_logits


def supervision_mask(loss_mask_BS: Tensor, anchor_pos_BA: Tensor, block_valid_BA: Tensor, block_size: int) -> Tensor:
    """Bool ``[B, A, K]``: slot k supervised (block valid, a+k+1 < S, loss_mask[a+k+1]; cumprod over k)."""
    B, S = loss_mask_BS.shape
    A = anchor_pos_BA.shape[1]
    dev = loss_mask_BS.device
    label_pos_BAK = anchor_pos_BA.to(dev).long().unsqueeze(-1) + torch.arange(1, block_size + 1, device=dev)
    in_range_BAK = label_pos_BAK < S
    lm_BAK = torch.gather(loss_mask_BS.bool(), 1, label_pos_BAK.clamp(max=S - 1).view(B, -1)).view(B, A, block_size)
    ok_BAK = in_range_BAK & lm_BAK & block_valid_BA.to(dev).bool().unsqueeze(-1)
    return torch.cumprod(ok_BAK.to(torch.int32), dim=-1).bool()


def confidence_targets(valid_BAK: Tensor, match_BAK: Tensor, accept_prob_BAK: Tensor,
                       rule: str, *, eos_BAK: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The confidence head's ``(label_BAK, reach_BAK)`` float32 ``[B, A, K]`` (module docstring).

    ``valid_BAK`` bool: supervised slots; ``match_BAK`` bool: the draft's argmax equals the target's
    (teacher-forced); ``accept_prob_BAK`` float: ``1 - TV`` per slot. ``rule``: ``"greedy"`` (label the
    match, reach the product of the earlier slots' matches: 0 after the first mismatch) or ``"tv"`` (label
    ``1 - TV``, reach the product of the earlier slots' ``1 - TV``). Both are 0 at invalid slots. The rule
    follows the eval's calibration pairs (slot k's acceptance given slots 1..k-1 accepted, under the
    verify rule in use), not the original DSpark loss (which labels every valid slot ``1 - TV`` with
    reach 1). ``eos_BAK`` bool (optional): the slot's label is an EOS; an accepted EOS ends the step, so the
    slots after it have reach 0 (the eval never pairs them). Raises ValueError for another ``rule``.
    """
    if rule == "greedy":
        label_BAK = (match_BAK & valid_BAK).float()
    elif rule == "tv":
        label_BAK = accept_prob_BAK.float().clamp(0.0, 1.0) * valid_BAK
    else:
        raise ValueError(f"confidence_targets.rule: expected 'greedy' or 'tv', received {rule!r}.")
    go_on_BAK = label_BAK if eos_BAK is None else label_BAK * (~eos_BAK.bool()).float()  # an EOS ends the step
    survive_BAK = torch.cumprod(go_on_BAK, dim=-1)  # prod_{j<=k} label_j (and no EOS)
    reach_BAK = torch.cat([torch.ones_like(survive_BAK[..., :1]), survive_BAK[..., :-1]], dim=-1) * valid_BAK
    return label_BAK, reach_BAK


def slot_decay_weights(block_size: int, gamma: float, device=None) -> Tensor:
    """``w_k = exp(-k / gamma)``, float32 ``[K]``."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / gamma)


def supervision_weights(loss_mask_BS: Tensor, anchor_pos_BA: Tensor, block_valid_BA: Tensor,
                        config: DraftConfig | None = None, *, block_size: int | None = None,
                        gamma: float | None = None) -> tuple[Tensor, Tensor]:
    """Pure: ``(valid_BAK bool, weight_BAK float32)`` with ``weight = w_k`` on valid slots, 0 elsewhere.

    ``block_size`` / ``gamma`` come from ``config`` unless given. ``weight_BAK.sum()`` over all
    micro-batches of a global batch is the ``weight_sum`` to pass to :func:`dspark_loss`.
    """
    if config is not None:
        block_size = config.num_draft_slots if block_size is None else block_size
        gamma = config.loss_decay_gamma if gamma is None else gamma
    if block_size is None or gamma is None:
        raise ValueError("supervision_weights: expected a DraftConfig or block_size= and gamma=, received neither.")
    valid_BAK = supervision_mask(loss_mask_BS, anchor_pos_BA, block_valid_BA, block_size)
    return valid_BAK, valid_BAK.float() * slot_decay_weights(block_size, gamma, loss_mask_BS.device)


@dataclass
class LossOutput:
    """``loss`` carries the graph; the other tensors are detached diagnostics, on the loss's device
    (reading one on the host is a device sync: the trainer reads them once per logged step).

    accept_rate_K: mean over valid slots at k of ``1 - L1/2`` (= 1 - TV: the probability that
      rejection sampling at T=1 accepts a draft token given an accepted prefix; teacher-forced).
    top1_match_K: fraction of valid slots at k where argmax(draft) == argmax(target) (greedy accept).
    acceptance: the blocks' additive acceptance counts (:mod:`deepspec.models.acceptance`); the
      trainer sums them over the global batch and ranks before taking the tau estimates. None
      when the loss has no target distribution.
    num_valid_slots: N, a host int (the loss's one sync, ``nonzero``, already read it).
    num_labels_outside_vocab: float32 0-d, valid slots whose label is not in a reduced draft
      vocabulary; None with the full vocabulary.
    """

    loss: Tensor
    ce: Tensor
    l1: Tensor
    confidence: Tensor
    weight_sum: Tensor
    local_weight_sum: Tensor
    num_valid_slots: int
    accept_rate_K: Tensor
    top1_match_K: Tensor
    acceptance: AcceptanceCounts | None
    num_labels_outside_vocab: Tensor | None = None

    @property
    def tau_estimate(self) -> float:
        """This micro-batch's T = 1 estimate (NaN without a target distribution; a host read)."""
        return float("nan") if self.acceptance is None else self.acceptance.tau()

    @property
    def greedy_tau_estimate(self) -> float:
        """This micro-batch's greedy estimate (NaN without a target distribution; a host read)."""
        return float("nan") if self.acceptance is None else self.acceptance.greedy_tau()

    def scalars(self) -> dict[str, Tensor]:
        """Loggable values as float64 0-d tensors on the loss's device (no host read); each adds up over
        the micro-batches of a global batch (global ``weight_sum``). The tau estimates come from the
        pooled ``acceptance`` counts instead. ``num_labels_outside_vocab`` only for a reduced draft
        vocabulary. float64 so that sums over micro-batches equal the host's sums of Python floats."""
        dev = self.loss.device
        out = {"loss": self.loss.detach().double(), "ce": self.ce.double(), "l1": self.l1.double(),
               "confidence": self.confidence.double(),
               "num_valid_slots": torch.full((), float(self.num_valid_slots), dtype=torch.float64, device=dev)}
        if self.num_labels_outside_vocab is not None:
            out["num_labels_outside_vocab"] = self.num_labels_outside_vocab.double()
        return out


def compute_dtype(autocast: Any, weight: Tensor) -> torch.dtype:
    """The dtype the loss's matmuls run in: ``autocast``'s when it is an enabled ``torch.autocast``
    (the context the draft's forward ran in), else an autocast active on ``weight``'s device, else
    ``weight``'s own dtype (float32 training: float32, where CUDA may run it as TF32)."""
    if autocast is not None and getattr(autocast, "_enabled", False):
        return autocast.fast_dtype
    if torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    return weight.dtype


@torch.no_grad()
def _target_side(target_hidden_CH: Tensor, lm_w: Tensor, d2t_W: Tensor | None, softcap: float | None,
                 lse_C: Tensor | None, target_argmax_C: Tensor | None, lm_head_rows_WH: Tensor | None):
    """The target side of a chunk of C slots, computed once in the forward (never with a graph, never
    recomputed in backward): ``(logits_CW in lm_w's dtype, logsumexp_C fp32, outside_C fp32 | None,
    target argmax_C int64)`` (:func:`deepspec.target.capture.target_draft_logits`)."""
    return target_draft_logits(target_hidden_CH, lm_w, d2t_W, softcap, logsumexp_N=lse_C, argmax_N=target_argmax_C,
                               lm_head_rows_WH=lm_head_rows_WH)


def _slot_terms(head_in_CX: Tensor, markov_in_Cr: Tensor | None, head_logits, autocast, draft_labels_C: Tensor,
                in_vocab_C: Tensor | None, target_logits_CW: Tensor | None, target_lse_C: Tensor | None,
                target_outside_C: Tensor | None, d2t_W: Tensor | None, need_target: bool):
    """Per-slot ``(ce_C, l1_C | None, draft argmax_C)`` of a chunk of C valid slots.

    ``head_in_CX``: the slots' draft logits ``[C, W]`` when ``head_logits`` is None, else their final
    hidden states ``[C, D]``, turned into logits by ``head_logits(hidden, markov_in_Cr)`` under
    ``autocast`` (this part is what the deferred path recomputes in backward). The draft log-softmax
    and the target probabilities ``exp(target_logits_CW.float() - target_lse_C)`` are float32; the
    target logits come from :func:`_target_side` (no graph). The argmax is a target id; ``l1_C`` only
    with ``target_logits_CW``, with a graph only when ``need_target`` (the module docstring)."""
    if head_logits is None:
        logits_CW = head_in_CX
    else:
        with autocast if autocast is not None else contextlib.nullcontext():
            logits_CW = head_logits(head_in_CX, markov_in_Cr)
    logp_CW = F.log_softmax(logits_CW.float(), dim=-1)
    ce_C = -logp_CW.gather(1, draft_labels_C[:, None]).squeeze(1)
    if in_vocab_C is not None:
        ce_C = ce_C * in_vocab_C
    drf_arg_C = logp_CW.detach().argmax(-1)
    if d2t_W is not None:
        drf_arg_C = d2t_W[drf_arg_C]
    if target_logits_CW is None:
        return ce_C, None, drf_arg_C
    with torch.no_grad():
        tprob_CW = torch.exp(target_logits_CW.float() - target_lse_C[:, None])
    with contextlib.nullcontext() if need_target else torch.no_grad():
        l1_C = (logp_CW.exp() - tprob_CW).abs().sum(-1)
        if target_outside_C is not None:
            l1_C = l1_C + target_outside_C
    return ce_C, l1_C, drf_arg_C


def dspark_loss(
    out,
    input_ids_BS: Tensor,
    loss_mask_BS: Tensor,
    anchor_pos_BA: Tensor,
    block_valid_BA: Tensor,
    target_last_hidden_BSH: Tensor | None,
    lm_head: nn.Module | Tensor,
    config: DraftConfig,
    weight_sum: Tensor | float | None = None,
    *,
    d2t_W: Tensor | None = None,
    target_logsumexp_BS: Tensor | None = None,
    target_argmax_BS: Tensor | None = None,
    lm_head_rows_WH: Tensor | None = None,
    chunk_slots: int = 1024,
    autocast: Any = None,
) -> LossOutput:
    """DSpark loss (DFlash: config with l1/confidence weights 0). See the module docstring.

    Args:
        out: a ``DraftTrainOutput`` (``logits_BAKV``, ``[B, A, K, W]`` over draft ids; ``confidence_logits_BAK``).
            With deferred logits (``logits_BAKV`` None: ``forward_train(..., defer_logits=True)``) the logits
            of the valid slots are computed per chunk of ``chunk_slots`` by ``out.head_logits`` under
            ``autocast`` and recomputed in backward (``torch.utils.checkpoint``): the same loss and
            gradients, with memory ``chunk_slots x W`` for the draft logits instead of ``B x A x K x W``.
        target_last_hidden_BSH: final-norm target hidden states; required when ``l1_weight`` or
            ``confidence_weight`` > 0, optional otherwise (then accept diagnostics use it if given).
        lm_head: the frozen *full* target lm_head (a module, or its weight ``[V, D]``): the draft's copy
            with a full vocabulary, ``DSparkDraftModel.target_lm_head_weight`` with a reduced one. Cast to
            the compute dtype (:func:`compute_dtype`) once per call when it is in another.
        d2t_W: int64 ``[W]`` draft -> target ids of a reduced draft vocabulary (None: W = V, identity).
        weight_sum: global normaliser (sum of :func:`supervision_weights` over the global batch).
        target_logsumexp_BS, target_argmax_BS: the target logits' full-vocabulary logsumexp and argmax
            per position (the target cache's, :func:`deepspec.target.capture.target_logit_stats`). With a
            reduced vocabulary they replace the ``[N, V]`` target logits by ``[N, W]`` ones
            (``p_t[d2t[d]] = exp(logit[d2t[d]] - logsumexp)``; the same values up to rounding); ignored
            when W = V, where the full softmax is needed anyway.
        lm_head_rows_WH: ``lm_head``'s rows ``d2t_W`` (the draft's frozen ``lm_head``); gathered when None.
        chunk_slots: slots per chunk (transient memory ``chunk_slots x V`` float32 for the target softmax and
            the deferred draft logits; the chunks' target logits, ``N x W`` in the compute dtype, live until
            backward).
        autocast: the context the draft's forward ran in (deferred logits are computed in it; None: none).
    Raises:
        ValueError: a needed ``target_last_hidden_BSH`` / confidence logits is missing, or the statistics
            are not finite (-1) at a supervised slot.
    """
    K = config.num_draft_slots
    logits_BAKV = out.logits_BAKV  # [B, A, K, W] over the draft slots
    B, S = input_ids_BS.shape
    dev = out.hidden_BAKD.device
    lm_w = lm_head.weight if isinstance(lm_head, nn.Module) else lm_head  # [V, D]
    need_target = config.l1_weight > 0 or config.confidence_weight > 0
    if need_target and target_last_hidden_BSH is None:
        raise ValueError("dspark_loss: target_last_hidden_BSH is required when l1_weight or confidence_weight > 0; "
                         "pass the cache's target_last_hidden (or use DFlash weights).")
    if config.confidence_weight > 0 and out.confidence_logits_BAK is None:
        raise ValueError("dspark_loss: confidence_weight > 0 but the model has no confidence head; "
                         "set use_confidence_head=True or confidence_weight=0.")

    valid_BAK, w_BAK = supervision_weights(loss_mask_BS.to(dev), anchor_pos_BA.to(dev), block_valid_BA.to(dev),
                                           config)
    local_ws = w_BAK.sum()
    norm = local_ws if weight_sum is None else torch.as_tensor(weight_sum, dtype=torch.float32, device=dev)
    norm = norm.clamp_min(1e-12)

    # Host syncs: this nonzero is the loss's one read of the device per micro-batch (N sizes every
    # gathered [N, ...] tensor and the chunks); without it every B x A x K slot would be scored,
    # padding included. Everything else stays on the device (LossOutput.scalars).
    idx_N3 = valid_BAK.nonzero()  # [N, 3] (b, a, k)
    N = idx_N3.shape[0]
    if N == 0:
        # keeps the graph with a zero gradient for every head parameter, deferred logits included (FSDP2
        # reduce-scatters only parameters with a gradient: a rank without one would mismatch the others)
        if logits_BAKV is not None:
            zero = logits_BAKV.sum() * 0.0
        else:
            h_1D = out.hidden_BAKD.reshape(-1, out.hidden_BAKD.shape[-1])[:1]
            z_1r = None if out.markov_input_BAKr is None else out.markov_input_BAKr.reshape(
                -1, out.markov_input_BAKr.shape[-1])[:1]
            with autocast if autocast is not None else contextlib.nullcontext():
                zero = out.head_logits(h_1D, z_1r).sum() * 0.0
        if out.confidence_logits_BAK is not None:
            zero = zero + out.confidence_logits_BAK.sum() * 0.0
        z = zero.detach()
        zk = torch.zeros(K, device=dev)
        return LossOutput(loss=zero, ce=z, l1=z, confidence=z, weight_sum=norm.detach(), local_weight_sum=local_ws,
                          num_valid_slots=0, accept_rate_K=zk, top1_match_K=zk,
                          acceptance=AcceptanceCounts.zeros(K, device=dev),
                          num_labels_outside_vocab=None if d2t_W is None else torch.zeros((), device=dev))
    b_N, a_N, k_N = idx_N3.unbind(-1)
    w_N = w_BAK[b_N, a_N, k_N]
    slot_pos_N = anchor_pos_BA.to(dev).long()[b_N, a_N] + k_N  # position a+k (< S-1 for valid slots)
    labels_N = input_ids_BS.to(dev).long()[b_N, slot_pos_N + 1]  # target ids
    num_outside = None
    if d2t_W is not None:
        d2t_W = d2t_W.to(dev).long()
        draft_labels_N = t2d_table(d2t_W, lm_w.shape[0])[labels_N]  # -1: not in the draft vocabulary
        in_vocab_N = draft_labels_N >= 0
        num_outside = (~in_vocab_N).sum().float()
        draft_labels_N = draft_labels_N.clamp_min(0)
    else:
        draft_labels_N, in_vocab_N = labels_N, None

    # the frozen target lm_head in the compute dtype: no copy when the caller passes it so (the trainer
    # does), one per call otherwise, never one per chunk
    cdt = compute_dtype(autocast, lm_w)
    lm_c = lm_w if lm_w.dtype == cdt else lm_w.detach().to(cdt)
    stats = (d2t_W is not None and target_logsumexp_BS is not None and target_argmax_BS is not None
             and target_last_hidden_BSH is not None)
    if stats:
        at = (b_N.to(target_logsumexp_BS.device), slot_pos_N.to(target_logsumexp_BS.device))
        lse_N, tgt_argmax_N = target_logsumexp_BS[at].to(dev), target_argmax_BS[at].to(dev)
        if lm_head_rows_WH is None:
            lm_head_rows_WH = lm_c.index_select(0, d2t_W.to(lm_c.device))
        elif lm_head_rows_WH.dtype != cdt:
            lm_head_rows_WH = lm_head_rows_WH.detach().to(cdt)
        # a host sync kept on purpose: a cache whose statistics miss a supervised slot must stop the run
        # at the micro-batch that meets it, with a message (only with a reduced vocabulary and statistics)
        if not bool(torch.isfinite(lse_N).all() and (tgt_argmax_N >= 0).all()):
            raise ValueError(STATS_MISSING.format(who="dspark_loss", what="slot"))
    deferred = logits_BAKV is None
    if deferred:  # the draft logits of each chunk are computed in it and recomputed in backward
        head_in_N = out.hidden_BAKD[b_N, a_N, k_N]
        markov_in_N = None if out.markov_input_BAKr is None else out.markov_input_BAKr[b_N, a_N, k_N]
    else:
        head_in_N, markov_in_N = logits_BAKV[b_N, a_N, k_N], None
    ce_parts, l1_parts, tgt_arg_parts, drf_arg_parts = [], [], [], []
    for s in range(0, N, chunk_slots):
        e = min(N, s + chunk_slots)
        tgt = (None, None, None, None)
        if target_last_hidden_BSH is not None:
            th_C = target_last_hidden_BSH[b_N[s:e].to(target_last_hidden_BSH.device),
                                          slot_pos_N[s:e].to(target_last_hidden_BSH.device)].to(dev)
            # outside the checkpoint: computed once, kept (logits_CW in the compute dtype) for backward
            tgt = _target_side(th_C, lm_c, d2t_W, config.final_logit_softcapping, lse_N[s:e] if stats else None,
                               tgt_argmax_N[s:e] if stats else None, lm_head_rows_WH)
        tlogits_C, tlse_C, toutside_C, tgt_arg_C = tgt
        args = (head_in_N[s:e], None if markov_in_N is None else markov_in_N[s:e], out.head_logits if deferred else None,
                autocast, draft_labels_N[s:e], None if in_vocab_N is None else in_vocab_N[s:e], tlogits_C, tlse_C,
                toutside_C, d2t_W, need_target)
        ce_C, l1_C, drf_arg_C = (checkpoint(_slot_terms, *args, use_reentrant=False) if deferred
                                 else _slot_terms(*args))
        ce_parts.append(ce_C)
        drf_arg_parts.append(drf_arg_C)
        if l1_C is not None:
            l1_parts.append(l1_C)
            tgt_arg_parts.append(tgt_arg_C)
    ce_N = torch.cat(ce_parts)
    ce = (w_N * ce_N).sum() / norm
    loss = config.ce_weight * ce
    l1 = conf = torch.zeros((), device=dev)
    accept_K = torch.zeros(K, device=dev)
    top1_K = torch.zeros(K, device=dev)
    acceptance = None
    if l1_parts:
        l1_N = torch.cat(l1_parts)
        l1 = (w_N * l1_N).sum() / norm
        acc_N = (1.0 - 0.5 * l1_N.detach()).clamp(0.0, 1.0)
        if config.l1_weight > 0:
            loss = loss + config.l1_weight * l1
        with torch.no_grad():
            match_N = (torch.cat(drf_arg_parts) == torch.cat(tgt_arg_parts)).float()
            match_BAK = torch.zeros_like(valid_BAK)
            match_BAK[b_N, a_N, k_N] = match_N.bool()
            prob_BAK = torch.zeros(valid_BAK.shape, device=dev)
            prob_BAK[b_N, a_N, k_N] = acc_N.float()
            eos_BAK = torch.zeros_like(valid_BAK)  # the label is an EOS: an accepted one ends the step, no bonus
            eos_BAK[b_N, a_N, k_N] = is_eos(labels_N, config.eos_token_ids)
        if out.confidence_logits_BAK is not None:
            label_BAK, reach_BAK = confidence_targets(valid_BAK, match_BAK, prob_BAK, config.confidence_label,
                                                      eos_BAK=eos_BAK)
            c_N = out.confidence_logits_BAK[b_N, a_N, k_N].float()
            conf_N = F.binary_cross_entropy_with_logits(c_N, label_BAK[b_N, a_N, k_N], reduction="none")
            conf = (w_N * reach_BAK[b_N, a_N, k_N] * conf_N).sum() / norm
            if config.confidence_weight > 0:
                loss = loss + config.confidence_weight * conf
        with torch.no_grad():
            cnt = torch.bincount(k_N, minlength=K).clamp_min(1).float()
            accept_K = torch.zeros(K, device=dev).index_add_(0, k_N, acc_N) / cnt
            top1_K = torch.zeros(K, device=dev).index_add_(0, k_N, match_N) / cnt
            acceptance = chain_acceptance(valid_BAK.flatten(0, 1), match_BAK.flatten(0, 1), prob_BAK.flatten(0, 1),
                                          eos_BAK.flatten(0, 1))
    return LossOutput(loss=loss, ce=ce.detach(), l1=l1.detach(), confidence=conf.detach(), weight_sum=norm.detach(),
                      local_weight_sum=local_ws, num_valid_slots=int(N), accept_rate_K=accept_K, top1_match_K=top1_K,
                      acceptance=acceptance, num_labels_outside_vocab=num_outside)
