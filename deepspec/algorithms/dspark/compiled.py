"""DSpark / DFlash proposals as compiled graphs: a static context cache and one graph per proposal.

Legend: K block_size, J draft slots (``config.num_draft_slots``), F target features, D draft hidden,
Hk key/value heads, d head dim, L the static context length, T positions appended in one call.

The eager :class:`~deepspec.algorithms.dspark.proposer.DSparkProposer` issues a few thousand small
operators per proposal (the block's draft layers, then J serial slot steps of the heads) and grows its
context K/V by concatenation. On a GPU each operator is a kernel launched from Python, so a proposal
costs tens of milliseconds whatever the draft's size: more than the target's own compiled verify step.
:class:`CompiledDSparkProposer` applies to the draft what :mod:`deepspec.decoding.compiled` applies to the
target (gpt-fast's recipe):

- **Static context cache.** Per draft layer, context keys and values ``[1, Hk, L, d]`` allocated once per
  length bucket (:func:`~deepspec.utils.cache_len_bucket` of the generation's positions plus one
  append) and reused; ``length`` (a host int) counts the committed positions. Keys at positions
  ``>= anchor_pos`` are masked, so a rolled-back context needs no copy: the crop only moves ``length``.
- **Two graphs of fixed shapes.** ``append``: the context K/V of ``K + 1`` positions (the most one
  verify step commits), the rows beyond the T given zero-padded and written past ``length``, where the
  next append overwrites them. ``propose``: the block forward over ``[anchor, mask, ..]`` with every
  context slot under a position mask, the output layer over the J slots, then the J greedy slot steps of
  the Markov and confidence heads, returning ``(ids [J], confidence [J] | None)``. Positions and the
  anchor enter as 0-d device tensors at fixed addresses, so no value is baked into a graph.
- **What stays eager**: the prefill's append (longer than ``K + 1``), proposals at a temperature above
  0 (a multinomial draw), proposals cut short by ``max_positions``, and drafts asked for trees. They
  read the same static cache through views (:class:`~deepspec.algorithms.dspark.model.DraftContextCache`).

The proposal is the eager proposer's up to rounding (a masked attention over the whole buffer instead
of the exact context; compiled kernels): the same tokens wherever the draft's top two logits are not
tied within rounding. The target's verification keeps decoding lossless either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch import Tensor

from deepspec.algorithms.dspark.model import DraftContextCache
from deepspec.algorithms.dspark.proposer import DSparkProposer
from deepspec.algorithms.protocol import Proposal
from deepspec.target.decoding import SamplingParams
from deepspec.utils import cache_len_bucket


# One graph per (proposer, cache length) for each of the two steps: a few per engine, a few engines per run
RECOMPILE_LIMIT = 64
RECOMPILE_ERROR = ("CompiledDSparkProposer: torch.compile recompiled a proposal graph past {limit} graphs; it would "
                   "now run eagerly and silently slow. Build fewer compiled proposers in one process, or propose "
                   "with the eager DSparkProposer.")


class CompiledDSparkProposer(DSparkProposer):
    """A :class:`DSparkProposer` (chains only) whose greedy proposals and context appends run compiled.

    Args:
        model: a ``DSparkDraftModel`` in eval mode, on its decoding device and dtype.
        confidence_threshold, max_positions: as :class:`DSparkProposer`; the threshold cuts the compiled
            proposal on the host (slot k's confidence depends only on the slots before it, so the cut is
            the eager proposer's).
        mode: ``torch.compile`` mode; None picks ``"reduce-overhead"`` (CUDA graphs) on CUDA and the default
            elsewhere.
        backend: ``torch.compile`` backend (tests pass ``"eager"`` or a counting backend).

    :meth:`prepare` allocates the cache for a generation's positions and compiles both graphs (the engine
    calls it before its clock starts). Raises ValueError as :class:`DSparkProposer` does.
    """

    def __init__(self, model, *, confidence_threshold: float | None = None, max_positions: int | None = None,
                 mode: str | None = None, backend: str | Callable[..., Any] = "inductor"):
        super().__init__(model, confidence_threshold=confidence_threshold, max_positions=max_positions)
        c = model.config
        self.device = model.fc.weight.device
        self.dtype = model.fc.weight.dtype
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"
        self.mode = mode
        self.append_len = c.block_size + 1  # the most positions one verify step commits
        self.num_layers = len(model.layers)
        self.length = 0
        self._keys: list[Tensor] = []
        self._values: list[Tensor] = []
        # fixed-address inputs of the graphs
        self._pos = torch.zeros((), dtype=torch.long, device=self.device)
        self._anchor = torch.zeros((), dtype=torch.long, device=self.device)
        self._feats = torch.zeros((self.append_len, c.feature_width), dtype=self.dtype, device=self.device)
        for t in (self._pos, self._anchor, self._feats):
            torch._dynamo.mark_static_address(t)
        self._propose_graph = torch.compile(self._propose_block, fullgraph=True, dynamic=False, mode=mode,
                                            backend=backend)
        self._append_graph = torch.compile(self._append_block, fullgraph=True, dynamic=False, mode=mode,
                                           backend=backend)
        self._buffers: dict[int, tuple[list[Tensor], list[Tensor]]] = {}  # L -> (keys, values) per layer

    # ------------------------------------------------------------------ cache
    @property
    def cache_len(self) -> int:
        """L, the static context length allocated (0 before :meth:`prepare`)."""
        return self._keys[0].shape[2] if self._keys else 0

    def prepare(self, num_positions: int) -> None:
        """Hold ``num_positions`` context positions (one length bucket: :func:`cache_len_bucket` of
        ``num_positions`` plus one append) and compile both graphs for it, before a generation is timed.
        Allocates once per bucket (kept for the next generation of that bucket); empties the context."""
        L = cache_len_bucket(int(num_positions) + self.append_len)
        new = L not in self._buffers
        if new:  # allocated once per bucket and kept: a CUDA graph reads fixed addresses
            self._buffers[L] = self._allocate(L)
        self._keys, self._values = self._buffers[L]
        if new:  # compile both graphs for this bucket on throwaway input
            self.length = 0
            self._feats.zero_()
            self._run_append(self.append_len)
            self._run_propose(int(self.model.config.mask_token_id), 1)
        self.reset()

    def _allocate(self, L: int) -> tuple[list[Tensor], list[Tensor]]:
        """Zeroed context keys and values ``[1, Hk, L, d]`` per layer, at static addresses."""
        c = self.model.config
        shape = (1, c.num_key_value_heads, L, c.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for t in (*keys, *values):
            torch._dynamo.mark_static_address(t)
        return keys, values

    def reset(self) -> None:
        super().reset()  # the eager fallback's view and queue (this proposer appends at once, into its buffers)
        self.length = 0

    def _context_view(self) -> DraftContextCache:
        """The committed context as the eager proposer's cache (views of the static buffers)."""
        n = self.length
        return DraftContextCache(k=[k[:, :, :n] for k in self._keys], v=[v[:, :, :n] for v in self._values],
                                 length=n)

    # ------------------------------------------------------------------ graphs
    def _append_block(self, feats_TF: Tensor, start: Tensor, keys: list[Tensor], values: list[Tensor]) -> None:
        m = self.model
        T = feats_TF.shape[0]
        ctx_1TD = m.context_features(feats_TF.unsqueeze(0))
        pos_T = start + torch.arange(T, device=feats_TF.device)
        cos, sin = m._rope(ctx_1TD, pos_T.unsqueeze(0))
        for layer, k_buf, v_buf in zip(m.layers, keys, values):
            k, v = layer.self_attn.context_kv(ctx_1TD, cos, sin)
            k_buf.index_copy_(2, pos_T, k.to(k_buf.dtype))
            v_buf.index_copy_(2, pos_T, v.to(v_buf.dtype))

    def _propose_block(self, anchor: Tensor, anchor_pos: Tensor, keys: list[Tensor],
                       values: list[Tensor]) -> tuple[Tensor, Tensor | None]:
        m, c = self.model, self.model.config
        K, L, dev = c.block_size, keys[0].shape[2], anchor.device
        ids_1K = torch.cat([anchor.view(1, 1), torch.full((1, K - 1), c.mask_token_id, dtype=torch.long, device=dev)],
                           dim=1)
        h = m.embed(ids_1K).to(m.fc.weight.dtype)
        cos, sin = m._rope(h, (anchor_pos + torch.arange(K, device=dev)).unsqueeze(0))
        context_seen_L = torch.arange(L, device=dev) < anchor_pos  # the committed context: positions < anchor
        mask_11KX = torch.cat([context_seen_L.expand(K, L), torch.ones(K, K, dtype=torch.bool, device=dev)],
                              dim=1)[None, None]
        for layer, ctx_k, ctx_v in zip(m.layers, keys, values):
            h = layer(h, cos, sin, ctx_k, ctx_v, mask_11KX)
        hidden_JD = m.norm(h)[0, c.first_draft_slot:]
        base_JV = m.lm_head(hidden_JD).float()
        prev, state, ids, confs = anchor.view(1), None, [], []
        for k in range(hidden_JD.shape[0]):
            logits_W, conf_logit, state = m.slot_step(hidden_JD[k], base_JV[k], prev, state)
            prev = m.target_ids(logits_W.argmax().view(1))
            ids.append(prev)
            if conf_logit is not None:
                confs.append(torch.sigmoid(conf_logit.float()).reshape(1))
        return torch.cat(ids), (torch.cat(confs) if confs else None)

    def _call(self, graph: Callable[..., Any], *args: Any) -> Any:
        """One graph call; a recompile past :data:`RECOMPILE_LIMIT` is an error, never a silent eager run."""
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=RECOMPILE_LIMIT):
                return graph(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            raise RuntimeError(RECOMPILE_ERROR.format(limit=RECOMPILE_LIMIT)) from exc

    def _run_append(self, T: int) -> None:
        self._pos.fill_(self.length)
        self._call(self._append_graph, self._feats, self._pos, self._keys, self._values)
        self.length += T

    def _run_propose(self, anchor_token: int, anchor_pos: int) -> tuple[Tensor, Tensor | None]:
        self._anchor.fill_(int(anchor_token))
        self._pos.fill_(int(anchor_pos))
        ids_J, conf_J = self._call(self._propose_graph, self._anchor, self._pos, self._keys, self._values)
        # copies: CUDA graph outputs live in a pool the next replay overwrites
        return ids_J.clone(), None if conf_J is None else conf_J.clone()

    # ------------------------------------------------------------------ the Proposer protocol
    @torch.no_grad()
    def extend_context(self, target_hidden_TF: Tensor, token_ids_T: list[int]) -> None:
        """Append the committed positions' features (``[T, F]``): compiled for ``T <= K + 1``, eagerly
        (the prefill) above. Raises RuntimeError before :meth:`prepare`, or past the cache's length."""
        T = int(target_hidden_TF.shape[0])
        if not self._keys:
            raise RuntimeError("CompiledDSparkProposer: call prepare(num_positions) before a generation")
        if self.length + max(T, self.append_len) > self.cache_len:
            raise RuntimeError(f"CompiledDSparkProposer: {self.length} + {T} context positions exceed its "
                               f"{self.cache_len}; prepare() it for the generation's positions")
        if T == 0:
            return
        if T <= self.append_len:
            self._feats[:T].copy_(target_hidden_TF)
            self._feats[T:].zero_()
            self._run_append(T)
            return
        m = self.model
        ctx_1TD = m.context_features(target_hidden_TF.to(self.device).unsqueeze(0))
        pos_T = torch.arange(self.length, self.length + T, device=self.device)
        cos, sin = m._rope(ctx_1TD, pos_T.unsqueeze(0))
        for layer, k_buf, v_buf in zip(m.layers, self._keys, self._values):
            k, v = layer.self_attn.context_kv(ctx_1TD, cos, sin)
            k_buf[:, :, self.length:self.length + T] = k
            v_buf[:, :, self.length:self.length + T] = v
        self.length += T

    @torch.no_grad()
    def propose(self, anchor_token: int, anchor_pos: int, *, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """The proposal of :meth:`DSparkProposer.propose`: compiled when greedy with the whole block
        (module docstring), else eagerly over the same cache."""
        if self.length > anchor_pos:  # a rejected proposal's positions: roll back
            self.length = int(anchor_pos)
        n_max = min(self.max_proposal_len, self.max_positions - 1 - int(anchor_pos))
        if (not sampling.greedy or n_max < self.max_proposal_len or self.tree_width > 1 or n_max <= 0
                or self.length != anchor_pos):
            self.cache = self._context_view()
            return super().propose(anchor_token, anchor_pos, sampling=sampling, generator=generator)
        ids_J, conf_J = self._run_propose(anchor_token, anchor_pos)
        ids_J, conf_J = ids_J[:n_max], None if conf_J is None else conf_J[:n_max]  # a capped K
        raw_J = None
        if conf_J is not None and self.calibration is not None:  # the eager proposer's map, on the host
            raw_J = conf_J.float()
            conf_J = torch.tensor(self.calibration.apply_all(raw_J.tolist()), dtype=torch.float32,
                                  device=raw_J.device)
        if conf_J is not None and self.confidence_threshold is not None:
            below = (conf_J < self.confidence_threshold).nonzero()
            if below.numel():
                n = int(below[0, 0])
                ids_J, conf_J = ids_J[:n], conf_J[:n]
                raw_J = None if raw_J is None else raw_J[:n]
            if ids_J.numel() == 0:
                return Proposal.empty(self.device)
        return Proposal(draft_ids_N=ids_J, draft_probs_NV=None, confidence_N=conf_J, raw_confidence_N=raw_J)


def compile_proposer(proposer: Any, *, backend: str | Callable[..., Any] = "inductor") -> Any:
    """``proposer`` with its DSpark / DFlash chain draft on compiled graphs: a :class:`DSparkProposer`
    becomes a :class:`CompiledDSparkProposer` (same model, threshold, positions, K and calibration); a proposer that
    routes to a ``draft`` (prompt lookup in front) gets its draft replaced so; any other proposer (trees,
    Eagle3, n-gram, target-only) is returned as it is."""
    draft = getattr(proposer, "draft", None)
    if draft is not None:
        proposer.draft = compile_proposer(draft, backend=backend)
        return proposer
    if type(proposer) is not DSparkProposer or proposer.tree_width > 1:
        return proposer
    compiled = CompiledDSparkProposer(proposer.model, confidence_threshold=proposer.confidence_threshold,
                                      max_positions=proposer.max_positions, backend=backend)
    compiled.max_proposal_len = proposer.max_proposal_len
    compiled.calibration = proposer.calibration  # the eager proposer's choice (calibrate or not)
    return compiled
