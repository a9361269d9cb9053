"""Crash safety of the target cache writer: SIGKILL in the middle of a shard, rerun, compare checksums.

The writer runs as `deepspec cache` in a subprocess on a tiny random target saved to disk (so the
subprocess can load it). A driver script slows each capture down (sleep only; features unchanged) so
the test can kill the process while a shard's temporary file exists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.data.cache import sha256_file

DRIVER = """
import os, sys, time
import torch
torch.set_num_threads(1)
delay = float(os.environ.get("DEEPSPEC_TEST_CAPTURE_DELAY_S", "0"))
if delay:
    import deepspec.data.cache.writer as writer_mod  # the writer looks the capture up in its own module
    real = writer_mod.capture_sample_features

    def slow_capture(*args, **kwargs):
        time.sleep(delay)
        return real(*args, **kwargs)

    writer_mod.capture_sample_features = slow_capture
from deepspec.cli import main
sys.exit(main(sys.argv[1:]))
"""


def make_tiny_target(folder: Path) -> Path:
    """A 2-layer random Llama with a byte-level ChatML tokenizer, saved as a Hugging Face folder."""
    from tests.unit.test_chat import tiny_chatml_tokenizer

    tok = tiny_chatml_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_prepared(path: Path, num_rows: int) -> Path:
    """Prepared rows in `deepspec prepare`'s layout (every 5th row held out)."""
    rows = []
    for k in range(num_rows):
        rows.append({
            "id": f"row{k}", "source_index": k, "truncated": False, "truncated_turns": [],
            "split": "heldout" if k % 5 == 4 else "train",
            "messages": [{"role": "user", "content": f"Question {k}: what is {k} + {k}?"},
                         {"role": "assistant", "content": f"{k} + {k} = {2 * k}." + " Indeed." * (k % 3)}],
        })
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def shard_hashes(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.glob("shard-*.safetensors"))}


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache_crash")
    target = make_tiny_target(root / "target")
    prepared = make_prepared(root / "prepared.jsonl", 14)
    driver = root / "driver.py"
    driver.write_text(DRIVER, encoding="utf-8")
    return root, target, prepared, driver


def cache_args(target: Path, prepared: Path, out: Path) -> list[str]:
    return ["cache", "--input", str(prepared), "--output-dir", str(out), "--target", str(target),
            "--target-layer-ids", "0", "2", "--shard-size", "2", "--max-seq-len", "256", "--storage-dtype", "bfloat16"]


def kill_mid_shard(driver: Path, target: Path, prepared: Path, out: Path, repo: Path) -> None:
    """Start the cache writer (each capture slowed by 0.15 s) and SIGKILL it during its 3rd or a later shard."""
    proc = subprocess.Popen([sys.executable, str(driver), *cache_args(target, prepared, out)], cwd=repo,
                            env=subprocess_env(DEEPSPEC_TEST_CAPTURE_DELAY_S="0.15"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            finals = list(out.glob("shard-*.safetensors")) if out.exists() else []
            temps = list(out.glob(".shard-*.tmp")) if out.exists() else []
            if len(finals) >= 2 and temps:  # in the middle of the 3rd (or a later) shard
                break
            if proc.poll() is not None:
                pytest.fail(f"writer exited (rc {proc.returncode}) before it could be killed mid-shard")
            time.sleep(0.005)
        else:
            pytest.fail("the writer never reached a state with a shard temp file")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_mid_shard_then_rerun_gives_an_identical_cache(setup):
    root, target, prepared, driver = setup
    repo = Path(__file__).resolve().parents[2]
    ref = root / "ref"
    subprocess.run([sys.executable, str(driver), *cache_args(target, prepared, ref)], check=True, cwd=repo,
                   env=subprocess_env(), capture_output=True, timeout=300)
    ref_manifest = json.loads((ref / "manifest.json").read_text())
    ref_hashes = {s["file"]: s["sha256"] for s in ref_manifest["shards"]}
    assert len(ref_hashes) == 7 and shard_hashes(ref) == ref_hashes
    assert ref_manifest["num_heldout"] == 2 and ref_manifest["num_samples"] == 12

    # Kill the writer while a shard is half-written. The poll sees a temp file, then the kill lands a moment
    # later; if the shard was renamed in between (its last capture had just ended), try again in a fresh folder.
    for attempt in range(3):
        out = root / f"killed-{attempt}"
        kill_mid_shard(driver, target, prepared, out, repo)
        if list(out.glob(".shard-*.tmp")):
            break
    else:
        pytest.fail("three kills in a row landed while no shard temp file existed")
    assert not (out / "manifest.json").exists()
    # no partial file carries a final name: every final-named shard is whole and already final
    finals = shard_hashes(out)
    assert finals and len(finals) < len(ref_hashes)
    for name, digest in finals.items():
        assert digest == ref_hashes[name], f"{name} under its final name differs from the finished shard"

    done = subprocess.run([sys.executable, str(driver), *cache_args(target, prepared, out)], cwd=repo,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "reused" in done.stdout
    assert shard_hashes(out) == ref_hashes
    assert (out / "manifest.json").read_bytes() == (ref / "manifest.json").read_bytes()
    assert not list(out.glob(".*.tmp"))
    # and the CLI verify agrees
    v = subprocess.run([sys.executable, str(driver), "cache", "--verify", "true", "--output-dir", str(out)],
                       cwd=repo, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert v.returncode == 0 and v.stdout.count(": OK") == 7, v.stdout + v.stderr
