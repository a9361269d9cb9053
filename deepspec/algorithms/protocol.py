"""The two small protocols a drafting algorithm implements, and the data they exchange.

This module imports no algorithm, trainer or evaluation code (only :mod:`deepspec.target` and
:mod:`deepspec.models`), so every algorithm folder, the trainer and the engine can depend on it.

Training (:class:`DraftAlgorithm`, :class:`DraftOptions`, :class:`LossLike`, :class:`TrainBatch`). An
algorithm is a few things (docs/design/: draft-models.md, training.md, decoding.md): its training options
(a :class:`DraftOptions` dataclass, ``deepspec train``'s flags), a draft model (built from the target's
configuration and the options, saved and loaded as safetensors + ``config.json``), a training loss, a
proposer for the speculative decoding engine, and the serving-engine layouts its drafts export to
(:class:`~deepspec.models.engine_layout.ExportFormat`). The trainer runs every algorithm through the same loop:

    prepared = algo.prepare(model, batch, generator, options)  # per micro-batch (e.g. DSpark's anchors)
    weight_sum = sum(algo.weight(model, p) for p in micro)  # the global batch's supervision weight
    out = algo.loss(model, prepared, weight_sum=weight_sum) # sum over the micro-batch / weight_sum

so the loss of a step is the supervision-weighted mean over the whole global batch, whatever the
micro-batching (and, under data parallelism, ranks all-reduce ``weight_sum``).

Decoding (:class:`Proposer`, :class:`Proposal`, :func:`draw_token`, :class:`NullProposer`). The
engine (``deepspec.decoding.engine``) drives every proposer through the same four calls:

0. ``prepare(num_positions)`` before each generation, untimed: the most positions it will hold (most
   proposers do nothing; a compiled draft allocates its static buffers and compiles for them);
1. ``reset()`` before each prompt;
2. ``extend_context(target_hidden_TF, token_ids_T)`` with the target features of the next committed
   positions and the tokens at those positions, in order (first the whole prompt after prefill,
   then after every verify step the verified, committed positions ``anchor .. anchor + num_accepted``);
3. ``propose(anchor_token, anchor_pos, sampling=..., generator=...)``.

Context invariant: when ``propose(anchor_pos=p)`` is called the proposer has received the features
of exactly positions ``0 .. p-1``; the anchor token itself has no target feature yet (it was just
sampled from the target). A proposer may return fewer than ``max_proposal_len`` tokens (even 0; the
engine then does a plain target step). The engine itself truncates a proposal that would run past
the target's ``max_position_embeddings`` (the proposer is not told; it simply sees fewer committed
features next step). A proposer with ``max_proposal_len == 0`` (``NullProposer``) gets no
``extend_context`` calls: the engine then runs the target without capturing features. A proposer
that reads only token ids declares ``needs_features = False`` (the n-gram baseline,
:mod:`deepspec.algorithms.ngram`): its ``extend_context`` gets ``target_hidden_TF=None`` and the target
runs without capture hooks too. A proposer without the attribute needs features.

Legend: B batch, S padded sequence length, A anchors per sequence, H target hidden, F feature width
(``len(target_layer_ids) * hidden_size``), T positions, N proposal length (number of draft tokens,
0 <= N <= K), V target vocab, W draft vocab (= V unless reduced).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from deepspec.models.acceptance import AcceptanceCounts
from deepspec.models.engine_layout import ExportFormat
from deepspec.target.decoding import SamplingParams, greedy_tokens, sampling_probs


@dataclass
class TrainBatch:
    """One micro-batch, right-padded. Padding has ``loss_mask`` 0 so it carries no anchor and no loss.

    Two forms. As collated on the host (:func:`deepspec.train.data.collate`) the features keep the
    target cache's storage dtype (float32, bfloat16, float16, or fp8: float8_e4m3fn payload with
    ``target_hidden_scale_BSn``), so the host copies and the host-to-device transfer move the stored
    bytes. :func:`deepspec.train.data.batch_to_device` moves it and turns the features into float32 on
    the device (``target_hidden_scale_BSn`` then None): the form ``algo.weight`` and ``algo.loss`` read.
    ``algo.prepare`` runs on the host form and reads only ids and the loss mask.
    """

    input_ids_BS: torch.Tensor  # int64
    loss_mask_BS: torch.Tensor  # int64 (0/1)
    target_hidden_BSF: torch.Tensor  # float32 on the device; the storage dtype on the host (fp8: float8_e4m3fn)
    target_last_hidden_BSH: torch.Tensor  # float32 on the device; the storage dtype on the host
    sample_indices: list[int]
    # the target logits' logsumexp (float32, NaN where no loss reads) and argmax (int64, -1 there) at each
    # position, from the target cache (deepspec.target.capture.target_logit_stats); None: compute them
    target_logsumexp_BS: torch.Tensor | None = None
    target_argmax_BS: torch.Tensor | None = None
    # fp8 storage on the host only: float32 [B, S, n] per-token, per-layer scales of target_hidden_BSF
    # (deepspec.data.cache.fp8; padding 0); None otherwise and after batch_to_device
    target_hidden_scale_BSn: torch.Tensor | None = None


class LossLike(Protocol):
    loss: torch.Tensor  # scalar, differentiable: this micro-batch's share of the global-batch mean
    # additive acceptance counts (summed over the global batch and ranks, then turned into the tau
    # estimates); None when the loss has no target distribution to compare with
    acceptance: AcceptanceCounts | None

    def scalars(self) -> dict[str, float]: ...  # what the trainer logs (summed over micro-batches)


# field metadata of an algorithm's option (:func:`option`)
OPTION_ELSEWHERE = "deepspec_elsewhere"
OPTION_REFUSED_ELSEWHERE = "deepspec_refused_elsewhere"


@dataclass(kw_only=True)
class DraftOptions:
    """The draft settings every algorithm reads: the base of each algorithm's ``Options``.

    An algorithm's ``Options`` is a keyword-only dataclass deriving from this one, one field per setting, each
    with its ``--help`` text as the field's comment (the trailing ``# ...``, else the comment lines above it;
    :func:`deepspec.config.field_comments`) and its section as a ``# -- Title --`` header. ``deepspec train``
    exposes the union of the registered algorithms' options as flags
    (:func:`deepspec.train.config.train_config_class`), so an option needs no line outside its algorithm's folder.
    Fields declared by two algorithms are one flag: they must agree on type and default. An option holds data
    only (no ``__post_init__``, no methods): the algorithm checks it (``check_options``).

    Each field of a subclass says what another algorithm does with it when it is set away from its default
    (:func:`option`): ignore it with a warning, or refuse it.
    """

    # -- Draft --
    num_draft_layers: int = 1  # decoder layers of the draft
    # the draft layers' attention: qwen3 (per-head q/k RMSNorm, no bias, for any target family: the layer vLLM's
    # DSpark loader builds) | target (the target family's own) | auto (qwen3 for dspark/dflash, target for eagle3
    # and with --init-from-target)
    draft_backbone: str = "auto"


def option(default: Any = None, *, elsewhere: str, refused_elsewhere: bool = False) -> Any:
    """A field of an algorithm's :class:`DraftOptions` subclass with a default and what another algorithm
    does with it, set away from that default (``deepspec.train.config`` acts on it):

    - ``refused_elsewhere`` False (settings a shared recipe gives every algorithm: shapes, budgets): the run
      goes on and warns ``--FLAG VALUE is ignored: a <algorithm> draft <elsewhere>``; the same words serve a
      configuration of the owning algorithm that does not read it (its ``ignored_options``).
    - ``refused_elsewhere`` True (settings that change what a draft learns or starts from, given on purpose):
      ``train.FIELD: <elsewhere>; <algorithm> has its own options (...): drop --FLAG``.
    """
    return dataclasses.field(default=default, metadata={OPTION_ELSEWHERE: elsewhere,
                                                        OPTION_REFUSED_ELSEWHERE: refused_elsewhere})


@dataclass(frozen=True)
class TrainingShape:
    """What a training step of an algorithm supervises per sequence, for the trainer's messages and its
    learning curve (:meth:`DraftAlgorithm.training_shape`).

    ``proposal_len``: the most tokens one proposal of the draft holds (the held-out reference's margin,
    :func:`deepspec.train.heldout.make_reference`). ``rows``: the supervised rows of a sequence in words
    (``"32 anchors x block 7"``). ``memory_flags``: the algorithm's flags whose lower values shrink a
    micro-batch (``--num-anchors``); ``memory_fixes``: its other ways out of memory, worded for the message.
    """

    proposal_len: int
    rows: str
    memory_flags: tuple[str, ...] = ()
    memory_fixes: tuple[str, ...] = ()


class DraftAlgorithm(Protocol):
    """What the trainer, the evaluation and the export need from a drafting algorithm."""

    name: str
    # the algorithm's training options: a DraftOptions dataclass (``deepspec train`` flags)
    Options: type[DraftOptions]
    # format name -> the layout that carries its drafts (``deepspec export --format``)
    export_formats: dict[str, ExportFormat]

    def check_options(self, options: Any) -> None:
        """Raise ValueError (naming ``train.<field>``, what was expected and the fix) for options this
        algorithm cannot train with; ``options`` is an instance of :attr:`Options`."""
        ...

    def ignored_options(self, options: Any) -> tuple[str, ...]:
        """The fields of :attr:`Options` this configuration of the algorithm does not read (the trainer warns
        when they are set away from their defaults; e.g. DFlash, DSpark without heads, and the Markov head's)."""
        ...

    def training_shape(self, options: Any) -> TrainingShape:
        """What a training step with ``options`` supervises (:class:`TrainingShape`)."""
        ...

    def build(self, target_model: nn.Module, tokenizer: Any, options: Any, target_layer_ids: list[int], *,
              d2t: torch.Tensor | None = None) -> nn.Module:
        """A freshly initialised draft for this target from ``options`` (an instance of :attr:`Options`,
        checked with :meth:`check_options`; the caller seeds). ``d2t``: the reduced draft vocabulary (draft ->
        target ids) when ``train --draft-vocab-size`` asks for one (:func:`deepspec.models.vocab.select_draft_vocab`);
        an algorithm without that support refuses it."""
        ...

    def load(self, path: str | Path) -> nn.Module:
        """A draft saved by ``model.save_pretrained(path)``."""
        ...

    def prepare(self, model: nn.Module, batch: TrainBatch, generator: torch.Generator, options: Any) -> Any:
        """Everything a micro-batch's loss needs besides the model (a pure function of the generator state)."""
        ...

    def weight(self, model: nn.Module, prepared: Any) -> torch.Tensor:
        """This micro-batch's total supervision weight (float scalar), for global-batch normalisation."""
        ...

    def loss(self, model: nn.Module, prepared: Any, *, weight_sum: torch.Tensor, autocast: Any) -> LossLike:
        """The micro-batch's weighted loss sum divided by ``weight_sum`` (the global batch's weight)."""
        ...

    def proposer(self, model: nn.Module, *, confidence_threshold: float | None = None,
                 max_positions: int | None = None, tree_width: int = 1,
                 num_draft_tokens: int | None = None) -> Proposer:
        """A :class:`Proposer` drafting with ``model``, built with its final settings (the decoding set-up:
        :func:`deepspec.decoding.settings.build_proposers`): at most ``num_draft_tokens`` tokens per step
        (None: the draft's own K; :func:`cap_proposal_len`), a draft tree of ``tree_width`` nodes per slot
        (1: a chain; an algorithm that drafts chains only ignores more), proposals cut at
        ``confidence_threshold`` (algorithms without a confidence head ignore it)."""
        ...

    def owns(self, model: nn.Module) -> bool:
        """Whether ``model`` is a draft of this algorithm's model class."""
        ...


@dataclass(kw_only=True)
class Proposal:
    """What a proposer returns for one speculative step.

    Attributes:
        draft_ids_N: int64 ``[N]``, the proposed tokens ``d_1 .. d_N`` (positions
            ``anchor_pos + 1 .. anchor_pos + N``).
        draft_probs_NV: float32 ``[N, V]``, row ``i`` is the distribution ``q_i`` that ``d_i`` was
            sampled from: ``sampling_probs(draft_logits_i, sampling)`` (temperature, top-k, top-p),
            the very tensor the token was drawn from. Used by rejection sampling at T > 0; at T = 0 the
            verify is greedy and only ``draft_ids_N`` is read (a one-hot is NOT required), so a
            greedy proposer may return ``None`` here.
        confidence_N: float32 ``[N]`` or ``None``: the proposer's own acceptance estimate per slot
            (the scheduler's prior and the eval's calibration figures; a proposer that cuts its proposal on
            confidence does so itself). A calibrated drafter gives its calibrated values here.
        raw_confidence_N: float32 ``[N]`` or ``None``: the uncalibrated head's values when ``confidence_N``
            was calibrated (:mod:`deepspec.models.calibration`); None when ``confidence_N`` is raw itself.
        max_proposal_len: the most tokens the proposer that made this proposal could have proposed
            (its K), or ``None``: the proposer's ``max_proposal_len``. Set by a proposer that routes
            between proposers of different K (:class:`~deepspec.algorithms.ngram.LookupFirstProposer`),
            so a step's truncation is judged against the K of whichever proposed.
        parents_N: ``None`` for a chain (``d_i`` follows ``d_{i-1}``), or a draft tree: node ``i``'s
            parent, ``-1`` for the anchor, else an earlier node (``parents_N[i] < i``), no two siblings
            with the same token (build one with :class:`DraftTree`). Node ``i`` sits at position
            ``anchor_pos + depth_i``; the target verifies every node in one forward with a tree
            attention mask and walks the tree with its own tokens (greedy: the longest path it agrees
            with; T > 0: its draws; :func:`~deepspec.decoding.verify.verify_tree`; SpecInfer, Miao et al.
            2024, s.4; EAGLE-2, Li et al. 2024, s.4). A tree's ``confidence_N`` (optional, one value per
            node) is NaN at the nodes the proposer does not score; the scored nodes form one path from the
            anchor (DSpark scores its chain, the draft's first choices: :meth:`scored_path`). At T > 0 its
            ``draft_probs_NV`` (optional) gives the distribution each node was drawn from: a node
            *sampled* from the draft's ``q`` has ``q`` as its row, a *chosen* node (top-k, a lookup's
            match) a point mass on its token; ``None`` means every node was chosen. A sampled node must
            come before any sibling whose choice depended on it (SpecInfer's multi-step speculative
            sampling tests a node's children in order; :func:`~deepspec.decoding.verify.verify_tree`).
        sources_N: where each node came from, one of :data:`SOURCES` per node (``"lookup"``: a prompt-lookup
            match, ``"corpus"``: a corpus continuation), or ``None``: every node is a draft model's
            (``"draft"``). The scheduler keeps acceptance estimates per source.
    """

    draft_ids_N: Tensor
    draft_probs_NV: Tensor | None = None
    confidence_N: Tensor | None = None
    max_proposal_len: int | None = None
    parents_N: tuple[int, ...] | None = None
    raw_confidence_N: Tensor | None = None
    sources_N: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.draft_ids_N.dim() != 1:
            raise ValueError(
                f"Proposal.draft_ids_N: expected a 1-D tensor [N], received shape "
                f"{tuple(self.draft_ids_N.shape)}; squeeze the batch axis (the engine is batch size 1)."
            )
        if self.draft_probs_NV is not None and (
            self.draft_probs_NV.dim() != 2 or self.draft_probs_NV.shape[0] != self.draft_ids_N.shape[0]
        ):
            raise ValueError(
                f"Proposal.draft_probs_NV: expected shape [N={self.draft_ids_N.shape[0]}, V], received "
                f"{tuple(self.draft_probs_NV.shape)}; give one draft distribution per draft token."
            )
        if self.parents_N is not None:
            n = self.num_proposed
            if len(self.parents_N) != n:
                raise ValueError(f"Proposal.parents_N: expected one parent per draft token ({n}), received "
                                 f"{len(self.parents_N)}.")
            bad = next((i for i, p in enumerate(self.parents_N) if not -1 <= p < i), None)
            if bad is not None:
                raise ValueError(f"Proposal.parents_N[{bad}]: expected -1 (the anchor) or an earlier node "
                                 f"(0..{bad - 1}), received {self.parents_N[bad]}; list parents before children.")
            for name in ("confidence_N", "raw_confidence_N"):
                value = getattr(self, name)
                if value is not None and tuple(value.shape) != (n,):
                    raise ValueError(f"Proposal.{name}: a draft tree's confidences are one per node ([{n}]), "
                                     f"received shape {tuple(value.shape)}.")
            if self.confidence_N is not None:
                self.scored_path()  # raises unless the scored nodes form one path from the anchor
        if self.sources_N is not None and (len(self.sources_N) != self.num_proposed
                                           or any(x not in SOURCES for x in self.sources_N)):
            raise ValueError(f"Proposal.sources_N: expected one of {', '.join(SOURCES)} per draft token "
                             f"({self.num_proposed}), received {self.sources_N!r}.")

    def node_scores(self) -> list[float | None]:
        """Each node's own score: its ``confidence_N`` value where that is not NaN, else None (every node
        without ``confidence_N``; a DSpark tree's nodes off its scored path)."""
        if self.confidence_N is None:
            return [None] * self.num_proposed
        return [None if math.isnan(c) else c for c in self.confidence_N.tolist()]

    def scored_path(self) -> list[int]:
        """A tree's scored nodes (:meth:`node_scores` not None) in depth order: a path from the anchor (depth 1,
        2, ..); a chain's nodes ``0..N-1``; ``[]`` without ``confidence_N``. Raises ValueError when a tree's
        scored nodes do not form such a path (two at one depth, or one whose parent is not scored)."""
        if self.confidence_N is None:
            return []
        if self.parents_N is None:
            return list(range(self.num_proposed))
        scored = [i for i, c in enumerate(self.node_scores()) if c is not None]
        for j, i in enumerate(scored):
            if self.parents_N[i] != (scored[j - 1] if j else -1):
                raise ValueError(f"Proposal.confidence_N: a draft tree's scored nodes must form one path from the "
                                 f"anchor; node {i} (parent {self.parents_N[i]}) does not continue {scored[:j]}. "
                                 "Give NaN to the nodes off the path.")
        return scored

    @property
    def num_proposed(self) -> int:
        """N: the proposal's draft tokens (a tree's nodes)."""
        return int(self.draft_ids_N.shape[0])

    @property
    def depths_N(self) -> list[int]:
        """Each draft token's depth: 1 for the anchor's children (a chain's ``d_i`` has depth ``i``)."""
        if self.parents_N is None:
            return list(range(1, self.num_proposed + 1))
        depths: list[int] = []
        for p in self.parents_N:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    @property
    def depth(self) -> int:
        """The most draft tokens one step can accept: N for a chain, the longest path of a tree."""
        return max(self.depths_N, default=0)

    def truncated(self, max_depth: int) -> "Proposal":
        """This proposal without the tokens deeper than ``max_depth`` (the engine's cut at the target's
        ``max_position_embeddings``): a chain's first ``max_depth`` tokens, a tree's nodes of depth
        ``<= max_depth`` (renumbered, parents still before children). Returns ``self`` when nothing is cut."""
        max_depth = max(int(max_depth), 0)
        if self.depth <= max_depth:
            return self
        return self.subset([i for i, d in enumerate(self.depths_N) if d <= max_depth])

    def subset(self, keep: Sequence[int]) -> "Proposal":
        """This proposal with only the nodes ``keep`` (increasing indices, every kept node's parent kept:
        a chain's prefix, a subtree hanging from the anchor), renumbered with parents before children.

        Raises ValueError for indices out of order or out of range, or a kept node whose parent is not kept.
        """
        keep = [int(i) for i in keep]
        n = self.num_proposed
        if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and not 0 <= keep[0] <= keep[-1] < n):
            raise ValueError(f"Proposal.subset: expected increasing node indices in 0..{n - 1}, got {keep}")
        parents = self.parents_N if self.parents_N is not None else tuple(range(-1, n - 1))
        new_index = {old: new for new, old in enumerate(keep)}
        orphan = next((i for i in keep if parents[i] >= 0 and parents[i] not in new_index), None)
        if orphan is not None:
            raise ValueError(f"Proposal.subset: node {orphan} is kept without its parent {parents[orphan]}; keep "
                             "every kept node's ancestors")
        rows = torch.tensor(keep, dtype=torch.long, device=self.draft_ids_N.device)
        return dataclasses.replace(
            self, draft_ids_N=self.draft_ids_N[rows],
            draft_probs_NV=None if self.draft_probs_NV is None else self.draft_probs_NV[rows.to(self.draft_probs_NV.device)],
            confidence_N=None if self.confidence_N is None else self.confidence_N[rows.to(self.confidence_N.device)],
            raw_confidence_N=(None if self.raw_confidence_N is None
                              else self.raw_confidence_N[rows.to(self.raw_confidence_N.device)]),
            parents_N=None if self.parents_N is None else tuple(-1 if parents[i] < 0 else new_index[parents[i]]
                                                                for i in keep),
            sources_N=None if self.sources_N is None else tuple(self.sources_N[i] for i in keep))

    def source(self, i: int) -> str:
        """Where node ``i`` came from (:attr:`sources_N`; ``"draft"`` when not recorded)."""
        return DRAFT_SOURCE if self.sources_N is None else self.sources_N[i]

    def with_source(self, source: str) -> "Proposal":
        """This proposal with every node marked as coming from ``source`` (one of :data:`SOURCES`)."""
        if source not in SOURCES:
            raise ValueError(f"Proposal.with_source: expected one of {', '.join(SOURCES)}, got {source!r}")
        return dataclasses.replace(self, sources_N=None if source == DRAFT_SOURCE else (source,) * self.num_proposed)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "Proposal":
        """A proposal of zero tokens (the engine then does a plain target-only step)."""
        return Proposal(draft_ids_N=torch.zeros(0, dtype=torch.long, device=device))


DRAFT_SOURCE = "draft"
SOURCES = (DRAFT_SOURCE, "lookup", "corpus")  # where a proposal's nodes come from (Proposal.sources_N)


class DraftTree:
    """Builds a draft tree (:attr:`Proposal.parents_N`) from paths, merging shared prefixes.

    ``add(parent, token)`` returns the node of ``token`` under ``parent`` (``-1``: the anchor), creating
    it unless that sibling exists, so several candidate continuations (a draft's branches, a prompt
    lookup's match) become one trie with distinct siblings, the form tree verification reads. At T > 0
    ``add(.., q_V=q)`` marks a node sampled from ``q`` (:attr:`Proposal.parents_N`). Only a *chosen* copy
    may merge into an existing node, which is exact: once a node is rejected its token has probability 0
    in the residual, so the copy would be rejected and would leave the residual as it is. A sampled copy
    may not: rejected, it would still change the residual (``max(0, p - q)``). So add sampled proposals
    (a draft's) before chosen ones (a lookup's match); :meth:`add` raises ValueError otherwise.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._children: dict[tuple[int, int], int] = {}
        self._probs: dict[int, Tensor] = {}  # node -> the q it was sampled from
        self.sources: list[str] = []  # node -> where it came from (the first proposal that added it)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, q_V: Tensor | None = None, source: str = DRAFT_SOURCE) -> int:
        """The node index of ``token`` as a child of node ``parent`` (-1: the anchor); ``q_V`` fp32 ``[V]``:
        the distribution over target ids a new node was sampled from (None: chosen); ``source``: where a new
        node came from (:attr:`Proposal.sources_N`).

        Raises ValueError when a sampled node (``q_V`` given) repeats a node already in the tree."""
        key = (int(parent), int(token))
        node = self._children.get(key)
        if node is not None and q_V is not None:
            raise ValueError(f"DraftTree.add: token {key[1]} under node {key[0]} is already in the tree, and a sampled "
                             "copy cannot merge into it (its rejection would change the residual); add sampled "
                             "proposals before chosen ones.")
        if node is None:
            node = self._children[key] = len(self.tokens)
            self.tokens.append(key[1])
            self.parents.append(key[0])
            self.sources.append(source)
            if q_V is not None:
                self._probs[node] = q_V
        return node

    def add_path(self, tokens: Sequence[int], parent: int = -1) -> list[int]:
        """Add ``tokens`` as a path below ``parent``; returns its nodes."""
        nodes = []
        for t in tokens:
            parent = self.add(parent, t)
            nodes.append(parent)
        return nodes

    def add_proposal(self, proposal: Proposal) -> None:
        """Add a chain's tokens, or a tree's nodes (merged where they repeat a path already here), below the
        anchor, with the distributions they were drawn from (``draft_probs_NV``; a point mass: chosen)."""
        probs = proposal.draft_probs_NV
        parents = proposal.parents_N if proposal.parents_N is not None else range(-1, proposal.num_proposed - 1)
        nodes: list[int] = []
        for i, (p, t) in enumerate(zip(parents, proposal.draft_ids_N.tolist())):
            q_V = None if probs is None or bool(probs[i, t] == 1) else probs[i]
            nodes.append(self.add(-1 if p < 0 else nodes[p], t, q_V, proposal.source(i)))

    def to_proposal(self, device: torch.device | str = "cpu", **kwargs: Any) -> Proposal:
        """The tree as a :class:`Proposal` (``kwargs``: its other fields, e.g. ``max_proposal_len``): with
        ``draft_probs_NV`` when a node was sampled (the chosen nodes' rows point masses), else None."""
        ids = torch.tensor(self.tokens, dtype=torch.long, device=device)
        probs = None
        if self._probs:
            first = next(iter(self._probs.values()))
            probs = first.new_zeros(len(self.tokens), first.shape[-1])
            probs[torch.arange(len(self.tokens)), ids.to(first.device)] = 1.0
            for node, q_V in self._probs.items():
                probs[node] = q_V
        sources = None if all(x == DRAFT_SOURCE for x in self.sources) else tuple(self.sources)
        return Proposal(draft_ids_N=ids, parents_N=tuple(self.parents), draft_probs_NV=probs, sources_N=sources,
                        **kwargs)


@dataclass
class TreeLevel:
    """The nodes a draft tree keeps at one depth (:func:`grow_draft_tree`): ``nodes`` their indices in the
    :class:`DraftTree` (``[-1]``: the anchor, before the first level), ``scores_X`` fp32 ``[X]`` their paths'
    summed draft log-probabilities, ``parent_X`` the index in the previous level of each one's parent (so a
    drafter gathers its per-node state with it), ``token_ids_X`` int64 ``[X]`` their target ids. Node 0 is
    the chain's (the path the chain proposer would draft)."""

    nodes: list[int]
    scores_X: Tensor
    parent_X: list[int]
    token_ids_X: Tensor

    @staticmethod
    def root(anchor_token: int, device: torch.device | str) -> "TreeLevel":
        """The level before the first: the anchor alone."""
        return TreeLevel([-1], torch.zeros(1, device=device), [0], torch.tensor([int(anchor_token)], device=device))


def grow_draft_tree(tree: DraftTree, level: TreeLevel, logits_XW: Tensor, *, width: int, sampling: SamplingParams,
                    generator: torch.Generator | None, draft: Any) -> TreeLevel:
    """One depth of a draft tree (EAGLE-2's expansion, Li et al. 2024, s.4): the next level's nodes, added to
    ``tree``.

    ``logits_XW`` (any float dtype) are the draft's next-token logits below each of ``level``'s X nodes, over
    its W draft ids; ``draft`` maps them to target ids (``target_ids``, ``target_probs``:
    :class:`~deepspec.models.draft_common.DraftVocabMixin`). Each child is scored by its path's summed
    log-probability: of the softmax when greedy, of ``sampling_probs`` at T > 0, so tokens the filters drop
    are never proposed. The level keeps, in this order, the chain's next node (below node 0; greedy the
    argmax, at T > 0 drawn from ``q`` by :func:`draw_token`, the tree's only sampled node at that depth,
    added with its ``q`` over target ids) and the ``width - 1`` best-scored other children (chosen nodes).
    That order is what :func:`~deepspec.decoding.verify.verify_tree` needs at T > 0: the sampled chain is
    tested first by rejection sampling, the chosen siblings on the residual. Fewer than ``width`` nodes
    when the filters leave fewer children.
    """
    logp_XW = (torch.log_softmax(logits_XW.float(), dim=-1) if sampling.greedy
               else sampling_probs(logits_XW, sampling).log())  # filtered tokens: -inf
    chain_id, q_W = draw_token(logits_XW[0], sampling, generator)  # the argmax when greedy
    top = logp_XW.topk(min(width, logp_XW.shape[-1]), dim=-1)  # [X, width]
    per_parent = top.indices.shape[-1]
    scores, top_ids = (level.scores_X[:, None] + top.values).flatten(), top.indices.flatten()
    ids, chain_key = top_ids.tolist(), (0, int(chain_id))  # the chain's node is not an "other"
    others = [i for i in scores.argsort(descending=True).tolist()
              if scores[i] > float("-inf") and (i // per_parent, ids[i]) != chain_key][: width - 1]
    parent_X = [0] + [i // per_parent for i in others]
    token_ids_X = draft.target_ids(torch.cat([chain_id, top_ids[others]]))
    q_V = draft.target_probs(q_W)
    nodes = [tree.add(level.nodes[p], t, q_V if j == 0 else None)
             for j, (p, t) in enumerate(zip(parent_X, token_ids_X.tolist()))]
    scores_X = torch.cat([level.scores_X[:1] + logp_XW[0, chain_id], scores[others]])
    return TreeLevel(nodes, scores_X, parent_X, token_ids_X)


def check_tree_width(value: object, field: str) -> int:
    """A drafter's ``tree_width``: ``value`` when it is an integer >= 1 (1: chains, the default); ValueError
    naming ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}: expected an integer >= 1 (1: a chain of drafts; 2-4: a draft tree verified in "
                         f"one target forward), received {value!r}.")
    return value


@runtime_checkable
class Proposer(Protocol):
    """The interface every drafting algorithm implements (DSpark, DFlash, Eagle3, baselines).

    ``max_proposal_len`` is K, the most tokens one ``propose`` call returns (0 for the target-only
    baseline). An optional class attribute ``needs_features = False`` says the proposer reads only
    the token ids (see the module docstring); absent, the engine captures target features for it. An
    optional method ``propose_without_draft`` (``propose``'s signature) returns what the proposer offers
    without running a draft model (a prompt-lookup match; empty otherwise): the engine calls it on the
    steps its scheduler judges the draft not worth calling (:mod:`deepspec.decoding.schedule`). An
    optional class attribute ``drafts_serially = True`` says each proposed token costs one draft forward
    (Eagle3): ``propose`` then also takes ``max_len`` (draft at most that many tokens; a tree at most that
    deep), which the engine's scheduler sets to the depth worth drafting. An optional attribute
    ``num_pending_features`` counts the committed positions whose features the next ``propose`` first runs
    through the draft (a context kept lazily, so that a step without a draft call costs no draft forward;
    absent: 0): the scheduler prices that flush (a request's prompt) before it probes.
    """

    max_proposal_len: int

    def prepare(self, num_positions: int) -> None:
        """Get ready for a generation of at most ``num_positions`` positions (prompt, output and the K a
        last verify may feed beyond them), before its clock starts; most proposers do nothing."""
        ...

    def reset(self) -> None:
        """Forget all context (called before every prompt)."""
        ...

    def extend_context(self, target_hidden_TF: Tensor | None, token_ids_T: list[int]) -> None:
        """Append the target features of the next committed positions, in order (``[T, F]``; None for
        a proposer with ``needs_features = False``), with the tokens at those positions (``T`` ids;
        Eagle3 pairs each feature with the next token)."""
        ...

    def propose(
        self,
        anchor_token: int,
        anchor_pos: int,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Propose up to K tokens following ``anchor_token`` at ``anchor_pos``.

        ``sampling.greedy``: each token is the argmax of the draft logits (``draft_probs_NV`` may be
        None). Otherwise each token is drawn (with ``generator``) from
        ``q = sampling_probs(draft_logits, sampling)`` and that same fp32 ``q`` is returned as the
        row of ``draft_probs_NV``, so the token is scored with the distribution it came from."""
        ...


class NullProposer:
    """Proposes nothing: the engine becomes plain target-only decoding (the speedup baseline)."""

    max_proposal_len: int = 0

    def prepare(self, num_positions: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def extend_context(self, target_hidden_TF: Tensor, token_ids_T: list[int]) -> None:
        pass

    def propose(
        self,
        anchor_token: int,
        anchor_pos: int,
        *,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        return Proposal.empty()


def draw_token(
    logits_V: Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[Tensor, Tensor | None]:
    """One draft token from logits ``[V]`` (any float dtype): ``(token int64 [1], q fp32 [V] or None)``.

    Greedy: the argmax and no distribution. Otherwise ``q = sampling_probs(logits_V, sampling)`` and
    one ``torch.multinomial`` draw from that same ``q`` (on the generator's device; the token comes
    back on the logits' device), so a proposer scores its token with the exact tensor it sampled
    from (the ``q`` of Leviathan et al. 2023, Alg. 1).
    """
    if sampling.greedy:
        return greedy_tokens(logits_V).view(1), None
    q_V = sampling_probs(logits_V, sampling)
    gen_device = generator.device if generator is not None else q_V.device
    tok = torch.multinomial(q_V.to(gen_device), 1, generator=generator).to(q_V.device)
    return tok, q_V


def check_tree_setting(value: object, field: str, *, has_draft: bool = True) -> int:
    """The ``--tree-width`` setting (eval, serve, demo): ``value`` when it is an integer >= 0 (and 0 without a
    draft), else ValueError naming ``field``.

    0: chains. 1: a draft with prompt lookup in front verifies the match beside the draft's proposal
    (``LookupFirstProposer(tree=True)``). W >= 2: also draft trees of W nodes per slot from drafts that
    can propose them. :meth:`deepspec.decoding.settings.DecodeSettings.from_flags` splits the setting in two."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}: expected an integer >= 0 (0: chains; 1: prompt lookup's match verified beside the "
                         f"draft; 2-4: also draft trees of that many nodes per slot), got {value!r}")
    if value and not has_draft:
        raise ValueError(f"{field}: set with no draft; draft trees come from a draft (and prompt lookup in front of "
                         "it): give --draft, or drop --tree-width")
    return value


def cap_proposal_len(proposer: Proposer, num_draft_tokens: int) -> Proposer:
    """Make ``proposer`` propose at most ``num_draft_tokens`` tokens per step (vLLM's
    ``num_speculative_tokens``); returns it. Every proposer here reads ``max_proposal_len`` as the
    most tokens one ``propose`` call returns, so lowering it is the whole change (a DSpark/DFlash
    draft still predicts its whole block in one forward and keeps the first slots).

    Raises ValueError for ``num_draft_tokens < 1``.
    """
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: expected an integer >= 1, received {num_draft_tokens}.")
    proposer.max_proposal_len = min(int(proposer.max_proposal_len), int(num_draft_tokens))
    return proposer
