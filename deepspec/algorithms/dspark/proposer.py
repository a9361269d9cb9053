"""The DSpark / DFlash drafter for the decoding engine (docs/design/decoding.md):
one block forward, then the heads slot by slot.

Legend: K block_size, W draft vocab (= V unless reduced), V target vocab, D draft hidden, T committed positions.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.protocol import (DraftTree, Proposal, TreeLevel, cap_proposal_len, check_tree_width, draw_token,
                                         grow_draft_tree)
from deepspec.target.decoding import SamplingParams


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

    The confidence head gives ``c_k = sigmoid(logit)`` per slot. With a calibration (``calibrate`` and the
    draft's ``confidence_calibration``, fitted on held-out steps in training and loaded with the draft:
    :mod:`deepspec.models.calibration`) ``confidence_N`` holds the calibrated ``c'_k = map_k(c_k)`` and
    ``raw_confidence_N`` the raw ``c_k``; without one ``confidence_N`` holds ``c_k``. With
    ``confidence_threshold`` set, the proposal is cut before the first slot whose ``confidence_N`` value is
    below it.
    ``max_positions`` (the target's ``max_position_embeddings``): draft tokens never land at a
    position ``>= max_positions``. ``num_draft_tokens``: K is at most this (vLLM's
    ``num_speculative_tokens``; the block is still predicted whole and its first slots kept); None: the
    draft's slots.

    ``tree_width`` W > 1: a draft tree of up to W nodes per slot (EAGLE-2's expansion, Li et al. 2024,
    s.4, on DSpark's slots). Slot ``k`` expands each of the W nodes kept at slot ``k - 1`` (the anchor at
    slot 0) with the Markov head fed that node's token, scores each child by the path's summed draft
    log-probability (at T > 0 of ``sampling_probs``, so tokens the filters drop are never proposed),
    and keeps the chain's next node and the W - 1 best other children. The chain is the one the
    chain proposer above would propose: greedy, the argmax path, so a greedy step accepts at least what
    the chain would; at T > 0 sampled from ``q`` (its rows are the tree's ``draft_probs_NV``, every
    other node a chosen point mass, listed after it), so the target's multi-step speculative sampling
    (:func:`~deepspec.decoding.verify.verify_tree`) tests the sampled chain by rejection sampling first and
    the chosen siblings on the residual. ``W * K`` nodes, ``1 + W * (K - 1)`` slot steps (the block
    forward is shared). The target verifies them all in one forward
    (:attr:`~deepspec.algorithms.protocol.Proposal.parents_N`). The confidence head scores the chain's nodes
    (its estimate is for the draft's first choice below an accepted parent): their ``confidence_N`` values,
    calibrated as above, NaN at the other nodes (one extra serial slot step per depth).
    """

    def __init__(self, model, *, confidence_threshold: float | None = None, max_positions: int | None = None,
                 tree_width: int = 1, num_draft_tokens: int | None = None, calibrate: bool = True):
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
        if num_draft_tokens is not None:  # the whole block is still predicted; the first slots are kept
            cap_proposal_len(self, num_draft_tokens)
        self.confidence_threshold = confidence_threshold
        cal = getattr(model, "confidence_calibration", None)
        self.calibration = cal if calibrate and model.confidence_head is not None else None
        self.max_positions = int(max_positions if max_positions is not None
                                 else model.config.max_position_embeddings)
        self.reset()

    def prepare(self, num_positions: int) -> None:
        pass  # the eager context cache grows as it goes (the compiled proposer allocates here)

    def reset(self) -> None:
        self.cache = self.model.new_context_cache()
        self.pending: list[Tensor] = []  # committed positions' features not yet in the cache, in order
        self.num_pending_features = 0  # their positions: the next propose's context flush (a scheduler prices it)

    def extend_context(self, target_hidden_TF: Tensor, token_ids_T: list[int]) -> None:
        """Queue the features ``[T, F]`` of the next committed positions (DSpark's context is the features
        alone); they enter the context cache at the next :meth:`propose`, so a step a scheduler makes without
        a proposal costs no draft forward, and the positions of several such steps enter in one.

        Raises ValueError for a shape other than ``[T, feature_width]``."""
        self.model.check_context_features(target_hidden_TF, "DSparkProposer.extend_context")
        if target_hidden_TF.shape[0]:
            self.pending.append(target_hidden_TF)
            self.num_pending_features += int(target_hidden_TF.shape[0])

    def _flush_context(self) -> None:
        """Append the queued features to the context cache (one draft forward over all of them)."""
        if self.pending:
            feats_TF = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
            self.pending, self.num_pending_features = [], 0
            self.model.append_context(self.cache, feats_TF)

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
        self._flush_context()
        if self.cache.length > anchor_pos:  # defensive: never attend to positions >= anchor
            self.cache.crop(anchor_pos)
        # base logits over draft ids, for the n_max slots used only
        hidden_KD, base_KV = m.block_hidden(self.cache, anchor_token, anchor_pos, num_slots=n_max)
        base_KV = base_KV.float()  # the slots' fp32 logits in one conversion (a no-op in fp32)
        dev = hidden_KD.device
        prev = torch.tensor([int(anchor_token)], device=dev)
        if self.tree_width > 1:
            return self._propose_tree(hidden_KD, base_KV, prev, n_max, sampling, generator)
        ids, probs_rows, conf, raw = [], [], [], []
        markov_state = None  # the Markov head's state along the block (rnn variant; None otherwise)
        for k in range(n_max):
            logits_W, conf_logit, markov_state = m.slot_step(hidden_KD[k], base_KV[k], prev, markov_state)
            if conf_logit is not None:
                c = torch.sigmoid(conf_logit.float()).reshape(())
                if self.calibration is not None:
                    raw.append(c)
                    c = torch.tensor(self.calibration.apply(float(c), k + 1), dtype=torch.float32, device=dev)
                if self.confidence_threshold is not None and float(c) < self.confidence_threshold:
                    if raw:
                        raw.pop()
                    break
                conf.append(c)
            draft_tok, q_W = draw_token(logits_W, sampling, generator)
            tok = m.target_ids(draft_tok)
            if q_W is not None:
                probs_rows.append(m.target_probs(q_W))
            ids.append(tok)
            prev = tok
        if not ids:
            return Proposal.empty(dev)
        return Proposal(
            draft_ids_N=torch.cat(ids).long(),
            draft_probs_NV=torch.stack(probs_rows) if probs_rows else None,
            confidence_N=torch.stack(conf).float() if conf else None,
            raw_confidence_N=torch.stack(raw).float() if raw else None,
        )

    def _propose_tree(self, hidden_KD: Tensor, base_KV: Tensor, anchor_1: Tensor, n_max: int,
                      sampling: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """The draft tree of the class docstring over the block's first ``n_max`` slots, one
        :func:`~deepspec.algorithms.protocol.grow_draft_tree` level per slot (the Markov head fed each kept
        node's token, its state gathered by parent)."""
        m, tree = self.model, DraftTree()
        level, state_X = TreeLevel.root(int(anchor_1), anchor_1.device), None
        chain_prev, chain_state, chain_nodes, raw = anchor_1, None, [], []
        for k in range(n_max):
            logits_XW, state_X = m.slot_logits(hidden_KD[k], base_KV[k], level.token_ids_X, state_X)
            if m.confidence_head is not None:  # the head scores the chain's slot (node 0 of each level)
                _, conf_logit, chain_state = m.slot_step(hidden_KD[k], base_KV[k], chain_prev, chain_state)
                raw.append(float(torch.sigmoid(conf_logit.float())))
            level = grow_draft_tree(tree, level, logits_XW, width=self.tree_width, sampling=sampling,
                                    generator=generator, draft=m)
            chain_nodes.append(level.nodes[0])
            chain_prev = level.token_ids_X[:1]
            if state_X is not None:
                state_X = state_X[level.parent_X]
        proposal = tree.to_proposal(anchor_1.device)
        if not raw:
            return proposal
        conf = self.calibration.apply_all(raw) if self.calibration is not None else raw
        dev = anchor_1.device
        conf_N = torch.full((len(tree),), float("nan"), device=dev)
        conf_N[chain_nodes] = torch.tensor(conf, device=dev)
        raw_N = None
        if self.calibration is not None:
            raw_N = torch.full((len(tree),), float("nan"), device=dev)
            raw_N[chain_nodes] = torch.tensor(raw, device=dev)
        return dataclasses.replace(proposal, confidence_N=conf_N, raw_confidence_N=raw_N)
