"""DSpark / DFlash proposals on compiled graphs (deepspec.algorithms.dspark.compiled): the eager proposer's
proposals from a static context cache, compiled once per cache length, lossless in the engine.

The graphs compile with a counting ``eager`` backend (dynamo captures them, no code generation): the
static cache, masks, padding and roll-back are what these tests check; on CUDA the same graphs run as
CUDA graphs (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from deepspec.algorithms.dspark.compiled import CompiledDSparkProposer, compile_proposer
from deepspec.algorithms.dspark.proposer import DSparkProposer
from deepspec.algorithms.ngram.proposer import LookupFirstProposer, NGramProposer
from deepspec.decoding.compiled import CompiledTarget
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.verify import SamplingParams
from deepspec.target.capture import target_forward
from tests.helpers import CountingBackend
from tests.unit.test_draft_tree import _dspark_draft
from tests.unit.test_engine import K, LAYER_IDS, PROMPT, VOCAB, eos_token_id_unused, hf_greedy, target  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams()


def _pair(draft, **kw):
    backend = CountingBackend()
    compiled = CompiledDSparkProposer(draft, backend=backend, **kw)
    return DSparkProposer(draft, **kw), compiled, backend


def _features(target, ids):
    return target_forward(target, torch.tensor([ids]), LAYER_IDS).target_hidden_BTF[0]


@pytest.mark.parametrize("use_heads", [True, False])  # DSpark; DFlash (no heads)
def test_compiled_proposals_equal_the_eager_proposers_through_appends_and_roll_backs(target, use_heads):
    draft = _dspark_draft(target, use_heads)
    eager, compiled, backend = _pair(draft)
    ids = PROMPT + [3, 9, 27, 81, 11, 5, 60, 2, 14, 50, 7, 19, 23]
    feats = _features(target, ids)
    with torch.inference_mode():
        compiled.prepare(len(ids) + 20)
        assert backend.num_graphs == 2
        for p in (eager, compiled):
            p.reset()
            p.extend_context(feats[:len(PROMPT)], PROMPT)  # the prefill: longer than an append, eager
        pos = len(PROMPT)
        for step, n in enumerate([1, 3, K + 1, 2, 1]):  # commits of 1 .. K + 1 positions (padded appends)
            if step == 3:  # proposing leaves the context as it was: a second proposal is the same
                for p in (eager, compiled):
                    p.propose(ids[pos], pos, sampling=GREEDY, generator=None)
            a = eager.propose(ids[pos], pos, sampling=GREEDY, generator=None)
            b = compiled.propose(ids[pos], pos, sampling=GREEDY, generator=None)
            assert b.draft_ids_N.tolist() == a.draft_ids_N.tolist() and len(a.draft_ids_N) == K
            if use_heads:
                torch.testing.assert_close(b.confidence_N, a.confidence_N, rtol=1e-5, atol=1e-6)
            else:
                assert a.confidence_N is None and b.confidence_N is None
            for p in (eager, compiled):
                p.extend_context(feats[pos:pos + n], ids[pos:pos + n])
            pos += n
        assert compiled.length == pos
        back = pos - 3  # an anchor before the context's end: both roll the context back to it
        a = eager.propose(ids[back], back, sampling=GREEDY, generator=None)
        b = compiled.propose(ids[back], back, sampling=GREEDY, generator=None)
        assert compiled.length == back and b.draft_ids_N.tolist() == a.draft_ids_N.tolist()
    assert backend.num_graphs == 2  # compiled once per cache length, whatever the appends' lengths


def test_a_capped_k_a_confidence_cut_and_the_last_positions_follow_the_eager_rules(target):
    draft = _dspark_draft(target)
    feats = _features(target, PROMPT)
    with torch.inference_mode():
        for kw in ({"confidence_threshold": 0.5}, {"confidence_threshold": 0.0}, {"max_positions": len(PROMPT) + 3}):
            eager, compiled, _ = _pair(draft, **kw)
            compiled.prepare(64)
            for p in (eager, compiled):
                p.extend_context(feats, PROMPT)
            a = eager.propose(9, len(PROMPT), sampling=GREEDY, generator=None)
            b = compiled.propose(9, len(PROMPT), sampling=GREEDY, generator=None)
            assert b.draft_ids_N.tolist() == a.draft_ids_N.tolist(), kw
        eager, compiled, _ = _pair(draft)
        for p in (eager, compiled):
            p.max_proposal_len = 2
        compiled.prepare(64)
        for p in (eager, compiled):
            p.extend_context(feats, PROMPT)
        a, b = (p.propose(9, len(PROMPT), sampling=GREEDY, generator=None) for p in (eager, compiled))
        assert b.draft_ids_N.tolist() == a.draft_ids_N.tolist() and len(b.draft_ids_N) == 2
        hot = SamplingParams(temperature=1.0)  # sampled proposals run eagerly over the same cache
        a = eager.propose(9, len(PROMPT), sampling=hot, generator=torch.Generator().manual_seed(3))
        b = compiled.propose(9, len(PROMPT), sampling=hot, generator=torch.Generator().manual_seed(3))
        assert b.draft_ids_N.tolist() == a.draft_ids_N.tolist()
        torch.testing.assert_close(b.draft_probs_NV, a.draft_probs_NV)


def test_the_engine_with_compiled_target_and_draft_is_lossless(target):
    draft = _dspark_draft(target)
    eos = [eos_token_id_unused()]
    max_new = 24
    ref = hf_greedy(target, PROMPT, max_new, eos[0])
    backend = CountingBackend()
    proposer = compile_proposer(DSparkProposer(draft), backend=backend)
    assert isinstance(proposer, CompiledDSparkProposer)
    compiled_target = CompiledTarget(target, {1, K + 1}, backend=CountingBackend())
    engine = SpeculativeEngine(target, LAYER_IDS, proposer, eos, compiled=compiled_target)
    eager = SpeculativeEngine(target, LAYER_IDS, DSparkProposer(draft), eos).generate(PROMPT, max_new_tokens=max_new)
    for _ in range(2):  # the second generation reuses the cache and the graphs
        res = engine.generate(PROMPT, max_new_tokens=max_new)
        assert res.output_ids == ref == eager.output_ids
        assert [s.num_accepted for s in res.steps] == [s.num_accepted for s in eager.steps]
    assert backend.num_graphs == 2


def test_compile_proposer_wraps_chain_drafts_only(target):
    draft = _dspark_draft(target)
    assert compile_proposer(DSparkProposer(draft, tree_width=3)).tree_width == 3
    assert type(compile_proposer(DSparkProposer(draft, tree_width=3))) is DSparkProposer
    ngram = NGramProposer(vocab_size=VOCAB, num_tokens=K)
    assert compile_proposer(ngram) is ngram
    combined = LookupFirstProposer(DSparkProposer(draft), vocab_size=VOCAB, ngram_max=3, ngram_min=2)
    assert compile_proposer(combined, backend="eager") is combined
    assert isinstance(combined.draft, CompiledDSparkProposer)
    capped = DSparkProposer(draft)
    capped.max_proposal_len = 2
    assert compile_proposer(capped, backend="eager").max_proposal_len == 2


def test_the_static_cache_refuses_what_it_cannot_hold(target):
    draft = _dspark_draft(target)
    compiled = CompiledDSparkProposer(draft, backend="eager")
    feats = _features(target, PROMPT)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="call prepare"):
            compiled.extend_context(feats, PROMPT)
        compiled.prepare(8)
        assert compiled.cache_len == 256
        compiled.extend_context(torch.zeros(252, feats.shape[1]), list(range(252)))
        with pytest.raises(RuntimeError, match="exceed its 256"):
            compiled.extend_context(feats, PROMPT)


def test_inductor_compiled_draft_is_lossless(target):
    """The graphs through inductor's code generation (the CPU's C++ kernels): what a GPU runs as CUDA graphs."""
    draft = _dspark_draft(target)
    eos = [eos_token_id_unused()]
    proposer = compile_proposer(DSparkProposer(draft))
    res = SpeculativeEngine(target, LAYER_IDS, proposer, eos).generate(PROMPT, max_new_tokens=16)
    eager = SpeculativeEngine(target, LAYER_IDS, DSparkProposer(draft), eos).generate(PROMPT, max_new_tokens=16)
    assert res.output_ids == hf_greedy(target, PROMPT, 16, eos[0]) == eager.output_ids
    assert [s.num_proposed for s in res.steps] == [s.num_proposed for s in eager.steps]


def test_recompiling_past_the_limit_is_an_error(target, monkeypatch):
    import deepspec.algorithms.dspark.compiled as compiled_mod

    monkeypatch.setattr(compiled_mod, "RECOMPILE_LIMIT", 1)
    torch._dynamo.reset()  # the limit counts the graphs of the proposal's code objects in this process
    draft = _dspark_draft(target)
    with torch.inference_mode():
        CompiledDSparkProposer(draft, backend=CountingBackend()).prepare(8)
        with pytest.raises(RuntimeError, match="recompiled a proposal graph past 1 graphs"):
            CompiledDSparkProposer(draft, backend=CountingBackend()).prepare(8)


def test_each_cache_length_keeps_its_buffers_and_graphs(target):
    """Back to a length bucket seen before: the same tensors (a CUDA graph reads fixed addresses), no new graph."""
    draft = _dspark_draft(target)
    backend = CountingBackend()
    compiled = CompiledDSparkProposer(draft, backend=backend)
    with torch.inference_mode():
        compiled.prepare(8)
        first = compiled._keys[0]
        compiled.prepare(400)
        assert compiled.cache_len == 512 and compiled._keys[0] is not first
        graphs = backend.num_graphs
        compiled.prepare(8)
        assert compiled.cache_len == 256 and compiled._keys[0] is first and backend.num_graphs == graphs
