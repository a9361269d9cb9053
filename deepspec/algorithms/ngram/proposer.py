"""Prompt lookup (n-gram) proposer: the training-free baseline every report compares a draft with.

Legend: N proposal length (0 <= N <= K), V vocab, T positions.

Rule (Saxena 2023, "Prompt Lookup Decoding", Hugging Face ``prompt_lookup_num_tokens``; vLLM's
``ngram`` speculator; docs/design/decoding.md, "Training-free baseline: prompt lookup"): the context
is the prompt + every committed token + the anchor. For n from ``ngram_max`` down to ``ngram_min``,
look for the most recent *earlier* occurrence of the context's last n tokens (an occurrence that
ends before the context's last token); the first n with a match wins. No match: an empty proposal
(the engine does a plain target step).

The proposal copies K tokens from just after that occurrence, and the copy may run past the
context's end into its own output (the overlapping copy of LZ77, Ziv and Lempel 1977): with the
match ending at position e (< L, the context's length), proposed token i is ``context[e + i]`` while
``e + i < L`` and proposed token ``e + i - L`` after that. So a context whose tail repeats with period
``d = L - e`` is continued with that period for all K tokens: a run of one token, ``ab ab``, a
repeated line, a loop. Cutting the copy at the context's end instead (Hugging Face's and vLLM's
proposers do) proposes at most ``d`` tokens on such a tail, whatever K is.

Hugging Face and vLLM (``vllm/v1/spec_decode/ngram_proposer.py``: the longest n in
[``prompt_lookup_min``, ``prompt_lookup_max``], then its earliest position) take the leftmost
occurrence; the most recent one is taken here. Measured side by side (``bench/lookup_rule.py``,
``docs/results/lookup-rule_cpu_2026-12-05``): on the demo's benchmarks, both continued, the two
decode in steps within 3 of each other (the leftmost ahead on humaneval); on loops whose repeated
text is already in the prompt the leftmost is ahead, since the most recent occurrence there is the
last of the prompt's repeats, followed by the prompt's end.

The proposal is deterministic, so its draft distribution is a point mass: at T > 0 each row of
``draft_probs_NV`` is one-hot (fp32), and rejection sampling accepts ``d`` with probability
``min(1, p(d) / 1) = p(d)`` and on rejection samples ``normalise(max(0, p - onehot(d)))``: exactly
the target's distribution (Leviathan et al. 2023, Alg. 1 holds for any ``q``). At T = 0 the rows
are not needed and ``draft_probs_NV`` is None.

The proposer reads no target features (``needs_features = False``): the engine runs the target
without capture hooks and passes ``None`` as ``target_hidden_TF`` to :meth:`NGramProposer.extend_context`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from deepspec.algorithms.ngram.corpus import DEFAULT_CORPUS_NGRAM_MIN, NGramCorpus, check_corpus_vocab
from deepspec.algorithms.protocol import DraftTree, Proposal
from deepspec.target.decoding import SamplingParams

DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_MIN = 1
DEFAULT_NUM_TOKENS = 7  # K when there is no draft to copy its block size from


def ngram_proposal(context: Sequence[int], *, ngram_max: int, ngram_min: int, num_tokens: int) -> list[int]:
    """The prompt-lookup proposal for ``context`` (see the module docstring): ``num_tokens`` ids after a
    match, none without one.

    Pure; ``context`` ends with the anchor. For each n = ``ngram_max`` .. ``ngram_min`` (skipping n
    that do not fit: an earlier occurrence needs ``len(context) >= n + 1``), scan start positions
    from the most recent earlier one backwards; the tokens after the first match are copied, the
    copy running on into its own output past the context's end (the period of the tail continued).
    """
    length = len(context)
    for n in range(ngram_max, ngram_min - 1, -1):
        if length < n + 1:
            continue
        suffix = list(context[length - n:])
        for start in range(length - n - 1, -1, -1):
            if context[start] == suffix[0] and list(context[start:start + n]) == suffix:
                return continued_copy(context, start + n, num_tokens)
    return []


def continued_copy(context: Sequence[int], source: int, num_tokens: int) -> list[int]:
    """``num_tokens`` ids copied from ``context[source:]`` (``0 <= source < len(context)``), the copy
    reading its own output once it passes the context's end: the tail ``context[source:]`` repeated
    with period ``len(context) - source`` (see the module docstring)."""
    length = len(context)
    out: list[int] = []
    for i in range(num_tokens):
        out.append(int(context[source + i]) if source + i < length else out[source + i - length])
    return out


class NGramProposer:
    """Prompt lookup behind the :class:`~deepspec.algorithms.protocol.Proposer` protocol.

    Args:
        vocab_size: V of the target (the width of the one-hot ``draft_probs_NV`` rows at T > 0).
        num_tokens: K, the most tokens proposed per step (the draft's ``block_size`` in a report that
            compares them, else :data:`DEFAULT_NUM_TOKENS`).
        ngram_max, ngram_min: the n-gram lengths tried, longest first (``1 <= ngram_min <= ngram_max``).
        max_positions: the target's ``max_position_embeddings``: no draft token at a position ``>=`` it.
        device: where the returned tensors live (the target's device).
        corpus: an :class:`~deepspec.algorithms.ngram.corpus.NGramCorpus` of the target's earlier answers
            asked when the context has no match (None: the context only); ``steps_from_corpus`` counts
            the proposals it made.
        corpus_ngram_min: the shortest context suffix looked up in the corpus, in [1, ``corpus.ngram_max``]
            (:meth:`~deepspec.algorithms.ngram.corpus.NGramCorpus.continuation`).

    Raises ValueError (naming the argument) for K < 1, V < 1, an invalid n-gram range or ``corpus_ngram_min``,
    or a corpus holding a token id >= V (prepared with another target).
    """

    needs_features = False
    # the context lookup; bench/lookup_rule.py sets an instance's to earlier rules to compare tau
    context_rule = staticmethod(ngram_proposal)

    def __init__(self, *, vocab_size: int, num_tokens: int = DEFAULT_NUM_TOKENS, ngram_max: int = DEFAULT_NGRAM_MAX,
                 ngram_min: int = DEFAULT_NGRAM_MIN, max_positions: int | None = None,
                 device: torch.device | str = "cpu", corpus: NGramCorpus | None = None,
                 corpus_ngram_min: int = DEFAULT_CORPUS_NGRAM_MIN) -> None:
        check_ngram_range(ngram_max=ngram_max, ngram_min=ngram_min, field="NGramProposer")
        if num_tokens < 1:
            raise ValueError(f"NGramProposer.num_tokens: expected K >= 1, received {num_tokens}.")
        if vocab_size < 1:
            raise ValueError(f"NGramProposer.vocab_size: expected >= 1, received {vocab_size}.")
        if corpus is not None and (isinstance(corpus_ngram_min, bool) or not isinstance(corpus_ngram_min, int)
                                   or not 1 <= corpus_ngram_min <= corpus.ngram_max):
            raise ValueError(f"NGramProposer.corpus_ngram_min: expected an integer in [1, {corpus.ngram_max}] (the "
                             f"corpus's ngram_max), received {corpus_ngram_min!r}.")
        if corpus is not None:
            check_corpus_vocab(corpus, vocab_size, "NGramProposer.corpus")
        self.vocab_size = int(vocab_size)
        self.max_proposal_len = int(num_tokens)
        self.ngram_max, self.ngram_min = int(ngram_max), int(ngram_min)
        self.max_positions = max_positions
        self.device = torch.device(device)
        self.corpus, self.corpus_ngram_min = corpus, corpus_ngram_min
        self.steps_from_corpus = 0
        self.tokens: list[int] = []

    def prepare(self, num_positions: int) -> None:
        pass

    def reset(self) -> None:
        self.tokens = []

    def extend_context(self, target_hidden_TF: Tensor | None, token_ids_T: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in token_ids_T)

    def propose(self, anchor_token: int, anchor_pos: int, *, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        if len(self.tokens) != anchor_pos:
            raise ValueError(f"NGramProposer.propose: expected the tokens of exactly positions 0..{anchor_pos - 1}, "
                             f"received {len(self.tokens)}.")
        n_max = self.max_proposal_len
        if self.max_positions is not None:
            n_max = min(n_max, self.max_positions - 1 - int(anchor_pos))
        if n_max <= 0:
            return Proposal.empty(self.device)
        context = [*self.tokens, int(anchor_token)]
        ids = self.context_rule(context, ngram_max=self.ngram_max, ngram_min=self.ngram_min, num_tokens=n_max)
        source = "lookup"
        if not ids and self.corpus is not None:
            ids = self.corpus.continuation(context, max_len=n_max, ngram_min=self.corpus_ngram_min)
            self.steps_from_corpus += bool(ids)
            source = "corpus"
        draft_ids_N = torch.tensor(ids, dtype=torch.long, device=self.device)
        probs_NV = None
        if not sampling.greedy:  # a point mass on each proposed token
            probs_NV = torch.zeros(len(ids), self.vocab_size, dtype=torch.float32, device=self.device)
            probs_NV[torch.arange(len(ids), device=self.device), draft_ids_N] = 1.0
        return Proposal(draft_ids_N=draft_ids_N, draft_probs_NV=probs_NV, sources_N=(source,) * len(ids))


def corpus_lookup(proposer: Any) -> NGramProposer | None:
    """The :class:`NGramProposer` with a corpus that ``proposer`` proposes through (itself, or the lookup of a
    :class:`LookupFirstProposer`), else None; its ``steps_from_corpus`` counts the corpus's proposals."""
    lookup = getattr(proposer, "lookup", proposer)
    return lookup if getattr(lookup, "corpus", None) is not None else None


def check_ngram_range(*, ngram_max: int, ngram_min: int, field: str) -> None:
    """ValueError (naming ``field``) unless ``1 <= ngram_min <= ngram_max``."""
    for name, value in (("ngram_max", ngram_max), ("ngram_min", ngram_min)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}.{name}: expected an integer >= 1, received {value!r}.")
    if ngram_min > ngram_max:
        raise ValueError(f"{field}.ngram_min: expected <= ngram_max ({ngram_max}), received {ngram_min}; "
                         "lower --ngram-min or raise --ngram-max.")


def check_lookup_settings(lookup_first: Any, lookup_num_tokens: Any, *, has_draft: bool, field: str) -> None:
    """ValueError (naming ``<field>.lookup_first`` / ``<field>.lookup_num_tokens``) unless each is None or an
    integer >= 1, and ``lookup_num_tokens`` comes with ``lookup_first`` and both with a draft."""
    for name, value in (("lookup_first", lookup_first), ("lookup_num_tokens", lookup_num_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            hint = ("the shortest n-gram match that proposes in front of the draft; 2 is a good start"
                    if name == "lookup_first" else "the most tokens a match proposes")
            raise ValueError(f"{field}.{name}: expected an integer >= 1 ({hint}) or none (off / the draft's K), "
                             f"got {value!r}")
    if lookup_num_tokens is not None and lookup_first is None:
        raise ValueError(f"{field}.lookup_num_tokens: set without {field}.lookup_first; give --lookup-first N "
                         "(2 is a good start) or drop it")
    if lookup_first is not None and not has_draft:
        raise ValueError(f"{field}.lookup_first: set with no draft; give the draft to put prompt lookup in front of, "
                         "or drop it")


DEFAULT_LOOKUP_FIRST_MIN = 2  # the shortest n-gram match that proposes in front of a draft


class LookupFirstProposer:
    """A draft with prompt lookup in front of it: a long enough n-gram match proposes, else the draft does.

    Each step the lookup of :func:`ngram_proposal` runs first over n = ``ngram_max`` .. ``ngram_min``
    (``ngram_min`` defaults to 2: a match of a single token predicts poorly); when it finds a match
    its continuation is the proposal, otherwise the draft proposes (the hybrid of SuffixDecoding,
    Oliaro et al. 2024, which falls back to a model drafter where its own match is weak, with prompt
    lookup in place of a suffix tree). It wins where the output copies the context (code, quoted
    text, a repeated answer), where a small draft is weakest, and costs no draft forward there.

    Lossless at any temperature: which proposer runs is a function of the committed tokens alone
    (not of any random draw of the step), and each returns the distribution its tokens were drawn
    from (a point mass for the lookup), so the verify step's rejection sampling (Leviathan et al.
    2023, Alg. 1, which holds for any ``q``) yields the target's distribution either way. With
    ``tree`` both run and one tree holds both proposals: see there.

    Both proposers see every committed position: ``extend_context`` goes to both (the lookup ignores
    the features), ``reset`` to both. ``needs_features`` is the draft's. A match proposes up to
    ``lookup_num_tokens`` tokens, the draft up to its own K: a lookup that matched tends to go on
    matching (the n-gram rows of the reports accept most second and third tokens once the first is
    accepted), while a verify over a few more tokens costs little more than a one-token step
    (``docs/results/verify-cost-cpu-2026-11-30``), so a longer lookup proposal is cheap to try (Hugging
    Face's ``prompt_lookup_num_tokens`` defaults to 10). ``max_proposal_len`` is the larger of the two;
    setting it (as :func:`deepspec.algorithms.protocol.cap_proposal_len` does) caps both at the value,
    never above what each was built with. ``steps_from_lookup`` / ``steps_from_draft`` count the
    proposals of each kind since construction.

    Args:
        draft: the draft's proposer (any :class:`~deepspec.algorithms.protocol.Proposer`).
        vocab_size, max_positions, device: as :class:`NGramProposer`.
        ngram_max, ngram_min: the n-gram lengths the lookup tries, longest first.
        lookup_num_tokens: the most tokens a match proposes (None: the draft's K).
        corpus, corpus_ngram_min: a corpus of the target's earlier answers the lookup asks when the
            context has no match, before the draft (as :class:`NGramProposer`).
        tree: propose the match *and* the draft's proposal (a chain or a draft tree), merged into one
            draft tree the target verifies in one forward, instead of choosing: the step accepts
            whichever path the target's tokens walk (greedy: the one it agrees with longest), so a
            match never takes a step from a draft that would have done better.
            ``steps_from_lookup`` then counts the steps with a match among their branches. The draft's
            proposal goes in first, with the distributions it was drawn from, and the match (chosen
            nodes) after it, merging where it repeats the draft's tokens: at T > 0 the target tests
            the draft's sampled nodes by rejection sampling before the match on the residual
            (multi-step speculative sampling, :func:`~deepspec.decoding.verify.verify_tree`; the order
            :class:`~deepspec.algorithms.protocol.DraftTree` needs to stay lossless).

    Raises ValueError (naming the argument) for an invalid n-gram range, a draft with K < 1 or
    ``lookup_num_tokens < 1``.
    """

    def __init__(self, draft: Any, *, vocab_size: int, ngram_max: int = DEFAULT_NGRAM_MAX,
                 ngram_min: int = DEFAULT_LOOKUP_FIRST_MIN, lookup_num_tokens: int | None = None,
                 max_positions: int | None = None, device: torch.device | str = "cpu",
                 corpus: NGramCorpus | None = None, corpus_ngram_min: int = DEFAULT_CORPUS_NGRAM_MIN,
                 tree: bool = False) -> None:
        if int(draft.max_proposal_len) < 1:
            raise ValueError(f"LookupFirstProposer.draft: expected a proposer with K >= 1, received "
                             f"{type(draft).__name__} with K = {draft.max_proposal_len}.")
        if lookup_num_tokens is not None and (isinstance(lookup_num_tokens, bool) or not isinstance(lookup_num_tokens, int)
                                              or lookup_num_tokens < 1):
            raise ValueError(f"LookupFirstProposer.lookup_num_tokens: expected an integer >= 1 or None (the draft's "
                             f"K), received {lookup_num_tokens!r}.")
        self.draft = draft
        self._built_len = (int(lookup_num_tokens or draft.max_proposal_len), int(draft.max_proposal_len))
        self.lookup = NGramProposer(vocab_size=vocab_size, num_tokens=self._built_len[0],
                                    ngram_max=ngram_max, ngram_min=ngram_min, max_positions=max_positions,
                                    device=device, corpus=corpus, corpus_ngram_min=corpus_ngram_min)
        self.needs_features = bool(getattr(draft, "needs_features", True))
        self.tree = bool(tree)
        self.steps_from_lookup = 0
        self.steps_from_draft = 0

    @property
    def num_pending_features(self) -> int:
        """The draft's queued context positions (its next call flushes them)."""
        return int(getattr(self.draft, "num_pending_features", 0))

    @property
    def drafts_serially(self) -> bool:
        """The draft's ``drafts_serially``: ``propose``'s ``max_len`` then caps the draft's depth (not the match)."""
        return bool(getattr(self.draft, "drafts_serially", False))

    @property
    def max_proposal_len(self) -> int:
        return max(self.lookup.max_proposal_len, self.draft.max_proposal_len)

    @max_proposal_len.setter
    def max_proposal_len(self, k: int) -> None:
        self.lookup.max_proposal_len = min(self._built_len[0], int(k))
        self.draft.max_proposal_len = min(self._built_len[1], int(k))

    def reset(self) -> None:
        self.draft.reset()
        self.lookup.reset()

    def prepare(self, num_positions: int) -> None:
        """The draft's set-up for a generation of ``num_positions`` positions, where it has one
        (:meth:`~deepspec.algorithms.dspark.compiled.CompiledDSparkProposer.prepare`)."""
        self.draft.prepare(num_positions)

    def extend_context(self, target_hidden_TF: Tensor | None, token_ids_T: Sequence[int]) -> None:
        self.draft.extend_context(target_hidden_TF, token_ids_T)
        self.lookup.extend_context(None, token_ids_T)

    def propose_without_draft(self, anchor_token: int, anchor_pos: int, *, sampling: SamplingParams,
                              generator: torch.Generator | None) -> Proposal:
        """The lookup's match alone, as a chain (empty without a match): what this proposer offers without
        running the draft, for a step on which a scheduler judged the draft not worth its call
        (:meth:`deepspec.decoding.schedule.StepScheduler.plan`)."""
        proposal = self.lookup.propose(anchor_token, anchor_pos, sampling=sampling, generator=generator)
        self.steps_from_lookup += bool(proposal.num_proposed)
        return dataclasses.replace(proposal, max_proposal_len=self.lookup.max_proposal_len)

    def _draft(self, anchor_token: int, anchor_pos: int, sampling: SamplingParams, generator: torch.Generator | None,
               max_len: int | None) -> Proposal:
        if max_len is None:
            return self.draft.propose(anchor_token, anchor_pos, sampling=sampling, generator=generator)
        return self.draft.propose(anchor_token, anchor_pos, sampling=sampling, generator=generator, max_len=max_len)

    def propose(self, anchor_token: int, anchor_pos: int, *, sampling: SamplingParams,
                generator: torch.Generator | None, max_len: int | None = None) -> Proposal:
        """The match (and, with ``tree``, the draft's proposal beside it), else the draft's proposal;
        ``max_len``: the draft's most tokens this call (a serial draft's, see :attr:`drafts_serially`)."""
        proposal = self.lookup.propose(anchor_token, anchor_pos, sampling=sampling, generator=generator)
        if proposal.num_proposed and self.tree:
            self.steps_from_lookup += 1
            tree = DraftTree()  # the draft's (possibly sampled) nodes first, then the chosen match
            tree.add_proposal(self._draft(anchor_token, anchor_pos, sampling, generator, max_len))
            tree.add_proposal(proposal)
            return tree.to_proposal(proposal.draft_ids_N.device, max_proposal_len=self.max_proposal_len)
        if proposal.num_proposed:
            self.steps_from_lookup += 1
            return dataclasses.replace(proposal, max_proposal_len=self.lookup.max_proposal_len)
        self.steps_from_draft += 1
        proposal = self._draft(anchor_token, anchor_pos, sampling, generator, max_len)
        return dataclasses.replace(proposal, max_proposal_len=self.draft.max_proposal_len)
