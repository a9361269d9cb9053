"""Lossless greedy speculative decoding on the embedded default target with real benchmark prompts.

At temperature 0 the committed tokens must equal target-only greedy decoding token for token
(fp32), whatever the draft proposes (docs/design/decoding.md). An untrained DSpark draft proposes mostly wrong
tokens, so this exercises rejection, KV-cache cropping and context bookkeeping on every step.
"""

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target():
    from deepspec.target.load import load_target

    return load_target("default")


def test_dspark_greedy_output_equals_target_only_greedy(target):
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.data.chat import render_prompt
    from deepspec.decoding.engine import SpeculativeEngine
    from deepspec.eval.benchmarks import load_benchmark
    from deepspec.eval.run import eos_token_ids_of
    from deepspec.target.capture import default_target_layer_ids
    from deepspec.train.config import TrainConfig
    from deepspec.train.draft import build_draft

    model, tokenizer = target
    layer_ids = default_target_layer_ids(model.config.num_hidden_layers)
    cfg = TrainConfig(cache_dir="unused", output_dir="unused", markov_rank=32, seed=1)
    draft = build_draft(model, tokenizer, cfg, layer_ids).eval()
    eos = eos_token_ids_of(model, tokenizer)
    prompts = load_benchmark("gsm8k", max_samples=2) + load_benchmark("humaneval", max_samples=1)
    for prompt in prompts:
        ids = render_prompt(tokenizer, prompt.messages)
        baseline = SpeculativeEngine(model, layer_ids, NullProposer(), eos).generate(ids, max_new_tokens=24)
        spec = SpeculativeEngine(
            model, layer_ids, DSparkProposer(draft, max_positions=model.config.max_position_embeddings), eos
        ).generate(ids, max_new_tokens=24)
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids):].tolist()
        assert spec.output_ids == baseline.output_ids, prompt.id
        assert baseline.output_ids == hf[: len(baseline.output_ids)], prompt.id
        assert len(spec.output_ids) > 0 and any(s.num_proposed > 0 for s in spec.steps)


def test_reduced_vocab_dspark_greedy_output_equals_target_only_greedy(target):
    """A 4,096-token draft vocabulary (the prompt's tokens first, then the smallest ids) on the embedded
    target: the draft proposes only those tokens, the target verifies in its full 49,152."""
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.data.chat import render_prompt
    from deepspec.decoding.engine import SpeculativeEngine
    from deepspec.eval.benchmarks import load_benchmark
    from deepspec.eval.run import eos_token_ids_of
    from deepspec.models.vocab import count_supervised_tokens, select_draft_vocab
    from deepspec.target.capture import default_target_layer_ids
    from deepspec.train.config import TrainConfig
    from deepspec.train.draft import build_draft

    model, tokenizer = target
    layer_ids = default_target_layer_ids(model.config.num_hidden_layers)
    eos = eos_token_ids_of(model, tokenizer)
    prompt = load_benchmark("gsm8k", max_samples=1)[0]
    ids = render_prompt(tokenizer, prompt.messages)
    counts = count_supervised_tokens([{"input_ids": torch.tensor(ids), "loss_mask": torch.ones(len(ids))}],
                                     model.config.vocab_size)
    d2t = select_draft_vocab(counts, 4096)
    cfg = TrainConfig(cache_dir="unused", output_dir="unused", markov_rank=32, seed=1, draft_vocab_size=4096)
    draft = build_draft(model, tokenizer, cfg, layer_ids, d2t=d2t).eval()
    assert draft.lm_head.weight.shape[0] == 4096
    baseline = SpeculativeEngine(model, layer_ids, NullProposer(), eos).generate(ids, max_new_tokens=24)
    spec = SpeculativeEngine(model, layer_ids, DSparkProposer(draft), eos).generate(ids, max_new_tokens=24)
    assert spec.output_ids == baseline.output_ids
    assert any(s.num_proposed > 0 for s in spec.steps)
