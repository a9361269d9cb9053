"""The target's decode steps compiled: a static KV cache and ``torch.compile``d fixed-length forwards.

Legend: B batch (1), T tokens fed in a call, S the step length compiled for (T padded up to it), F
target features (``len(layer_ids) * H``), H target hidden size, V vocabulary size.

The eager engine (:mod:`deepspec.decoding.engine`) runs the target through Hugging Face's eager forward
and a ``DynamicCache`` that grows every step. On a GPU that path is bound by Python and kernel-launch
overhead, not by the weights (a one-token step of a 4B target issues hundreds of small kernels), so
it is the gpt-fast recipe (github.com/pytorch-labs/gpt-fast, ``generate.py``: a static cache,
``torch.compile(mode="reduce-overhead")`` of the decode step, a fixed-length verify) that makes decoding
fast. :class:`CompiledTarget` applies it to any Hugging Face decoder through the library's own
building blocks (its compile-ready model forwards) and a static KV cache of our own, with the eager
engine kept as the readable reference:

- **Static KV cache.** A :class:`StaticKVCache`: per decoder layer, keys and values in fixed tensors of
  ``max_cache_len`` positions (every layer full attention, as the eager engine's ``DynamicCache`` of
  full layers: a sliding-window layer could not be rolled back), ``max_cache_len`` rounded up to a power
  of two (at least :data:`deepspec.utils.MIN_CACHE_LEN`), allocated once per length and reused (reset) for every
  prompt: a CUDA graph reads and writes fixed addresses. The cache owns its write position twice: a
  host ``int`` (what the engine reads and crops, never a device sync) and the same count in a 0-d
  device tensor at a fixed address (what a compiled graph reads and advances, so the graph does not
  specialise on the position). Rolling back a rejected proposal is :meth:`StaticKVCache.crop`, which
  only moves the write position back; the stale keys and values beyond it are masked by position (a
  query at position ``p`` sees keys at positions <= ``p``, and every slot up to ``p`` has been written
  by then). Nothing here depends on which transformers version provides a static cache layer or
  whether its layers can be cropped: only on the ``Cache`` / ``CacheLayerMixin`` interface a model's
  attention calls (``update``, ``get_seq_length``, ``get_mask_sizes``).
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
from transformers.cache_utils import Cache, CacheLayerMixin

from deepspec.target.capture import (TargetOutput, _base_model, _cache_kwarg, features_from_hidden_states,
                                     target_forward, target_logits)
from deepspec.utils import cache_len_bucket

# One graph per (step length, cache length, feature layers, CompiledTarget): a few per engine, a few engines.
RECOMPILE_LIMIT = 64
RECOMPILE_ERROR = ("CompiledTarget: torch.compile recompiled the decode step past {limit} graphs (step lengths "
                   "{lengths}, cache lengths {buckets}); it would now run the step eagerly and silently slow. "
                   "Share one CompiledTarget between the engines of a run, or decode with the eager engine.")


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


class StaticKVLayer(CacheLayerMixin):
    """One decoder layer's keys and values in fixed ``[B, Hk, max_cache_len, d]`` tensors, written at the
    cache's write position (allocated lazily, at the first write, in the keys' dtype and device).

    ``length`` (host ``int``) and ``write_pos`` (0-d ``int64`` tensor on the keys' device, a static address
    for CUDA graphs) both count the positions written. Inside a compiled graph only ``write_pos`` is read
    and advanced (an ``int`` there would be a guard: one recompilation per position); eagerly both
    advance. :meth:`StaticKVCache.set_seq_length` makes them equal again after a graph ran.
    """

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, max_cache_len: int) -> None:
        super().__init__()
        self.max_cache_len = int(max_cache_len)
        self.length = 0
        self.write_pos = torch.zeros((), dtype=torch.long)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the keys and values for ``key_states``' batch, heads, dtype and device."""
        B, H, _, dk = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.zeros((B, H, self.max_cache_len, dk), dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros((B, H, self.max_cache_len, value_states.shape[-1]), dtype=value_states.dtype,
                                  device=value_states.device)
        self.write_pos = self.write_pos.to(key_states.device)
        if not _is_compiling():
            for t in (self.keys, self.values, self.write_pos):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states`` / ``value_states`` ``[B, Hk, T, d]`` at positions ``write_pos .. write_pos + T``
        and advance; returns the whole ``[B, Hk, max_cache_len, d]`` keys and values (the stale tail is
        masked by position). Raises RuntimeError, outside a graph, when the T positions do not fit."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[-2]
        if not _is_compiling():
            if self.length + T > self.max_cache_len:
                raise RuntimeError(f"StaticKVCache: {self.length} + {T} positions exceed its {self.max_cache_len}; "
                                   "allocate the cache for the prompt, the output and the longest verify.")
            self.length += T
        index = self.write_pos + torch.arange(T, device=self.keys.device)
        self.keys.index_copy_(2, index, key_states)
        self.values.index_copy_(2, index, value_states)
        self.write_pos.add_(T)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        """(kv_length, kv_offset) for the mask: every slot of the cache, from position 0."""
        return self.max_cache_len, 0

    def get_seq_length(self) -> int | torch.Tensor:
        """Positions written: ``write_pos`` (0-d tensor) inside a compiled graph, ``length`` elsewhere."""
        return self.write_pos if _is_compiling() else self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def set_seq_length(self, num_positions: int) -> None:
        """Move the write position to ``num_positions`` (host and device counts)."""
        self.length = int(num_positions)
        self.write_pos.fill_(self.length)

    def reset(self) -> None:
        """Empty the layer (write position 0; the stale keys and values are masked by position)."""
        self.set_seq_length(0)


class StaticKVCache(Cache):
    """A transformers ``Cache`` of one :class:`StaticKVLayer` of ``max_cache_len`` positions per decoder
    layer: the compiled path's KV cache (module docstring).

    ``get_seq_length()`` is a host ``int`` outside a compiled graph; :meth:`crop` and
    :meth:`set_seq_length` move the write position without touching the keys and values. Raises
    ValueError for ``num_layers`` or ``max_cache_len`` below 1.
    """

    def __init__(self, num_layers: int, max_cache_len: int) -> None:
        if num_layers < 1 or max_cache_len < 1:
            raise ValueError(f"StaticKVCache: expected num_layers >= 1 and max_cache_len >= 1, received "
                             f"{num_layers} and {max_cache_len}")
        super().__init__(layers=[StaticKVLayer(max_cache_len) for _ in range(num_layers)])

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        return self.layers[layer_idx].get_seq_length()

    def set_seq_length(self, num_positions: int) -> None:
        """Move every layer's write position to ``num_positions`` (after a compiled step advanced the
        device count by its padded length, or to roll back). Raises ValueError outside ``0 ..
        max_cache_len``."""
        max_len = self.layers[0].max_cache_len
        if not 0 <= num_positions <= max_len:
            raise ValueError(f"StaticKVCache.set_seq_length: expected 0..{max_len} positions, received {num_positions}")
        for layer in self.layers:
            layer.set_seq_length(num_positions)

    def crop(self, max_length: int) -> None:
        """transformers' crop: keep the first ``max_length`` positions, or, for a negative value, drop
        the last ``-max_length``. Raises ValueError when that would grow the cache or go below 0."""
        cur = self.layers[0].length
        keep = max_length if max_length >= 0 else cur + max_length
        if keep > cur or keep < 0:
            raise ValueError(f"StaticKVCache.crop({max_length}): holds {cur} positions; a crop keeps 0..{cur}")
        self.set_seq_length(keep)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()


def static_cache(model: torch.nn.Module, max_cache_len: int) -> StaticKVCache:
    """A :class:`StaticKVCache` of ``max_cache_len`` positions for every decoder layer of ``model``."""
    return StaticKVCache(len(_base_model(model).layers), max_cache_len)


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
        if not isinstance(past_key_values, StaticKVCache):
            raise TypeError(f"CompiledTarget: past_key_values must come from new_cache(), received "
                            f"{type(past_key_values).__name__}")
        start = past_key_values.get_seq_length()
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs were copied out
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=RECOMPILE_LIMIT):
                features_BSF, last_BSH, logits_BSV = self._step(ids_BS, pos_BS, past_key_values,
                                                                tuple(target_layer_ids))
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            raise RuntimeError(RECOMPILE_ERROR.format(limit=RECOMPILE_LIMIT, lengths=self.step_lengths,
                                                      buckets=sorted(self._caches))) from exc
        past_key_values.set_seq_length(start + T)  # the graph advanced the device count by S
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
