"""The few-row linear path (deepspec.target.few_row_linear) and proposal caps (cap_proposal_len):
same values as F.linear, restored on exit, lossless through the engine, and the capped DSpark
proposal equals the first slots of the full one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepspec.algorithms.dspark.config import draft_config_from_target
from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.dspark.proposer import DSparkProposer
from deepspec.algorithms.ngram.proposer import NGramProposer
from deepspec.algorithms.protocol import NullProposer, cap_proposal_len
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.verify import SamplingParams
from deepspec.target.few_row_linear import few_row_forward, few_row_linear, few_row_linear_applies
from tests.helpers import sharp_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 24), (3, 24), (1, 16, 24), (1, 17, 24), (1, 1, 24)])
def test_few_row_forward_equals_linear(shape, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    y = few_row_forward(layer, x, 16)
    assert y.shape == (*shape[:-1], 40) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    if shape[-2] == 1 or shape[-2] > 16:  # one row and long inputs take F.linear itself: bit-identical
        assert torch.equal(y, F.linear(x, layer.weight, layer.bias))


def test_swap_is_scoped_and_shared_layers_count_once():
    torch.manual_seed(0)
    a, b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.nn.Sequential()
    b.add_module("shared", a[0])
    b.add_module("own", torch.nn.Linear(8, 4))
    calls = []
    real = F.linear

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    x = torch.randn(3, 8)
    with few_row_linear(a, b) as n:
        assert n == 2
        torch.nn.functional.linear = spy
        try:
            b(x)
        finally:
            torch.nn.functional.linear = real
        assert calls == []  # few rows: no F.linear call
    assert "forward" not in a[0].__dict__ and "forward" not in b.own.__dict__
    with pytest.raises(RuntimeError, match="boom"):
        with few_row_linear(a):
            raise RuntimeError("boom")
    assert "forward" not in a[0].__dict__
    with pytest.raises(ValueError, match="max_rows"):
        with few_row_linear(a, max_rows=0):
            pass


def test_auto_applies_to_float32_cpu_models_only():
    layer = torch.nn.Linear(4, 4)
    assert few_row_linear_applies("auto", layer)
    assert not few_row_linear_applies("auto", torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert few_row_linear_applies("on", torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert not few_row_linear_applies("off", layer)
    with pytest.raises(ValueError, match="few_row_linear"):
        few_row_linear_applies("fast", layer)


def _draft(target, block_size=4):
    cfg = draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=[0],
                                   mask_token_id=target.config.vocab_size - 1, block_size=block_size, markov_rank=8)
    torch.manual_seed(1)
    return DSparkDraftModel.from_target(target, cfg).float().eval()


PROMPT = [0, 5, 17, 42, 8, 33, 41, 5, 17]


def test_engine_with_few_row_linear_is_lossless_and_restores_layers():
    target = sharp_tiny_llama()
    draft = _draft(target)
    ref = SpeculativeEngine(target, [0], NullProposer(), [1]).generate(PROMPT, max_new_tokens=20).output_ids
    for proposer in (DSparkProposer(draft), NGramProposer(vocab_size=64, num_tokens=4, max_positions=128)):
        engine = SpeculativeEngine(target, [0], proposer, [1], few_row_linear=True)
        res = engine.generate(PROMPT, max_new_tokens=20)
        assert res.output_ids == ref
        assert any(s.num_proposed > 0 for s in res.steps)
    assert not any("forward" in m.__dict__ for m in [*target.modules(), *draft.modules()])


def test_capped_dspark_proposal_is_the_prefix_of_the_full_one():
    target = sharp_tiny_llama()
    draft = _draft(target, block_size=6)
    feats = torch.randn(1, 12, target.config.hidden_size)
    full, capped = DSparkProposer(draft), cap_proposal_len(DSparkProposer(draft), 2)
    assert capped.max_proposal_len == 2 and full.max_proposal_len == 6
    ids = []
    for prop in (full, capped):
        prop.extend_context(feats[0], list(range(12)))
        ids.append(prop.propose(7, 12, sampling=SamplingParams(), generator=None).draft_ids_N)
    assert ids[1].shape == (2,) and torch.equal(ids[1], ids[0][:2])
    assert cap_proposal_len(NullProposer(), 3).max_proposal_len == 0  # a cap never raises K
    with pytest.raises(ValueError, match="num_draft_tokens"):
        cap_proposal_len(full, 0)


def test_eval_and_demo_configs_check_the_new_settings():
    from deepspec.demo import DemoConfig
    from deepspec.eval.stage import EvalConfig

    with pytest.raises(ValueError, match="eval.few_row_linear"):
        EvalConfig(draft=["x"], output_dir="o", few_row_linear="yes")
    with pytest.raises(ValueError, match="eval.num_draft_tokens"):
        EvalConfig(draft=["x"], output_dir="o", num_draft_tokens=0)
    with pytest.raises(ValueError, match="demo.num_draft_tokens"):
        DemoConfig(num_draft_tokens=0)
    for bad in (0, 1):  # one slot is no block: refused before prepare, naming the demo's flag
        with pytest.raises(ValueError, match="demo.block_size"):
            DemoConfig(block_size=bad)


def test_report_names_proposal_lengths_and_the_linear_path():
    from deepspec.eval.report import _setup_lines

    lines = _setup_lines({"proposers": {"dspark": {"max_proposal_len": 3}, "ngram": {"max_proposal_len": 3}},
                          "few_row_linear": True})
    text = " ".join(lines)
    assert "dspark 3, ngram 3" in text and "few-row linear path on" in text
    assert "few-row" not in " ".join(_setup_lines({"proposers": {"a": {"max_proposal_len": 7}}}))
