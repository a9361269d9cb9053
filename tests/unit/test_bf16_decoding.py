"""Decoding in bfloat16: a bf16 target feeding bf16 features to a bf16 DSpark or Eagle3 draft through
the engine, greedy and at T > 0. The drafts' q stays float32 (``sampling_probs``), nothing is NaN, and a
greedy output that differs from bf16 target-only does so only at a near-tie of the target (the
runner-up token), which is what docs/design/decoding.md says bf16 can do."""

from __future__ import annotations

import pytest
import torch

from deepspec.algorithms.dspark.config import draft_config_from_target
from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.dspark.proposer import DSparkProposer
from deepspec.algorithms.eagle3.config import eagle3_config_from_target
from deepspec.algorithms.eagle3.model import Eagle3DraftModel
from deepspec.algorithms.eagle3.proposer import Eagle3Proposer
from deepspec.algorithms.protocol import NullProposer
from deepspec.decoding.engine import SpeculativeEngine
from deepspec.decoding.flips import chunked_argmax, first_divergence
from deepspec.decoding.verify import SamplingParams
from deepspec.device import cast_for_decoding
from tests.helpers import sharp_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
LAYER_IDS = [0]
EOS = [VOCAB + 1]  # never produced: every generation runs to max_new_tokens
PROMPTS = [[0, 5, 17, 42, 8, 5, 17, 42, 9, 33], [0, 3, 3, 3, 7, 11, 3, 7]]


@pytest.fixture(scope="module")
def target_bf16():
    return cast_for_decoding(sharp_tiny_llama(VOCAB), torch.bfloat16)


def _draft(kind: str, target_fp32):
    torch.manual_seed(1)
    if kind == "dspark":
        cfg = draft_config_from_target(target_fp32.config, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                       mask_token_id=2, markov_rank=8)
        draft = DSparkDraftModel.from_target(target_fp32, cfg)
        torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.5)  # a non-zero Markov bias
        return draft, DSparkProposer
    cfg = eagle3_config_from_target(target_fp32.config, target_layer_ids=LAYER_IDS, ttt_steps=4)
    return Eagle3DraftModel.from_target(target_fp32, cfg), Eagle3Proposer


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_bf16_draft_proposes_from_bf16_features(target_bf16, kind):
    draft, proposer_cls = _draft(kind, sharp_tiny_llama(VOCAB))
    draft = cast_for_decoding(draft, torch.bfloat16)
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}  # frozen embed / lm_head too
    base = SpeculativeEngine(target_bf16, LAYER_IDS, NullProposer(), EOS)
    spec = SpeculativeEngine(target_bf16, LAYER_IDS, proposer_cls(draft), EOS)
    for prompt in PROMPTS:
        ref = base.generate(prompt, max_new_tokens=24)
        out = spec.generate(prompt, max_new_tokens=24)
        assert all(s.num_proposed > 0 for s in out.steps[:-1])
        d = first_divergence(out.output_ids, ref.output_ids)
        if d is not None:  # only at a near-tie: the speculative token is the target's runner-up there
            chunk = chunked_argmax(target_bf16, prompt, ref.output_ids, chunk_len=spec.proposer.max_proposal_len + 1)
            assert out.output_ids[d] in (chunk.second[d], chunk.argmax[d]), (d, chunk.margin[d])

    # T > 0: q is float32, sums to 1, and the engine commits valid tokens
    proposer = proposer_cls(draft)
    spec = SpeculativeEngine(target_bf16, LAYER_IDS, proposer, EOS)
    seen = []
    original = proposer.propose

    def propose(*args, **kw):
        p = original(*args, **kw)
        seen.append(p)
        return p

    proposer.propose = propose
    res = spec.generate(PROMPTS[0], max_new_tokens=16, sampling=SamplingParams(temperature=0.8),
                        generator=torch.Generator().manual_seed(0))
    assert len(res.output_ids) == 16 and all(0 <= t < VOCAB for t in res.output_ids)
    for p in seen:
        if p.num_proposed:
            assert p.draft_probs_NV.dtype == torch.float32 and torch.isfinite(p.draft_probs_NV).all()
            torch.testing.assert_close(p.draft_probs_NV.sum(-1), torch.ones(p.num_proposed))
