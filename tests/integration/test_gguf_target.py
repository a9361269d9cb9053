"""GGUF files as targets and ``--chat-template``, on a tiny random Llama GGUF written by
:func:`tests.helpers.write_tiny_gguf`.

Checked (and for a tiny random Gemma 3 GGUF with no chat template, the whole pipeline with
``--chat-template gemma3``): a GGUF file (or a folder holding one) converts once into a safetensors
folder keyed by the file's content hash, and the converted target is the GGUF's model; a renamed copy
reuses it and a changed file converts anew; unreadable files, architectures transformers cannot read and folders with several GGUFs are
refused naming why; a target without a chat template is refused by ``prepare`` before any row, naming
``--chat-template FILE``, which then gives every stage the same tokenizer (the cache records the target
folder with that template, so ``train`` finds it).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from deepspec.algorithms.registry import load_draft
from deepspec.cli import main
from deepspec.checkpoints import draft_folder
from deepspec.target import load
from deepspec.target.load import load_target, resolve_target_dir, tokenizer_fingerprint
from tests.helpers import write_tiny_gguf
from tests.unit.test_chat import CHATML

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_gguf_file_converts_once_keyed_by_its_content(tmp_path, home, monkeypatch):
    from transformers import AutoModelForCausalLM

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", chat_template=CHATML)
    folder = resolve_target_dir(str(gguf))
    assert folder.parent == home / "targets" and folder.name.startswith("gguf-")
    source = json.loads((folder / "DEEPSPEC_SOURCE.json").read_text())
    assert source["architecture"] == "llama" and len(source["sha256"]) == 64
    model, tok = load_target(str(gguf))
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    got, want = model.state_dict(), direct.state_dict()  # the GGUF's own weights, dequantised
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert tok.chat_template == CHATML and tok.eos_token == "<|im_end|>"

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(load, "_convert_gguf", no_conversion)
    (tmp_path / "copy").mkdir()
    shutil.copy(gguf, tmp_path / "copy" / "renamed.gguf")
    assert resolve_target_dir(str(tmp_path / "copy" / "renamed.gguf")) == folder  # keyed by content, not name
    assert resolve_target_dir(str(tmp_path / "copy")) == folder  # a folder holding one GGUF
    monkeypatch.undo()
    monkeypatch.setenv("DEEPSPEC_HOME", str(home))
    changed = write_tiny_gguf(tmp_path / "copy" / "renamed.gguf", seed=1, chat_template=CHATML)
    assert resolve_target_dir(str(changed)) != resolve_target_dir(str(gguf))


def test_unreadable_gguf_targets_are_refused_naming_why(tmp_path, home):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_target_dir(str(tmp_path / "junk.gguf"))
    other = write_tiny_gguf(tmp_path / "rwkv.gguf", architecture="rwkv6", tensors=False)
    with pytest.raises(ValueError, match="the GGUF architecture 'rwkv6' is not one transformers can read from GGUF "
                                         r"\(.*llama.*\)"):
        resolve_target_dir(str(other))
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        write_tiny_gguf(tmp_path / "two" / name, tensors=False)
    with pytest.raises(ValueError, match="several GGUF files \\(a.gguf, b.gguf\\)"):
        resolve_target_dir(str(tmp_path / "two"))
    empty = write_tiny_gguf(tmp_path / "empty.gguf", tensors=False)
    with pytest.raises(ValueError, match="holds no tensors"):
        resolve_target_dir(str(empty))
    partial = write_tiny_gguf(tmp_path / "partial.gguf", skip=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=r"lacks 1 of the model's weights \(model.layers.1.mlp.down_proj.weight\)"):
        resolve_target_dir(str(partial))
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="a file that is not a GGUF"):
        resolve_target_dir(str(tmp_path / "model.bin"))
    assert not (home / "targets").exists() or not any((home / "targets").iterdir())  # nothing half-converted


def _prepare_argv(tmp_path, gguf, prompts, *, max_new_tokens):
    """``(prepared path, prepare argv)`` regenerating one answer to each message list of ``prompts``."""
    rows = [{"id": str(i), "messages": [*msgs, {"role": "assistant", "content": "(regenerated)"}]}
            for i, msgs in enumerate(prompts)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepared = tmp_path / "prepared.jsonl"
    return prepared, ["prepare", "--input", str(source), "--output", str(prepared), "--target", str(gguf),
                      "--max-new-tokens", str(max_new_tokens), "--dtype", "float32"]


def test_a_target_without_chat_template_is_refused_at_prepare_and_the_flag_fixes_it(tmp_path, home, capsys):
    gguf = write_tiny_gguf(tmp_path / "plain.gguf")  # no chat template, as many GGUF files
    prepared, argv = _prepare_argv(tmp_path, gguf, [[{"role": "user", "content": f"Count to {i}."}] for i in range(3)],
                                   max_new_tokens=4)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--chat-template FILE" in err and "Traceback" not in err
    assert not prepared.exists() and not list(tmp_path.glob("prepared*"))  # refused before any row
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    assert main([*argv, "--chat-template", str(template)]) == 0
    assert sum(1 for _ in prepared.open()) == 3
    assert main(["cache", "--input", str(prepared), "--output-dir", str(tmp_path / "cache"), "--target", str(gguf),
                 "--chat-template", str(template), "--target-layer-ids", "0", "--storage-dtype", "float32"]) == 0
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    with_template = resolve_target_dir(str(gguf), template)
    assert manifest["target"] == str(with_template) and with_template.name.endswith(
        "-template-" + with_template.name.split("-template-")[1])
    _, tok = load_target(manifest["target"])  # what train loads from the cache's record
    assert tok.chat_template == CHATML and manifest["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    assert main(["train", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "train"),
                 "--max-steps", "1", "--block-size", "2", "--num-anchors", "2", "--batch-size", "1",
                 "--mask-token", "<|endoftext|>"]) == 0
    capsys.readouterr()
    assert main(["train", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "train2"),
                 "--target", str(gguf), "--max-steps", "1", "--mask-token", "<|endoftext|>"]) == 2
    assert "pass the same --chat-template" in capsys.readouterr().err  # the template left out at train time
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }}")
    for template, needle in ((tmp_path / "nope.jinja", "no such file"), (tmp_path, "is a folder"),
                             (broken, "line 2: Unexpected end of template")):
        assert main([*argv, "--output", str(tmp_path / "p2.jsonl"), "--chat-template", str(template)]) == 2
        assert needle in capsys.readouterr().err
    assert not (tmp_path / "p2.jsonl").exists()


def test_a_gemma3_gguf_runs_prepare_cache_train_eval_with_identical_outputs(tmp_path, home, capsys):
    """A Gemma 3 GGUF (no chat template, as Gemma's files) as ``--target`` runs
    prepare -> cache -> train -> eval on CPU with ``--chat-template gemma3``; the draft knows the target's
    embedding scale, and every speculative output equals the target's own."""
    gguf = write_tiny_gguf(tmp_path / "gemma.gguf", architecture="gemma3")
    prepared, argv = _prepare_argv(tmp_path, gguf, [[{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": f"count to {i} please"}]
                                                    for i in range(4)], max_new_tokens=12)
    assert main(argv) == 2
    assert "--chat-template gemma3" in capsys.readouterr().err  # the refusal names the built-in template
    assert main([*argv, "--chat-template", "gemma3"]) == 0
    first = json.loads(prepared.open().readline())
    assert first["messages"][0]["role"] == "system"
    assert main(["cache", "--input", str(prepared), "--output-dir", str(tmp_path / "cache"), "--target", str(gguf),
                 "--chat-template", "gemma3", "--target-layer-ids", "0", "1", "--storage-dtype", "float32"]) == 0
    _, tok = load_target(json.loads((tmp_path / "cache" / "manifest.json").read_text())["target"])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "<bos><start_of_turn>user\nhi<end_of_turn>\n" \
                                                                  "<start_of_turn>model\n"
    for algorithm in ("dspark", "eagle3"):
        assert main(["train", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / algorithm),
                     "--algorithm", algorithm, "--max-steps", "2", "--batch-size", "2",
                     *(["--ttt-steps", "3", "--num-chains", "4"] if algorithm == "eagle3" else
                       ["--block-size", "3", "--num-anchors", "4", "--mask-token", "<mask>"])]) == 0
    _, draft = load_draft(draft_folder(str(tmp_path / "dspark")))
    assert draft.config.family == "gemma3_text" and draft.config.embed_scale == pytest.approx(32 ** 0.5)
    saved = json.loads((draft_folder(str(tmp_path / "dspark")) / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3DSparkModel"]
    assert saved["layer_types"] == ["full_attention"]  # the draft's own attention: no sliding window
    capsys.readouterr()
    bench = tmp_path / "gsm8k.jsonl"
    bench.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n"
                             for q in ("count to three", "name a letter")))
    out = tmp_path / "eval"
    assert main(["eval", "--draft", str(tmp_path / "dspark"), str(tmp_path / "eagle3"), "--target", str(gguf),
                 "--chat-template", "gemma3", "--benchmarks", "gsm8k", "--benchmark-files", f"gsm8k={bench}",
                 "--num-prompts", "2", "--max-new-tokens", "16", "--dtype", "float32", "--output-dir", str(out),
                 "--compare-hf-generate", "false"]) == 0
    results = json.loads((out / "eval_results.json").read_text())
    records = results["samples"]["gsm8k"]
    assert len(records) == 4 and all(len(r) == 2 for r in records.values())  # 2 drafts, n-gram, target-only
    assert all(r["identical_to_baseline"] for rs in records.values() for r in rs)
    assert all(r["num_new_tokens"] > 0 for rs in records.values() for r in rs)
