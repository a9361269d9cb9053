"""The trainer on a tiny random target: checkpoints, exact resume, refusal of a foreign cache."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.data.cache import write_target_cache_from_samples
from deepspec.models.dspark import DSparkDraftModel
from deepspec.target.load import target_fingerprint, tokenizer_fingerprint
from deepspec.train.loop import TrainConfig, train
from tests.unit.test_chat import tiny_chatml_tokenizer

LAYER_IDS = [0, 1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = tiny_chatml_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i in range(6):
        ids = torch.randint(4, len(tok), (40,), generator=gen).tolist()  # never the mask token (id 3)
        samples.append((f"s{i}", ids, [0] * 12 + [1] * 28))
    cache = tmp_path_factory.mktemp("cache") / "cache"
    write_target_cache_from_samples(
        samples, cache, model, target_layer_ids=LAYER_IDS, target_fingerprint=target_fingerprint(model),
        tokenizer_fingerprint=tokenizer_fingerprint(tok), storage_dtype="float32", progress=False,
    )
    return model, tok, cache


def _cfg(cache, out, **kw):
    base = dict(cache_dir=str(cache), output_dir=str(out), batch_size=2, num_anchors=4, markov_rank=8,
                max_steps=6, lr=1e-2, warmup_frac=0.2)
    base.update(kw)
    return TrainConfig(**base)


def _weights(checkpoint):
    return DSparkDraftModel.from_pretrained(checkpoint / "draft").state_dict()


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(setup, tmp_path):
    model, tok, cache = setup
    full = train(_cfg(cache, tmp_path / "full", save_every=3), target_model=model, tokenizer=tok)
    middle = tmp_path / "full" / "checkpoint-000003"
    assert full.name == "checkpoint-000006" and (middle / "trainer_state.pt").exists()
    # continue from the middle checkpoint in another folder: steps 4..6 must replay exactly
    resumed = train(_cfg(cache, tmp_path / "resumed", resume=str(middle)), target_model=model, tokenizer=tok)
    a, b = _weights(full), _weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (tmp_path / "resumed" / "latest").read_text().strip() == "checkpoint-000006"


def test_training_reduces_loss_and_refuses_another_target(setup, tmp_path):
    model, tok, cache = setup
    train(_cfg(cache, tmp_path / "run", max_steps=12), target_model=model, tokenizer=tok)
    import json

    rows = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and rows[-1]["loss"] < rows[0]["loss"]
    assert (tmp_path / "run" / "train_loss.png").stat().st_size > 0
    other = LlamaForCausalLM(model.config).eval().requires_grad_(False)
    with pytest.raises(ValueError, match="target"):
        train(_cfg(cache, tmp_path / "other"), target_model=other, tokenizer=tok)
