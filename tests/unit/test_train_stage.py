"""`deepspec train` refuses what a new user gets wrong before the target loads: a --cache-dir that is
no target cache, and an --output-dir that already holds a run (without --resume)."""

import json

import pytest

from deepspec.cli import main
from deepspec.train import checkpoint, data as train_data, loop
from deepspec.checkpoints import clear_previous_run, previous_run
from deepspec.train.config import TrainConfig


def _train_error(capsys, *argv) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line, no traceback
    return err


def test_cache_dir_that_is_no_target_cache_is_a_one_line_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _train_error(capsys, "--cache-dir", str(empty), "--output-dir", str(tmp_path / "run"))
    assert "train.cache_dir" in err and "not a target cache" in err and "`deepspec cache`" in err
    # a prepared JSONL given as the cache: point to online mode
    prepared = tmp_path / "prepared.jsonl"
    prepared.write_text(json.dumps({"messages": []}) + "\n")
    err = _train_error(capsys, "--cache-dir", str(prepared), "--output-dir", str(tmp_path / "run"))
    assert "is a file, not a target cache" in err and f"--online-data {prepared}" in err
    # an unfinished build (shards or progress, no manifest) says so
    (empty / "progress-rank0.json").write_text("{}")
    err = _train_error(capsys, "--cache-dir", str(empty), "--output-dir", str(tmp_path / "run"))
    assert "cache incomplete" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("left", ["latest", "checkpoint-000004", "train_log.jsonl"])
def test_output_dir_holding_a_run_is_refused_without_resume(tmp_path, capsys, left):
    out = tmp_path / "run"
    out.mkdir()
    (out / left).mkdir() if left.startswith("checkpoint-") else (out / left).write_text("x\n")
    assert previous_run(out) == [left]
    err = _train_error(capsys, "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(out))
    assert "train.output_dir" in err and left in err and "--resume auto" in err and "--resume never" in err
    assert previous_run(out) == [left]  # nothing touched
    # "never" and "auto" are accepted (auto with a latest naming nothing is its own error)
    assert checkpoint.resolve_resume(TrainConfig(cache_dir="c", output_dir=str(out), resume="never")) is None
    if left != "latest":
        assert checkpoint.resolve_resume(TrainConfig(cache_dir="c", output_dir=str(out), resume="auto")) is None


def test_resume_never_clears_the_earlier_run_only(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-000002" / "draft").mkdir(parents=True)
    (out / "tensorboard").mkdir()
    for name in ("latest", "train_log.jsonl", "train_config.json", "train_loss.png", "heldout_reference.pt",
                 "notes.txt"):
        (out / name).write_text("x")
    assert previous_run(out) == ["checkpoint-000002", "latest", "train_log.jsonl"]
    removed = clear_previous_run(out)
    assert sorted(p.name for p in removed) == ["checkpoint-000002", "latest", "tensorboard", "train_config.json",
                                               "train_log.jsonl", "train_loss.png"]
    assert sorted(p.name for p in out.iterdir()) == ["heldout_reference.pt", "notes.txt"]
    assert previous_run(out) == [] and clear_previous_run(tmp_path / "missing") == []


def test_train_without_target_uses_the_target_the_cache_records(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from deepspec.data.cache import check_compatible
    from deepspec.target.load import recorded_target_name

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    said = []

    def resolve(target, recorded):  # target None: --target left out of the config
        given = {} if target is None else {"target": target}
        cfg = TrainConfig(cache_dir=str(tmp_path / "cache"), output_dir=str(tmp_path / "run"), **given)
        return train_data.resolve_train_target(cfg, SimpleNamespace(manifest={"target": recorded}), log=said.append)

    monkeypatch.chdir(tmp_path)  # `deepspec cache` records a folder as an absolute path, "default" as is
    assert recorded_target_name("model") == str(model_dir) and recorded_target_name("default") == "default"
    assert resolve(None, str(model_dir)) == str(model_dir)
    assert len(said) == 1 and "--target not given" in said[0] and str(model_dir) in said[0]
    assert resolve(None, "default") == "default"
    assert resolve(None, None) == "default"  # a cache written before caches recorded their target
    # an explicit --target is kept (the fingerprint check then refuses a cache built for another target)
    assert resolve("default", str(model_dir)) == "default" and resolve(str(model_dir), "default") == str(model_dir)
    assert len(said) == 2
    with pytest.raises(FileNotFoundError, match=r"train.target: .*--target .*gone.*no longer exists; pass --target"):
        resolve(None, str(tmp_path / "gone"))
    with pytest.raises(ValueError, match=rf"target_fingerprint mismatch.*train against the target it was built "
                                         rf"with \(--target {model_dir}\)"):
        check_compatible({"target": str(model_dir), "target_fingerprint": "a"}, target_fingerprint="b",
                         tokenizer_fingerprint="t", target_layer_ids=[])
    # the online mode has no cache: the embedded default
    online = TrainConfig(online_data="p.jsonl", output_dir=str(tmp_path / "run"))
    assert train_data.resolve_train_target(online, None) == "default"


def test_optimizer_is_fused_adamw_with_the_same_update_as_the_loop():
    """The training loop's AdamW runs fused on the CPU (sharded parameters opt out) and takes the
    same step as the default per-tensor implementation, up to float rounding."""
    import torch

    cfg = TrainConfig(online_data="x.jsonl", output_dir="unused", lr=1e-2, weight_decay=0.1)
    steps = {}
    for fused in (True, False):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3))]
        optimizer = loop.build_optimizer(params, cfg, fused=fused)
        assert optimizer.defaults["fused"] is (True if fused else None)
        assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["weight_decay"] == 0.1
        for _ in range(3):
            for p in params:
                p.grad = torch.ones_like(p) * p.detach().sum().sign()
            optimizer.step()
        steps[fused] = [p.detach().clone() for p in params]
    for a, b in zip(steps[True], steps[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("algorithm", ["dspark", "eagle3"])
def test_zlab_layout_is_for_dflash_only(algorithm):
    with pytest.raises(ValueError, match="train.sample_from_anchor: false is z-lab's DFlash layout, for --algorithm "
                                         "dflash only"):
        TrainConfig(cache_dir="c", output_dir="o", algorithm=algorithm, sample_from_anchor=False)
    assert TrainConfig(cache_dir="c", output_dir="o", algorithm="dflash", sample_from_anchor=False).block_size == 7
