"""The compiled target path (deepspec.decoding.compiled): static KV cache, padded fixed-length steps, compiled once.

Most tests compile with a counting ``eager`` backend (dynamo captures the graph, no code generation):
the padding, cache and recompile logic is what they check; one test runs inductor for real.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.algorithms.protocol import NullProposer, Proposal
from deepspec.decoding import compiled as compiled_mod
from deepspec.decoding.compiled import CompiledTarget, StaticKVCache, cache_len_bucket
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.verify import SamplingParams
from deepspec.target.capture import features_from_hidden_states, target_forward
from tests.helpers import CountingBackend
from tests.unit.test_engine import PROMPT, OracleProposer, RandomProposer, hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, K, EOS = 96, 4, 1


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=EOS, pad_token_id=EOS)
    model = LlamaForCausalLM(cfg).float().eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # no near-ties in greedy decoding
    return model


def _compiled(model, lengths=(1, K + 1)):
    backend = CountingBackend()
    return CompiledTarget(model, lengths, backend=backend), backend


def test_cache_len_bucket():
    assert [cache_len_bucket(n) for n in (1, 255, 256, 257, 1000, 1025)] == [256, 256, 256, 512, 1024, 2048]
    with pytest.raises(ValueError, match="num_positions"):
        cache_len_bucket(0)


def test_static_kv_cache_owns_its_write_position():
    """Host int and device count move together; crop keeps transformers' convention (n >= 0 keeps n,
    n < 0 drops -n) and never grows; an overfull write is refused."""
    cache = StaticKVCache(num_layers=2, max_cache_len=8)
    k = torch.randn(1, 2, 5, 4)
    for layer_idx in range(2):
        keys, _ = cache.update(k, k, layer_idx)
        assert keys.shape == (1, 2, 8, 4)
    assert cache.get_seq_length() == 5 and isinstance(cache.get_seq_length(), int)
    assert [int(layer.write_pos) for layer in cache.layers] == [5, 5]
    cache.crop(-2)
    assert cache.get_seq_length() == 3 and [int(layer.write_pos) for layer in cache.layers] == [3, 3]
    cache.crop(2)
    assert cache.get_seq_length() == 2
    with pytest.raises(ValueError, match="holds 2 positions"):
        cache.crop(4)
    new_k = torch.randn(1, 2, 1, 4)
    keys, _ = cache.update(new_k, new_k, 0)
    torch.testing.assert_close(keys[:, :, 2:3], new_k)  # written at the cropped position
    torch.testing.assert_close(keys[:, :, :2], k[:, :, :2])
    with pytest.raises(RuntimeError, match="exceed its 8"):
        cache.update(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), 0)
    cache.reset()
    assert cache.get_seq_length() == 0 and int(cache.layers[1].write_pos) == 0


def test_compiled_path_needs_no_static_cache_layer_of_transformers(target, monkeypatch):
    """transformers versions differ in whether their StaticLayer can be cropped (or exists as such):
    the compiled path must run with it gone."""
    import transformers.cache_utils as cache_utils

    monkeypatch.delattr(cache_utils, "StaticLayer")
    compiled, _ = _compiled(target)
    width = target.config.hidden_size
    res = SpeculativeEngine(target, [0], RandomProposer(width, seed=3), [EOS], compiled=compiled).generate(
        PROMPT, max_new_tokens=12)
    assert res.output_ids == hf_greedy(target, PROMPT, 12, EOS)


def test_features_from_hidden_states_equal_the_capture_hooks(target):
    ids_BT = torch.tensor([PROMPT])
    layer_ids = [-1, 0, 1]
    hooked = target_forward(target, ids_BT, layer_ids).target_hidden_BTF
    out = target.model(input_ids=ids_BT, output_hidden_states=True)
    torch.testing.assert_close(features_from_hidden_states(out.hidden_states, layer_ids), hooked, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["null", "random", "oracle"])
def test_compiled_engine_greedy_equals_hf_generate(target, kind):
    """Target-only, proposals of every length 0..K (padded up to K + 1) and full acceptance."""
    max_new = 20
    ref = hf_greedy(target, PROMPT, max_new, EOS)
    width = target.config.hidden_size
    proposer = {"null": lambda: NullProposer(), "random": lambda: RandomProposer(width, seed=3),
                "oracle": lambda: OracleProposer(width, PROMPT + hf_greedy(target, PROMPT, max_new + K + 1, EOS))}[kind]()
    compiled, backend = _compiled(target)
    engine = SpeculativeEngine(target, [0], proposer, [EOS], compiled=compiled)
    res = engine.generate(PROMPT, max_new_tokens=max_new)
    assert res.output_ids == ref
    if kind == "random":
        assert {s.num_proposed for s in res.steps} >= {0, K}
    if kind == "oracle":
        assert all(s.num_accepted == K for s in res.steps[:-1])
    assert backend.num_graphs == (1 if kind == "null" else 2)  # one per step length, compiled once


def test_compiled_cache_is_reused_and_holds_the_committed_length(target):
    compiled, backend = _compiled(target)
    engine = SpeculativeEngine(target, [0], RandomProposer(target.config.hidden_size, seed=1), [EOS],
                               compiled=compiled)
    first = engine.generate(PROMPT, max_new_tokens=12)
    cache = compiled.new_cache(len(PROMPT) + 12 + K)
    assert int(cache.get_seq_length()) == 0  # reset for the next prompt
    other = [0, 9, 3, 60, 2]
    for prompt in (other, PROMPT):
        res = engine.generate(prompt, max_new_tokens=12)
        assert res.output_ids == hf_greedy(target, prompt, 12, EOS)[:len(res.output_ids)]
    assert res.output_ids == first.output_ids
    assert compiled.new_cache(len(PROMPT) + 12 + K) is cache  # one allocation per length bucket
    assert backend.num_graphs == 2


def test_compiled_engine_near_max_positions_matches_the_eager_engine(target):
    """Proposals truncated at max_position_embeddings are padded past it; output and stop reason are the
    eager engine's."""
    prompt = (PROMPT * 8)[:56]
    width = target.config.hidden_size
    eager = SpeculativeEngine(target, [0], RandomProposer(width, seed=5), [EOS]).generate(prompt, max_new_tokens=30)
    compiled, _ = _compiled(target)
    res = SpeculativeEngine(target, [0], RandomProposer(width, seed=5), [EOS], compiled=compiled).generate(
        prompt, max_new_tokens=30)
    assert res.output_ids == eager.output_ids
    assert res.stop_reason == eager.stop_reason == "max_positions"


def test_compiled_engine_samples_reproducibly(target):
    compiled, _ = _compiled(target)
    runs = [SpeculativeEngine(target, [0], RandomProposer(target.config.hidden_size, seed=2), [EOS],
                              compiled=compiled).generate(PROMPT, max_new_tokens=16, sampling=SamplingParams(temperature=1.0),
                                                          generator=torch.Generator().manual_seed(7)).output_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_prepare_compiles_before_the_clock_and_only_once(target):
    compiled, backend = _compiled(target)
    compiled.prepare([0], 40, [1, K + 1])
    assert backend.num_graphs == 2
    compiled.prepare([0], 40, [1, K + 1])
    engine = SpeculativeEngine(target, [0], RandomProposer(target.config.hidden_size), [EOS], compiled=compiled)
    engine.generate(PROMPT, max_new_tokens=10)  # 7 + 10 + 4 positions: the same bucket
    assert backend.num_graphs == 2
    with pytest.raises(ValueError, match="not among the compiled lengths"):
        compiled.prepare([0], 40, [3])


def test_recompile_past_the_limit_is_an_error(target, monkeypatch):
    monkeypatch.setattr(compiled_mod, "RECOMPILE_LIMIT", 1)
    torch._dynamo.reset()  # the limit counts the graphs of the step's code object in this process
    compiled, _ = _compiled(target)
    compiled.prepare([], 40, [1])
    with pytest.raises(RuntimeError, match="recompiled the decode step past 1 graphs"):
        compiled.prepare([], 40, [K + 1])


def test_engine_refuses_a_compiled_target_it_cannot_use(target):
    compiled, _ = _compiled(target, lengths=(1, 3))
    with pytest.raises(ValueError, match="shorter than a verify"):
        SpeculativeEngine(target, [0], RandomProposer(32), [EOS], compiled=compiled)
    with pytest.raises(ValueError, match="few_row_linear off"):
        SpeculativeEngine(target, [0], NullProposer(), [EOS], compiled=compiled, few_row_linear=True)
    other = LlamaForCausalLM(target.config).eval()
    with pytest.raises(ValueError, match="another model"):
        SpeculativeEngine(other, [0], NullProposer(), [EOS], compiled=compiled)
    with pytest.raises(ValueError, match="step_lengths"):
        CompiledTarget(target, [0])


def test_inductor_compiled_engine_is_lossless(target):
    """The real code generation (inductor, C++ on the CPU): greedy speculative output equals the compiled
    target-only output and HF generate's."""
    compiled = CompiledTarget(target, (1, K + 1))
    max_new = 16
    ref = hf_greedy(target, PROMPT, max_new, EOS)
    base = SpeculativeEngine(target, [0], NullProposer(), [EOS], compiled=compiled).generate(PROMPT, max_new_tokens=max_new)

    class Oracle:
        max_proposal_len = K
        seq = PROMPT + hf_greedy(target, PROMPT, max_new + K + 1, EOS)

        def prepare(self, num_positions):
            pass

        def reset(self):
            pass

        def extend_context(self, target_hidden_TF, token_ids_T):
            assert target_hidden_TF.shape == (len(token_ids_T), 32) and torch.isfinite(target_hidden_TF).all()

        def propose(self, anchor_token, anchor_pos, *, sampling, generator):
            return Proposal(draft_ids_N=torch.tensor(self.seq[anchor_pos + 1:anchor_pos + 1 + K]))

    spec = SpeculativeEngine(target, [0], Oracle(), [EOS], compiled=compiled).generate(PROMPT, max_new_tokens=max_new)
    assert base.output_ids == spec.output_ids == ref
    assert max(s.num_accepted for s in spec.steps) == K


def test_run_eval_with_the_compiled_target_is_lossless_and_recorded(target, tmp_path, monkeypatch):
    """``deepspec eval --compile``: every method and the baseline on one shared compiled path."""
    from deepspec.eval import run as run_mod
    from deepspec.decoding.settings import DecodeSettings
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from tests.unit.test_engine import _FakeChatTokenizer

    built = []

    def counting(cls, model, proposers):  # for_proposers' lengths, with the counting backend
        built.append(_compiled(model, {1, *(p.max_proposal_len + 1 for p in proposers)}))
        return built[-1][0]

    monkeypatch.setattr(CompiledTarget, "for_proposers", classmethod(counting))
    benches = {"tiny": [BenchmarkPrompt(id=f"p{i}", turns=(f"hello {i}",)) for i in range(2)]}
    res = run_mod.run_eval(target, _FakeChatTokenizer(), [0], {"random": RandomProposer(32, seed=2)}, benches,
                           max_new_tokens=6, sampling=SamplingParams(), seed=0, out_dir=tmp_path, progress=False,
                           log=lambda _: None, settings=DecodeSettings(compile=True))
    assert len(built) == 1 and built[0][1].num_graphs == 3  # (1 token, no features), (1, features), (K + 1, features)
    assert res["benchmarks"]["tiny"]["random"]["frac_identical_to_baseline"] == 1.0
    assert res["config"]["compile"] is True
    assert "compiled path" in (tmp_path / "eval_report.md").read_text()


def test_eval_config_refuses_compile_with_the_few_row_path_forced_on():
    from deepspec.eval.stage import EvalConfig

    with pytest.raises(ValueError, match="eval.few_row_linear: on cannot be combined with eval.compile"):
        EvalConfig(draft=["unused"], output_dir="unused", compile=True, few_row_linear="on")
    assert EvalConfig(draft=["unused"], output_dir="unused", compile=True).compile


def test_for_proposers_compiles_the_drafts_own_length_behind_prompt_lookup(target):
    """A draft with prompt lookup in front proposes up to the lookup's K on lookup steps and up to its
    own K on the others: both verify lengths are compiled, so a draft step is not padded to the lookup's."""
    from deepspec.algorithms.ngram.proposer import LookupFirstProposer

    draft = RandomProposer(32, seed=2)
    draft.max_proposal_len = 3
    lookup_first = LookupFirstProposer(draft, vocab_size=32, lookup_num_tokens=7)
    assert CompiledTarget.for_proposers(target, [NullProposer(), lookup_first]).step_lengths == [1, 4, 8]
