"""The trainer's --draft-vocab-size and --init-from-target on a tiny random target."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.algorithms.registry import load_draft
from deepspec.data.cache import TargetCache
from deepspec.models.target_init import init_layers_from_target
from deepspec.models.vocab import count_supervised_tokens, select_draft_vocab
from deepspec.train import draft as train_draft
from deepspec.train.config import TrainConfig
from deepspec.train.loop import train
from tests.integration.test_train_resume import LAYER_IDS, _cfg, _weights, setup  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- --draft-vocab-size
def test_reduced_vocab_training_saves_the_selected_map_and_resumes_exactly(setup, tmp_path):
    model, tok, cache = setup
    data = TargetCache(cache)
    want = select_draft_vocab(count_supervised_tokens((data.read(i) for i in range(len(data))), len(tok)), 20)
    kw = dict(draft_vocab_size=20, max_steps=3, save_every=1)
    final = train(_cfg(cache, tmp_path / "a", **kw), target_model=model, tokenizer=tok)
    name, draft = load_draft(final / "draft")
    assert name == "dspark" and torch.equal(draft.d2t, want)
    assert draft.lm_head.weight.shape == (20, 32) and torch.equal(draft.lm_head.weight, model.lm_head.weight[want])
    saved = json.loads((final / "draft" / "config.json").read_text())
    assert saved["draft_config"]["draft_vocab_size"] == 20
    rows = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert all("num_labels_outside_vocab" in r for r in rows) and any(r["num_labels_outside_vocab"] > 0 for r in rows)
    resumed = train(_cfg(cache, tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-000001"), **kw),
                    target_model=model, tokenizer=tok)
    a, b = _weights(final), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="draft_vocab_size: \\(20, 16\\)"):
        train(_cfg(cache, tmp_path / "c", resume=str(tmp_path / "a" / "checkpoint-000001"),
                   **{**kw, "draft_vocab_size": 16}), target_model=model, tokenizer=tok)


def test_draft_vocab_size_is_checked(setup, tmp_path):
    model, tok, cache = setup
    assert _cfg(cache, tmp_path, draft_vocab_size=0).draft_vocab_size is None  # 0 = the full vocabulary
    with pytest.raises(ValueError, match="train.draft_vocab_size"):
        _cfg(cache, tmp_path, draft_vocab_size=-3)
    with pytest.raises(ValueError, match=f"train.draft_vocab_size: expected at most the target vocabulary \\({len(tok)}"):
        train_draft.build_draft(model, tok, _cfg(cache, tmp_path, draft_vocab_size=len(tok) + 1), LAYER_IDS,
                         data=TargetCache(cache))
    with pytest.raises(ValueError, match="needs the training data"):
        train_draft.build_draft(model, tok, _cfg(cache, tmp_path, draft_vocab_size=8), LAYER_IDS)


def test_reduced_vocab_eagle3_trains_and_saves_the_map(setup, tmp_path):
    model, tok, cache = setup
    final = train(_cfg(cache, tmp_path / "e", algorithm="eagle3", draft_vocab_size=20, max_steps=2),
                  target_model=model, tokenizer=tok)
    name, draft = load_draft(final / "draft")
    data = TargetCache(cache)
    want = select_draft_vocab(count_supervised_tokens((data.read(i) for i in range(len(data))), len(tok)), 20)
    assert name == "eagle3" and torch.equal(draft.d2t, want) and draft.lm_head.weight.shape == (20, 32)


# ----------------------------------------------------------------------------- --init-from-target
def _layer_tensors(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("layers, want", [(None, [1, 2]), ([0, 2], [0, 2])])
def test_init_from_target_copies_exactly_the_named_layers(setup, tmp_path, layers, want):
    model, tok, cache = setup
    kw = dict(num_draft_layers=2, markov_rank=8)
    plain = train_draft.build_draft(model, tok, _cfg(cache, tmp_path, **kw), LAYER_IDS)
    init = train_draft.build_draft(model, tok, _cfg(cache, tmp_path, init_from_target=True, init_from_target_layers=layers,
                                             **kw), LAYER_IDS)
    target_layers = model.get_decoder().layers
    for j, i in enumerate(want):  # draft layer j <- target layer i, every tensor bit for bit
        src, dst = _layer_tensors(target_layers[i]), _layer_tensors(init.layers[j])
        assert sorted(dst) == sorted(k for k in src if k in dst) and len(dst) >= 9
        for k in dst:
            assert torch.equal(dst[k], src[k]), (j, i, k)
    assert torch.equal(init.norm.weight, model.get_decoder().norm.weight)
    # everything else keeps the initialisation of the same seed
    copied = {f"layers.{j}." for j in range(2)}
    for k, v in plain.state_dict().items():
        if not any(k.startswith(p) for p in copied) and not k.startswith("norm."):
            assert torch.equal(v, init.state_dict()[k]), k
    assert not torch.equal(plain.layers[0].mlp.up_proj.weight, init.layers[0].mlp.up_proj.weight)
    assert all(p.requires_grad for p in init.layers.parameters())  # copies are trained, not frozen


def test_init_from_target_refusals(setup, tmp_path):
    model, tok, cache = setup
    with pytest.raises(ValueError, match="train.init_from_target_layers: names the target layers"):
        _cfg(cache, tmp_path, init_from_target_layers=[2])
    with pytest.raises(ValueError, match="expected 2 target layer ids"):
        train_draft.build_draft(model, tok, _cfg(cache, tmp_path, num_draft_layers=2, init_from_target=True,
                                          init_from_target_layers=[2]), LAYER_IDS)
    with pytest.raises(ValueError, match="expected ids in \\[0, 3\\)"):
        train_draft.build_draft(model, tok, _cfg(cache, tmp_path, init_from_target=True, init_from_target_layers=[3]),
                         LAYER_IDS)
    with pytest.raises(ValueError, match="train.init_from_target: copies the target's layers into a DSpark / DFlash "
                                         "draft; eagle3 has its own options"):
        train_draft.build_draft(model, tok, _cfg(cache, tmp_path, algorithm="eagle3", init_from_target=True), LAYER_IDS)
    with pytest.raises(ValueError, match="Qwen3-style q/k norms and the target's have none.*--draft-backbone target"):
        train_draft.build_draft(model, tok, _cfg(cache, tmp_path, init_from_target=True, draft_backbone="qwen3"), LAYER_IDS)
    draft = train_draft.build_draft(model, tok, _cfg(cache, tmp_path, draft_backbone="target"), LAYER_IDS)
    c = model.config
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    gemma = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=c.vocab_size, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=8, max_position_embeddings=256))
    with pytest.raises(ValueError, match="train.init_from_target: a gemma3_text target's decoder layers have four "
                                         "norms.*drop --init-from-target"):
        train_draft.build_draft(gemma, tok, _cfg(cache, tmp_path, init_from_target=True, draft_backbone="target"),
                         LAYER_IDS)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=c.vocab_size, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256))
    before = _layer_tensors(draft)
    with pytest.raises(ValueError, match="'mlp.gate_proj.weight' has shape \\(48, 32\\) in the target, expected "
                                         "\\(64, 32\\)"):
        init_layers_from_target(draft, other)
    assert all(torch.equal(v, before[k]) for k, v in draft.state_dict().items())  # nothing half-copied


def test_init_from_target_trains(setup, tmp_path):
    model, tok, cache = setup
    final = train(_cfg(cache, tmp_path / "a", init_from_target=True, max_steps=2), target_model=model, tokenizer=tok)
    assert (final / "draft" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "a" / "train_config.json").read_text())["init_from_target"] is True
    assert isinstance(TrainConfig.__dataclass_fields__["init_from_target_layers"].default, type(None))
