"""The target's decode steps compiled: a static KV cache and ``torch.compile``d fixed-length forwards.

Legend: B batch (1), T tokens fed in a call, S the step length compiled for (T padded up to it), F
target features (``len(layer_ids) * H``), H target hidden size, V vocabulary size.

The eager engine (:mod:`deepspec.eval.engine`) runs the target through Hugging Face's eager forward
and a ``DynamicCache`` that grows every step. On a GPU that path is bound by Python and kernel-launch
overhead, not by the weights (a one-token step of a 4B target issues hundreds of small kernels), so
it is the gpt-fast recipe (github.com/pytorch-labs/gpt-fast, ``generate.py``: a static cache,
``torch.compile(mode="reduce-overhead")`` of the decode step, a fixed-length verify) that makes decoding
fast. :class:`CompiledTarget` applies it to any Hugging Face decoder through the library's own
building blocks (transformers' ``StaticLayer`` cache and its compile-ready model forwards), with the
eager engine kept as the readable reference:

- **Static KV cache.** One cache of full-attention ``StaticLayer`` s (every layer, as the eager
  engine's ``DynamicCache`` of full layers: a sliding-window cache layer could not be rolled back), of
  ``max_cache_len`` positions rounded up to a power of two (at least :data:`MIN_CACHE_LEN`), allocated
  once per length and reused (reset) for every prompt: a CUDA graph reads and writes fixed addresses.
  Rolling back a rejected proposal is ``crop``, which only moves the cache's write position back; the
  stale keys and values beyond it are masked by position (a query at position ``p`` sees keys at
  positions <= ``p``, and every slot up to ``p`` has been written by then).
- **Fixed step lengths.** One graph per step length: ``1`` (a target-only step, or a step whose
  proposal is empty) and ``K + 1`` (a verify over the anchor and ``K`` drafts). A call over fewer tokens
  is padded up to the next compiled length with copies of its last token at the following positions;
  the padding's outputs are dropped and the cache is cropped back, so a caller sees exactly the
  tokens it fed. The prefill (any length) runs eagerly into the same cache, through
  :func:`~deepspec.target.capture.target_forward`.
- **Compilation.** ``torch.compile(dynamic=False, fullgraph=True)``: a graph break is an error at the
  first call, not a silent slow path; on CUDA ``mode="reduce-overhead"`` (CUDA graphs), elsewhere the
  default mode (inductor's C++/OpenMP kernels on the CPU). Each new (step length, cache length, feature
  layers) is one compilation, which costs a minute on a 2-core CPU for the embedded target; the engine
  calls :meth:`CompiledTarget.prepare` before it starts a generation's clock, so no compilation is
  ever timed.
- **Features.** Inside the graph the target features come from the forward's ``hidden_states``
  (:func:`~deepspec.target.capture.features_from_hidden_states`, the same rule as the capture hooks:
  a test checks they are equal), because forward hooks registered per call would recompile.

Numerics: inductor fuses and reorders operations, so a compiled forward may differ from the eager one
in the last bits (float32: about 1e-6 relative). Target-only and speculative decoding both use the
compiled steps when this path is on, so the lossless check compares like with like.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch._dynamo

from deepspec.target.capture import (TargetOutput, _base_model, _cache_kwarg, features_from_hidden_states,
                                     target_forward, target_logits)

MIN_CACHE_LEN = 256
# One graph per (step length, cache length, feature layers, CompiledTarget): a few per engine, a few engines.
RECOMPILE_LIMIT = 64
RECOMPILE_ERROR = ("CompiledTarget: torch.compile recompiled the decode step past {limit} graphs (step lengths "
                   "{lengths}, cache lengths {buckets}); it would now run the step eagerly and silently slow. "
                   "Share one CompiledTarget between the engines of a run, or decode with the eager engine.")


def cache_len_bucket(num_positions: int) -> int:
    """The static cache length allocated for ``num_positions`` positions: the next power of two, at
    least :data:`MIN_CACHE_LEN` (few lengths, so few compilations). Raises ValueError below 1."""
    if num_positions < 1:
        raise ValueError(f"num_positions: expected >= 1, received {num_positions}")
    return max(MIN_CACHE_LEN, 1 << (int(num_positions) - 1).bit_length())


def static_cache(model: torch.nn.Module, max_cache_len: int) -> Any:
    """A transformers ``Cache`` of one full-attention ``StaticLayer`` of ``max_cache_len`` positions per
    decoder layer of ``model`` (allocated lazily, on the first write, in the keys' dtype and device)."""
    from transformers.cache_utils import Cache, StaticLayer

    num_layers = len(_base_model(model).layers)
    return Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(num_layers)])


class CompiledTarget:
    """Static-cache, compiled decode steps of a target: a ``forward_fn`` for the engine.

    Args:
        model: a Hugging Face ``*ForCausalLM`` in eval mode (its dtype and device are used as they are).
        step_lengths: the token counts compiled for (e.g. ``{1, K + 1}``); every call over at most
            ``max(step_lengths)`` tokens that asks for logits runs a compiled graph.
        mode: ``torch.compile`` mode; None picks ``"reduce-overhead"`` (CUDA graphs) on CUDA and the
            default elsewhere.
        backend: ``torch.compile`` backend (default inductor; tests pass ``"eager"`` to check the
            padding and cache logic without code generation).

    Raises ValueError for an empty ``step_lengths`` or a length < 1.
    """

    def __init__(self, model: torch.nn.Module, step_lengths: Collection[int], *, mode: str | None = None,
                 backend: str | Callable[..., Any] = "inductor") -> None:
        lengths = sorted({int(n) for n in step_lengths})
        if not lengths or lengths[0] < 1:
            raise ValueError(f"step_lengths: expected token counts >= 1, received {sorted(step_lengths)}")
        self.model = model
        self.step_lengths = lengths
        self.device = next(model.parameters()).device
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"
        self.mode = mode
        self._base = _base_model(model)
        self._cache_kwarg = _cache_kwarg(type(self._base))
        self._caches: dict[int, Any] = {}
        self._compiled_keys: set[tuple[int, int, tuple[int, ...]]] = set()  # (step length, cache length, layer ids)
        try:  # transformers 5.x installs its hidden-state capture hooks at the first such call: not inside a graph
            from transformers.utils.output_capturing import maybe_install_capturing_hooks
        except ImportError:
            pass
        else:
            maybe_install_capturing_hooks(self._base)
        self._step = torch.compile(self._eager_step, dynamic=False, fullgraph=True, mode=mode, backend=backend)

    @classmethod
    def for_proposers(cls, model: torch.nn.Module, proposers: Collection[Any]) -> CompiledTarget:
        """One compiled path for the engines of a run: the one-token step and a verify step of
        ``K + 1`` tokens for each proposer's ``max_proposal_len`` K (share it with the target-only engine);
        for a draft with prompt lookup in front (a ``draft`` attribute), for the draft's own K too, so its
        steps do not run padded to the lookup's length."""
        ks = {int(p.max_proposal_len) for p in proposers}
        ks |= {int(p.draft.max_proposal_len) for p in proposers if hasattr(p, "draft")}
        return cls(model, {1, *(k + 1 for k in ks)})

    def step_length_for(self, num_tokens: int) -> int | None:
        """The compiled step length a call over ``num_tokens`` tokens runs (the shortest >= it), or None
        when it is longer than every one (it then runs eagerly)."""
        return next((n for n in self.step_lengths if n >= num_tokens), None)

    def lengths_up_to(self, num_tokens: int) -> list[int]:
        """Every compiled step length a call over 1 to ``num_tokens`` tokens may run."""
        longest = self.step_length_for(num_tokens)
        return [n for n in self.step_lengths if longest is None or n <= longest]

    def new_cache(self, num_positions: int) -> Any:
        """An empty static cache that holds ``num_positions`` positions (prompt, output, and the ``K``
        positions a final verify may feed beyond it): the one allocated for its length bucket
        (:func:`cache_len_bucket`), reset."""
        n = cache_len_bucket(num_positions)
        cache = self._caches.get(n)
        if cache is None:
            cache = self._caches[n] = static_cache(self.model, n)
        else:
            with torch.inference_mode():  # its tensors were allocated in a generation, under inference mode
                cache.reset()
        return cache

    def _eager_step(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor, cache: Any,
                    layer_ids: tuple[int, ...]) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        out = self._base(input_ids=input_ids_BS, position_ids=position_ids_BS, use_cache=True,
                         output_hidden_states=bool(layer_ids), **{self._cache_kwarg: cache})
        features_BSF = features_from_hidden_states(out.hidden_states, layer_ids) if layer_ids else None
        last_BSH = out.last_hidden_state
        return features_BSF, last_BSH, target_logits(self.model, last_BSH)

    def __call__(self, model: torch.nn.Module, input_ids_BT: torch.Tensor, target_layer_ids: Sequence[int], *,
                 position_ids_BT: torch.Tensor, past_key_values: Any, use_cache: bool = True,
                 compute_logits: bool = False) -> TargetOutput:
        """The engine's ``forward_fn``: :func:`~deepspec.target.capture.target_forward`'s contract.

        A call without logits (the prefill) or over more tokens than the longest step runs eagerly;
        any other runs the compiled graph of the shortest step length >= T, padded (see the module
        docstring). ``position_ids_BT`` must be consecutive (the engine's are) and ``past_key_values`` a cache
        from :meth:`new_cache`. Returns tensors of
        the T tokens fed (never the padding's), detached from the graph's output buffers.
        """
        assert model is self.model, "CompiledTarget: called with another model than it was built for"
        T = int(input_ids_BT.shape[1])
        S = self.step_length_for(T)
        if not compute_logits or S is None:
            return target_forward(model, input_ids_BT, list(target_layer_ids), position_ids_BT=position_ids_BT,
                                  past_key_values=past_key_values, use_cache=use_cache, compute_logits=compute_logits)
        # Fresh [1, S] inputs (standard strides: the graph guards on them): the T tokens, then copies of the
        # last one at the following positions, whose outputs are dropped below.
        ids_BS = input_ids_BT[:, -1:].repeat(1, S)
        ids_BS[:, :T] = input_ids_BT
        pos_BS = position_ids_BT[:, :1] + torch.arange(S, device=position_ids_BT.device)[None]
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs were copied out
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=RECOMPILE_LIMIT):
                features_BSF, last_BSH, logits_BSV = self._step(ids_BS, pos_BS, past_key_values,
                                                                tuple(target_layer_ids))
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            raise RuntimeError(RECOMPILE_ERROR.format(limit=RECOMPILE_LIMIT, lengths=self.step_lengths,
                                                      buckets=sorted(self._caches))) from exc
        if S > T:
            past_key_values.crop(-(S - T))
        # Copies: CUDA graph outputs live in a pool the next replay overwrites.
        return TargetOutput(
            target_hidden_BTF=None if features_BSF is None else features_BSF[:, :T].clone(),
            target_last_hidden_BTH=last_BSH[:, :T].clone(),
            logits_BTV=logits_BSV[:, :T].clone(),
            past_key_values=past_key_values,
        )

    def prepare(self, layer_ids: Sequence[int], num_positions: int, step_lengths: Collection[int]) -> None:
        """Compile the graphs a generation will run, before it is timed: each of ``step_lengths`` (a
        subset of the compiled lengths) with the features of ``layer_ids``, for the cache bucket of
        ``num_positions``, on a throwaway input. Does nothing for graphs already compiled; the cache it
        used is reset by the next :meth:`new_cache`. Raises ValueError for a length not compiled for."""
        unknown = sorted(set(step_lengths) - set(self.step_lengths))
        if unknown:
            raise ValueError(f"step_lengths: {unknown} are not among the compiled lengths {self.step_lengths}")
        bucket, ids = cache_len_bucket(num_positions), tuple(layer_ids)
        todo = [n for n in sorted(set(step_lengths)) if (n, bucket, ids) not in self._compiled_keys]
        if not todo:
            return
        with torch.inference_mode():
            cache = self.new_cache(bucket)
            ids_BT = torch.zeros((1, 1 + max(todo)), dtype=torch.long, device=self.device)
            pos_BT = torch.arange(1 + max(todo), device=self.device)[None]
            # An eager one-token prefill first: it allocates the cache's tensors (lazily, at the first write),
            # as a generation's prefill does, so the graphs are compiled for an allocated cache.
            self(self.model, ids_BT[:, :1], [], position_ids_BT=pos_BT[:, :1], past_key_values=cache)
            for n in todo:
                self(self.model, ids_BT[:, 1:1 + n], ids, position_ids_BT=pos_BT[:, 1:1 + n], past_key_values=cache,
                     compute_logits=True)
                cache.crop(-n)
                self._compiled_keys.add((n, bucket, ids))
