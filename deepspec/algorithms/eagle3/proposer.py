"""The Eagle3 drafter for the decoding engine (docs/design/draft-models.md, "Eagle3"): chains, or draft trees.

Legend: K proposal length (``ttt_steps``), W draft vocab (= V unless reduced), V target vocab, H hidden,
T committed rows, F target feature width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepspec.algorithms.eagle3.model import Eagle3DraftModel
from deepspec.algorithms.protocol import DraftTree, Proposal, TreeLevel, check_tree_width, draw_token, grow_draft_tree
from deepspec.target.decoding import SamplingParams


class Eagle3Proposer:
    """Eagle3 drafter behind the :class:`~deepspec.algorithms.protocol.Proposer` protocol.

    Draft row ``t`` pairs the target feature of position ``t`` with the token at ``t + 1``, so the
    proposer needs the committed *tokens* as well as their features: ``extend_context`` takes
    ``token_ids_T``, the tokens at the same positions as ``target_hidden_TF``. A row enters the draft's KV cache (step 0,
    from target features) once its next token is known; ``propose(anchor_token, anchor_pos)``
    therefore first commits rows ``.. anchor_pos - 1`` (the last one reads the anchor), then drafts
    ``k`` tokens by chaining: step ``j >= 1`` reads the token drafted at step ``j - 1`` and that
    step's own pre-norm hidden state, at RoPE position ``anchor_pos - 1 + j``, attending to every
    committed row and to the chain's earlier steps (the TTT attention rule). Chain K/V are never
    committed: after verify, the accepted positions come back with real target features through
    ``extend_context``, so a rejection needs no crop of the draft's cache.

    Each drafted token is one draft forward (``drafts_serially``): ``propose(..., max_len=m)`` drafts at most
    ``m`` tokens (a tree at most ``m`` deep), the depth a scheduler judged worth drafting
    (:meth:`~deepspec.decoding.schedule.StepScheduler.plan`).

    ``k`` defaults to the draft's ``ttt_steps``; ``max_positions`` caps drafted positions as in
    :class:`~deepspec.algorithms.dspark.proposer.DSparkProposer`. At T = 0 tokens are argmaxes and
    ``draft_probs_NV`` is None; at T > 0 ``sampling_probs(logits, sampling)`` (fp32) is sampled from
    and returned. A reduced draft vocabulary is handled as in DSpark's proposer (draft ids mapped to
    target ids, ``q`` scattered into the full target vocabulary).

    ``tree_width`` W > 1: a draft tree of up to W nodes per depth (EAGLE-2's dynamic draft tree, Li et al.
    2024, s.4): each depth is one :func:`~deepspec.algorithms.protocol.grow_draft_tree` level (the chain's
    next node first, then the W - 1 children with the best summed draft log-probability), and its nodes are
    drafted together in one :meth:`~deepspec.algorithms.eagle3.model.Eagle3DraftModel.tree_step` in which each
    node attends to its own ancestors' steps only, so every path is the chain the draft would have drafted
    along it. ``W * k`` nodes for ``k - 1`` steps of W rows; the target verifies them in one forward.
    """

    drafts_serially = True

    def __init__(self, model, *, k: int | None = None, max_positions: int | None = None, tree_width: int = 1):
        if not isinstance(model, Eagle3DraftModel):
            raise ValueError(f"Eagle3Proposer.model: expected an Eagle3DraftModel, received {type(model).__name__}.")
        self.tree_width = check_tree_width(tree_width, "Eagle3Proposer.tree_width")
        self.model = model.eval()
        self.max_proposal_len = int(k if k is not None else model.config.ttt_steps)
        if self.max_proposal_len < 1:
            raise ValueError(f"Eagle3Proposer.k: expected >= 1, received {self.max_proposal_len}.")
        self.max_positions = int(max_positions if max_positions is not None
                                 else model.config.max_position_embeddings)
        self.reset()

    def prepare(self, num_positions: int) -> None:
        pass  # the draft's cache grows as it goes

    def reset(self) -> None:
        self.cache = self.model.new_cache()
        self.tokens: list[int] = []  # committed tokens by position (0 .. num_features - 1)
        self.pending: list[Tensor] = []  # features [F] of positions cache.length .. num_features - 1
        self.last_hidden: Tensor | None = None  # step-0 output of the last committed row

    @property
    def num_features(self) -> int:
        return self.cache.length + len(self.pending)

    @property
    def num_pending_features(self) -> int:
        """Committed positions whose rows the next :meth:`propose` commits first."""
        return len(self.pending)

    def extend_context(self, target_hidden_TF: Tensor, token_ids_T: Tensor | list[int]) -> None:
        ids = [int(t) for t in (token_ids_T.tolist() if isinstance(token_ids_T, Tensor) else token_ids_T)]
        if len(ids) != target_hidden_TF.shape[0]:
            raise ValueError(f"Eagle3Proposer.extend_context: expected {target_hidden_TF.shape[0]} token ids (one per "
                             f"feature row), received {len(ids)}.")
        start = self.num_features
        del self.tokens[start:]
        self.tokens.extend(ids)
        self.pending.extend(target_hidden_TF.unbind(0))

    @torch.no_grad()
    def propose(
        self,
        anchor_token: int,
        anchor_pos: int,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        max_len: int | None = None,
    ) -> Proposal:
        m = self.model
        dev = m.fc.weight.device
        if anchor_pos < 1 or self.num_features != anchor_pos:
            raise ValueError(f"Eagle3Proposer.propose: expected features of exactly positions 0..{anchor_pos - 1}, "
                             f"received {self.num_features}.")
        if max_len is not None and max_len < 1:
            raise ValueError(f"Eagle3Proposer.propose: expected max_len >= 1 or None, received {max_len}.")
        n_max = min(self.max_proposal_len, self.max_positions - 1 - int(anchor_pos), max_len or self.max_proposal_len)
        if n_max <= 0:
            return Proposal.empty(dev)
        del self.tokens[anchor_pos:]
        self.tokens.append(int(anchor_token))
        # Commit rows cache.length .. anchor_pos - 1 (row t reads token t + 1; the last reads the anchor).
        start = self.cache.length
        if self.pending:
            next_ids = torch.tensor(self.tokens[start + 1: anchor_pos + 1], dtype=torch.long, device=dev)
            self.last_hidden = m.commit_rows(self.cache, next_ids, torch.stack(self.pending))[-1]
            self.pending = []
        if self.tree_width > 1:
            return self._propose_tree(anchor_token, anchor_pos, n_max, sampling, generator)
        hidden = self.last_hidden
        step_k: list[Tensor] = []
        step_v: list[Tensor] = []
        ids, probs_rows = [], []
        for j in range(n_max):
            if j > 0:
                hidden = m.tree_step(self.cache, step_k, step_v, ids[-1], hidden.view(1, -1), anchor_pos - 1 + j)[0]
            draft_tok, q_W = draw_token(m.logits(hidden), sampling, generator)
            if q_W is not None:
                probs_rows.append(m.target_probs(q_W))
            ids.append(m.target_ids(draft_tok))  # the next chain step embeds the target id
        return Proposal(draft_ids_N=torch.cat(ids).long(),
                        draft_probs_NV=torch.stack(probs_rows) if probs_rows else None)

    def _propose_tree(self, anchor_token: int, anchor_pos: int, n_max: int, sampling: SamplingParams,
                      generator: torch.Generator | None) -> Proposal:
        """The draft tree of the class docstring, ``n_max`` deep: a level from the kept nodes' logits, then one
        step for its nodes (each seeing its ancestors' steps) unless it is the last."""
        m, tree = self.model, DraftTree()
        dev = self.last_hidden.device
        level, hidden_XH = TreeLevel.root(anchor_token, dev), self.last_hidden.view(1, -1)
        step_k: list[Tensor] = []
        step_v: list[Tensor] = []
        path_XM = torch.zeros(1, 0, dtype=torch.bool, device=dev)  # each kept node's path among the steps so far
        for j in range(n_max):
            level = grow_draft_tree(tree, level, m.logits(hidden_XH), width=self.tree_width, sampling=sampling,
                                    generator=generator, draft=m)
            if j == n_max - 1:
                break
            visible_XM = path_XM[level.parent_X]
            hidden_XH = m.tree_step(self.cache, step_k, step_v, level.token_ids_X, hidden_XH[level.parent_X],
                                    anchor_pos + j, visible_XM)
            eye = torch.eye(len(level.nodes), dtype=torch.bool, device=dev)
            path_XM = torch.cat([visible_XM, eye], dim=1)
        return tree.to_proposal(dev)
