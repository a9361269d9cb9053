"""The decoding behind ``deepspec serve``: the speculative engine (:mod:`deepspec.decoding.engine`) for one
request at a time, with a trained draft (``--draft``) or without one (target-only, the same code).

:class:`EngineDecoder` loads and checks the draft exactly as ``deepspec eval`` does (a training run
folder, a checkpoint or a draft folder; a draft made for another target is refused), casts target and
draft to the decoding dtype (``auto``: :mod:`deepspec.device`) and decodes each request through a
fresh :class:`~deepspec.decoding.engine.SpeculativeEngine` whose stop set is the one stop rule
(:func:`deepspec.data.chat.target_stop_token_ids`) plus the request's ``stop_token_ids``. Greedy
requests give the target's own greedy answer (lossless, docs/design/decoding.md); sampled ones follow the target's
distribution (rejection sampling), seeded by the request's ``seed``.

Per-request acceptance (:class:`ServeResult`): verify steps, drafts proposed and accepted, and
``tau`` = mean over verify steps of the tokens each committed (accepted drafts + 1, or the accepted drafts
alone at an accepted EOS, which no bonus token follows), the metric ``deepspec eval`` reports.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepspec.algorithms.ngram.corpus import DEFAULT_CORPUS_NGRAM_MIN, NGramCorpus, check_corpus_vocab
from deepspec.algorithms.ngram.proposer import check_lookup_settings
from deepspec.algorithms.protocol import NullProposer, check_tree_setting
from deepspec.algorithms.registry import load_draft
from deepspec.checkpoints import draft_folder
from deepspec.data.chat import target_stop_token_ids
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.schedule import StepScheduler
from deepspec.decoding.settings import DecodeSettings, build_proposers
from deepspec.device import cast_for_decoding, resolve_device, resolve_dtype
from deepspec.target.decoding import SamplingParams
from deepspec.target.few_row_linear import few_row_linear_applies
from deepspec.target.load import target_fingerprint


# EngineDecoder's keyword flags at their defaults (what settings= stands in for)
_FLAG_DEFAULTS = dict(num_draft_tokens=None, dtype="auto", device=None, few_row_linear="auto", lookup_first=None,
                      lookup_num_tokens=None, corpus_ngram_min=DEFAULT_CORPUS_NGRAM_MIN, tree_width=0,
                      schedule="auto", exact=False)


@dataclass(frozen=True, kw_only=True)
class ServeResult:
    """One answered request. ``output_ids``: the generated ids (prompt excluded), ending with the stop
    token when one was produced; ``finish_reason``: ``"stop"`` (a stop token) or ``"length"``
    (``max_tokens`` or the target's position limit cut the answer). Counts are over the request's verify
    steps (none for a one-token answer); ``tau`` is None when there was no verify step."""

    output_ids: list[int]
    finish_reason: str
    num_verify_steps: int
    num_draft_tokens: int  # drafts proposed, summed over the verify steps
    num_accepted_tokens: int  # drafts accepted, summed over the verify steps
    num_committed_tokens: int  # tokens the verify steps committed (before the max_tokens cut), summed
    time_s: float

    @classmethod
    def from_generation(cls, out: Any) -> ServeResult:
        """The result of one :meth:`SpeculativeEngine.generate <deepspec.decoding.engine.SpeculativeEngine.generate>`
        (a ``GenerationResult``): its output, finish reason and the counts summed over its step records."""
        steps = out.steps
        return cls(output_ids=out.output_ids, finish_reason="stop" if out.stop_reason == "eos" else "length",
                   num_verify_steps=len(steps),
                   num_draft_tokens=sum(s.num_draft_nodes or s.num_proposed for s in steps),
                   num_accepted_tokens=sum(s.num_accepted for s in steps),
                   num_committed_tokens=sum(s.num_committed for s in steps), time_s=out.total_time_s)

    @property
    def tau(self) -> float | None:
        """Acceptance length: mean over verify steps of the tokens each committed (accepted drafts + 1, or the
        accepted drafts at an accepted EOS: no bonus token follows it), as :mod:`deepspec.eval.metrics`; 1.0 for
        target-only."""
        if not self.num_verify_steps:
            return None
        return self.num_committed_tokens / self.num_verify_steps

    def acceptance(self) -> dict[str, Any]:
        """The per-request acceptance figures a response reports."""
        return {"num_verify_steps": self.num_verify_steps, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "num_committed_tokens": self.num_committed_tokens,
                "tau": self.tau,
                "tok_per_s": len(self.output_ids) / self.time_s if self.time_s > 0 else None}


class EngineDecoder:
    """Target (+ optional draft) ready to decode requests one at a time.

    Args:
        target_model, tokenizer: the loaded target (any dtype; a cast copy decodes when ``dtype`` differs).
        draft: a training run folder, checkpoint or draft folder (``deepspec train``'s output); None or
            "" = target-only.
        settings: the decoding set-up (:class:`~deepspec.decoding.settings.DecodeSettings`, shared with
            eval, the demo and ``bench/decode.py``): K, draft trees, prompt lookup in front of the draft, dtype,
            device (``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``), the few-row linear path. None: built from
            the keyword flags below, named as ``serve.<flag>`` in its errors; give one or the other.
        num_draft_tokens: cap on the tokens proposed per step (vLLM's ``num_speculative_tokens``); None
            = the draft's own block size.
        dtype: ``auto`` | ``float32`` | ``bfloat16`` (aliases fp32, bf16) for target and draft.
        device: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` (:func:`deepspec.device.resolve_device`) for both;
            None = where ``target_model`` already is.
        few_row_linear: ``auto`` | ``on`` | ``off`` (:mod:`deepspec.target.few_row_linear`).
        exact: verify with exact rows (``SpeculativeEngine(exact=True)``, :mod:`deepspec.target.exact_rows`):
            greedy output token-identical to target-only in bfloat16 too, at a cost per verify step.
        allow_target_mismatch: accept a draft whose recorded target fingerprint differs (same shape).
        lookup_first: prompt lookup in front of the draft (:class:`~deepspec.algorithms.ngram.proposer.
            LookupFirstProposer`): an n-gram match of at least this many tokens proposes, else the draft;
            None = the draft alone.
        lookup_num_tokens: the most tokens a match proposes (None: the draft's K after ``num_draft_tokens``).
        corpus, corpus_ngram_min: a corpus of the target's earlier answers
            (:class:`~deepspec.algorithms.ngram.corpus.NGramCorpus`) the lookup asks where the context has
            no match, before the draft; needs ``lookup_first``.
        tree_width: requests verify draft trees (:func:`~deepspec.algorithms.protocol.check_tree_setting`:
            0 chains; 1 the lookup's match beside the draft; W >= 2 also W draft nodes per slot;
            sampled requests walk the tree with the target's own draws).
        schedule: ``auto`` (a cost-aware scheduler, :mod:`deepspec.decoding.schedule`, shared by every
            request and measured here) | ``fixed`` (every proposal verified whole).
        cast_in_place: cast and move ``target_model`` itself instead of a copy (a target nobody else
            holds, such as the one ``deepspec serve`` loads: no second copy in host memory).

    Raises:
        FileNotFoundError: no draft at ``draft``.
        ValueError: a bad dtype or device name, a device that is not there, ``num_draft_tokens < 1``,
            ``lookup_first`` or ``lookup_num_tokens`` < 1 or set without a draft, a corpus without
            ``lookup_first``, a ``tree_width`` below 0 or above 0 without a draft, settings given beside
            keyword flags, baselines or a compiled target path in ``settings``, or a draft made for another
            target.
    """

    def __init__(self, target_model: Any, tokenizer: Any, *, draft: str | Path | None = None,
                 settings: DecodeSettings | None = None,
                 num_draft_tokens: int | None = None, dtype: str = "auto", device: str | None = None,
                 few_row_linear: str = "auto", exact: bool = False, allow_target_mismatch: bool = False,
                 lookup_first: int | None = None, lookup_num_tokens: int | None = None,
                 corpus: NGramCorpus | None = None, corpus_ngram_min: int = DEFAULT_CORPUS_NGRAM_MIN,
                 tree_width: int = 0, schedule: str = "auto", cast_in_place: bool = False) -> None:
        flags = dict(num_draft_tokens=num_draft_tokens, dtype=dtype, device=device, few_row_linear=few_row_linear,
                     lookup_first=lookup_first, lookup_num_tokens=lookup_num_tokens,
                     corpus_ngram_min=corpus_ngram_min, tree_width=tree_width, schedule=schedule, exact=exact)
        if settings is None:
            check_lookup_settings(lookup_first, lookup_num_tokens, has_draft=bool(draft), field="serve")
            check_tree_setting(tree_width, "serve.tree_width", has_draft=bool(draft))
            target_device = str(next(target_model.parameters()).device)
            settings = DecodeSettings.from_flags("serve", **{**flags, "device": device or target_device})
        else:
            given = [name for name, value in flags.items() if value != _FLAG_DEFAULTS[name]]
            if given:
                raise ValueError(f"serve: {', '.join(given)} given beside settings; set them in the DecodeSettings")
            if settings.baselines or settings.compile:
                raise ValueError("serve: settings with baselines or compile; a server decodes one proposer on the "
                                 "eager target path")
            if not draft and (settings.lookup_first is not None or settings.tree_width):
                raise ValueError("serve: settings with prompt lookup or draft trees but no draft; give the draft")
        if corpus is not None and settings.lookup_first is None:
            raise ValueError("serve.lookup_corpus: set without serve.lookup_first; the corpus is searched by the "
                             "prompt lookup in front of the draft: give --lookup-first N or drop it")
        self.settings = settings
        device = resolve_device(settings.device, "serve.device")
        decode_dtype = resolve_dtype(settings.dtype, device)
        folder = draft_folder(draft) if draft else None  # a wrong path fails before any work
        fingerprint = target_fingerprint(target_model) if folder is not None else None
        self.target_model = cast_for_decoding(target_model, decode_dtype, device, in_place=cast_in_place).eval()
        self.device = device
        self.dtype = decode_dtype
        self.draft_name = None
        self.lookup_first = settings.lookup_first
        if folder is None:
            self.proposer, self.target_layer_ids = NullProposer(), []
        else:
            algorithm, model = load_draft(folder, target_model=self.target_model, target_fingerprint=fingerprint,
                                          allow_target_mismatch=allow_target_mismatch)
            model = cast_for_decoding(model, decode_dtype, device, in_place=True).eval()  # loaded here
            if corpus is not None:
                check_corpus_vocab(corpus, int(self.target_model.get_output_embeddings().weight.shape[0]),
                                   "serve.lookup_corpus")
            self.draft_name = f"{algorithm}:{folder}"
            # the one row a server decodes with: the draft, or the draft behind prompt lookup
            proposers = build_proposers(settings, self.target_model, {self.draft_name: model}, corpus=corpus,
                                        draft_rows=settings.lookup_first is None, where="serve")
            (self.proposer,) = proposers.values()
            self.target_layer_ids = list(model.config.target_layer_ids)
        self.stop_token_ids = target_stop_token_ids(self.target_model, tokenizer)
        self.few_row_linear = few_row_linear_applies(settings.few_row_linear, self.target_model)
        # one scheduler for every request (its acceptance counts and timings carry over; each request resets its
        # plan), its step cost curve measured now rather than in the first request's time
        self.scheduler: StepScheduler | None = None
        self.scheduler = self._engine(self.stop_token_ids).ensure_scheduler()

    def _engine(self, stop_token_ids: Collection[int]) -> SpeculativeEngine:
        return SpeculativeEngine(self.target_model, self.target_layer_ids, self.proposer, stop_token_ids,
                                 few_row_linear=self.few_row_linear, exact=self.settings.exact,
                                 schedule=self.scheduler or self.settings.schedule)

    @property
    def num_draft_tokens(self) -> int:
        """Tokens proposed per step at most (0: target-only; with prompt lookup in front, the larger of the
        lookup's and the draft's K: see :attr:`num_lookup_tokens`)."""
        return int(self.proposer.max_proposal_len)

    @property
    def num_lookup_tokens(self) -> int | None:
        """Tokens a prompt-lookup match proposes per step at most (None without prompt lookup in front)."""
        lookup = getattr(self.proposer, "lookup", None)
        return None if lookup is None else int(lookup.max_proposal_len)

    def stop_token_ids_for(self, extra_stop_token_ids: Sequence[int] = ()) -> frozenset[int]:
        """The ids that end a request: the one stop rule plus the request's own ``stop_token_ids``."""
        return frozenset(self.stop_token_ids) | {int(t) for t in extra_stop_token_ids}

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, sampling: SamplingParams,
                 seed: int | None = None, extra_stop_token_ids: Sequence[int] = (),
                 on_tokens: Callable[[list[int]], None] | None = None) -> ServeResult:
        """Decode one request (see the module docstring); ``on_tokens`` gets the committed tokens step by
        step (:meth:`SpeculativeEngine.generate`). Raises ValueError for what the engine refuses (an empty
        prompt, one that does not fit the target's positions, ``max_new_tokens < 1``)."""
        engine = self._engine(self.stop_token_ids_for(extra_stop_token_ids))
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=engine.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(int(seed))
        out = engine.generate(list(prompt_ids), max_new_tokens=max_new_tokens, sampling=sampling, generator=generator,
                              on_tokens=on_tokens)
        return ServeResult.from_generation(out)
