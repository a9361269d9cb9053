"""Corpus lookup: an n-gram table of the target's own earlier answers, read by prompt lookup's proposer.

Legend: C corpus tokens, n an n-gram length, K proposal length.

Prompt lookup (:mod:`deepspec.algorithms.ngram.proposer`) finds continuations in the current context
only. The target's answers to other prompts of the same kind repeat each other too (the same
phrasing of a worked solution, the same code scaffolding), and DeepSpec holds a corpus of exactly
those answers: the prepare stage's regenerated answers (``generated_ids``), the tokens the target
itself produced. :class:`NGramCorpus` counts, for every n-gram of length 1..``ngram_max`` of that
corpus, which token followed it how often. A proposal walks greedily from the context's end: the
next token is the most frequent follower of the longest suffix of (context + tokens proposed so far)
of length ``ngram_max`` .. ``ngram_min`` that the corpus holds, until no such suffix is held or K
tokens are proposed. This is the frequency-ranked walk of
SuffixDecoding (Oliaro et al. 2024, "SuffixDecoding: A Model-Free Approach to Speeding Up Large
Language Model Inference", Sec. 3), over an n-gram table instead of a suffix tree, with a fixed
suffix window instead of an unbounded match.

The proposal depends on the committed tokens alone, so it is a point mass like prompt lookup's:
lossless at any temperature behind rejection sampling.

Storage: per n, the sorted 64-bit hashes of the n-grams with their most frequent follower, its count
and the n-gram's count (four flat numpy arrays, 32 bytes per distinct n-gram); a lookup is one binary
search. Two n-grams with the same hash would share an entry: with 64-bit hashes the chance is about
(distinct n-grams)^2 / 2^65 (1e-7 at 2e6 n-grams), and a collision could only cost acceptance, never
correctness (the target verifies every token).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

DEFAULT_CORPUS_NGRAM_MAX = 4  # the longest context suffix looked up in the corpus
# the shortest: behind prompt lookup and a draft, a match of 3 tokens gave a higher tau than one of 2
# (docs/results/corpus-lookup-cpu-2026-12-03)
DEFAULT_CORPUS_NGRAM_MIN = 3

_MULT = 0x9E3779B97F4A7C15  # odd 64-bit multiplier (2^64 / golden ratio)
_MASK = (1 << 64) - 1


def _hash_step(h: int, token: int) -> int:
    """One step of the n-gram hash: ``(h * MULT + token + 1) mod 2^64`` (Python ints; the numpy build
    computes the same in wrapping uint64)."""
    return (h * _MULT + token + 1) & _MASK


class NGramCorpus:
    """Follower counts of every n-gram (n = 1..``ngram_max``) of a token corpus.

    Args:
        sequences: token-id sequences (each a list or 1-D array of ints >= 0); n-grams never span two.
        ngram_max: the longest n-gram counted (>= 1).

    Raises ValueError naming ``sequences`` for a negative id and ``ngram_max`` for a value < 1.
    ``max_token_id`` is the largest id held (-1 when empty): a proposer checks it against its target's
    vocabulary.
    """

    def __init__(self, sequences: Iterable[Sequence[int]], *, ngram_max: int = DEFAULT_CORPUS_NGRAM_MAX) -> None:
        if isinstance(ngram_max, bool) or not isinstance(ngram_max, int) or ngram_max < 1:
            raise ValueError(f"NGramCorpus.ngram_max: expected an integer >= 1, received {ngram_max!r}.")
        self.ngram_max = ngram_max
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
        seqs = [s for s in seqs if s.size]
        if any(int(s.min()) < 0 for s in seqs):
            raise ValueError("NGramCorpus.sequences: expected token ids >= 0, found a negative id.")
        self.num_sequences = len(seqs)
        self.num_tokens = int(sum(s.size for s in seqs))
        self.max_token_id = max((int(s.max()) for s in seqs), default=-1)
        self.rows_without_ids = 0  # rows of a prepared file that held no token ids (from_prepared)
        self._prompt_keys: set[int] = set()  # the user turns answered in the rows read (from_prepared)
        self.rows_without_messages = 0  # rows with ids but no messages: not checked by answers_prompt
        self.files: list[str] = []  # the prepared files read (from_prepared)
        # One array, a -1 between sequences: an n-gram containing -1 spans two and is skipped.
        flat = np.concatenate([np.append(s, -1) for s in seqs]) if seqs else np.zeros(0, dtype=np.int64)
        self._tables: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        h = np.zeros(flat.size, dtype=np.uint64)  # h[i]: hash of flat[i - n : i] for the current n
        valid = np.ones(flat.size, dtype=bool)  # flat[i - n : i + 1] lies inside one sequence
        valid &= flat >= 0
        with np.errstate(over="ignore"):
            for n in range(1, ngram_max + 1):
                # the n-gram ending before i: its first token is flat[i - n]; hash built last token first
                prev = np.full(flat.size, -1, dtype=np.int64)
                prev[n:] = flat[:-n] if n < flat.size else prev[n:]
                valid &= prev >= 0
                h = h * np.uint64(_MULT) + (prev + 1).astype(np.uint64)
                self._tables.append(_aggregate(h[valid], flat[valid]))

    @classmethod
    def from_prepared(cls, paths: Sequence[str | Path], *, ngram_max: int = DEFAULT_CORPUS_NGRAM_MAX,
                      field: str = "lookup_corpus") -> "NGramCorpus":
        """The corpus of the target's answers in prepare-stage outputs (JSONL rows whose ``generated_ids``
        holds one entry per message: the ids of an assistant turn the target wrote, else None).

        A row without ``generated_ids`` (a server that answered with text only) adds nothing; ``rows_without_ids``
        counts them. Errors name ``field`` (the flag's config field), the file and the row.

        Raises:
            FileNotFoundError: a path that is not a file.
            ValueError: a row that is not a JSON object, a ``generated_ids`` that is not a list of
                turns each None or a list of integer ids in [0, 2^31), or no answer tokens in all the files.
        """
        sequences: list[list[int]] = []
        prompt_keys: set[int] = set()
        rows_without = rows_without_messages = 0
        for path in map(Path, paths):
            if not path.is_file():
                raise FileNotFoundError(f"{field}: {path} is not a file; give prepare-stage outputs "
                                        "(`deepspec prepare ... --output prepared.jsonl`).")
            with path.open(encoding="utf-8") as f:
                for row, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{field}: {path} row {row} is not JSON ({exc.msg}).") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"{field}: {path} row {row} is not a JSON object; give prepare-stage outputs.")
                    ids = record.get("generated_ids")
                    if ids is None:
                        rows_without += 1
                        continue
                    sequences.extend(_checked_turns(ids, f"{field}: {path} row {row}"))
                    messages = record.get("messages")
                    if isinstance(messages, list) and messages:
                        prompt_keys.update(_answered_user_turns(messages, ids))
                    else:
                        rows_without_messages += 1
        if not sequences:
            raise ValueError(f"{field}: no answer token ids in {', '.join(map(str, paths))} ({rows_without} rows "
                             "without 'generated_ids': a server that returned text only); prepare with the local "
                             "backend or a server that returns token ids, or drop the corpus.")
        corpus = cls(sequences, ngram_max=ngram_max)
        corpus.rows_without_ids = rows_without
        corpus._prompt_keys = prompt_keys
        corpus.rows_without_messages = rows_without_messages
        corpus.files = [str(path) for path in paths]
        return corpus

    def answers_prompt(self, prompt: str) -> bool:
        """Whether a row read by :meth:`from_prepared` holds the target's answer (token ids) to the user turn
        ``prompt`` (compared with surrounding whitespace stripped): a lookup evaluated on that prompt then
        reads its own answer (a memorisation figure, not a held-out one). False for a corpus built from ids."""
        return _prompt_key(prompt) in self._prompt_keys

    def follower(self, ngram: Sequence[int]) -> tuple[int, int, int] | None:
        """``(most frequent follower, its count, the n-gram's count)`` of ``ngram``, or None when the corpus
        does not hold it (or it is longer than ``ngram_max`` or empty)."""
        n = len(ngram)
        if not 1 <= n <= self.ngram_max:
            return None
        h = 0
        for token in reversed(ngram):  # as the build: the last token first
            h = _hash_step(h, int(token))
        keys, best, best_count, total = self._tables[n - 1]
        i = int(np.searchsorted(keys, np.uint64(h)))
        if i == keys.size or int(keys[i]) != h:
            return None
        return int(best[i]), int(best_count[i]), int(total[i])

    def continuation(self, context: Sequence[int], *, max_len: int,
                     ngram_min: int = DEFAULT_CORPUS_NGRAM_MIN) -> list[int]:
        """Up to ``max_len`` tokens continuing ``context`` (see the module docstring): each the most frequent
        follower of the longest suffix (``ngram_max`` .. ``ngram_min`` tokens) the corpus holds. Empty when
        the corpus holds no suffix of ``ngram_min`` tokens."""
        out: list[int] = []
        window = list(context[-self.ngram_max:])
        while len(out) < max_len:
            found = None
            for n in range(min(self.ngram_max, len(window)), ngram_min - 1, -1):
                found = self.follower(window[len(window) - n:])
                if found is not None:
                    break
            if found is None:
                break
            out.append(found[0])
            window = [*window[1:], found[0]] if len(window) == self.ngram_max else [*window, found[0]]
        return out


def _prompt_key(text: str) -> int:
    """A key of a user turn for :meth:`NGramCorpus.answers_prompt` (Python's string hash: stable within a process)."""
    return hash(text.strip())


def _answered_user_turns(messages: list, ids: list) -> set[int]:
    """Keys of the user turns of a prepared row whose next message is an answer with token ids
    (``generated_ids`` holds one entry per message, prepare's row format)."""
    return {_prompt_key(m["content"]) for i, m in enumerate(messages[:-1])
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)
            and i + 1 < len(ids) and ids[i + 1]}


def check_prompts_in_corpus(corpus: "NGramCorpus", prompts: Mapping[str, Sequence[tuple[str, str]]], field: str,
                            log=print) -> dict[str, dict]:
    """Which evaluated prompts the corpus holds the target's own answer to (:meth:`NGramCorpus.answers_prompt`:
    the first user turn equal to a user turn a corpus row answered, whitespace around it aside; the same
    question in other words or another prompt format is not caught).

    Args:
        prompts: benchmark name -> its prompts as ``(prompt id, first user turn)``.
        field: the setting that gave the corpus, named in the warning.
        log: where the warning goes (one line), when some prompt is answered or some row could not be checked.

    Returns ``{benchmark: {"answered": n, "of": prompts, "ids": [...]}}`` for the benchmarks with an answered
    prompt: rows that read such a corpus replay the answers (a memorisation figure, not a held-out one).
    """
    out = {}
    for name, items in prompts.items():
        ids = [pid for pid, text in items if corpus.answers_prompt(text)]
        if ids:
            out[name] = {"answered": len(ids), "of": len(items), "ids": ids}
    files = ", ".join(corpus.files) or "the corpus"
    if out:
        counts = ", ".join(f"{name} {v['answered']}/{v['of']}" for name, v in out.items())
        log(f"warning: {field} ({files}) holds the target's own answers to evaluated prompts ({counts}): the rows "
            "that read the corpus replay those answers, so their tau is a memorisation figure, not a held-out one; "
            "for a held-out figure give a corpus prepared from other prompts")
    if corpus.rows_without_messages:
        log(f"note: {corpus.rows_without_messages} rows of {field} ({files}) have token ids but no 'messages': "
            "whether they answer evaluated prompts was not checked")
    return out


def _checked_turns(turns: object, where: str) -> list[list[int]]:
    """The non-empty turns of a row's ``generated_ids`` (a list of None or lists of ids in [0, 2^31));
    ValueError naming ``where`` and the turn otherwise."""
    if not isinstance(turns, list):
        raise ValueError(f"{where}: 'generated_ids' is {type(turns).__name__}, expected a list with one entry per "
                         "turn (None, or the target's token ids).")
    out = []
    for t, turn in enumerate(turns):
        if turn is None:
            continue
        if not isinstance(turn, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**31
                                             for i in turn):
            raise ValueError(f"{where}: 'generated_ids' entry {t} (message {t}) is not a list of integer token ids "
                             "in [0, 2^31).")
        if turn:
            out.append(turn)
    return out


def check_corpus_vocab(corpus: "NGramCorpus", vocab_size: int, field: str) -> None:
    """ValueError naming ``field`` when ``corpus`` holds a token id outside ``[0, vocab_size)``: it was
    prepared with another target's tokenizer, and proposing its ids would index past the target's vocabulary."""
    if corpus.max_token_id >= vocab_size:
        raise ValueError(f"{field}: the corpus holds token id {corpus.max_token_id}, outside the target's vocabulary "
                         f"of {vocab_size}; it was prepared with another target: give prepare outputs of this one.")


def check_corpus_use(lookup_corpus: Sequence[str], corpus_ngram_min: object, *, lookup_first: int | None,
                     baselines: Sequence[str] | None, field: str,
                     corpus_hint: str = "prepare-stage outputs: --lookup-corpus prepared.jsonl") -> None:
    """ValueError naming ``<field>.lookup_corpus`` / ``<field>.corpus_ngram_min`` / ``<field>.baselines``
    unless the corpus settings are usable: ``corpus_ngram_min`` in [1, :data:`DEFAULT_CORPUS_NGRAM_MAX`] (and its
    default without a corpus),
    the ``ngram+corpus`` baseline only with a corpus, and a corpus only with something that reads it
    (``lookup_first`` or that baseline; ``baselines`` None: a stage without baselines, such as serve);
    ``corpus_hint`` says how to give a corpus in the error. The files are checked when read (:meth:`NGramCorpus.from_prepared`):
    a stage may name one that an earlier stage of the same run writes."""
    if isinstance(lookup_corpus, (str, Path)):
        raise ValueError(f"{field}.lookup_corpus: expected a list of files, got the single string {str(lookup_corpus)!r}; "
                         "wrap it in a list")
    if (isinstance(corpus_ngram_min, bool) or not isinstance(corpus_ngram_min, int)
            or not 1 <= corpus_ngram_min <= DEFAULT_CORPUS_NGRAM_MAX):
        raise ValueError(f"{field}.corpus_ngram_min: expected an integer in [1, {DEFAULT_CORPUS_NGRAM_MAX}] (the "
                         f"shortest context suffix looked up in the corpus; 3 is a good start), got {corpus_ngram_min!r}")
    if corpus_ngram_min != DEFAULT_CORPUS_NGRAM_MIN and not lookup_corpus:
        raise ValueError(f"{field}.corpus_ngram_min: {corpus_ngram_min} with no {field}.lookup_corpus, so nothing reads "
                         f"it; give a corpus ({corpus_hint}) or drop it")
    if baselines is not None and "ngram+corpus" in baselines and not lookup_corpus:
        raise ValueError(f"{field}.baselines: ngram+corpus needs {field}.lookup_corpus ({corpus_hint}); give it or "
                         "drop the baseline")
    if lookup_corpus and lookup_first is None and "ngram+corpus" not in (baselines or ()):
        readers = ("--lookup-first N with a --draft" if baselines is None else
                   "--lookup-first N (prompt lookup and the corpus in front of the draft) or the baseline ngram+corpus")
        raise ValueError(f"{field}.lookup_corpus: nothing reads it; give {readers}, or drop it")


def _aggregate(keys: np.ndarray, followers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct key (sorted): its most frequent follower (the smallest id on a tie), that follower's
    count and the key's count."""
    if keys.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(0, dtype=np.uint64), empty, empty, empty
    order = np.lexsort((followers, keys))
    keys, followers = keys[order], followers[order]
    # runs of equal (key, follower) pairs
    pair_start = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (followers[1:] != followers[:-1])])
    pair_count = np.diff(np.r_[pair_start, keys.size])
    pair_key, pair_follower = keys[pair_start], followers[pair_start]
    # per key: the pair with the largest count (lexsort: by key, then count descending, then follower ascending)
    order = np.lexsort((pair_follower, -pair_count, pair_key))
    pair_key, pair_follower, pair_count = pair_key[order], pair_follower[order], pair_count[order]
    key_start = np.flatnonzero(np.r_[True, pair_key[1:] != pair_key[:-1]])
    key_total = np.add.reduceat(pair_count, key_start)
    return pair_key[key_start], pair_follower[key_start], pair_count[key_start], key_total
