"""One-line errors (exit 2) for the rough edges a new user hits, before any slow work starts."""

from __future__ import annotations

import socket

import pytest

from deepspec.cli import main
from deepspec.target import load


@pytest.fixture
def no_target_load(monkeypatch):
    """Fail the test if a stage loads a target: the error must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the error")

    monkeypatch.setattr(load, "load_target", refuse)


def test_serve_on_a_taken_port_fails_before_loading_the_target(capsys, no_target_load):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"deepspec serve: error: serve: cannot listen on 127.0.0.1:{port}" in err
    assert "choose another --port" in err and "Traceback" not in err


def test_a_draft_given_as_target_is_named_as_a_draft(tmp_path):
    """A draft folder (ours or the original's layout), a checkpoint or a run folder given as
    --target is refused saying what it is and where a draft goes, without calling transformers."""
    import json

    from deepspec.target.load import resolve_target_dir

    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps({"architectures": ["LlamaDSparkModel"], "deepspec_algorithm": "dspark"}))
    original = tmp_path / "original"
    original.mkdir()
    (original / "config.json").write_text(json.dumps({"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3"}))
    checkpoint = tmp_path / "run" / "checkpoint-000010"
    (checkpoint / "draft").mkdir(parents=True)
    (checkpoint / "draft" / "config.json").write_text("{}")
    (tmp_path / "run" / "latest").write_text("checkpoint-000010")
    (tmp_path / "run" / "train_config.json").write_text("{}")
    for path, said in ((ours, "a draft model folder (LlamaDSparkModel)"),
                       (original, "a draft model folder (Qwen3DSparkModel)"),
                       (checkpoint, "a DeepSpec training checkpoint"), (tmp_path / "run", "a DeepSpec training run")):
        with pytest.raises(FileNotFoundError, match=r"is " + said.replace("(", r"\(").replace(")", r"\)")
                           + r".*not a target model.*deepspec eval --draft"):
            resolve_target_dir(str(path))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert resolve_target_dir(str(target)) == target


def test_estimate_on_a_gguf_or_binary_file_says_what_it_is(tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)))
    assert main(["estimate", "--target", str(gguf), "--num-tokens", "1000"]) == 2
    err = capsys.readouterr().err
    assert f"{gguf} is a GGUF file; estimate reads a Hugging Face config.json" in err and "Traceback" not in err
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\xec\x00\xff" * 10)
    assert main(["estimate", "--target", str(binary), "--num-tokens", "1000"]) == 2
    assert f"{binary} is not a JSON config" in capsys.readouterr().err


def test_demo_with_damaged_training_data_stops_in_one_line_before_loading_the_target(
        tmp_path, monkeypatch, capsys, no_target_load):
    """A damaged packaged training file stops `deepspec demo` with exit 2 and one line naming the file
    and the fix, before any model loads and before anything is prepared; no other data is used instead."""
    from deepspec.eval import benchmarks as B

    packaged = tmp_path / "packaged"
    for relative in B.PACKAGED_SHA256:
        (packaged / relative).parent.mkdir(parents=True, exist_ok=True)
        (packaged / relative).write_bytes((B.PACKAGED_DIR / relative).read_bytes())
    (packaged / "gsm8k" / "train.jsonl.gz").write_bytes(b"\x1f\x8b damaged")
    monkeypatch.setattr(B, "PACKAGED_DIR", packaged)
    monkeypatch.delenv(B.BENCHMARKS_DIR_ENV, raising=False)
    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepspec demo: error: ")
    assert str(packaged / "gsm8k" / "train.jsonl.gz") in lines[0] and "reinstall DeepSpec" in lines[0]
    assert "sharegpt" not in captured.out.lower() and not out.exists()


@pytest.mark.parametrize("config_text,message", [
    ("{not json", "not valid JSON"),
    ('{"architectures": ["LlamaForCausalLM"]}', "is not a DeepSpec draft's"),
])
def test_eval_names_a_draft_config_no_draft_wrote_before_loading_the_target(tmp_path, capsys, no_target_load,
                                                                             config_text, message):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(config_text)
    assert main(["eval", "--draft", str(draft), "--benchmarks", "gsm8k", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "deepspec eval: error:" in err and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
