"""Drafts in the original DeepSpec layout (``Qwen3DSparkModel``): load through ``load_draft``, decode
losslessly, refuse bad layouts by name.

The main checkpoint is hand-written here from the original's layout (its trainer's config: a copy of
the target config plus the draft keys; tensors named and shaped as the original's modules), not
through :func:`save_original_dspark`, so the loader is checked against the layout itself; the saver is
checked separately by a round trip. Tiny random Qwen3 target (hidden 32, 3 layers), fp32.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from deepspec.algorithms.dspark.config import dflash_knobs, draft_config_from_target
from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.dspark.original import (
    draft_config_from_original, is_original_layout, load_original_dspark, save_original_dspark,
)
from deepspec.algorithms.protocol import NullProposer
from deepspec.algorithms.registry import algorithm_for_model, load_draft
from deepspec.decoding.engine import SpeculativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 96, 32, 3, 4, 2, 8, 64
LAYER_IDS = [0, 1]
MASK, EOS, PAD = 5, 1, 2
K, RANK, DRAFT_LAYERS = 4, 8, 2
BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=128, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharpen: greedy decoding off near-ties
    return model.requires_grad_(False)


def original_config(target, **overrides) -> dict:
    """What the original's ``build_draft_config`` + ``save_pretrained`` write: the target config with
    the draft keys set."""
    cfg = copy.deepcopy(target.config.to_dict())
    cfg.update(architectures=["Qwen3DSparkModel"], num_target_layers=LAYERS, num_hidden_layers=DRAFT_LAYERS,
               block_size=K, tie_word_embeddings=False, layer_types=["full_attention"] * DRAFT_LAYERS,
               mask_token_id=MASK, target_layer_ids=LAYER_IDS, num_anchors=512, enable_confidence_head=True,
               confidence_head_with_markov=True, markov_rank=RANK, markov_head_type="vanilla", dtype="bfloat16")
    cfg.update(overrides)
    return cfg


def original_tensors(target, *, markov: str | None = "vanilla", confidence: bool = True, rank: int = RANK,
                     seed: int = 1) -> dict:
    """Tensors named and shaped as the original's ``Qwen3DSparkModel`` state dict, in bf16 (its training
    precision); embed_tokens / lm_head are the target's (the original copies them)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, base=0.0):
        return (base + 0.2 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    t = {"embed_tokens.weight": target.model.embed_tokens.weight.to(torch.bfloat16),
         "lm_head.weight": target.lm_head.weight.to(torch.bfloat16),
         "fc.weight": rnd(H, len(LAYER_IDS) * H), "hidden_norm.weight": rnd(H, base=1.0),
         "norm.weight": rnd(H, base=1.0)}
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, H),
                  p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, H),
                  p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, H),
                  p + "self_attn.o_proj.weight": rnd(H, HEADS * HEAD_DIM),
                  p + "self_attn.q_norm.weight": rnd(HEAD_DIM, base=1.0),
                  p + "self_attn.k_norm.weight": rnd(HEAD_DIM, base=1.0),
                  p + "mlp.gate_proj.weight": rnd(FFN, H), p + "mlp.up_proj.weight": rnd(FFN, H),
                  p + "mlp.down_proj.weight": rnd(H, FFN),
                  p + "input_layernorm.weight": rnd(H, base=1.0),
                  p + "post_attention_layernorm.weight": rnd(H, base=1.0)})
    r = rank if markov else 0
    if markov:
        t["markov_head.markov_w1.weight"] = rnd(VOCAB, r)
        t["markov_head.markov_w2.weight"] = rnd(VOCAB, r)
    if markov == "gated":
        t["markov_head.gate_proj.weight"] = rnd(r, H + r)
        t["markov_head.gate_proj.bias"] = rnd(r)
    if markov == "rnn":
        t["markov_head.joint_proj.weight"] = rnd(3 * r, 2 * r + H)
        t["markov_head.joint_proj.bias"] = rnd(3 * r)
    if confidence:
        t["confidence_head.proj.weight"] = rnd(1, H + r)
        t["confidence_head.proj.bias"] = rnd(1)
    return t


def write_original(folder: Path, cfg: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def params(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if k not in BUFFERS}


@pytest.mark.parametrize("markov", ["vanilla", "gated", "rnn"])
def test_hand_written_original_checkpoint_loads_exactly(target, tmp_path, markov):
    tensors = original_tensors(target, markov=markov)
    folder = write_original(tmp_path / "orig", original_config(target, markov_head_type=markov.upper()), tensors)
    assert is_original_layout(folder)
    name, draft = load_draft(folder)
    assert name == "dspark" and isinstance(draft, DSparkDraftModel)
    assert algorithm_for_model(draft).name == "dspark"
    c = draft.config
    assert (c.family, c.num_draft_layers, c.block_size, c.mask_token_id, c.target_layer_ids) == (
        "qwen3", DRAFT_LAYERS, K, MASK, LAYER_IDS)
    assert (c.markov_head_type, c.markov_rank, c.use_confidence_head, c.qk_norm) == (markov, RANK, True, True)
    assert (c.target_num_hidden_layers, c.eos_token_ids, c.pad_token_id) == (LAYERS, [EOS], PAD)
    got = params(draft)
    assert sorted(got) == sorted(tensors)  # every original tensor used, every draft parameter filled
    for k, v in tensors.items():
        assert torch.equal(got[k], v.float()), k
    assert not draft.embed_tokens.weight.requires_grad and not draft.lm_head.weight.requires_grad


def test_original_draft_decodes_losslessly(target, tmp_path):
    """Greedy speculative output == target-only output. So that drafts are both accepted and rejected,
    the hand-written Markov head (rank = vocab, W1 = identity) is a strong bigram table read off the
    target's own greedy outputs: the draft guesses the target's next token wherever the bigram holds."""
    prompts = ([0, 7, 19, 42, 8, 33], [10, 20, 30, 40], [55, 66, 77, 11, 22])
    plain = SpeculativeEngine(target, LAYER_IDS, NullProposer(), [EOS])
    refs = [plain.generate(p, max_new_tokens=24).output_ids for p in prompts]
    tensors = original_tensors(target, rank=VOCAB)
    w2 = torch.zeros(VOCAB, VOCAB)
    for p, ref in zip(prompts, refs):
        seq = [p[-1], *ref]
        for prev, nxt in zip(seq, seq[1:]):
            if not w2[:, prev].any():
                w2[nxt, prev] = 40.0
    tensors["markov_head.markov_w1.weight"] = torch.eye(VOCAB, dtype=torch.bfloat16)
    tensors["markov_head.markov_w2.weight"] = w2.to(torch.bfloat16)
    folder = write_original(tmp_path / "orig", original_config(target, markov_rank=VOCAB), tensors)
    name, draft = load_draft(folder, target_model=target)
    proposer = algorithm_for_model(draft).proposer(draft, max_positions=target.config.max_position_embeddings)
    spec = SpeculativeEngine(target, LAYER_IDS, proposer, [EOS])
    proposed = accepted = 0
    for prompt, ref in zip(prompts, refs):
        got = spec.generate(prompt, max_new_tokens=24)
        assert got.output_ids == ref
        proposed += sum(s.num_proposed for s in got.steps)
        accepted += sum(s.num_accepted for s in got.steps)
    assert 0 < accepted < proposed


def test_model_prefix_and_tied_lm_head(target, tmp_path):
    """A ``model.`` prefix on every key is stripped; a tied config without lm_head reuses embed_tokens."""
    tensors = original_tensors(target)
    del tensors["lm_head.weight"]
    folder = write_original(tmp_path / "orig", original_config(target, tie_word_embeddings=True),
                            {f"model.{k}": v for k, v in tensors.items()})
    _, draft = load_draft(folder)
    assert torch.equal(draft.lm_head.weight, tensors["embed_tokens.weight"].float())
    assert torch.equal(draft.fc.weight, tensors["fc.weight"].float())


@pytest.mark.parametrize("kind", ["dspark-rnn", "dflash"])
def test_saver_round_trip(target, tmp_path, kind):
    knobs = dflash_knobs() if kind == "dflash" else dict(markov_head_type="rnn")
    config = draft_config_from_target(target.config, num_draft_layers=DRAFT_LAYERS, target_layer_ids=LAYER_IDS,
                                      mask_token_id=MASK, block_size=K, markov_rank=RANK, **knobs)
    torch.manual_seed(3)
    model = DSparkDraftModel.from_target(target, config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # markov_w2 starts at zero: make every tensor distinctive
    folder = save_original_dspark(model, tmp_path / "exported")
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3DSparkModel"] and saved["model_type"] == "qwen3"
    assert saved["num_hidden_layers"] == DRAFT_LAYERS and saved["num_target_layers"] == LAYERS
    assert "draft_config" not in saved and is_original_layout(folder)
    name, loaded = load_draft(folder)
    assert name == kind.split("-")[0]
    want_cfg = model.config.to_dict()
    if not model.config.use_markov_head:  # the original writes markov_rank=0: the unused knob is not kept
        want_cfg["markov_rank"] = loaded.config.markov_rank
    assert loaded.config.to_dict() == want_cfg
    want, got = params(model), params(loaded)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_saver_refuses_a_reduced_vocabulary_draft(target, tmp_path):
    config = draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                      mask_token_id=MASK, block_size=K, markov_rank=RANK, draft_vocab_size=16)
    model = DSparkDraftModel.from_target(target, config, d2t=torch.arange(16) * 2)
    with pytest.raises(ValueError, match="draft_vocab_size=16"):
        save_original_dspark(model, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_saver_refuses_zlab_layout_dflash(target, tmp_path):
    config = draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                      mask_token_id=MASK, block_size=K, sample_from_anchor=False, **dflash_knobs())
    with pytest.raises(ValueError, match="z-lab's DFlash layout.*--format vllm-dflash"):
        save_original_dspark(DSparkDraftModel.from_target(target, config), tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_saver_refuses_layers_the_original_would_build_otherwise(tmp_path):
    """The original builds the layers from model_type: a Qwen3-style draft for a Llama target
    (--draft-backbone qwen3) would load there without its q/k norms."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN,
                                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=128,
                                         eos_token_id=EOS, pad_token_id=PAD)).eval()
    config = draft_config_from_target(llama.config, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                      mask_token_id=MASK, block_size=K, markov_rank=RANK, backbone="qwen3")
    with pytest.raises(ValueError, match="original layout: the original builds the draft's layers from model_type "
                                         "'llama'.*--draft-backbone target"):
        save_original_dspark(DSparkDraftModel.from_target(llama, config), tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_missing_embeddings_come_from_the_target(target, tmp_path):
    config = draft_config_from_target(target.config, num_draft_layers=DRAFT_LAYERS, target_layer_ids=LAYER_IDS,
                                      mask_token_id=MASK, block_size=K, markov_rank=RANK)
    model = DSparkDraftModel.from_target(target, config)
    folder = save_original_dspark(model, tmp_path / "stripped", include_embeddings=False)
    with pytest.raises(ValueError, match=r"embed_tokens.*target_model"):
        load_draft(folder)
    _, draft = load_draft(folder, target_model=target)
    assert torch.equal(draft.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    assert not draft.lm_head.weight.requires_grad


def _drop(key):
    def edit(cfg, tensors):
        cfg.pop(key)
    return edit


def _set(**kw):
    def edit(cfg, tensors):
        cfg.update(kw)
    return edit


def _tensor(name, value=None):
    def edit(cfg, tensors):
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    return edit


BAD_LAYOUTS = {
    "missing block_size": (_drop("block_size"), "'block_size'"),
    "missing markov_head_type": (_drop("markov_head_type"), "'markov_head_type'"),
    "missing enable_confidence_head": (_drop("enable_confidence_head"), "'enable_confidence_head'"),
    "unknown markov_head_type": (_set(markov_head_type="fancy"), "'markov_head_type'.*fancy"),
    "unknown architecture": (_set(architectures=["Gemma4DSparkModel"]), "'architectures'.*Gemma4DSparkModel"),
    "model_type disagrees": (_set(model_type="llama"), "'model_type'"),
    "layer count mismatch": (_set(num_hidden_layers=3), r"num_hidden_layers=3.*layers \[0, 1\]"),
    "confidence head reading Markov features without a Markov head": (_set(markov_rank=0),
                                                                      "'confidence_head_with_markov'"),
    "sliding window layers": (_set(layer_types=["sliding_attention"] * DRAFT_LAYERS), "'layer_types'"),
    "a window without layer_types": (_set(layer_types=None, use_sliding_window=True, sliding_window=16),
                                     "'use_sliding_window'.*sliding_window=16 without layer_types"),
    "pruned vocabulary": (_set(draft_vocab_size=50), "'draft_vocab_size'"),
    "post-norm target layer": (_set(target_layer_ids=[0, LAYERS - 1]), "target_layer_ids"),
    "wrong tensor shape": (_tensor("fc.weight", torch.zeros(H, 3 * H, dtype=torch.bfloat16)),
                           r"fc\.weight: expected \(32, 64\), received \(32, 96\)"),
    "missing tensor": (_tensor("layers.1.mlp.up_proj.weight"), r"no tensor \['layers\.1\.mlp\.up_proj\.weight'\]"),
    "unused tensor": (_tensor("markov_head.gate_proj.bias", torch.zeros(RANK, dtype=torch.bfloat16)),
                      r"not used by the draft \['markov_head\.gate_proj\.bias'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_LAYOUTS))
def test_bad_layouts_name_the_field(target, tmp_path, case):
    edit, pattern = BAD_LAYOUTS[case]
    cfg, tensors = original_config(target), original_tensors(target)
    edit(cfg, tensors)
    folder = write_original(tmp_path / "bad", cfg, tensors)
    with pytest.raises(ValueError, match=pattern):
        load_draft(folder)


def test_a_draft_for_another_target_is_refused(target, tmp_path):
    cfg = original_config(target, num_target_layers=LAYERS + 2)
    folder = write_original(tmp_path / "other", cfg, original_tensors(target))
    load_draft(folder)  # fine on its own
    with pytest.raises(ValueError, match=r"'num_target_layers'.*the target's"):
        load_draft(folder, target_model=target)


def _with(config, **changes):
    config = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("changes, key", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                          "original_max_position_embeddings": 128}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "rope_parameters"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"intermediate_size": 2 * FFN}, "intermediate_size"),
    ({"max_position_embeddings": 512}, "max_position_embeddings"),
])
def test_a_field_that_changes_the_forward_must_be_the_targets(target, changes, key):
    """The original copies the target's config; a draft config.json whose RoPE (default theta 1e6 against a
    yarn x4 target), norms, activation or shape differ from the target's is refused, naming the key."""
    cfg = original_config(target, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    draft_config_from_original(cfg, target_config=_with(target.config, rope_parameters=cfg["rope_parameters"]))
    other = _with(target.config, **{"rope_parameters": cfg["rope_parameters"], **changes})
    with pytest.raises(ValueError, match=rf"key '{key}'.*the target's.*pass that target"):
        draft_config_from_original(cfg, target_config=other)


def test_a_confidence_head_without_markov_features_loads(target, tmp_path):
    """``confidence_head_with_markov: false`` (the original supports it): the head is Linear(H, 1) over the
    hidden state alone; DeepSpec's own layout, the original layout and vllm-dspark keep the field."""
    from deepspec.export import build_export

    tensors = original_tensors(target)
    tensors["confidence_head.proj.weight"] = tensors["confidence_head.proj.weight"][:, :H].clone()
    folder = write_original(tmp_path / "orig", original_config(target, confidence_head_with_markov=False), tensors)
    _, draft = load_draft(folder, target_model=target)
    assert draft.config.confidence_head_with_markov is False and draft.config.use_markov_head
    hidden, prev = torch.randn(3, K, H), torch.randint(0, VOCAB, (3, K))
    _, conf = draft.heads(hidden, prev)
    want = hidden @ tensors["confidence_head.proj.weight"].float()[0] + tensors["confidence_head.proj.bias"].float()
    torch.testing.assert_close(conf.squeeze(-1), want)
    ours = tmp_path / "ours"
    draft.save_pretrained(ours)
    again = load_draft(ours)[1]
    assert again.config.confidence_head_with_markov is False
    torch.testing.assert_close(again.heads(hidden, prev)[1], conf)
    save_original_dspark(draft, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["confidence_head_with_markov"] is False
    assert load_original_dspark(tmp_path / "back").config.confidence_head_with_markov is False
    config, weights, _ = build_export(ours, "vllm-dspark")
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"] is False
    assert weights["confidence_head.proj.weight"].shape == (1, H)


def test_layout_detection(target, tmp_path):
    config = draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                      mask_token_id=MASK, block_size=K, markov_rank=RANK)
    ours = DSparkDraftModel.from_target(target, config).save_pretrained(tmp_path / "ours")
    target.save_pretrained(tmp_path / "target")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("[1, 2")
    assert not is_original_layout(ours)
    assert not is_original_layout(tmp_path / "target")
    assert not is_original_layout(tmp_path / "junk")
    assert not is_original_layout(tmp_path / "missing")
    assert load_draft(ours)[0] == "dspark"  # DeepSpec's own layout still loads through its own path
    with pytest.raises(ValueError, match="architectures"):
        load_original_dspark(ours)


def test_qwen3_4b_original_config_maps_without_weights():
    """The released DSpark Qwen3-4B recipe (config/dspark/dspark_qwen3_4b.py) on the real Qwen3-4B config
    (transformers 4.x layout: rope_theta, no rope_parameters)."""
    cfg = json.loads((Path(__file__).parents[1] / "fixtures" / "qwen3-4b-config.json").read_text())
    cfg.update(architectures=["Qwen3DSparkModel"], num_target_layers=36, num_hidden_layers=5, block_size=7,
               tie_word_embeddings=False, layer_types=["full_attention"] * 5, mask_token_id=151669,
               target_layer_ids=[1, 9, 17, 25, 33], num_anchors=512, enable_confidence_head=True,
               confidence_head_with_markov=True, markov_rank=256, markov_head_type="vanilla")
    c = draft_config_from_original(cfg)
    assert (c.num_draft_layers, c.target_num_hidden_layers, c.block_size, c.mask_token_id) == (5, 36, 7, 151669)
    assert (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (2560, 128, 32, 8)
    assert c.rope_parameters["rope_theta"] == 1_000_000 and c.feature_width == 5 * 2560
    assert (c.eos_token_ids, c.markov_dim, c.qk_norm, c.qkv_bias) == ([151645], 256, True, False)
    dflash = draft_config_from_original(dict(cfg, markov_rank=0, enable_confidence_head=False))
    assert not dflash.use_markov_head and not dflash.use_confidence_head and dflash.ce_weight == 1.0


def test_gemma3_draft_round_trips_as_gemma3dsparkmodel(tmp_path):
    """A Gemma 3 draft in the original layout: ``Gemma3DSparkModel`` with Gemma's own config keys
    (``hidden_activation``), read back to the same config (embedding scale, soft-capping, the global
    layers' RoPE) and weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=128, eos_token_id=EOS,
        pad_token_id=PAD, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}})).eval()
    config = draft_config_from_target(gemma.config, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                      mask_token_id=MASK, block_size=K, markov_rank=RANK)
    assert config.embed_scale == pytest.approx(H ** 0.5) and config.final_logit_softcapping == 30.0
    assert config.rope_parameters == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert config.hidden_act == "gelu_pytorch_tanh" and config.qk_norm
    model = DSparkDraftModel.from_target(gemma, config)
    folder = save_original_dspark(model, tmp_path / "exported")
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3DSparkModel"] and saved["model_type"] == "gemma3_text"
    assert saved["hidden_activation"] == "gelu_pytorch_tanh" and "hidden_act" not in saved
    _, loaded = load_draft(folder)
    assert loaded.config.to_dict() == model.config.to_dict()
    want, got = params(model), params(loaded)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
