"""The speculative decoding engine: one loop for every proposer (docs/design/decoding.md).

Legend: B batch (always 1 here), T positions, N draft tokens in a proposal, V vocab, F feature width
(``len(target_layer_ids) * hidden_size``), H target hidden size.

One step, read top to bottom in :meth:`SpeculativeEngine.generate` (gpt-fast style):
propose ``[d_1..d_N]`` after the anchor -> one target forward over ``[anchor, d_1..d_N]`` with
explicit position ids -> verify (``deepspec.decoding.verify``) -> commit accepted + 1 token -> crop the
target KV cache to the committed length -> give the proposer the target features of the verified,
committed positions ``anchor .. anchor + num_accepted`` -> the bonus / residual token is the new
anchor (its features come from the next step's forward). ``NullProposer`` (N = 0) makes this plain
target-only decoding: the speedup baseline runs the very same code.

Scope and choices:
- Batch size 1 (no padding, no ragged acceptance across a batch); the attention mask is implicit,
  except for a draft tree (``Proposal.parents_N``): its nodes are fed after the anchor at positions
  ``anchor_pos + depth`` under :func:`target_tree_mask` (sliding-window layers keep their window),
  verified by :func:`~deepspec.decoding.verify.verify_tree` (greedy: the longest path the target agrees
  with; T > 0: SpecInfer's multi-step speculative sampling), and the accepted path's KV entries are moved to
  consecutive positions before the crop (:func:`compact_kv_cache`). The step is then the same:
  features of the anchor and the accepted path go to ``extend_context``, the token after the path is
  the new anchor.
- Sampling (:class:`~deepspec.target.decoding.SamplingParams`): ``None`` or temperature 0 is greedy;
  at T > 0 the first token is drawn from ``sampling_probs(prefill logits)`` and every verify step
  uses the same params (the draft's ``q`` and the target's ``p`` go through the same top-k / top-p
  filters), so the output follows exactly the distribution target-only sampling draws from.
- The first output token is sampled from the prefill logits; it counts as an output token and
  its time is the TTFT. It is not a verify step.
- ``max_new_tokens``: proposals are NOT shortened for it; the final step may commit more tokens
  than needed and the output is truncated to ``max_new_tokens``. The step records keep the
  untruncated figures (``num_accepted``, ``num_committed``), so acceptance metrics (tau,
  accept_rate) describe the drafter and are unaffected, while token counts used for throughput
  (``GenerationResult.num_new_tokens``) are the truncated ones.
- The target's ``max_position_embeddings`` caps positions: a proposal is truncated so that
  ``anchor_pos + N < max_position_embeddings`` (so no position id fed reaches it); near the limit
  speculation shortens, then stops (plain one-token steps), and generation stops when the anchor
  itself cannot be fed (``stop_reason == "max_positions"``).
- The KV cache is a transformers ``DynamicCache`` of full layers; after verify it is cropped to the
  committed length. With ``compiled`` (a :class:`~deepspec.decoding.compiled.CompiledTarget`) it is a static
  cache of full layers instead, and every verify and one-token forward runs a compiled fixed-length
  graph (gpt-fast style; CUDA graphs on CUDA); the step itself is the same code. A cache that cannot
  crop raises ``RuntimeError`` (never a silent stale cache): checked once after the prefill when the
  proposer can propose, and at every crop.
- A proposer with ``max_proposal_len == 0`` (``NullProposer``) never reads target features: the
  engine then runs the target without capture hooks (``target_layer_ids=[]`` to ``forward_fn``,
  see :func:`deepspec.target.capture.target_forward`) and never calls ``extend_context``, so the target-only baseline pays
  for nothing it does not use and is comparable with Hugging Face ``generate()``. A proposer whose
  ``needs_features`` attribute is False (the n-gram baseline, :mod:`deepspec.algorithms.ngram`) gets the
  committed token ids through ``extend_context`` with ``target_hidden_TF=None``, and the target
  again runs without capture hooks. Without the attribute a proposer needs features.
- The prefill computes logits only for the last prompt position (``lm_head`` on the final-norm
  hidden state, soft-capped where the target's config says so, as every verify forward's:
  :func:`deepspec.target.capture.target_logits`), not ``[P, V]``.
- ``few_row_linear`` (default False): the target's and the proposer's linear layers compute inputs
  of 2-16 rows as ``(W @ x^T)^T`` during :meth:`SpeculativeEngine.generate`
  (:mod:`deepspec.target.few_row_linear`: on CPUs where the row-major GEMM over 2-8 rows costs far more
  than a GEMV, it makes a verify forward cost about a one-token one). Give the target-only engine
  the same setting as the speculative one, so both decode with the same kernels.
- ``exact`` (default False): every verify forward (2 or more tokens after the prefill) computes each
  row bit for bit as a one-token forward would (:class:`deepspec.target.exact_rows.ExactRows`: attention
  one query row at a time, linear layers in row-invariant chunks), so greedy speculative output is
  token-identical to target-only output in bfloat16 too, near-ties included. One-token forwards and the
  prefill are unchanged, so the target-only engine needs no setting. Not with ``compiled``.
- Timing (``time.perf_counter``; on CUDA the device is synchronised at each boundary, where the
  next host read would wait anyway): a step's ``propose_s`` is the proposer's call, ``verify_s``
  the target forward over ``[anchor, d_1..d_N]`` (input tensors included), and the remainder of
  ``time_s`` (verify math, KV crop, ``extend_context``, bookkeeping) is the per-step overhead.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspec.algorithms.protocol import Proposal, Proposer, draw_token
from deepspec.decoding.compiled import CompiledTarget
from deepspec.decoding.schedule import (StepCostCurve, StepScheduler, load_or_measure_step_costs, measure_step_costs,
                                       step_cost_cache_dir)
from deepspec.decoding.verify import GREEDY, verify, verify_tree
from deepspec.device import device_model_name
from deepspec.target.capture import capture_hooks, target_forward, target_logits
from deepspec.target.decoding import SamplingParams
from deepspec.target.exact_rows import PROBE_ROWS, ExactRows
from deepspec.target.few_row_linear import few_row_linear
from deepspec.target.gqa_attention import GroupedQueryVerify


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One verify step.

    ``num_proposed`` N (after position truncation), ``num_accepted`` accepted drafts,
    ``num_committed`` tokens committed by the step (before ``max_new_tokens`` truncation). Times in
    seconds: ``time_s`` the whole step (propose + target forward + verify + update), ``propose_s``
    the ``proposer.propose`` call, ``verify_s`` the target forward over ``[anchor, d_1..d_N]``;
    overhead = ``time_s - propose_s - verify_s``. ``confidence``: the proposal's ``confidence_N``
    for the N proposed tokens (after position truncation), or None when the proposer gives none;
    ``raw_confidence``: its ``raw_confidence_N`` (the uncalibrated head's values) when the proposer
    calibrated them, else None (``confidence`` is then raw). For a draft tree both hold the values of its
    scored path (``Proposal.scored_path``: DSpark's chain), depth 1 first, and ``num_scored_accepted`` counts
    the accepted path's leading nodes that are on it (the scored path's accepted slots); None for a chain.
    ``max_proposal_len``: the K of the proposer that made the proposal (``Proposal.max_proposal_len``,
    else the proposer's), or None when unknown (the metrics then use the row's largest K).
    ``num_draft_nodes``: for a draft tree, the nodes the target verified beside the anchor (``num_proposed``
    is then the tree's depth, the most tokens the step could accept); None for a chain (N nodes).
    With a scheduler (:mod:`deepspec.decoding.schedule`): ``drafted`` whether the proposer was called (False:
    the scheduler made a plain step without a proposal), ``num_drafted`` the nodes it proposed before the
    scheduler's cut, ``schedule_s`` the seconds the scheduler's estimates took (part of the overhead).
    """

    num_proposed: int
    num_accepted: int
    num_committed: int
    time_s: float
    propose_s: float = 0.0
    verify_s: float = 0.0
    confidence: tuple[float, ...] | None = None
    raw_confidence: tuple[float, ...] | None = None
    num_scored_accepted: int | None = None
    max_proposal_len: int | None = None
    num_draft_nodes: int | None = None
    drafted: bool = True
    num_drafted: int | None = None
    schedule_s: float = 0.0

    @property
    def num_nodes_verified(self) -> int:
        """The draft tokens the target verified beside the anchor: a tree's nodes, a chain's N (0: a plain step)."""
        return self.num_proposed if self.num_draft_nodes is None else self.num_draft_nodes


def step_confidences(proposal: Proposal, path: Sequence[int] | None
                     ) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None, int | None]:
    """A verified proposal's ``(confidence, raw_confidence, num_scored_accepted)`` for its :class:`StepRecord`.

    A chain: its ``confidence_N`` / ``raw_confidence_N`` as tuples (None where absent) and None. A tree
    (``path``: its accepted nodes, depth order): the values along :meth:`Proposal.scored_path` and how many of
    the path's leading nodes are scored ones (the scored slots accepted given the earlier ones were); all
    None when the tree has no confidences.
    """
    conf, raw = proposal.confidence_N, proposal.raw_confidence_N
    if proposal.parents_N is None:
        return (None if conf is None else tuple(conf.tolist()), None if raw is None else tuple(raw.tolist()), None)
    scored = proposal.scored_path()
    if not scored:
        return None, None, None
    accepted = 0
    for node, on_path in zip(path or (), scored):
        if node != on_path:
            break
        accepted += 1
    values = conf.tolist()
    raw_values = None if raw is None else raw.tolist()
    return (tuple(values[i] for i in scored), None if raw_values is None else tuple(raw_values[i] for i in scored),
            accepted)


@dataclass(kw_only=True)
class GenerationResult:
    """Output of :meth:`SpeculativeEngine.generate` for one prompt.

    ``output_ids``: generated tokens (prompt excluded), at most ``max_new_tokens``, ending with the
    EOS when one was produced. ``ttft_s``: prefill + first-token sampling. ``total_time_s``: whole
    call. ``stop_reason``: ``"eos" | "max_new_tokens" | "max_positions"``.
    """

    prompt_len: int
    output_ids: list[int]
    steps: list[StepRecord] = field(default_factory=list)
    ttft_s: float = 0.0
    total_time_s: float = 0.0
    stop_reason: str = ""

    @property
    def num_new_tokens(self) -> int:
        return len(self.output_ids)


def _check_croppable(cache: Any) -> None:
    if not hasattr(cache, "crop") or getattr(cache, "is_croppable", True) is False:
        raise RuntimeError(
            f"crop_kv_cache: the target's KV cache ({type(cache).__name__}) cannot be cropped; speculative "
            "decoding needs a croppable cache (transformers DynamicCache without sliding/linear layers)."
        )


def compact_kv_cache(cache: Any, start: int, keep: Sequence[int]) -> None:
    """Keep the cache entries at positions ``start + keep[j]`` as ``start + j`` and drop the rest after ``start``.

    After a draft tree's verify forward the cache holds ``[anchor, node_1..node_N]`` from ``start``; the
    accepted path (``keep``: ``0`` for the anchor, then ``1 + node`` per accepted node, increasing) moves
    to consecutive positions, which are the positions its keys were rotated for (a node at depth ``d``
    was fed at ``start + d``). Then the cache is cropped to ``start + len(keep)``. Raises RuntimeError
    for a cache without per-layer ``keys`` / ``values`` tensors (only a transformers ``DynamicCache`` of
    full layers is compacted), and whatever :func:`crop_kv_cache` raises.
    """
    keep = [int(k) for k in keep]
    if keep != list(range(len(keep))):  # a chain's prefix needs the crop alone
        layers = getattr(cache, "layers", None)
        if not layers or not all(isinstance(getattr(la, "keys", None), torch.Tensor) for la in layers):
            raise RuntimeError(f"compact_kv_cache: the target's KV cache ({type(cache).__name__}) has no per-layer "
                               "keys/values tensors to move; draft trees need a DynamicCache of full layers.")
        dst = slice(start, start + len(keep))
        src = torch.tensor(keep, device=layers[0].keys.device) + start
        for layer in layers:
            layer.keys[:, :, dst] = layer.keys[:, :, src]
            layer.values[:, :, dst] = layer.values[:, :, src]
    crop_kv_cache(cache, start + len(keep))


def tree_attention_mask(parents_N: Sequence[int], past_len: int, device: torch.device | str = "cpu", *,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Bool ``[1, 1, N+1, past_len + N+1]`` (True = attend) for a verify forward over ``[anchor, tree nodes]``.

    Every row sees the ``past_len`` cached positions; the anchor (row 0) sees itself, node ``i``
    (row ``i + 1``) the anchor, its ancestors and itself (``parents_N``: -1 for the anchor's children,
    see :attr:`~deepspec.algorithms.protocol.Proposal.parents_N`). A chain gives the causal mask. With
    ``sliding_window`` W a row at position ``q`` sees only keys at positions ``k > q - W`` (the rule of
    transformers' sliding-window layers; a node at depth ``d`` sits at ``past_len + d``).
    """
    n1 = len(parents_N) + 1
    tree = torch.zeros(n1, n1, dtype=torch.bool)
    tree[0, 0] = True
    depth = [0] * n1
    for i, p in enumerate(parents_N):
        tree[i + 1] = tree[p + 1]
        tree[i + 1, i + 1] = True
        depth[i + 1] = depth[p + 1] + 1
    mask = torch.cat([torch.ones(n1, past_len, dtype=torch.bool), tree], dim=1)
    if sliding_window is not None:
        q_pos = past_len + torch.tensor(depth)
        k_pos = torch.cat([torch.arange(past_len), q_pos])
        mask &= (q_pos[:, None] - k_pos[None, :]) < int(sliding_window)
    return mask.to(device)[None, None]


def target_tree_mask(config: Any, parents_N: Sequence[int], past_len: int,
                     device: torch.device | str = "cpu") -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask a draft tree's verify forward gives a transformers model with ``config``.

    A model with per-layer attention types (``config.layer_types``, e.g. Gemma 3's sliding and full layers)
    takes a dict by type, and its sliding layers' masks keep their window (a 4-D mask is used as it is,
    so the window must be in it). A model without ``layer_types`` but with ``config.sliding_window``
    (Mistral-style: every layer slides) gets one mask with the window; any other model one tree mask.
    Raises RuntimeError for a layer type other than full or sliding attention (a chunked or linear
    layer cannot take a tree mask).
    """
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or ())
    if not types:
        return tree_attention_mask(parents_N, past_len, device, sliding_window=window)
    unknown = types - {"full_attention", "sliding_attention"}
    if unknown:
        raise RuntimeError(f"draft trees: the target has {', '.join(sorted(unknown))} layers, which take no tree "
                           "attention mask; decode it with chains (--tree-width 0).")
    if types == {"full_attention"}:
        return tree_attention_mask(parents_N, past_len, device)
    return {t: tree_attention_mask(parents_N, past_len, device,
                                   sliding_window=window if t == "sliding_attention" else None) for t in types}


def crop_kv_cache(cache: Any, new_len: int) -> None:
    """Crop a transformers cache to ``new_len`` positions, or raise ``RuntimeError``.

    Raises when the cache would have to grow, has no ``crop`` / reports ``is_croppable`` False, or
    still holds another length after the crop. transformers 5.x ``DynamicCache.crop`` takes a
    negative count of tokens to remove (a positive argument raises); 4.x accepted a negative count
    too (``max_length < 0`` removes from the end), so ``crop(-remove)`` works on both.
    """
    cur = int(cache.get_seq_length())
    if cur == new_len:
        return
    if new_len > cur:
        raise RuntimeError(f"crop_kv_cache: cannot grow a KV cache from {cur} to {new_len} positions.")
    _check_croppable(cache)
    cache.crop(new_len - cur)
    if int(cache.get_seq_length()) != new_len:
        raise RuntimeError(
            f"crop_kv_cache: after crop the KV cache holds {cache.get_seq_length()} positions, expected {new_len}."
        )


class SpeculativeEngine:
    """Speculative decoding with any :class:`~deepspec.algorithms.protocol.Proposer` (batch size 1).

    Args:
        target_model: a Hugging Face causal LM (eval mode); its ``lm_head`` maps the final-norm
            hidden state to logits.
        target_layer_ids: the decoder layers whose outputs are the proposer's context features
            (not captured at all when the proposer's ``max_proposal_len`` is 0 or its
            ``needs_features`` is False).
        proposer: the drafter; ``NullProposer`` gives the target-only baseline.
        eos_token_ids: tokens that end generation.
        forward_fn: the target forward, called as ``forward_fn(model, input_ids_BT, layer_ids, *,
            position_ids_BT, past_key_values, use_cache, compute_logits)`` and returning a
            :class:`~deepspec.target.capture.TargetOutput`; ``layer_ids`` is ``[]`` when no features
            are needed. Default :func:`deepspec.target.capture.target_forward` (the parameter exists for tests).
        few_row_linear: run :meth:`generate` with the few-row linear path (see the module docstring)
            for the target and the proposer's ``model`` (when it has one).
        exact: compute every verify forward's rows as one-token forwards do (see the module docstring); the
            per-layer row tests run here (about a second, once per process), when the proposer can propose.
        compiled: run the target's decode steps through this static-cache, compiled path
            (:mod:`deepspec.decoding.compiled`; built for ``target_model``, with a step length of at least
            ``proposer.max_proposal_len + 1``). Give the target-only engine the same one.
        schedule: ``"fixed"`` verifies every proposal whole (K and tree as the proposer drafts them);
            ``"auto"`` lets a :class:`~deepspec.decoding.schedule.StepScheduler` choose per step how much of
            the proposal to verify, or a plain target step, from this target's measured step cost curve
            (measured before the first generation's clock starts, cached on disk) and the acceptance seen
            so far; a :class:`StepScheduler` instance is used as given. Lossless either way.

    Raises ValueError for an empty ``eos_token_ids``, and for ``compiled`` together with
    ``forward_fn``, ``few_row_linear`` or ``exact``, built for another model or too short for the proposer's K;
    with ``exact``, for a target whose attention implementation is not registered with transformers.
    """

    def __init__(
        self,
        target_model: torch.nn.Module,
        target_layer_ids: Sequence[int],
        proposer: Proposer,
        eos_token_ids: Collection[int],
        *,
        forward_fn: Callable[..., Any] | None = None,
        few_row_linear: bool = False,
        exact: bool = False,
        compiled: CompiledTarget | None = None,
        schedule: str | StepScheduler = "fixed",
    ) -> None:
        if not isinstance(schedule, StepScheduler) and schedule not in ("auto", "fixed"):
            raise ValueError(f"schedule: expected 'auto' (cost-aware) or 'fixed', received {schedule!r}.")
        if not eos_token_ids:
            raise ValueError("eos_token_ids: expected at least one token id, received none; pass tokenizer.eos_token_id.")
        if compiled is not None:
            if forward_fn is not None or few_row_linear or exact:
                raise ValueError("compiled: the compiled target path is its own forward with its own kernels; pass "
                                 "it without forward_fn, with few_row_linear off and exact off.")
            if compiled.model is not target_model:
                raise ValueError("compiled: a CompiledTarget built for another model than target_model.")
            if max(compiled.step_lengths) < int(proposer.max_proposal_len) + 1:
                raise ValueError(f"compiled: its longest step ({max(compiled.step_lengths)} tokens) is shorter than "
                                 f"a verify over the proposer's {proposer.max_proposal_len} drafts + the anchor; build "
                                 "it with step_lengths that include K + 1.")
        self.target_model = target_model
        self.target_layer_ids = list(target_layer_ids)
        self.proposer = proposer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.compiled = compiled
        self.forward_fn = compiled if compiled is not None else (forward_fn or target_forward)
        self.max_positions = int(getattr(target_model.config, "max_position_embeddings", 1 << 62))
        self.device = next(target_model.parameters()).device
        # A proposer that can never propose reads nothing; one that reads only token ids (n-gram)
        # gets them without features: either way the target runs without capture hooks.
        self.can_propose = int(proposer.max_proposal_len) > 0
        self.uses_features = self.can_propose and bool(getattr(proposer, "needs_features", True))
        self._feature_layer_ids = self.target_layer_ids if self.uses_features else []
        self.few_row_linear = bool(few_row_linear)
        self.exact = bool(exact)
        # linear layers tested up to the verify of a whole chain (K + 1 rows): longer ones go in chunks
        self._exact_rows = (ExactRows(target_model, max_rows=min(int(proposer.max_proposal_len) + 1, PROBE_ROWS))
                            if self.exact and self.can_propose else None)
        # a verify's attention on the CPU without the key/value heads repeated (exact rows swap attention themselves)
        gqa = GroupedQueryVerify(target_model) if self.can_propose and compiled is None and not self.exact else None
        self._gqa_verify = gqa if gqa is not None and gqa.applies else None
        # a proposer that never proposes needs no schedule; "auto" builds its scheduler at the first generation
        self._measure_schedule = self.can_propose and schedule == "auto"
        self.scheduler: StepScheduler | None = (schedule if isinstance(schedule, StepScheduler) and self.can_propose
                                                else None)

    def _cost_key(self, max_tokens: int) -> dict[str, Any]:
        """What a step cost curve depends on: the target's config and size, device, dtype, threads, kernels."""
        import hashlib

        m = self.target_model
        config = m.config.to_json_string(use_diff=False)
        param = next(m.parameters())
        return {"config": hashlib.sha256(config.encode()).hexdigest()[:16],
                "params": sum(p.numel() for p in m.parameters()), "device": self.device.type,
                "device_name": device_model_name(self.device),
                "dtype": str(param.dtype), "threads": torch.get_num_threads(), "few_row_linear": self.few_row_linear,
                "exact": self.exact, "gqa_verify": self._gqa_verify is not None,
                "compiled": self.compiled is not None, "features": bool(self._feature_layer_ids),
                "max_tokens": max_tokens, "torch": torch.__version__}

    def _measure_costs(self, max_tokens: int, context_len: int = 32) -> Any:
        """One target forward over n tokens after a ``context_len``-token context, synchronised, the cache
        cropped back after: the callable :func:`~deepspec.decoding.schedule.measure_step_costs` times."""
        from transformers import DynamicCache

        cache = (DynamicCache() if self.compiled is None
                 else self.compiled.new_cache(context_len + max_tokens))
        vocab = int(self.target_model.config.vocab_size)
        ids = [(7 * i + 3) % vocab for i in range(context_len + max_tokens)]
        cache = self._forward(ids[:context_len], 0, cache, compute_logits=False).past_key_values

        def forward_tokens(n: int) -> None:
            self._forward(ids[context_len:context_len + n], context_len, cache, compute_logits=True)
            crop_kv_cache(cache, context_len)
            self._sync()

        return measure_step_costs(forward_tokens, max_tokens)

    def ensure_scheduler(self) -> StepScheduler | None:
        """Build the ``"auto"`` scheduler once (:meth:`generate` does it before its clock starts; a server
        calls it at start-up): the cost curve up to the longest verify this engine can feed (a compiled
        target: its longest step; else 64 tokens, trees and lookup included), cached on disk. Returns the
        scheduler, None with ``schedule="fixed"`` or a proposer that never proposes."""
        if not self._measure_schedule or self.scheduler is not None:
            return self.scheduler
        max_tokens = max(self.compiled.step_lengths) if self.compiled is not None else 64
        max_tokens = max(max_tokens, int(self.proposer.max_proposal_len) + 1)

        def measure() -> StepCostCurve:
            print(f"deepspec: measuring the target's step cost curve (verify forwards of 1..{max_tokens} tokens; "
                  f"once per target, device, dtype and threads, cached in {step_cost_cache_dir()})",
                  file=sys.stderr, flush=True)
            return self._measure_costs(max_tokens)

        with torch.inference_mode():
            curve, _ = load_or_measure_step_costs(self._cost_key(max_tokens), measure)
        self.scheduler = StepScheduler(curve, serial_draft=bool(getattr(self.proposer, "drafts_serially", False)))
        return self.scheduler

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(self, ids: list[int], start_pos: int, cache: Any, *, compute_logits: bool,
                 parents: Sequence[int] | None = None, depths: Sequence[int] | None = None) -> Any:
        """The target over ``ids`` from ``start_pos``; with ``parents`` / ``depths`` (a draft tree after the
        anchor) at positions ``start_pos + depth`` under :func:`target_tree_mask`. With ``exact``, a forward
        over 2 or more tokens after the prefill runs under :class:`ExactRows`."""
        input_ids_BT = torch.tensor([ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {}
        if parents is None:
            position_ids_BT = torch.arange(start_pos, start_pos + len(ids), device=self.device).unsqueeze(0)
        else:
            position_ids_BT = torch.tensor([[start_pos, *(start_pos + d for d in depths)]], device=self.device)
            kwargs["attention_mask_BT"] = target_tree_mask(self.target_model.config, parents, start_pos, self.device)
        kernels: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if start_pos > 0 and len(ids) > 1:  # a verify after the cache
            if self._exact_rows is not None:
                kernels = self._exact_rows(len(ids))
            elif self._gqa_verify is not None:
                kernels = self._gqa_verify()
        with kernels:
            return self.forward_fn(
                self.target_model,
                input_ids_BT,
                self._feature_layer_ids,
                position_ids_BT=position_ids_BT,
                past_key_values=cache,
                use_cache=True,
                compute_logits=compute_logits,
                **kwargs,
            )

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (see the module docstring).

        Args:
            prompt_ids: the prompt's token ids (``P`` >= 1, ``P < max_position_embeddings``).
            max_new_tokens: the most output tokens returned (>= 1).
            sampling: greedy when None (or temperature 0); else temperature / top-k / top-p sampling.
            generator: drives every random draw at T > 0 (first token, proposer, verify); None uses
                the global RNG. Unused when greedy.
            on_tokens: called with the output tokens each step commits (the first token, then every
                step's committed tokens, cut at ``max_new_tokens``), in order, outside the step
                timings: a streaming server sends them as they come. Their concatenation is
                ``output_ids``.

        Returns a :class:`GenerationResult`. Raises ValueError for an empty prompt,
        ``max_new_tokens < 1``, a ``sampling`` that is not a SamplingParams or a prompt that does not
        fit the target's ``max_position_embeddings``; RuntimeError when the target's KV cache cannot
        be rolled back (see :func:`crop_kv_cache`).
        """
        draft = getattr(self.proposer, "model", None)
        kernels = (few_row_linear(self.target_model, *([draft] if isinstance(draft, torch.nn.Module) else []))
                   if self.few_row_linear else contextlib.nullcontext())
        # target_forward's feature hooks stay on for the generation's forwards (not added and removed every step)
        hooks = (capture_hooks(self.target_model, self._feature_layer_ids)
                 if self._feature_layer_ids and self.forward_fn is target_forward else contextlib.nullcontext())
        with kernels, hooks:
            return self._decode(prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, generator=generator,
                                on_tokens=on_tokens)

    @torch.inference_mode()
    def _decode(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams | None,
        generator: torch.Generator | None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        from transformers import DynamicCache

        if sampling is None:
            sampling = GREEDY
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: expected a SamplingParams or None (greedy), received {type(sampling).__name__}.")
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids: expected at least one token, received an empty prompt.")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, received {max_new_tokens}.")
        if len(prompt_ids) >= self.max_positions:
            raise ValueError(
                f"prompt_ids: {len(prompt_ids)} tokens leave no room under the target's max_position_embeddings "
                f"({self.max_positions}); shorten the prompt."
            )
        proposer, can_propose, uses_features, sync = self.proposer, self.can_propose, self.uses_features, self._sync
        proposer.reset()
        result = GenerationResult(prompt_len=len(prompt_ids), output_ids=[])
        num_emitted = 0

        def emit() -> None:  # hand on_tokens what was committed since its last call, within max_new_tokens
            nonlocal num_emitted
            new = result.output_ids[num_emitted:max_new_tokens]
            if on_tokens is not None and new:
                on_tokens(new)
            num_emitted += len(new)

        # positions a static cache must hold: prompt, output, and the K a final verify may feed beyond them
        num_positions = len(prompt_ids) + max_new_tokens + proposer.max_proposal_len
        if self.compiled is not None:  # compile what this generation runs, before its clock starts
            self.compiled.prepare(self._feature_layer_ids, num_positions,
                                  self.compiled.lengths_up_to(proposer.max_proposal_len + 1))
        proposer.prepare(num_positions)  # a proposer with static buffers (compiled drafts) allocates them
        sched = self.ensure_scheduler()
        without_draft = getattr(proposer, "propose_without_draft", None) if sched is not None else None
        if sched is not None:
            sched.reset()
        sync()
        t0 = time.perf_counter()

        # Prefill: KV cache + features of positions 0..P-1; the first token is the first anchor.
        # No config: every layer is a full DynamicLayer, which can always be cropped. Sliding-window
        # families keep the whole history (the attention mask still applies the window); a
        # sliding-window cache layer could not be rolled back after a rejection.
        cache = DynamicCache() if self.compiled is None else self.compiled.new_cache(num_positions)
        out = self._forward(list(prompt_ids), 0, cache, compute_logits=False)
        cache = out.past_key_values
        if can_propose:
            _check_croppable(cache)  # fail before the first rejection, not at it
        logits_V = target_logits(self.target_model, out.target_last_hidden_BTH[0, -1])
        anchor = int(draw_token(logits_V, sampling, generator)[0])  # the first output token
        anchor_pos = len(prompt_ids)
        if can_propose:
            proposer.extend_context(out.target_hidden_BTF[0] if uses_features else None, list(prompt_ids))
        result.output_ids.append(anchor)
        sync()
        result.ttft_s = time.perf_counter() - t0
        emit()

        stop = "eos" if anchor in self.eos_token_ids else ""
        while not stop:
            if len(result.output_ids) >= max_new_tokens:
                stop = "max_new_tokens"
                break
            if anchor_pos >= self.max_positions:
                stop = "max_positions"
                break
            t_step = time.perf_counter()
            # Propose (unless the scheduler plans a plain step), truncated so every fed position is
            # < max_position_embeddings; the scheduler then keeps what is worth verifying.
            drafted = sched is None or sched.plan(proposer.max_proposal_len,
                                                  pending=getattr(proposer, "num_pending_features", 0),
                                                  width=getattr(proposer, "tree_width", 1))
            t_planned = time.perf_counter()
            if drafted and sched is not None and sched.serial_draft:  # a serial drafter drafts the planned depth
                proposal = proposer.propose(anchor, anchor_pos, sampling=sampling, generator=generator,
                                            max_len=sched.depth_limit)
            elif drafted:
                proposal = proposer.propose(anchor, anchor_pos, sampling=sampling, generator=generator)
            elif without_draft is not None:  # what costs no draft call (a prompt-lookup match) is still offered
                proposal = without_draft(anchor, anchor_pos, sampling=sampling, generator=generator)
            else:
                proposal = Proposal.empty(self.device)
            proposal = proposal.truncated(self.max_positions - 1 - anchor_pos)
            t_proposed = time.perf_counter()
            num_drafted = proposal.num_proposed
            if sched is not None:
                proposal = sched.select(proposal, greedy=sampling.greedy)
            # a tree cut to no node is a plain step: the one-token forward without a tree mask (with one, the
            # attention takes another kernel path and its bits leave a target-only step's)
            parents = proposal.parents_N if proposal.num_proposed else None
            if parents is not None and self.compiled is not None:
                raise RuntimeError(f"{type(proposer).__name__} proposed a draft tree, which needs a dynamic KV cache "
                                   "(its accepted entries are moved); propose chains with a compiled target.")
            draft_ids_N = proposal.draft_ids_N
            draft_list = draft_ids_N.tolist()
            depths = proposal.depths_N if parents is not None else None
            sync()
            t_verify = time.perf_counter()
            schedule_s = (t_planned - t_step) + (t_verify - t_proposed) if sched is not None else 0.0

            # Verify: one target forward over [anchor, d_1..d_N] (a draft tree: under its tree mask).
            out = self._forward([anchor, *draft_list], anchor_pos, cache, compute_logits=True,
                                parents=parents, depths=depths)
            cache = out.past_key_values
            sync()
            t_verified = time.perf_counter()
            if parents is None:
                res = verify(draft_ids_N, proposal.draft_probs_NV, out.logits_BTV[0], sampling=sampling,
                             generator=generator, eos_token_ids=self.eos_token_ids)
                keep = list(range(res.num_accepted + 1))
            else:
                res, path = verify_tree(draft_ids_N, parents, out.logits_BTV[0], draft_probs_NV=proposal.draft_probs_NV,
                                        sampling=sampling, generator=generator, eos_token_ids=self.eos_token_ids)
                keep = [0, *(1 + i for i in path)]
            path_nodes = None if parents is None else path

            # Commit accepted + 1; keep KV and features of the verified positions anchor..anchor+accepted.
            num_verified = res.num_accepted + 1
            compact_kv_cache(cache, anchor_pos, keep)
            if can_propose:  # a chain keeps a prefix: a slice, not a gather
                feats = None if not uses_features else (
                    out.target_hidden_BTF[0, :num_verified] if parents is None else out.target_hidden_BTF[0, keep])
                proposer.extend_context(feats, [anchor, *res.committed[: res.num_accepted]])
            result.output_ids.extend(res.committed)
            anchor, anchor_pos = res.committed[-1], anchor_pos + num_verified
            conf, raw_conf, scored_accepted = step_confidences(proposal, path_nodes)
            sync()
            t_end = time.perf_counter()
            if sched is not None:
                sched.observe(proposal, res.num_accepted, path_nodes, verify_s=t_verified - t_verify,
                              propose_s=(t_verify - t_step - schedule_s) if drafted else None,
                              overhead_s=(t_end - t_verified) + schedule_s, num_committed=len(res.committed),
                              step_s=t_end - t_step, num_drafted=num_drafted)
            result.steps.append(
                StepRecord(
                    num_proposed=proposal.depth,
                    num_accepted=res.num_accepted,
                    num_committed=len(res.committed),
                    time_s=t_end - t_step,
                    propose_s=t_verify - t_step - schedule_s,
                    verify_s=t_verified - t_verify,
                    confidence=conf,
                    raw_confidence=raw_conf,
                    num_scored_accepted=scored_accepted,
                    max_proposal_len=(proposal.max_proposal_len if proposal.max_proposal_len is not None
                                      else proposer.max_proposal_len),
                    num_draft_nodes=None if parents is None else proposal.num_proposed,
                    drafted=drafted,
                    num_drafted=num_drafted,
                    schedule_s=schedule_s,
                )
            )
            emit()
            if res.hit_eos:
                stop = "eos"

        if len(result.output_ids) > max_new_tokens:
            del result.output_ids[max_new_tokens:]
            stop = "max_new_tokens"
        result.stop_reason = stop
        sync()
        result.total_time_s = time.perf_counter() - t0
        return result
