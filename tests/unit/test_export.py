"""`deepspec export`: each engine format's config keys, weight names and shapes, layer-id convention and
reduced-vocabulary encoding on tiny random drafts, and the clear refusals (docs/export.md)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from deepspec.algorithms.dspark.config import dflash_knobs, draft_config_from_target
from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.eagle3.config import eagle3_config_from_target
from deepspec.algorithms.eagle3.model import Eagle3DraftModel
from deepspec.cli import main
from deepspec.export import ExportConfig, ExportError, build_export, check_export, run_export

pytestmark = pytest.mark.usefixtures("one_thread")

V, MASK, LAYER_IDS = 64, 5, [0, 2]
H, I, HEAD = 32, 64, 8


def tiny_target(family):
    torch.manual_seed(0)
    kw = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD, intermediate_size=I,
              num_hidden_layers=5, vocab_size=V, pad_token_id=0, eos_token_id=1, max_position_embeddings=128)
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                          "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}[family]
    return model_cls(cfg_cls(**kw)).eval()


D2T = torch.tensor([7, 1, 3, 2, 9, 40, 63, 12, 11, 10, 20, 30])  # absolute target ids, not sorted


def saved_draft(tmp_path, algorithm, family, *, reduced=False, backbone="target", sample_from_anchor=True):
    target = tiny_target(family)
    d2t = D2T if reduced else None
    torch.manual_seed(1)
    if algorithm == "eagle3":
        cfg = eagle3_config_from_target(target.config, target_layer_ids=LAYER_IDS, ttt_steps=3,
                                        draft_vocab_size=len(D2T) if reduced else None, backbone=backbone)
        draft = Eagle3DraftModel.from_target(target, cfg, d2t=d2t)
    else:
        knobs = {} if algorithm == "dspark" else dict(dflash_knobs(), sample_from_anchor=sample_from_anchor)
        cfg = draft_config_from_target(target.config, num_draft_layers=2, target_layer_ids=LAYER_IDS,
                                       mask_token_id=MASK, markov_rank=4, block_size=4,
                                       draft_vocab_size=len(D2T) if reduced else None, backbone=backbone, **knobs)
        draft = DSparkDraftModel.from_target(target, cfg, d2t=d2t)
    folder = tmp_path / f"{algorithm}-{family}-{reduced}-{backbone}-{sample_from_anchor}"
    draft.save_pretrained(folder)
    return folder, draft


def export(tmp_path, folder, fmt, **kw):
    out = run_export(ExportConfig(draft=str(folder), format=fmt, output_dir=str(tmp_path / f"out-{fmt}"), **kw))
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


LLAMA_EAGLE3_NAMES = {
    "fc.weight", "norm.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
}


def test_vllm_eagle3_llama(tmp_path):
    folder, draft = saved_draft(tmp_path, "eagle3", "llama")
    config, weights = export(tmp_path, folder, "vllm-eagle3", dtype="float32")
    assert set(weights) == LLAMA_EAGLE3_NAMES  # no embedding, no lm_head (the target's are shared)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    # vLLM reads hidden_states[i]; DeepSpec's layer i is hidden_states[i + 1]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3] and config["num_aux_hidden_states"] == 2
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert "draft_vocab_size" not in config and config["norm_before_residual"] is False
    assert weights["fc.weight"].shape == (H, 2 * H) and weights["layers.0.self_attn.q_proj.weight"].shape == (32, 2 * H)
    torch.testing.assert_close(weights["layers.0.self_attn.q_proj.weight"], draft.midlayer.self_attn.q_proj.weight,
                               rtol=0, atol=0)
    assert config["deepspec"]["algorithm"] == "eagle3" and config["deepspec"]["target_layer_ids"] == LAYER_IDS


def test_reduced_vocabulary_ships_lm_head_and_d2t_offsets(tmp_path):
    folder, draft = saved_draft(tmp_path, "eagle3", "llama", reduced=True)
    config, weights = export(tmp_path, folder, "vllm-eagle3")
    assert config["draft_vocab_size"] == len(D2T) and config["vocab_size"] == V
    assert set(weights) == LLAMA_EAGLE3_NAMES | {"lm_head.weight", "d2t"}
    assert weights["d2t"].dtype == torch.int64  # offsets: target id = i + d2t[i]
    assert torch.equal(weights["d2t"] + torch.arange(len(D2T)), D2T)
    assert weights["lm_head.weight"].dtype == torch.bfloat16  # the default export dtype
    torch.testing.assert_close(weights["lm_head.weight"].float(), draft.lm_head.weight.bfloat16().float())


def test_sglang_eagle3_keeps_deepspec_layer_ids(tmp_path):
    folder, _ = saved_draft(tmp_path, "eagle3", "llama")
    config, weights = export(tmp_path, folder, "sglang-eagle3")
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": LAYER_IDS}  # SGLang adds 1 itself
    assert "eagle_aux_hidden_state_layer_ids" not in config and set(weights) == LLAMA_EAGLE3_NAMES


def test_qwen3_eagle3_uses_vllms_qwen3_head_and_is_refused_by_sglang(tmp_path):
    folder, _ = saved_draft(tmp_path, "eagle3", "qwen3")
    config, weights = export(tmp_path, folder, "vllm-eagle3")
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= set(weights)
    with pytest.raises(ExportError, match="SGLang's EAGLE-3 head .* has no q/k norm"):
        build_export(folder, "sglang-eagle3")


def test_vllm_dspark(tmp_path):
    folder, draft = saved_draft(tmp_path, "dspark", "qwen3", reduced=True)
    config, weights = export(tmp_path, folder, "vllm-dspark", dtype="float32")
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["sample_from_anchor"] is True
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}  # vLLM adds 1 itself
    assert (config["block_size"], config["markov_rank"], config["num_hidden_layers"]) == (4, 4, 2)
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"]
    assert weights["markov_head.markov_w1.weight"].shape == (V, 4)
    assert weights["markov_head.markov_w2.weight"].shape == (len(D2T), 4)
    assert weights["confidence_head.proj.weight"].shape == (1, H + 4)
    assert {"hidden_norm.weight", "layers.1.self_attn.q_norm.weight", "lm_head.weight", "d2t"} <= set(weights)
    assert not any(k.startswith(("embed_tokens", "model.")) for k in weights)
    torch.testing.assert_close(weights["layers.1.mlp.down_proj.weight"], draft.layers[1].mlp.down_proj.weight,
                               rtol=0, atol=0)


def test_qwen3_style_drafts_for_a_llama_target_export_to_vllm(tmp_path):
    """--draft-backbone qwen3 (the default for dspark and dflash): vLLM's Qwen3DSparkModel builds exactly
    these layers for a Llama target; an Eagle3 draft so built gets vLLM's Qwen3 EAGLE-3 head."""
    folder, draft = saved_draft(tmp_path, "dspark", "llama", backbone="qwen3")
    config, weights = export(tmp_path, folder, "vllm-dspark", dtype="float32")
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["attention_bias"] is False and config["deepspec"]["config"]["family"] == "llama"
    torch.testing.assert_close(weights["layers.1.self_attn.k_norm.weight"], draft.layers[1].self_attn.k_norm.weight,
                               rtol=0, atol=0)
    folder, _ = saved_draft(tmp_path, "eagle3", "llama", backbone="qwen3")
    config, weights = export(tmp_path, folder, "vllm-eagle3")
    assert config["architectures"] == ["Qwen3ForCausalLM"] and "layers.0.self_attn.q_norm.weight" in weights
    with pytest.raises(ExportError, match="train it with --draft-backbone target"):
        build_export(folder, "sglang-eagle3")


def test_zlab_layout_dflash_exports_to_vllm_dflash(tmp_path):
    """A DFlash draft trained in z-lab's layout is vLLM's DFlashDraftModel: Qwen3 layers, fc, hidden_norm,
    norm (no Markov or confidence head), block_size = K and K - 1 speculative tokens; with a reduced
    vocabulary lm_head and d2t offsets. vLLM's DSpark (which reads the anchor slot) refuses it."""
    folder, draft = saved_draft(tmp_path, "dflash", "qwen3", reduced=True, sample_from_anchor=False)
    out = run_export(ExportConfig(draft=str(folder), format="vllm-dflash", output_dir=str(tmp_path / "o"),
                                  dtype="float32"))
    config, weights = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}  # vLLM adds 1 itself
    assert (config["block_size"], config["num_hidden_layers"], config["draft_vocab_size"]) == (4, 2, len(D2T))
    assert not any(k.startswith(("markov_head", "confidence_head", "embed_tokens")) for k in weights)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight", "lm_head.weight",
            "d2t"} <= set(weights)
    torch.testing.assert_close(weights["fc.weight"], draft.fc.weight, rtol=0, atol=0)
    assert '"num_speculative_tokens": 3' in build_export(folder, "vllm-dflash")[2]
    for fmt in ("vllm-dspark", "speculators"):
        with pytest.raises(ExportError, match="z-lab's layout.*--format vllm-dflash"):
            build_export(folder, fmt, verifier="default")


def test_dflash_exports_as_dspark_with_a_zero_markov_head(tmp_path):
    folder, _ = saved_draft(tmp_path, "dflash", "qwen3")
    config, weights = export(tmp_path, folder, "vllm-dspark")
    assert config["markov_rank"] == 1 and not config["enable_confidence_head"]
    assert not weights["markov_head.markov_w1.weight"].any() and not weights["markov_head.markov_w2.weight"].any()
    assert not any(k.startswith("confidence_head") for k in weights)


@pytest.mark.parametrize("algorithm, family, fmt, message", [
    ("dspark", "llama", "vllm-dspark", "builds Qwen3 layers with q/k RMSNorm; this draft's layers .llama target, "
                                       "--draft-backbone target. have none.*Train the draft with --draft-backbone qwen3"),
    ("dspark", "qwen3", "vllm-dflash", "mask slots predict their own position.*--sample-from-anchor false"),
    ("dflash", "qwen3", "vllm-dflash", "this dflash draft proposes from the anchor slot on.*--format vllm-dspark"),
    ("dspark", "qwen3", "vllm-eagle3", "dspark draft; use --format vllm-dspark or vllm-dflash or speculators "
                                       r"\(vllm-eagle3 takes eagle3 drafts\)"),
    ("eagle3", "llama", "vllm-dflash", "eagle3 draft; use --format vllm-eagle3 or sglang-eagle3"),
    ("eagle3", "llama", "vllm-dspark", "vllm-dspark takes dspark and dflash drafts"),
    *((algorithm, "gemma3", fmt, r"gemma3_text target, whose RMSNorms are \(1 \+ w\).*no export format carries them")
      for algorithm, fmt in (("dspark", "vllm-dspark"), ("dspark", "speculators"), ("eagle3", "vllm-eagle3"),
                             ("eagle3", "sglang-eagle3"))),
])
def test_formats_that_cannot_express_the_draft_are_refused(tmp_path, algorithm, family, fmt, message):
    folder, _ = saved_draft(tmp_path, algorithm, family)
    verifier = {"verifier": "default"} if fmt == "speculators" else {}
    with pytest.raises(ExportError, match=message):
        run_export(ExportConfig(draft=str(folder), format=fmt, output_dir=str(tmp_path / "out"), **verifier))
    assert not (tmp_path / "out").exists()


def test_check_export_names_a_missing_or_misshapen_tensor(tmp_path):
    folder, _ = saved_draft(tmp_path, "eagle3", "llama")
    config, weights, _ = build_export(folder, "vllm-eagle3")
    check_export("vllm-eagle3", config, weights)
    missing = {k: v for k, v in weights.items() if k != "layers.0.hidden_norm.weight"}
    with pytest.raises(ExportError, match=r"missing \['layers.0.hidden_norm.weight'\]"):
        check_export("vllm-eagle3", config, missing)
    with pytest.raises(ExportError, match=r"wrong shapes fc.weight \(32, 32\) \(expected \(32, 64\)\)"):
        check_export("vllm-eagle3", config, {**weights, "fc.weight": torch.zeros(H, H)})


def test_existing_output_needs_overwrite_and_the_cli_says_so(tmp_path, capsys):
    folder, _ = saved_draft(tmp_path, "eagle3", "llama")
    out = tmp_path / "exported"
    argv = ["export", "--draft", str(folder), "--format", "vllm-eagle3", "--output-dir", str(out)]
    assert main(argv) == 0
    assert "num_speculative_tokens\": 3" in capsys.readouterr().out
    assert main(argv) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main(argv + ["--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert main(["export", "--draft", str(folder), "--format", "gguf", "--output-dir", str(tmp_path / "x")]) == 2
    assert "export.format: expected one of vllm-dspark, vllm-dflash, speculators, vllm-eagle3, sglang-eagle3, got " \
           "'gguf'" in capsys.readouterr().err


def test_overwrite_replaces_only_an_earlier_export(tmp_path, monkeypatch):
    folder, _ = saved_draft(tmp_path, "eagle3", "llama")
    kw = dict(draft=str(folder), format="vllm-eagle3", overwrite=True)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not an earlier `deepspec export`"):
        run_export(ExportConfig(**kw, output_dir=str(precious)))
    assert (precious / "notes.txt").read_text() == "keep me"
    for own in (folder, folder.parent):  # the draft being exported, and the folder holding it
        with pytest.raises(ValueError, match="is not an earlier `deepspec export`"):
            run_export(ExportConfig(**kw, output_dir=str(own)))
    (tmp_path / "a-file").write_text("x")
    for bad in (tmp_path / "a-file", tmp_path / "a-file" / "sub"):
        with pytest.raises(ValueError, match="is a file"):
            run_export(ExportConfig(**kw, output_dir=str(bad)))
    monkeypatch.chdir(tmp_path)
    for bad in ("", "."):
        with pytest.raises(ValueError, match="expected a folder of its own"):
            ExportConfig(**kw, output_dir=bad)
    assert (tmp_path / "precious" / "notes.txt").exists() and folder.exists()


def test_export_files_are_readable_by_the_serving_user(tmp_path):
    import os

    folder, _ = saved_draft(tmp_path, "eagle3", "llama")
    umask = os.umask(0o022)
    try:
        out = run_export(ExportConfig(draft=str(folder), format="vllm-eagle3", output_dir=str(tmp_path / "e")))
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {"config.json": 0o644,
                                                                        "model.safetensors": 0o644}


# ----------------------------------------------------------------------------------------------- speculators
def _verifier_folder(tmp_path, family="llama", **changes):
    folder = tmp_path / f"verifier-{family}"
    folder.mkdir(exist_ok=True)
    target = tiny_target(family)
    target.config.architectures = [type(target).__name__]
    (folder / "config.json").write_text(json.dumps({**target.config.to_dict(), **changes}))
    return folder


def test_speculators_eagle3_is_the_vllm_layout_with_the_decoder_keys_nested(tmp_path):
    folder, _ = saved_draft(tmp_path, "eagle3", "llama", reduced=True)
    verifier = _verifier_folder(tmp_path)
    vllm, vllm_weights, _ = build_export(folder, "vllm-eagle3")
    config, weights, hint = build_export(folder, "speculators", verifier=str(verifier))
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["hidden_size"] == H
    assert layer["num_aux_hidden_states"] == 2  # vLLM sizes fc from the layer config (3 when absent)
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3] and config["draft_vocab_size"] == len(D2T)
    assert config["norm_before_residual"] is False and config["target_hidden_size"] == H
    assert "hidden_size" not in config and "num_aux_hidden_states" not in config
    spec = config["speculators_config"]
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": str(verifier.resolve()), "architectures": ["LlamaForCausalLM"]}
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert set(weights) == set(vllm_weights) and all(torch.equal(weights[k], vllm_weights[k]) for k in weights)
    assert hint.startswith("vllm serve DIR")


def test_speculators_dspark_writes_vllms_aux_layer_ids(tmp_path):
    folder, _ = saved_draft(tmp_path, "dspark", "llama", backbone="qwen3")
    config, weights, _ = build_export(folder, "speculators", verifier=str(_verifier_folder(tmp_path)))
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["Qwen3DSparkModel"]
    assert config["aux_hidden_state_layer_ids"] == [1, 3]  # vLLM: target_layer_ids = aux - 1 = DeepSpec's ids
    assert "dflash_config" not in config and config["mask_token_id"] == MASK and config["sample_from_anchor"] is True
    assert (config["block_size"], config["markov_rank"]) == (4, 4)
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert "layers.1.self_attn.q_norm.weight" in weights


def test_speculators_refusals(tmp_path):
    folder, _ = saved_draft(tmp_path, "eagle3", "llama")
    kw = dict(draft=str(folder), output_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="export.verifier: the speculators format names the target it serves with; "
                                         "pass --verifier"):
        ExportConfig(**kw, format="speculators")
    with pytest.raises(ValueError, match="drop --verifier"):
        ExportConfig(**kw, format="vllm-eagle3", verifier="default")
    other = _verifier_folder(tmp_path, hidden_size=64)
    with pytest.raises(ExportError, match="export.verifier: .* has .*'hidden_size': 64.*made for a target with"):
        run_export(ExportConfig(**kw, format="speculators", verifier=str(other)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExportError, match="has no readable config.json"):
        run_export(ExportConfig(**kw, format="speculators", verifier=str(empty)))
    assert not (tmp_path / "out").exists()
    for typo in (str(tmp_path / "nonexist"), "./relative/dir"):
        with pytest.raises(ExportError, match="neither an existing model folder nor a hub id"):
            build_export(folder, "speculators", verifier=typo)
    config, _, _ = build_export(folder, "speculators", verifier="org/some-model")  # a hub id, written as given
    assert config["speculators_config"]["verifier"] == {"name_or_path": "org/some-model", "architectures": []}
    dspark, _ = saved_draft(tmp_path, "dspark", "llama")  # the family's own layers: no vLLM DSpark loader
    with pytest.raises(ExportError, match="--draft-backbone qwen3"):
        build_export(dspark, "speculators", verifier="org/some-model")


# ----------------------------------------------------------------------------------------------- full-size vocabulary
def _draft_with_vocab(tmp_path, algorithm, family, d2t, *, sample_from_anchor=True):
    """A draft saved with ``d2t`` as its draft vocabulary (None: the full vocabulary), the same weights either way."""
    target = tiny_target(family)
    n = None if d2t is None else int(d2t.shape[0])
    torch.manual_seed(1)
    if algorithm == "eagle3":
        cfg = eagle3_config_from_target(target.config, target_layer_ids=LAYER_IDS, ttt_steps=3, draft_vocab_size=n)
        draft = Eagle3DraftModel.from_target(target, cfg, d2t=d2t)
    else:
        knobs = {} if algorithm == "dspark" else dict(dflash_knobs(), sample_from_anchor=sample_from_anchor)
        cfg = draft_config_from_target(target.config, num_draft_layers=2, target_layer_ids=LAYER_IDS,
                                       mask_token_id=MASK, markov_rank=4, block_size=4, draft_vocab_size=n, **knobs)
        draft = DSparkDraftModel.from_target(target, cfg, d2t=d2t)
    folder = tmp_path / f"{algorithm}-{family}-{sample_from_anchor}-{'full' if d2t is None else n}"
    draft.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("algorithm, family, sample_from_anchor, fmt", [
    ("eagle3", "llama", True, "vllm-eagle3"), ("eagle3", "llama", True, "sglang-eagle3"),
    ("eagle3", "llama", True, "speculators"), ("dspark", "qwen3", True, "vllm-dspark"),
    ("dspark", "qwen3", True, "speculators"), ("dflash", "qwen3", True, "vllm-dspark"),
    ("dflash", "qwen3", False, "vllm-dflash"),
])
def test_a_draft_vocabulary_as_large_as_the_targets_exports_as_the_full_one(tmp_path, algorithm, family,
                                                                            sample_from_anchor, fmt):
    """``train --draft-vocab-size V`` on a V-token target (EAGLE-3's usual setting): every format writes it as
    the full vocabulary (no draft_vocab_size, lm_head or d2t, as vLLM's loaders want for N == V), and the
    export's own check passes: the export is exactly the full-vocabulary draft's."""
    from deepspec.algorithms.registry import get_algorithm

    assert fmt in get_algorithm(algorithm).export_formats
    verifier = str(_verifier_folder(tmp_path, family)) if fmt == "speculators" else None
    full_v = _draft_with_vocab(tmp_path, algorithm, family, torch.arange(V), sample_from_anchor=sample_from_anchor)
    full = _draft_with_vocab(tmp_path, algorithm, family, None, sample_from_anchor=sample_from_anchor)
    config, weights, _ = build_export(full_v, fmt, dtype=torch.float32, verifier=verifier)
    check_export(fmt, config, weights, algorithm=algorithm)
    assert "draft_vocab_size" not in config and not {"lm_head.weight", "d2t"} & set(weights)
    want_config, want_weights, _ = build_export(full, fmt, dtype=torch.float32, verifier=verifier)
    assert {k: v for k, v in config.items() if k != "deepspec"} == {k: v for k, v in want_config.items()
                                                                      if k != "deepspec"}
    assert set(weights) == set(want_weights) and all(torch.equal(weights[k], want_weights[k]) for k in weights)
    out = run_export(ExportConfig(draft=str(full_v), format=fmt, output_dir=str(tmp_path / f"out-{fmt}"),
                                  verifier=verifier))
    assert set(load_file(str(out / "model.safetensors"))) == set(weights)


def test_a_full_size_draft_vocabulary_out_of_target_order_is_refused(tmp_path):
    folder = _draft_with_vocab(tmp_path, "eagle3", "llama", torch.arange(V).flip(0))
    with pytest.raises(ExportError, match=r"holds all 64 target ids but not in target id order"):
        build_export(folder, "vllm-eagle3")


def test_reduced_vocabulary_rule():
    from deepspec.models.vocab import is_reduced_vocab

    assert is_reduced_vocab(64, 12) and not is_reduced_vocab(64, 64) and not is_reduced_vocab(64, None)
