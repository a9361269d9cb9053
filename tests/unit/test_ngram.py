"""The n-gram (prompt lookup) baseline: the pure lookup against a slow obvious version, proposals drawn
only from the context, lossless greedy decoding through the engine without feature capture, one-hot
draft rows at T > 0, and the eval config / stage wiring (``--baselines``)."""

from __future__ import annotations

import random

import pytest
import torch

from deepspec.algorithms.ngram.proposer import NGramProposer, ngram_proposal
from deepspec.algorithms.protocol import NullProposer, Proposal, cap_proposal_len
from deepspec.algorithms.registry import check_baselines
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.verify import SamplingParams, verify
from deepspec.target.capture import target_forward
from tests.helpers import sharp_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def slow_ngram_proposal(context, *, ngram_max, ngram_min, num_tokens):
    """The rule read literally: for n = max..min, every start whose n tokens equal the last n tokens and
    that ends before the last token; the latest such start wins; the tokens after it are copied one by
    one onto the end of the context, so the copy reads what it has just written."""
    L = len(context)
    for n in range(ngram_max, ngram_min - 1, -1):
        if n >= L:
            continue
        starts = [s for s in range(L - n) if context[s:s + n] == context[L - n:]]
        if starts:
            s, grown = max(starts), list(context)
            for i in range(num_tokens):
                grown.append(grown[s + n + i])
            return grown[L:]
    return []


def test_ngram_proposal_hand_made_cases():
    # last 2-gram (7, 8) occurred at 1..2 and 4..5: the most recent one (4..5) is followed by 9, 7, 8,
    # the context's end; the copy goes on with what it proposed (the period 9, 7, 8 continued)
    ctx = [1, 7, 8, 2, 7, 8, 9, 7, 8]
    assert ngram_proposal(ctx, ngram_max=2, ngram_min=1, num_tokens=5) == [9, 7, 8, 9, 7]
    assert ngram_proposal(ctx, ngram_max=2, ngram_min=1, num_tokens=2) == [9, 7]
    # no 3-gram match falls back to the 2-gram
    assert ngram_proposal(ctx, ngram_max=3, ngram_min=2, num_tokens=3) == [9, 7, 8]
    # nothing matches: empty; a single token has no earlier occurrence
    assert ngram_proposal([1, 2, 3, 4], ngram_max=2, ngram_min=1, num_tokens=3) == []
    assert ngram_proposal([5], ngram_max=3, ngram_min=1, num_tokens=3) == []
    # the continued copy past the context's end: a short context's one repeat gives all K
    assert ngram_proposal([4, 4], ngram_max=3, ngram_min=1, num_tokens=6) == [4] * 6


@pytest.mark.parametrize("k", [1, 3, 7, 10])
def test_ngram_proposal_continues_a_repeating_tail_for_all_k_tokens(k):
    """Text repeating with period p < K: the most recent match overlaps the context's end, and a copy
    cut there proposed p tokens (1 on a run of one token, 2 on "ab ab", 3 on a repeated 3-token line);
    continued, it proposes K, each the token the repetition puts there."""
    a, b, x, y, nl = 11, 12, 15, 16, 14
    cases = {  # context (prompt-like head, then the repetition), the repeating unit as it goes on
        "run of one token": ([5, 6] + [a] * 9, [a]),
        "ab ab": ([5, 6] + [a, b] * 4, [a, b]),
        "repeated 3-token line": ([5] + [x, y, nl] * 3, [x, y, nl]),
        "a repetition that only started": ([5, 6, a, b, a, b], [a, b]),
    }
    for name, (ctx, unit) in cases.items():
        for n_max, n_min in ((3, 1), (3, 2), (1, 1)):
            got = ngram_proposal(ctx, ngram_max=n_max, ngram_min=n_min, num_tokens=k)
            assert got == (unit * k)[:k], (name, n_max, n_min)


def test_ngram_proposal_matches_slow_version_and_stays_in_context():
    rng = random.Random(0)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 9])
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        n_max = rng.randint(1, 4)
        n_min = rng.randint(1, n_max)
        k = rng.randint(1, 8)
        got = ngram_proposal(ctx, ngram_max=n_max, ngram_min=n_min, num_tokens=k)
        assert got == slow_ngram_proposal(ctx, ngram_max=n_max, ngram_min=n_min, num_tokens=k), (ctx, n_max, n_min, k)
        assert len(got) <= k and set(got) <= set(ctx)


def test_proposer_checks_arguments_and_context():
    with pytest.raises(ValueError, match="ngram_min"):
        NGramProposer(vocab_size=8, ngram_max=2, ngram_min=3)
    with pytest.raises(ValueError, match="ngram_max"):
        NGramProposer(vocab_size=8, ngram_max=0, ngram_min=0)
    with pytest.raises(ValueError, match="num_tokens"):
        NGramProposer(vocab_size=8, num_tokens=0)
    prop = NGramProposer(vocab_size=8, num_tokens=3)
    prop.extend_context(None, [1, 2, 3, 1, 2])
    with pytest.raises(ValueError, match="positions 0..3"):
        prop.propose(3, 4, sampling=SamplingParams(), generator=None)
    p = prop.propose(3, 5, sampling=SamplingParams(), generator=None)  # context 1 2 3 1 2 3
    assert p.draft_ids_N.tolist() == [1, 2, 3] and p.draft_probs_NV is None
    capped = NGramProposer(vocab_size=8, num_tokens=3, max_positions=7)
    capped.extend_context(None, [1, 2, 3, 1, 2])
    assert capped.propose(3, 5, sampling=SamplingParams(), generator=None).draft_ids_N.tolist() == [1]


def test_sampling_rows_are_point_masses_and_verify_stays_finite():
    prop = NGramProposer(vocab_size=8, num_tokens=3)
    prop.extend_context(None, [1, 2, 3, 1, 2])
    p = prop.propose(3, 5, sampling=SamplingParams(temperature=1.0), generator=None)
    assert p.draft_probs_NV.dtype == torch.float32 and p.draft_probs_NV.shape == (3, 8)
    assert torch.equal(p.draft_probs_NV.argmax(-1), p.draft_ids_N) and torch.equal(p.draft_probs_NV.sum(-1),
                                                                                      torch.ones(3))
    # the target puts no mass on the first draft: rejected, and the residual never returns it
    logits = torch.randn(4, 8)
    logits[0, 1] = float("-inf")
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        res = verify(p.draft_ids_N, p.draft_probs_NV, logits, sampling=SamplingParams(temperature=1.0), generator=g,
                     eos_token_ids=())
        assert res.num_accepted == 0 and res.committed[0] != 1


def test_check_baselines():
    assert check_baselines(["none"], "eval.baselines") == []
    assert check_baselines([], "eval.baselines") == []
    assert check_baselines(["ngram", "ngram"], "eval.baselines") == ["ngram"]
    with pytest.raises(ValueError, match="eval.baselines"):
        check_baselines(["ngram", "none"], "eval.baselines")
    with pytest.raises(ValueError, match="'lookahead'"):
        check_baselines(["lookahead"], "eval.baselines")


# ----------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def target():
    return sharp_tiny_llama(VOCAB)


class RecordingForward:
    """The engine's forward, recording the layer ids each call asked to capture."""

    def __init__(self):
        self.layer_ids = []

    def __call__(self, model, input_ids_BT, ids, **kw):
        self.layer_ids.append(list(ids))
        return target_forward(model, input_ids_BT, ids, **kw)


class Recording(NGramProposer):
    def extend_context(self, target_hidden_TF, token_ids_T):
        assert target_hidden_TF is None
        super().extend_context(target_hidden_TF, token_ids_T)


PROMPTS = [[0, 5, 17, 42, 8, 5, 17, 42, 9, 33], [0, 3, 3, 3, 7, 11, 3, 7], [0, 60, 2, 61]]


@pytest.mark.parametrize("ngram_min", [1, 2])
def test_engine_greedy_is_lossless_and_captures_no_features(target, ngram_min):
    eos = [VOCAB + 1]  # never produced: every generation runs to max_new_tokens
    base = SpeculativeEngine(target, [0], NullProposer(), eos)
    forward = RecordingForward()
    spec = SpeculativeEngine(target, [0], Recording(vocab_size=VOCAB, num_tokens=4, ngram_min=ngram_min), eos,
                             forward_fn=forward)
    accepted = 0
    for prompt in PROMPTS:
        ref = base.generate(prompt, max_new_tokens=40)
        out = spec.generate(prompt, max_new_tokens=40)
        assert out.output_ids == ref.output_ids
        accepted += sum(s.num_accepted for s in out.steps)
    assert all(ids == [] for ids in forward.layer_ids)
    assert accepted > 0  # the lookup found repeats the target accepted (else the test shows little)


def test_engine_sampling_runs_with_point_masses(target):
    spec = SpeculativeEngine(target, [0], NGramProposer(vocab_size=VOCAB, num_tokens=4), [VOCAB + 1])
    g = torch.Generator().manual_seed(3)
    res = spec.generate(PROMPTS[0], max_new_tokens=30, sampling=SamplingParams(temperature=0.7, top_p=0.9),
                        generator=g)
    assert len(res.output_ids) == 30 and all(0 <= t < VOCAB for t in res.output_ids)
    assert any(s.num_proposed for s in res.steps)


def test_eval_config_baselines_and_ngram_knobs():
    from deepspec.eval.stage import EvalConfig

    assert EvalConfig(draft=["x"], output_dir="o").baselines == ["ngram"]
    assert EvalConfig(draft=["x"], output_dir="o", baselines=["none"]).baselines == []
    with pytest.raises(ValueError, match="eval.baselines"):
        EvalConfig(draft=["x"], output_dir="o", baselines=["eagle"])
    with pytest.raises(ValueError, match="eval.ngram_min"):
        EvalConfig(draft=["x"], output_dir="o", ngram_max=2, ngram_min=3)
    with pytest.raises(ValueError, match="eval.ngram_num_tokens"):
        EvalConfig(draft=["x"], output_dir="o", ngram_num_tokens=0)


def test_baseline_proposers_take_their_settings(target):
    from deepspec.decoding.settings import build_proposers
    from deepspec.eval.stage import EvalConfig

    settings = EvalConfig(draft=["x"], output_dir="o", ngram_max=4, ngram_min=2).decode_settings()
    out = build_proposers(settings, target, {})
    assert list(out) == ["ngram"]
    prop = out["ngram"]
    assert (prop.max_proposal_len, prop.ngram_max, prop.ngram_min, prop.vocab_size) == (7, 4, 2, VOCAB)
    capped = EvalConfig(draft=["x"], output_dir="o", num_draft_tokens=3).decode_settings()
    assert build_proposers(capped, target, {})["ngram"].max_proposal_len == 3  # no draft: 7, capped
    assert build_proposers(EvalConfig(draft=["x"], output_dir="o", baselines=["none"]).decode_settings(), target,
                           {}) == {}
    # (the first draft's K as the default: tests/unit/test_decode_settings.py)


# ----------------------------------------------------------------------------- lookup in front of a draft
class StubDraft:
    """A draft that records its calls and proposes ``[60, 61, ..]``; needs features."""

    def __init__(self, k: int = 3):
        self.max_proposal_len = k
        self.calls: list[tuple] = []
        self.features = 0

    def prepare(self, num_positions):
        pass

    def reset(self):
        self.calls.append(("reset",))
        self.features = 0

    def extend_context(self, target_hidden_TF, token_ids_T):
        assert target_hidden_TF is not None and target_hidden_TF.shape[0] == len(token_ids_T)
        self.features += len(token_ids_T)

    def propose(self, anchor_token, anchor_pos, *, sampling, generator):
        assert self.features == anchor_pos
        self.calls.append(("propose", anchor_pos))
        return Proposal(draft_ids_N=torch.arange(60, 60 + self.max_proposal_len))


def test_lookup_first_proposes_a_long_enough_match_else_the_draft():
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    draft = StubDraft()
    prop = LookupFirstProposer(draft, vocab_size=VOCAB, ngram_max=3, ngram_min=2)
    assert prop.needs_features and prop.max_proposal_len == 3
    prop.reset()
    ctx = [0, 5, 17, 42, 8, 9]
    prop.extend_context(torch.zeros(len(ctx), 4), ctx)
    g = SamplingParams()
    # anchor 17 after ..., 9: the last two tokens (9, 17) never occurred: the draft proposes
    out = prop.propose(17, len(ctx), sampling=g, generator=None)
    assert out.draft_ids_N.tolist() == [60, 61, 62] and draft.calls[-1] == ("propose", 6)
    prop.extend_context(torch.zeros(2, 4), [17, 5])  # committed: 17 (the anchor), 5
    # anchor 17 after ..., 5: the 2-gram (5, 17) occurred at positions 1-2: the lookup proposes 42, 8, 9
    out = prop.propose(17, 8, sampling=g, generator=None)
    assert out.draft_ids_N.tolist() == [42, 8, 9] and draft.calls[-1] == ("propose", 6)
    assert (prop.steps_from_lookup, prop.steps_from_draft) == (1, 1)
    # a 1-gram match is not enough with ngram_min 2: 8 occurred, (x, 8) did not
    prop.extend_context(torch.zeros(1, 4), [17])
    assert prop.propose(8, 9, sampling=g, generator=None).draft_ids_N.tolist() == [60, 61, 62]
    # T > 0: the lookup's rows are point masses over the target vocabulary
    prop.extend_context(torch.zeros(1, 4), [8])
    out = prop.propose(9, 10, sampling=SamplingParams(temperature=1.0), generator=None)
    assert out.draft_ids_N.tolist() == [17, 5, 17]
    assert out.draft_probs_NV.shape == (3, VOCAB) and out.draft_probs_NV.sum(-1).eq(1).all()
    cap_proposal_len(prop, 2)
    assert (prop.max_proposal_len, draft.max_proposal_len, prop.lookup.max_proposal_len) == (2, 2, 2)
    prop.reset()
    assert draft.calls[-1] == ("reset",) and prop.lookup.tokens == [] and draft.features == 0
    with pytest.raises(ValueError, match="LookupFirstProposer.draft"):
        LookupFirstProposer(StubDraft(k=0), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="ngram_min"):
        LookupFirstProposer(StubDraft(), vocab_size=VOCAB, ngram_max=2, ngram_min=3)
    for bad in (0, True):
        with pytest.raises(ValueError, match="lookup_num_tokens"):
            LookupFirstProposer(StubDraft(), vocab_size=VOCAB, lookup_num_tokens=bad)


def test_lookup_first_match_proposes_up_to_lookup_num_tokens_and_a_cap_bounds_both():
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    draft = StubDraft(k=2)
    prop = LookupFirstProposer(draft, vocab_size=VOCAB, ngram_max=3, ngram_min=2, lookup_num_tokens=5)
    assert prop.max_proposal_len == 5
    prop.reset()
    ctx = [3, 4, 10, 11, 12, 13, 14, 15, 3]
    prop.extend_context(torch.zeros(len(ctx), 4), ctx)
    g = SamplingParams()
    matched = prop.propose(4, len(ctx), sampling=g, generator=None)
    assert matched.draft_ids_N.tolist() == [10, 11, 12, 13, 14] and matched.max_proposal_len == 5
    prop.extend_context(torch.zeros(1, 4), [4])
    drafted = prop.propose(9, len(ctx) + 1, sampling=g, generator=None)
    assert drafted.draft_ids_N.tolist() == [60, 61] and drafted.max_proposal_len == 2  # the draft's K
    cap_proposal_len(prop, 3)
    assert (prop.max_proposal_len, prop.lookup.max_proposal_len, draft.max_proposal_len) == (3, 3, 2)
    prop.max_proposal_len = 9  # never above what each was built with
    assert (prop.max_proposal_len, prop.lookup.max_proposal_len, draft.max_proposal_len) == (5, 5, 2)


def test_lookup_first_and_the_corpus_continue_a_repeating_tail():
    """The +lookup proposer (eval and ``serve --lookup-first``) and the ngram+corpus baseline propose all
    K tokens on repeated text, as the context rule does, both chain and tree; the corpus walk continues a
    loop it holds."""
    from deepspec.algorithms.ngram.corpus import NGramCorpus
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    a, b, x, y, nl = 11, 12, 15, 16, 14
    g = SamplingParams()
    for tree in (False, True):
        for ctx, anchor, want in (([5, 6, a, a, a], a, [a] * 7),  # a run of one token
                                  ([5, 6, a, b, a, b, a], b, [a, b] * 3 + [a]),  # "ab ab"
                                  ([5, x, y, nl, x, y, nl, x], y, [nl, x, y] * 2 + [nl])):  # a repeated line
            draft = StubDraft(k=3)
            prop = LookupFirstProposer(draft, vocab_size=VOCAB, ngram_max=3, ngram_min=2, lookup_num_tokens=7,
                                       tree=tree)
            prop.reset()
            prop.extend_context(torch.zeros(len(ctx), 4), ctx)
            out = prop.propose(anchor, len(ctx), sampling=g, generator=None)
            assert prop.steps_from_lookup == 1
            if tree:  # the draft's chain first, then the match beside it: the match is the tree's deepest path
                assert out.max_proposal_len == 7 and out.draft_ids_N[-7:].tolist() == want
            else:
                assert out.draft_ids_N.tolist() == want and out.max_proposal_len == 7
    # ngram+corpus: the context's repeated line wins over the corpus and is continued for all K
    corpus = NGramCorpus([[20, 21, 22, 23, 24]], ngram_max=3)
    prop = NGramProposer(vocab_size=VOCAB, num_tokens=7, ngram_max=3, ngram_min=1, corpus=corpus)
    prop.extend_context(None, [5, x, y, nl, x, y, nl, x])
    assert prop.propose(y, 8, sampling=g, generator=None).draft_ids_N.tolist() == [nl, x, y] * 2 + [nl]
    assert prop.steps_from_corpus == 0
    # where the context has no match, the corpus's walk continues a loop it holds for all K
    corpus = NGramCorpus([[x, y, nl] * 4], ngram_max=3)
    prop = NGramProposer(vocab_size=VOCAB, num_tokens=7, ngram_max=2, ngram_min=2, corpus=corpus, corpus_ngram_min=2)
    prop.extend_context(None, [5, 6, x])
    assert prop.propose(y, 3, sampling=g, generator=None).draft_ids_N.tolist() == [nl, x, y] * 2 + [nl]
    assert prop.steps_from_corpus == 1


def test_lookup_first_with_a_dspark_draft_is_lossless_greedy(target):
    from deepspec.algorithms.dspark.config import draft_config_from_target
    from deepspec.algorithms.dspark.model import DSparkDraftModel
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    cfg = draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=[0], mask_token_id=VOCAB - 1,
                                   block_size=4, markov_rank=4)
    torch.manual_seed(0)
    draft = DSparkProposer(DSparkDraftModel.from_target(target, cfg).eval())
    prop = LookupFirstProposer(draft, vocab_size=VOCAB, ngram_min=2, lookup_num_tokens=7)
    eos = [VOCAB + 1]
    base = SpeculativeEngine(target, [0], NullProposer(), eos)
    spec = SpeculativeEngine(target, [0], prop, eos)
    for prompt in PROMPTS:
        assert spec.generate(prompt, max_new_tokens=40).output_ids == base.generate(prompt, max_new_tokens=40).output_ids
    assert prop.steps_from_lookup > 0 and prop.steps_from_draft > 0
    steps = [s for p in PROMPTS for s in spec.generate(p, max_new_tokens=40).steps]
    assert {s.max_proposal_len for s in steps} == {4, 7}  # each step judged against its own proposer's K


# ----------------------------------------------------------------------------- a corpus of earlier answers
def slow_followers(sequences, ngram):
    """Every token that follows ``ngram`` inside one of ``sequences``, with its count."""
    from collections import Counter

    n = len(ngram)
    return Counter(s[i + n] for s in sequences for i in range(len(s) - n) if list(s[i:i + n]) == list(ngram))


def test_corpus_followers_match_a_slow_count_and_never_span_two_sequences():
    from deepspec.algorithms.ngram.corpus import NGramCorpus

    rng = random.Random(1)
    seqs = [[rng.randrange(5) for _ in range(rng.randint(0, 25))] for _ in range(40)]
    corpus = NGramCorpus(seqs, ngram_max=3)
    assert (corpus.num_sequences, corpus.num_tokens) == (sum(1 for s in seqs if s), sum(map(len, seqs)))
    for n in (1, 2, 3):
        for ngram in {tuple(s[i:i + n]) for s in seqs for i in range(len(s) - n + 1)} | {(4,) * n}:
            counts = slow_followers(seqs, ngram)
            if not counts:
                assert corpus.follower(ngram) is None
                continue
            best = min(counts, key=lambda t: (-counts[t], t))  # most frequent, the smallest id on a tie
            assert corpus.follower(ngram) == (best, counts[best], sum(counts.values())), ngram
    two = NGramCorpus([[1, 2], [3, 4]], ngram_max=2)
    assert two.follower([2]) is None and two.follower([2, 3]) is None  # 2 -> 3 crosses the boundary
    assert two.follower([]) is None and two.follower([1, 2, 3]) is None  # empty, longer than ngram_max
    with pytest.raises(ValueError, match="NGramCorpus.sequences"):
        NGramCorpus([[1, -2]])
    with pytest.raises(ValueError, match="NGramCorpus.ngram_max"):
        NGramCorpus([[1, 2]], ngram_max=0)


def test_corpus_continuation_follows_the_longest_held_suffix():
    from deepspec.algorithms.ngram.corpus import NGramCorpus

    corpus = NGramCorpus([[1, 2, 3, 4, 5], [9, 2, 3, 7, 8], [2, 3, 7]], ngram_max=3)
    # (2, 3) is followed by 7 twice and 4 once; (1, 2, 3) by 4 only: the longer suffix wins
    assert corpus.continuation([0, 1, 2, 3], max_len=5, ngram_min=2) == [4, 5]  # (3, 4, 5) then nothing held
    assert corpus.continuation([0, 6, 2, 3], max_len=5, ngram_min=2) == [7, 8]
    assert corpus.continuation([0, 6, 2, 3], max_len=1, ngram_min=2) == [7]
    assert corpus.continuation([0, 6, 2, 3], max_len=5, ngram_min=3) == []  # (6, 2, 3) is not held
    assert corpus.continuation([3], max_len=5, ngram_min=2) == []  # the context is shorter than ngram_min


def test_corpus_from_prepared_reads_the_targets_answers_and_names_bad_rows(tmp_path):
    import json

    from deepspec.algorithms.ngram.corpus import NGramCorpus

    good = tmp_path / "prepared.jsonl"
    rows = [{"id": "a", "generated_ids": [None, [5, 6, 7]]}, {"id": "b", "generated_ids": [None, [5, 6, 8], None, [1]]}]
    good.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    corpus = NGramCorpus.from_prepared([good])
    assert (corpus.num_sequences, corpus.num_tokens) == (3, 7)
    assert corpus.follower([5, 6]) == (7, 1, 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps([5, 6]) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl row 2 is not a JSON object"):
        NGramCorpus.from_prepared([good, bad])
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl row 1 is not JSON"):
        NGramCorpus.from_prepared([bad])
    with pytest.raises(FileNotFoundError, match="eval.lookup_corpus: .*missing.jsonl is not a file"):
        NGramCorpus.from_prepared([tmp_path / "missing.jsonl"], field="eval.lookup_corpus")
    for ids, turn in (([1, 2, 3], 0), ([None, [1, "a"]], 1), ([[1.5]], 0), ([[True]], 0), ([[10**30]], 0), ([[-1]], 0)):
        bad.write_text(json.dumps({"generated_ids": ids}) + "\n")
        message = rf"bad.jsonl row 1: 'generated_ids' entry {turn} \(message {turn}\) is not a list of integer"
        with pytest.raises(ValueError, match=message):
            NGramCorpus.from_prepared([bad])
    bad.write_text(json.dumps({"generated_ids": "1 2 3"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl row 1: 'generated_ids' is str, expected a list"):
        NGramCorpus.from_prepared([bad])
    # the user turns a row with ids answered (whitespace around them aside): a corpus that answers an evaluated prompt
    from deepspec.algorithms.ngram.corpus import check_prompts_in_corpus

    chat = [{"role": "user", "content": q} for q in ("Q1 ", "Q2", "Q3", "Q4")]
    chat[1::2] = [{"role": "assistant", "content": "A1"}, {"role": "assistant", "content": "A3"}]
    chat += [{"role": "user", "content": "Q5"}, {"role": "assistant", "content": "A5"}]
    rows = [{"messages": chat, "generated_ids": [None, [1, 2], None, None, None, [3]]},  # A3 is not the target's
            {"messages": [{"role": "user", "content": "Q6"}, {"role": "assistant", "content": "A6"}]}]
    asked = tmp_path / "asked.jsonl"
    asked.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = NGramCorpus.from_prepared([asked, good], field="eval.lookup_corpus")
    assert [corpus.answers_prompt(q) for q in ("Q1", "\nQ5", "Q3", "Q6", "A1", "Q")] == [True, True] + [False] * 4
    logged = []
    answered = check_prompts_in_corpus(corpus, {"a": [("a0", "Q1"), ("a1", "Q3"), ("a2", "Q5")], "b": [("b0", "Q3")]},
                                       "eval.lookup_corpus", log=logged.append)
    assert answered == {"a": {"answered": 2, "of": 3, "ids": ["a0", "a2"]}}
    assert logged[0].startswith(f"warning: eval.lookup_corpus ({asked}, {good}) holds the target's own answers to "
                                "evaluated prompts (a 2/3)")
    assert logged[1] == (f"note: 2 rows of eval.lookup_corpus ({asked}, {good}) have token ids but no 'messages': "
                         "whether they answer evaluated prompts was not checked")  # the two rows of `good`
    logged.clear()
    assert check_prompts_in_corpus(NGramCorpus.from_prepared([asked]), {"b": [("b0", "Q3")]}, "f", log=logged.append) == {}
    assert logged == []
    assert not NGramCorpus([[1, 2]]).answers_prompt("Q1")  # built from ids alone: no prompts known
    # a row without ids (a server that answered with text only) adds nothing; no ids at all is an error
    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"id": "t", "messages": []}) + "\n")
    assert NGramCorpus.from_prepared([good, text_only]).rows_without_ids == 1
    with pytest.raises(ValueError, match=r"no answer token ids .*\(1 rows without 'generated_ids'"):
        NGramCorpus.from_prepared([text_only])


def test_ngram_proposer_asks_the_corpus_only_where_the_context_has_no_match():
    from deepspec.algorithms.ngram.corpus import NGramCorpus

    corpus = NGramCorpus([[20, 21, 22, 23, 24]], ngram_max=3)
    prop = NGramProposer(vocab_size=VOCAB, num_tokens=3, ngram_max=2, ngram_min=2, corpus=corpus, corpus_ngram_min=2)
    g = SamplingParams()
    prop.extend_context(None, [1, 20])
    assert prop.propose(21, 2, sampling=g, generator=None).draft_ids_N.tolist() == [22, 23, 24]  # from the corpus
    prop.extend_context(None, [21, 22, 5, 20])
    # (20, 21) now also occurs in the context (followed by 22, 5, 20): the context wins
    assert prop.propose(21, 6, sampling=g, generator=None).draft_ids_N.tolist() == [22, 5, 20]
    assert prop.steps_from_corpus == 1
    prop.reset()
    prop.extend_context(None, [1, 2])
    assert prop.propose(3, 2, sampling=g, generator=None).num_proposed == 0  # neither holds a match
    for bad in (0, 4, True):
        with pytest.raises(ValueError, match="NGramProposer.corpus_ngram_min"):
            NGramProposer(vocab_size=VOCAB, corpus=corpus, corpus_ngram_min=bad)
    # an id outside the target's vocabulary (a corpus of another target) is refused before decoding
    with pytest.raises(ValueError, match="NGramProposer.corpus: the corpus holds token id 24, outside the target's "
                                         "vocabulary of 20"):
        NGramProposer(vocab_size=20, corpus=corpus)


@pytest.mark.parametrize("ngram_min", [1, 2])
def test_engine_greedy_with_a_corpus_is_lossless(target, ngram_min):
    from deepspec.algorithms.ngram.corpus import NGramCorpus

    eos = [VOCAB + 1]
    base = SpeculativeEngine(target, [0], NullProposer(), eos)
    refs = [base.generate(p, max_new_tokens=40).output_ids for p in PROMPTS]
    # the target's own answers to two prompts, and noise: the corpus predicts the third prompt's answer in part
    rng = random.Random(0)
    corpus = NGramCorpus([refs[0], refs[1], [rng.randrange(VOCAB) for _ in range(200)]], ngram_max=3)
    prop = NGramProposer(vocab_size=VOCAB, num_tokens=4, ngram_min=2, corpus=corpus, corpus_ngram_min=ngram_min)
    spec = SpeculativeEngine(target, [0], prop, eos)
    for prompt, ref in zip(PROMPTS, refs):
        assert spec.generate(prompt, max_new_tokens=40).output_ids == ref
    assert prop.steps_from_corpus > 0


def test_corpus_settings_are_checked_together():
    from deepspec.algorithms.ngram.corpus import check_corpus_use

    check_corpus_use(["p.jsonl"], 3, lookup_first=2, baselines=["ngram"], field="eval")
    check_corpus_use(["p.jsonl"], 3, lookup_first=None, baselines=["ngram+corpus"], field="eval")
    check_corpus_use([], 3, lookup_first=None, baselines=["ngram"], field="eval")
    with pytest.raises(ValueError, match="eval.baselines: ngram\\+corpus needs eval.lookup_corpus"):
        check_corpus_use([], 3, lookup_first=2, baselines=["ngram+corpus"], field="eval")
    with pytest.raises(ValueError, match="eval.lookup_corpus: nothing reads it"):
        check_corpus_use(["p.jsonl"], 3, lookup_first=None, baselines=["ngram"], field="eval")
    for bad in (0, 5, True, "3"):
        with pytest.raises(ValueError, match="eval.corpus_ngram_min"):
            check_corpus_use(["p.jsonl"], bad, lookup_first=2, baselines=[], field="eval")
    with pytest.raises(ValueError, match="eval.lookup_corpus: expected a list of files, got the single string"):
        check_corpus_use("p.jsonl", 3, lookup_first=2, baselines=[], field="eval")
    with pytest.raises(ValueError, match="serve.lookup_corpus: nothing reads it; give --lookup-first N with a --draft"):
        check_corpus_use(["p.jsonl"], 3, lookup_first=None, baselines=None, field="serve")
    with pytest.raises(ValueError, match="bench.corpus_ngram_min: 2 with no bench.lookup_corpus, so nothing reads it"):
        check_corpus_use([], 2, lookup_first=2, baselines=["ngram"], field="bench")
