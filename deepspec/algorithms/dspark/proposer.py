"""The DSpark / DFlash drafter for the decoding engine (DESIGN s.6): one block forward, then the heads slot by slot.

Legend: K block_size, W draft vocab (= V unless reduced), V target vocab, D draft hidden, T committed positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.protocol import DraftTree, Proposal, draw_token
from deepspec.models.vocab import scatter_to_target
from deepspec.target.decoding import SamplingParams, sampling_probs


class DSparkProposer:
    """DSpark / DFlash drafter behind the :class:`~deepspec.algorithms.protocol.Proposer` protocol.

    One block forward ``[anchor, m, .., m]`` at positions ``anchor_pos .. anchor_pos+K-1`` attending
    to the cached context K/V (``DSparkDraftModel.block_hidden``; its draft slots: all K, or the K-1
    mask slots of z-lab's DFlash layout, ``DraftConfig.sample_from_anchor``), then a cheap serial pass: slot
    ``k``'s logits are ``base_k`` + the Markov head's bias (``DSparkDraftModel.slot_step``: vanilla
    ``markov_w2(markov_w1[prev])``, or the gated / rnn variant) with ``prev`` = the anchor for k=0 and
    the token just drafted afterwards (DSpark paper, "parallel backbone + sequential correction").
    ``q = sampling_probs(logits, sampling)`` (fp32; temperature, top-k, top-p) is both sampled from
    and returned. At T=0 the token is the argmax and ``draft_probs_NV`` is ``None`` (greedy verify
    reads only the tokens).

    A draft with a reduced vocabulary (``model.d2t``, W draft tokens) scores and samples over its W
    draft ids; each drafted id is mapped to its target id (``model.target_ids``) before it is returned
    or fed to the Markov head as the next ``prev``, and at T>0 ``q`` is scattered into the full target
    vocabulary (zeros outside the draft vocabulary), so the verify step's ``p / q`` test and
    ``max(0, p - q)`` residual are exactly those of a full-vocabulary draft that puts no mass there.

    The confidence head gives ``c_k = sigmoid(logit)`` per slot (returned as ``confidence_N``); with
    ``confidence_threshold`` set, the proposal is cut before the first slot with ``c_k`` below it.
    ``max_positions`` (the target's ``max_position_embeddings``): draft tokens never land at a
    position ``>= max_positions``.

    ``tree_width`` W > 1: a draft tree of up to W nodes per slot (EAGLE-2's expansion, Li et al. 2024,
    s.4, on DSpark's slots). Slot ``k`` expands each of the W nodes kept at slot ``k - 1`` (the anchor at
    slot 0) with the Markov head fed that node's token, scores each child by the path's summed draft
    log-probability (at T > 0 of ``sampling_probs``, so tokens the filters drop are never proposed),
    and keeps the chain's next node and the W - 1 best other children. The chain is the one the
    chain proposer above would propose: greedy, the argmax path, so a greedy step accepts at least what
    the chain would; at T > 0 sampled from ``q`` (its rows are the tree's ``draft_probs_NV``, every
    other node a chosen point mass, listed after it), so the target's multi-step speculative sampling
    (:func:`~deepspec.eval.verify.verify_tree`) tests the sampled chain by rejection sampling first and
    the chosen siblings on the residual. ``W * K`` nodes, ``1 + W * (K - 1)`` slot steps (the block
    forward is shared). The target verifies them all in one forward
    (:attr:`~deepspec.algorithms.protocol.Proposal.parents_N`).
    """

    def __init__(self, model, *, confidence_threshold: float | None = None, max_positions: int | None = None,
                 tree_width: int = 1):
        if not isinstance(model, DSparkDraftModel):
            raise ValueError(f"DSparkProposer.model: expected a DSparkDraftModel, received {type(model).__name__}.")
        if confidence_threshold is not None and model.confidence_head is None:
            raise ValueError("DSparkProposer.confidence_threshold: expected None for a draft without a confidence "
                             f"head, received {confidence_threshold}. Drop the threshold or load a DSpark draft.")
        check_tree_width(tree_width, "DSparkProposer.tree_width")
        if tree_width > 1 and confidence_threshold is not None:
            raise ValueError("DSparkProposer.tree_width: a draft tree is not cut by confidence; give tree_width 1 "
                             f"with confidence_threshold {confidence_threshold}, or drop the threshold.")
        self.tree_width = int(tree_width)
        self.model = model.eval()
        self.max_proposal_len = int(model.config.num_draft_slots)
        self.confidence_threshold = confidence_threshold
        self.max_positions = int(max_positions if max_positions is not None
                                 else model.config.max_position_embeddings)
        self.cache = model.new_context_cache()

    def reset(self) -> None:
        self.cache = self.model.new_context_cache()

    def extend_context(self, target_hidden_TF: Tensor, token_ids_T: list[int]) -> None:
        self.model.append_context(self.cache, target_hidden_TF)  # DSpark's context is the features alone

    @torch.no_grad()
    def propose(
        self,
        anchor_token: int,
        anchor_pos: int,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        m = self.model
        n_max = min(self.max_proposal_len, self.max_positions - 1 - int(anchor_pos))
        if n_max <= 0:
            return Proposal.empty(m.fc.weight.device)
        if self.cache.length > anchor_pos:  # defensive: never attend to positions >= anchor
            self.cache.crop(anchor_pos)
        # base logits over draft ids, for the n_max slots used only
        hidden_KD, base_KV = m.block_hidden(self.cache, anchor_token, anchor_pos, num_slots=n_max)
        base_KV = base_KV.float()  # the slots' fp32 logits in one conversion (a no-op in fp32)
        dev = hidden_KD.device
        prev = torch.tensor([int(anchor_token)], device=dev)
        if self.tree_width > 1:
            return self._propose_tree(hidden_KD, base_KV, prev, n_max, sampling, generator)
        ids, probs_rows, conf = [], [], []
        markov_state = None  # the Markov head's state along the block (rnn variant; None otherwise)
        for k in range(n_max):
            logits_W, conf_logit, markov_state = m.slot_step(hidden_KD[k], base_KV[k], prev, markov_state)
            if conf_logit is not None:
                c = torch.sigmoid(conf_logit.float())
                if self.confidence_threshold is not None and float(c) < self.confidence_threshold:
                    break
                conf.append(c.reshape(()))
            draft_tok, q_W = draw_token(logits_W, sampling, generator)
            tok = m.target_ids(draft_tok)
            if q_W is not None:
                probs_rows.append(q_W if m.d2t is None else scatter_to_target(q_W, m.d2t, m.config.vocab_size))
            ids.append(tok)
            prev = tok
        if not ids:
            return Proposal.empty(dev)
        return Proposal(
            draft_ids_N=torch.cat(ids).long(),
            draft_probs_NV=torch.stack(probs_rows) if probs_rows else None,
            confidence_N=torch.stack(conf).float() if conf else None,
        )

    def _propose_tree(self, hidden_KD: Tensor, base_KV: Tensor, anchor_1: Tensor, n_max: int,
                      sampling: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """The draft tree of the class docstring over the block's first ``n_max`` slots: per slot, the chain's
        next node first (greedy: the argmax; T > 0: sampled from ``q``, the only sampled node), then the
        W - 1 best other children, all chosen after it (the order :func:`~deepspec.eval.verify.verify_tree`
        needs at T > 0)."""
        m, width = self.model, self.tree_width
        tree = DraftTree()
        nodes, prev_X, state_X = [-1], anchor_1, None  # the kept nodes of the last slot (-1: the anchor)
        score_X = torch.zeros(1, device=anchor_1.device)  # their paths' summed draft log-probabilities
        chain = 0  # which of them is on the chain (kept first)
        for k in range(n_max):
            logits_XW, state_X = m.slot_logits(hidden_KD[k], base_KV[k], prev_X, state_X)
            logp_XW = (torch.log_softmax(logits_XW, dim=-1) if sampling.greedy
                       else sampling_probs(logits_XW, sampling).log())  # filtered tokens: -inf
            chain_id, q_W = draw_token(logits_XW[chain], sampling, generator)  # the argmax when greedy
            top = logp_XW.topk(width, dim=-1)  # [X, width]
            scores, top_ids = (score_X[:, None] + top.values).flatten(), top.indices.flatten()
            ids, chain_key = top_ids.tolist(), (chain, int(chain_id))  # the chain's node is not an "other"
            others = [i for i in scores.argsort(descending=True).tolist()
                      if scores[i] > float("-inf") and (i // width, ids[i]) != chain_key][: width - 1]
            parent_X = [chain] + [i // width for i in others]
            draft_ids = torch.cat([chain_id, top_ids[others]])
            tok_X = m.target_ids(draft_ids)
            q_V = None if q_W is None else (q_W if m.d2t is None else scatter_to_target(q_W, m.d2t, m.config.vocab_size))
            nodes = [tree.add(nodes[p], t, q_V if j == 0 else None)
                     for j, (p, t) in enumerate(zip(parent_X, tok_X.tolist()))]
            score_X = torch.cat([score_X[chain] + logp_XW[chain, chain_id], scores[others]])
            chain, prev_X = 0, tok_X
            if state_X is not None:
                state_X = state_X[parent_X]
        return tree.to_proposal(anchor_1.device)


def check_tree_width(value: object, field: str) -> int:
    """``value`` when it is an integer >= 1 (1: chains, the default); ValueError naming ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}: expected an integer >= 1 (1: a chain of drafts; 2-4: a draft tree verified in "
                         f"one target forward), received {value!r}.")
    return value
