"""Argmax flips (deepspec.decoding.flips): the pure counting rules on hand-made cases, and on a tiny random
float32 target no flip at all, greedy speculative output identical to target-only, and the figures
run_eval writes into the report."""

from __future__ import annotations

import pytest
import torch

from deepspec.algorithms.ngram.proposer import NGramProposer
from deepspec.algorithms.protocol import NullProposer
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.flips import (
    ChunkPass,
    argmax_flip_positions,
    chunked_argmax,
    divergence_record,
    first_divergence,
    flip_rate,
)
from deepspec.decoding.verify import SamplingParams
from tests.helpers import sharp_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def test_argmax_flip_positions_hand_made():
    decoded = [4, 7, 7, 2, 9, 1]
    chunked = [5, 7, 3, 2, 8, 1]  # position 0 differs too, but it is the prefill's token: never counted
    assert argmax_flip_positions(chunked, decoded) == [2, 4]
    assert argmax_flip_positions(decoded, decoded) == []
    assert argmax_flip_positions([3], [4]) == []
    with pytest.raises(ValueError, match="one length"):
        argmax_flip_positions([1, 2], [1])
    assert flip_rate(2, 5) == 400.0 and flip_rate(0, 0) is None


def test_first_divergence_and_record():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one ended early (an EOS): differs where it stops
    chunk = ChunkPass(argmax=[1, 2, 3], second=[9, 9, 4], margin=[5.0, 3.0, 0.125])
    rec = divergence_record(2, [1, 2, 4], [1, 2, 3], chunk, flips=[2])
    assert rec == {"position": 2, "baseline_token": 3, "token": 4, "baseline_margin": 0.125, "at_argmax_flip": True,
                   "token_is_runner_up": True}
    rec = divergence_record(2, [1, 2], [1, 2, 3], chunk, flips=[])
    assert rec["token"] is None and not rec["token_is_runner_up"] and not rec["at_argmax_flip"]


@pytest.fixture(scope="module")
def target():
    return sharp_tiny_llama(VOCAB)


PROMPT = [0, 5, 17, 42, 8, 5, 17, 42, 9, 33]


@pytest.mark.parametrize("chunk_len", [1, 3, 8])
def test_float32_target_has_no_flips(target, chunk_len):
    base = SpeculativeEngine(target, [0], NullProposer(), [VOCAB + 1]).generate(PROMPT, max_new_tokens=30)
    chunk = chunked_argmax(target, PROMPT, base.output_ids, chunk_len=chunk_len)
    assert len(chunk.argmax) == len(chunk.margin) == 30
    assert chunk.argmax == base.output_ids  # position 0 (the prefill) included
    assert argmax_flip_positions(chunk.argmax, base.output_ids) == []
    assert all(m >= 0 for m in chunk.margin)
    with pytest.raises(ValueError, match="chunk_len"):
        chunked_argmax(target, PROMPT, base.output_ids, chunk_len=0)


def test_exact_ties_take_decodings_argmax_not_topks_order():
    """Every logit tied (all lm_head rows equal, as a saturated soft-cap can make them): decoding takes
    the first maximum, id 0, and so must the chunked pass, or every position would count as a flip."""
    tied = sharp_tiny_llama(VOCAB)
    with torch.no_grad():
        tied.lm_head.weight.copy_(tied.lm_head.weight[:1].expand_as(tied.lm_head.weight))
    base = SpeculativeEngine(tied, [0], NullProposer(), [VOCAB + 1]).generate(PROMPT, max_new_tokens=12)
    assert base.output_ids == [0] * 12
    chunk = chunked_argmax(tied, PROMPT, base.output_ids, chunk_len=4)
    assert chunk.argmax == base.output_ids and argmax_flip_positions(chunk.argmax, base.output_ids) == []
    assert all(s != 0 for s in chunk.second) and chunk.margin == [0.0] * 12


class _Tokenizer:
    chat_template = "fake"
    eos_token_id = VOCAB + 1
    pad_token_id = 1

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kw):
        text = "".join(m["content"] for m in messages)
        return [0] + [2 + (ord(c) % 7) for c in text]  # few distinct ids: repeats for the n-gram lookup

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_run_eval_reports_zero_flips_and_identical_outputs_in_float32(target, tmp_path):
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from deepspec.eval.run import run_eval

    benches = {"tiny": [BenchmarkPrompt(id=f"p{i}", turns=(f"abcabc {i} abc",)) for i in range(2)]}
    res = run_eval(target, _Tokenizer(), [0], {"ngram": NGramProposer(vocab_size=VOCAB, num_tokens=4)}, benches,
                   max_new_tokens=12, sampling=SamplingParams(), seed=0, out_dir=tmp_path, progress=False,
                   compare_hf_generate=False, log=lambda _: None)
    base, ngram = res["benchmarks"]["tiny"]["target-only"], res["benchmarks"]["tiny"]["ngram"]
    assert (base["num_argmax_flips"], base["num_flip_positions"], base["flip_chunk_len"]) == (0, 22, 5)
    assert base["argmax_flips_per_1k_tokens"] == 0.0
    assert ngram["frac_identical_to_baseline"] == 1.0 and ngram["divergences"] == []
    assert ngram["break_even_tau"] > 0
    assert res["config"]["dtype"] == "float32" and res["config"]["flip_chunk_len"] == 5
    assert res["config"]["proposers"]["ngram"]["ngram_max"] == 3
    md = (tmp_path / "eval_report.md").read_text()
    assert "| 0.0 (0/22) |" in md and "in float32" in md

    # T > 0: no flip figures (tokens are samples, not argmaxes)
    res = run_eval(target, _Tokenizer(), [0], {}, benches, max_new_tokens=4, sampling=SamplingParams(temperature=1.0),
                   seed=0, out_dir=None, progress=False, compare_hf_generate=False, log=lambda _: None)
    assert "num_argmax_flips" not in res["benchmarks"]["tiny"]["target-only"]
    assert res["config"]["flip_chunk_len"] is None


def test_run_eval_out_of_memory_names_the_prompt_and_the_flags(target, tmp_path, monkeypatch):
    from deepspec.eval.benchmarks import BenchmarkPrompt
    from deepspec.eval.run import run_eval

    def oom(self, prompt_ids, **kwargs):
        if isinstance(self.proposer, NGramProposer):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")
        return real(self, prompt_ids, **kwargs)

    real = SpeculativeEngine.generate
    monkeypatch.setattr(SpeculativeEngine, "generate", oom)
    benches = {"tiny": [BenchmarkPrompt(id="p0", turns=("abcabc abc",))]}
    with pytest.raises(torch.OutOfMemoryError) as info:
        run_eval(target, _Tokenizer(), [0], {"ngram": NGramProposer(vocab_size=VOCAB, num_tokens=4)}, benches,
                 max_new_tokens=12, sampling=SamplingParams(), seed=0, out_dir=tmp_path, progress=False,
                 compare_hf_generate=False, warmup=False, log=lambda _: None)
    message = str(info.value)
    assert message.startswith("eval: out of memory on cpu (tiny prompt p0, ngram: 11 prompt tokens + up to 12 new, "
                              "float32); lower --max-new-tokens or --num-draft-tokens")
    assert "--dtype bfloat16" in message and "DefaultCPUAllocator" in message
