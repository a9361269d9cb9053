"""The trainer under torchrun with 2 CPU ranks (gloo, FSDP2): one checkpoint set written by rank 0,
weights equal to a 1-process run over the same global batch, and a checkpoint gathered from the
sharded run resumes exactly, in one process and in 2 ranks; no FSDP2 "returned a view tensor" warning."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepspec.data.cache import write_target_cache_from_samples

_CONNECTION_ERRORS = ("Address already in use", "EADDRINUSE", "Connection refused", "Connection reset",
                      "Connection closed by peer", "RendezvousConnectionError",
                      # on a loaded machine a rank can abort in torch's thread teardown after its last step
                      # and checkpoint; a rerun of the same run passes
                      "terminate called without an active exception")
from deepspec.target.load import load_target, target_fingerprint, tokenizer_fingerprint
from deepspec.train.config import TrainConfig
from deepspec.train.loop import train
from tests.integration.test_cache_crash import make_tiny_target, subprocess_env
from tests.integration.test_cache_torchrun import _torchrun

pytestmark = pytest.mark.usefixtures("one_thread")

# float32: two ranks and one process must agree within float32 rounding (bf16 autocast, the default on a
# CPU with bf16 units, would round the two reductions' orders differently)
COMMON = {"batch_size": 2, "num_anchors": 4, "markov_rank": 8, "max_steps": 4, "lr": 1e-2, "warmup_frac": 0.2,
          "save_every": 2, "dtype": "fp32"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_fsdp")
    target = make_tiny_target(root / "target")
    model, tok = load_target(str(target))
    gen = torch.Generator().manual_seed(1)
    # 8 samples of different lengths (padding differs between micro-batches)
    samples = [(f"s{i}", torch.randint(4, len(tok), (24 + 4 * i,), generator=gen).tolist(),
                [0] * 8 + [1] * (16 + 4 * i)) for i in range(8)]
    cache = root / "cache"
    write_target_cache_from_samples(samples, cache, model, target_layer_ids=[0, 2],
                                    target_fingerprint=target_fingerprint(model),
                                    tokenizer_fingerprint=tokenizer_fingerprint(tok), storage_dtype="float32",
                                    progress=False)
    return root, target, cache, model, tok


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "draft" / "model.safetensors"))


def _assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():  # fp32 tolerance (in practice bitwise here: same micro-batches)
        torch.testing.assert_close(value, b[name], rtol=1e-5, atol=1e-6, msg=name)


def _two_ranks(cache: Path, target: Path, out: Path, *flags: str) -> None:
    """``deepspec train`` under torchrun with 2 CPU ranks into ``out``; asserts it succeeds without FSDP2's
    view warning."""
    repo = Path(__file__).resolve().parents[2]
    cmd = [*_torchrun(), "--standalone", "--nproc-per-node", "2", "-m", "deepspec.cli", "train",
           "--cache-dir", str(cache), "--target", str(target), "--output-dir", str(out), *flags]
    for attempt in range(2):
        shutil.rmtree(out, ignore_errors=True)  # each attempt starts from an empty output folder
        run = subprocess.run(cmd, cwd=repo, env=subprocess_env(), capture_output=True, text=True, timeout=600,
                             check=False)
        # a loaded machine can lose torchrun's local rendezvous/gloo connection race (or abort in teardown);
        # retry that once
        if run.returncode == 0 or not any(m in run.stderr for m in _CONNECTION_ERRORS):
            break
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # the trainer clones the small view tensors forward_train returns (FSDP2 warned on every run)
    assert "returned a view tensor" not in run.stderr, run.stderr[-3000:]


def test_two_cpu_ranks_train_like_one_process_and_resume(setup, tmp_path):
    _, target, cache, model, tok = setup
    multi = tmp_path / "multi"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in COMMON.items()]

    def two_ranks(out: Path, *extra: str) -> None:
        _two_ranks(cache, target, out, *flags, *extra)

    two_ranks(multi)

    # one checkpoint set, written by rank 0 alone; logs and TensorBoard events from rank 0 only
    assert sorted(p.name for p in multi.iterdir()) == [
        "checkpoint-000002", "checkpoint-000004", "latest", "tensorboard", "train_config.json", "train_log.jsonl",
        "train_loss.png"]
    assert (multi / "latest").read_text().strip() == "checkpoint-000004"
    assert len(list((multi / "tensorboard").iterdir())) == 1
    rows_multi = [json.loads(line) for line in (multi / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_multi] == [1, 2, 3, 4]
    state = torch.load(multi / "checkpoint-000002" / "trainer_state.pt", weights_only=False)
    assert state["world_size"] == 2 and state["step"] == 2

    # one process over the same global batch (2 ranks x 2 samples = 2 micro-batches x 2 samples)
    single = train(TrainConfig(cache_dir=str(cache), output_dir=str(tmp_path / "single"), grad_accum_steps=2,
                               **COMMON), target_model=model, tokenizer=tok)
    _assert_close(_weights(multi / "checkpoint-000002"), _weights(single.parent / "checkpoint-000002"))
    _assert_close(_weights(multi / "checkpoint-000004"), _weights(single))
    rows_single = [json.loads(line) for line in (tmp_path / "single" / "train_log.jsonl").read_text().splitlines()]
    for key in ("loss", "lr", "grad_norm", "num_valid_slots", "num_tokens"):
        assert [r[key] for r in rows_multi] == pytest.approx([r[key] for r in rows_single], rel=1e-5), key

    # the gathered (full) weights and optimizer state of the 2-rank run resume exactly
    resumed = train(TrainConfig(cache_dir=str(cache), output_dir=str(tmp_path / "resumed"), grad_accum_steps=2,
                                resume=str(multi / "checkpoint-000002"), **COMMON), target_model=model, tokenizer=tok)
    _assert_close(_weights(multi / "checkpoint-000004"), _weights(resumed))
    # ... and so does the sharded run itself (full state dicts loaded into the FSDP model)
    two_ranks(tmp_path / "multi_resumed", "--resume", str(multi / "checkpoint-000002"))
    _assert_close(_weights(multi / "checkpoint-000004"), _weights(tmp_path / "multi_resumed" / "checkpoint-000004"))


def test_chunked_head_loss_under_two_cpu_ranks_trains_like_materialised_logits(setup, tmp_path):
    """The deferred draft logits (computed in the loss, outside forward_train, and recomputed in backward)
    under FSDP2 with 2 ranks give the weights of one process with the [B, A, K, W] logits."""
    _, target, cache, model, tok = setup
    common = {**COMMON, "max_steps": 2, "save_every": 0}
    _two_ranks(cache, target, tmp_path / "multi", *[f"--{k.replace('_', '-')}={v}" for k, v in common.items()],
               "--chunked-head-loss=on")
    single = train(TrainConfig(cache_dir=str(cache), output_dir=str(tmp_path / "single"), grad_accum_steps=2,
                               chunked_head_loss="off", **common), target_model=model, tokenizer=tok)
    _assert_close(_weights(tmp_path / "multi" / "checkpoint-000002"), _weights(single))
