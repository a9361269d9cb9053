"""One decoding set-up for ``deepspec eval``, ``deepspec serve``, the demo and ``bench/decode.py``.

:class:`DecodeSettings` holds what those four share and what does not depend on sampling (a request's
temperature, top-k and top-p are :class:`~deepspec.target.decoding.SamplingParams`): how many tokens a
draft proposes, its draft tree, prompt lookup in front of it, the training-free baselines, dtype, device,
the linear path, the compiled target and the step schedule. :func:`build_proposers` builds every proposer
of a run from it, each with its final K and tree width: nothing is set on a proposer after it is built.

The ``--tree-width W`` flag (eval, serve, the demo) meant two things in one integer; here they are two
fields (docs/design/decoding.md, "Draft trees"): ``lookup_beside_draft`` (W >= 1: a draft with prompt
lookup in front verifies the match beside the draft's proposal instead of choosing) and
``draft_tree_width`` (W >= 2: a draft proposes a tree of W nodes per slot; 1 is its chain).
:meth:`DecodeSettings.from_flags` splits the flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepspec.algorithms.ngram.corpus import DEFAULT_CORPUS_NGRAM_MAX, DEFAULT_CORPUS_NGRAM_MIN, NGramCorpus
from deepspec.algorithms.ngram.proposer import (DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_NUM_TOKENS,
                                                 LookupFirstProposer, NGramProposer, check_lookup_settings,
                                                 check_ngram_range)
from deepspec.algorithms.protocol import Proposer, check_tree_setting, check_tree_width
from deepspec.algorithms.registry import algorithm_for_model, check_baselines
from deepspec.device import check_device_name, check_dtype_name
from deepspec.target.few_row_linear import check_few_row_mode

SCHEDULES = ("auto", "fixed")  # deepspec.decoding.engine.SpeculativeEngine's schedule argument
_WHERE = "DecodeSettings"  # how a field is named in an error; from_flags names the stage's flag instead
# fields a stage sets through a flag of another name (the one --tree-width flag sets both)
_FLAG_OF = {"draft_tree_width": "tree_width", "lookup_beside_draft": "tree_width"}


@dataclass(frozen=True, kw_only=True)
class DecodeSettings:
    """The decoding set-up eval, serve, the demo and ``bench/decode.py`` share (see the module docstring).

    Validated when built: a bad value is a ValueError naming its field (``DecodeSettings.<field>``, or the
    stage's flag when built by :meth:`from_flags`). ``dtype``, ``device``, ``few_row_linear`` and
    ``baselines`` are kept in their canonical spelling (``fp32`` -> ``float32``; ``["none"]`` -> ``()``).
    """

    # each draft proposes at most this many tokens per step (vLLM's num_speculative_tokens); None = its own K.
    # The n-gram baselines and a lookup in front follow unless ngram_num_tokens / lookup_num_tokens are set.
    num_draft_tokens: int | None = None
    # nodes per slot of a draft tree (DSpark, DFlash, Eagle3; docs/design/decoding.md, "Draft trees"); 1 = chains
    draft_tree_width: int = 1
    # a draft with prompt lookup in front verifies the lookup's match beside the draft's proposal (one tree)
    # instead of choosing one of them
    lookup_beside_draft: bool = False
    confidence_threshold: float = 0.0  # DSpark: cut a proposal before the first slot below it; 0 = off
    # prompt lookup in front of each draft: an n-gram match of at least this many tokens proposes; None = off
    lookup_first: int | None = None
    lookup_num_tokens: int | None = None  # the most tokens such a match proposes; None = the draft's K
    ngram_max: int = DEFAULT_NGRAM_MAX  # the longest n-gram the lookups match (a lookup in front: at least lookup_first)
    ngram_min: int = DEFAULT_NGRAM_MIN  # the n-gram baselines' shortest match
    # the n-gram baselines' K; None = the first draft's K after num_draft_tokens (else 7, capped by it)
    ngram_num_tokens: int | None = None
    corpus_ngram_min: int = DEFAULT_CORPUS_NGRAM_MIN  # the shortest context suffix looked up in a corpus
    baselines: tuple[str, ...] = ()  # training-free proposers beside the drafts: "ngram", "ngram+corpus"
    dtype: str = "auto"  # target and draft dtype: auto | float32 | bfloat16 (deepspec.device.resolve_dtype)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (deepspec.device.resolve_device)
    few_row_linear: str = "auto"  # auto | on | off (deepspec.target.few_row_linear)
    compile: bool = False  # the target's decode steps on the compiled path (deepspec.decoding.compiled)
    # verify forwards compute each row as a one-token forward would, bit for bit (deepspec.target.exact_rows):
    # greedy output equal to target-only's in bfloat16 too, at a measured cost per verify
    exact: bool = False
    # auto: a cost-aware scheduler chooses per step how much of each proposal to verify, or a plain target step
    # (deepspec.decoding.schedule; lossless); fixed: every proposal is verified whole
    schedule: str = "auto"

    def __post_init__(self) -> None:
        normalised = {
            "dtype": check_dtype_name(self.dtype, f"{_WHERE}.dtype"),
            "device": check_device_name(self.device, f"{_WHERE}.device"),
            "few_row_linear": check_few_row_mode(self.few_row_linear, f"{_WHERE}.few_row_linear"),
            "baselines": tuple(check_baselines(_names(self.baselines, "baselines"), f"{_WHERE}.baselines")),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{_WHERE}.schedule: expected one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for name in ("compile", "exact"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{_WHERE}.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.exact and self.compile:
            raise ValueError(f"{_WHERE}.exact: exact rows need the eager target path (the compiled one picks its own "
                             "kernels); drop --exact or --compile.")
        if self.compile and self.few_row_linear == "on":
            raise ValueError(f"{_WHERE}.few_row_linear: on cannot be combined with {_WHERE}.compile (the compiled "
                             "path picks its own kernels); pass --few-row-linear auto or off with --compile.")
        for name in ("num_draft_tokens", "ngram_num_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{_WHERE}.{name}: expected an integer >= 1 or none (each proposer's own K), "
                                 f"got {value!r}")
        check_ngram_range(ngram_max=self.ngram_max, ngram_min=self.ngram_min, field=_WHERE)
        check_lookup_settings(self.lookup_first, self.lookup_num_tokens, has_draft=True, field=_WHERE)
        check_tree_width(self.draft_tree_width, f"{_WHERE}.draft_tree_width")
        if not isinstance(self.lookup_beside_draft, bool):
            raise ValueError(f"{_WHERE}.lookup_beside_draft: expected true or false, got {self.lookup_beside_draft!r}")
        threshold = self.confidence_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold < 1.0:
            raise ValueError(f"{_WHERE}.confidence_threshold: expected a value in [0, 1), got {threshold!r}")
        if self.draft_tree_width > 1 and self.confidence_threshold > 0:
            raise ValueError(f"{_WHERE}.draft_tree_width: a draft tree is not cut by confidence; drop "
                             f"--confidence-threshold or give --tree-width 0 or 1 (got {self.draft_tree_width})")
        if (self.draft_tree_width > 1 or self.lookup_beside_draft) and self.compile:
            name = "draft_tree_width" if self.draft_tree_width > 1 else "lookup_beside_draft"
            raise ValueError(f"{_WHERE}.{name}: draft trees need the eager target path (a dynamic KV cache "
                             "whose accepted entries are moved); give --tree-width 0 with --compile")
        if (isinstance(self.corpus_ngram_min, bool) or not isinstance(self.corpus_ngram_min, int)
                or not 1 <= self.corpus_ngram_min <= DEFAULT_CORPUS_NGRAM_MAX):
            raise ValueError(f"{_WHERE}.corpus_ngram_min: expected an integer in [1, {DEFAULT_CORPUS_NGRAM_MAX}] (the "
                             f"shortest context suffix looked up in a corpus), got {self.corpus_ngram_min!r}")

    @classmethod
    def from_flags(cls, where: str, *, tree_width: int = 0, **fields: Any) -> DecodeSettings:
        """The settings of a stage's flags, with ``--tree-width`` split (0: chains; 1: the lookup's match
        beside the draft; W >= 2: also draft trees of W nodes per slot). A bad value is a ValueError
        naming the stage's flag as ``<where>.<flag>`` (``eval.tree_width``, ``serve.num_draft_tokens``)."""
        check_tree_setting(tree_width, f"{where}.tree_width")
        try:
            return cls(draft_tree_width=max(int(tree_width), 1), lookup_beside_draft=tree_width >= 1, **fields)
        except ValueError as exc:
            message = str(exc)
            for name, flag in _FLAG_OF.items():
                message = message.replace(f"{_WHERE}.{name}", f"{where}.{flag}")
            raise ValueError(message.replace(f"{_WHERE}.", f"{where}.")) from None

    @property
    def tree_width(self) -> int:
        """The ``--tree-width`` value these settings stand for (a draft tree without the lookup beside it,
        which no flag asks for, reads as its width)."""
        return self.draft_tree_width if self.draft_tree_width > 1 else int(self.lookup_beside_draft)


def _names(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        raise ValueError(f"{_WHERE}.{name}: expected a list of names, got the single string {value!r}")
    return list(value)


def unique_name(name: str, taken: Mapping[str, Any]) -> str:
    """``name``, or ``name#2``, ``name#3``, ... if already taken (two proposers never share a report row)."""
    candidate, k = name, 1
    while candidate in taken:
        k += 1
        candidate = f"{name}#{k}"
    return candidate


def build_proposers(settings: DecodeSettings, target_model: Any, drafts: Mapping[str, Any], *,
                    corpus: NGramCorpus | None = None, draft_rows: bool = True,
                    where: str = "decode") -> dict[str, Proposer]:
    """Every proposer a run decodes with, name -> proposer, each built with its final K and tree width.

    In this order:

    - per draft (name -> draft model of any registered algorithm, already in the decoding dtype), unless
      ``draft_rows`` is false: the draft's proposer under its name, proposing at most
      ``settings.num_draft_tokens`` tokens, a tree of ``settings.draft_tree_width`` nodes per slot (drafts
      that draft trees; others keep chains), cut at ``settings.confidence_threshold`` when the draft has a
      confidence head (a draft without one proposes in full);
    - with ``settings.lookup_first``, per draft, ``<name>+lookup``: a
      :class:`~deepspec.algorithms.ngram.proposer.LookupFirstProposer` over a proposer of its own for the
      draft (n-grams of ``max(lookup_first, ngram_max)`` .. ``lookup_first`` tokens, then ``corpus``), the
      match verified beside the draft with ``settings.lookup_beside_draft``;
    - per ``settings.baselines`` entry (``ngram``, ``ngram+corpus``: prompt lookup, then ``corpus``), an
      :class:`~deepspec.algorithms.ngram.proposer.NGramProposer` of ``settings.ngram_num_tokens`` tokens,
      by default the first draft's K, else 7 capped by ``settings.num_draft_tokens``.

    A name already taken gets ``#2``, ``#3``... (:func:`unique_name`). The proposers sit on the target's
    device and never propose past its ``max_position_embeddings``. ``deepspec eval`` takes every row,
    ``bench/decode.py`` names its rows itself, and ``deepspec serve`` decodes through the one row of its
    draft (``<name>+lookup`` with a lookup in front: ``draft_rows=False``).

    Raises ValueError (naming ``<where>.confidence_threshold``) for a confidence threshold with drafts none
    of which has a confidence head.
    """
    max_positions = int(target_model.config.max_position_embeddings)
    vocab = int(target_model.get_output_embeddings().weight.shape[0])
    device = next(target_model.parameters()).device
    threshold = settings.confidence_threshold if settings.confidence_threshold > 0 else None
    headed = {n for n, m in drafts.items() if getattr(m, "confidence_head", None) is not None}
    if threshold is not None and drafts and not headed:
        raise ValueError(f"{where}.confidence_threshold: {threshold} needs a draft with a confidence head (DSpark); "
                         f"none of {', '.join(drafts)} has one. Drop the threshold.")

    def draft_proposer(name: str, model: Any) -> Proposer:
        return algorithm_for_model(model).proposer(
            model, confidence_threshold=threshold if name in headed else None, max_positions=max_positions,
            tree_width=settings.draft_tree_width, num_draft_tokens=settings.num_draft_tokens)

    proposers: dict[str, Proposer] = {}
    first_k = None
    for name, model in drafts.items():
        proposer = draft_proposer(name, model)
        first_k = proposer.max_proposal_len if first_k is None else first_k
        if draft_rows:
            proposers[name] = proposer
    if settings.lookup_first is not None:
        for name, model in drafts.items():
            proposers[unique_name(f"{name}+lookup", proposers)] = LookupFirstProposer(
                draft_proposer(name, model), vocab_size=vocab, ngram_min=settings.lookup_first,
                ngram_max=max(settings.lookup_first, settings.ngram_max), lookup_num_tokens=settings.lookup_num_tokens,
                max_positions=max_positions, device=device, corpus=corpus,
                corpus_ngram_min=settings.corpus_ngram_min, tree=settings.lookup_beside_draft)
    k = settings.ngram_num_tokens or first_k or min(DEFAULT_NUM_TOKENS, settings.num_draft_tokens or DEFAULT_NUM_TOKENS)
    for name in settings.baselines:
        proposers[unique_name(name, proposers)] = NGramProposer(
            vocab_size=vocab, num_tokens=k, ngram_max=settings.ngram_max, ngram_min=settings.ngram_min,
            max_positions=max_positions, device=device, corpus=corpus if name == "ngram+corpus" else None,
            corpus_ngram_min=settings.corpus_ngram_min)
    return proposers
