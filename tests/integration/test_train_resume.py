"""The trainer on a tiny random target: exact resume (10 steps = 5 + resume + 5), checkpoint retention,
TensorBoard scalars, refusal of a foreign cache, the input path (fp8 dequantised on the device, the
loader thread)."""

import json
import threading

import pytest
import torch
from transformers import LlamaForCausalLM

from deepspec.algorithms.dspark import DSparkAlgorithm
from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.data.cache import TargetCache, dequantize_fp8, write_target_cache_from_samples
from deepspec.target.load import target_fingerprint, tokenizer_fingerprint
from deepspec.train import checkpoint, data as train_data, draft as train_draft, loop
from deepspec.train.data import collate as collate_fn
from deepspec.checkpoints import apply_retention
from deepspec.train.config import TrainConfig
from deepspec.train.loop import train
from tests.helpers import tiny_llama_target
from tests.unit.test_chat import tiny_chatml_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_IDS = [0, 1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = tiny_chatml_tokenizer()
    model = tiny_llama_target(tok)
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


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def _tb_scalars(out) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class _Interrupted(Exception):
    pass


def _recording_collate(record):
    """``collate`` noting the samples of each micro-batch loaded (the prefetcher loads ahead of training)."""
    real = collate_fn

    def collate(samples, indices, **kw):
        record.append(list(indices))
        return real(samples, indices, **kw)

    return collate


_PREPARE = DSparkAlgorithm.prepare  # the real one, whatever a test has patched in since


def _recording_prepare(record):
    """DSpark's ``prepare`` noting the samples of each micro-batch trained on."""
    real = _PREPARE

    def prepare(self, model, batch, generator, cfg):
        record.append(list(batch.sample_indices))
        return real(self, model, batch, generator, cfg)

    return prepare


def test_ten_steps_equal_five_then_resume_then_five(setup, tmp_path, monkeypatch):
    """Same weights (bitwise, fp32 CPU), same learning rates, same data order, same log and TensorBoard steps."""
    model, tok, cache = setup
    # 6 samples, global batch 2 x 2 = 4: steps straddle epochs, so the order is not trivially periodic
    kw = dict(max_steps=10, grad_accum_steps=2, save_every=5)
    order_full: list[list[int]] = []
    monkeypatch.setattr(DSparkAlgorithm, "prepare", _recording_prepare(order_full))
    full = train(_cfg(cache, tmp_path / "full", **kw), target_model=model, tokenizer=tok)
    assert full.name == "checkpoint-000010"

    # the same run, killed right after its step-5 checkpoint, then resumed with resume="auto"
    order_cut: list[list[int]] = []
    monkeypatch.setattr(DSparkAlgorithm, "prepare", _recording_prepare(order_cut))
    real_save = loop.save_checkpoint

    def save_then_crash(*args, step, **kwargs):
        path = real_save(*args, step=step, **kwargs)
        if step == 5:
            raise _Interrupted
        return path

    monkeypatch.setattr(loop, "save_checkpoint", save_then_crash)
    with pytest.raises(_Interrupted):
        train(_cfg(cache, tmp_path / "cut", **kw), target_model=model, tokenizer=tok)
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    assert (tmp_path / "cut" / "latest").read_text().strip() == "checkpoint-000005"
    assert len(order_cut) == 5 * 2  # trained on: steps 1-5 (the prefetcher may have loaded step 6 too)
    loaded: list[list[int]] = []
    monkeypatch.setattr(train_data, "collate", _recording_collate(loaded))
    resumed = train(_cfg(cache, tmp_path / "cut", resume="auto", **kw), target_model=model, tokenizer=tok)
    assert resumed.name == "checkpoint-000010"
    assert loaded == order_full[10:]  # the resumed run loads steps 6-10 only, in order

    a, b = _weights(full), _weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert order_cut == order_full  # same data trained on, in the same order: 10 steps x 2 micro-batches
    # epochs of 6 samples concatenated: steps 1-3 (12 slots) see every sample exactly twice
    assert sorted(i for micro in order_full[:6] for i in micro) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    rows_full, rows_cut = _log(tmp_path / "full"), _log(tmp_path / "cut")
    assert [r["step"] for r in rows_cut] == list(range(1, 11))
    for key in ("lr", "loss", "grad_norm", "tau_estimate"):
        assert [r[key] for r in rows_cut] == [r[key] for r in rows_full], key
    # TensorBoard: one scalar per logged quantity and step, no duplicate steps after the resume
    scalars = _tb_scalars(tmp_path / "cut")
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tau_estimate", "train/tok_per_s", "train/ce"):
        assert [s for s, _ in scalars[tag]] == list(range(1, 11)), tag
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([r["lr"] for r in rows_full])


def test_resume_from_a_path_in_another_folder(setup, tmp_path):
    model, tok, cache = setup
    full = train(_cfg(cache, tmp_path / "full", save_every=3), target_model=model, tokenizer=tok)
    middle = tmp_path / "full" / "checkpoint-000003"
    assert full.name == "checkpoint-000006" and (middle / "trainer_state.pt").exists()
    # continue from the middle checkpoint in another folder: steps 4..6 must replay exactly
    resumed = train(_cfg(cache, tmp_path / "resumed", resume=str(middle)), target_model=model, tokenizer=tok)
    a, b = _weights(full), _weights(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (tmp_path / "resumed" / "latest").read_text().strip() == "checkpoint-000006"
    # resume happens only when asked: a rerun into the run's folder needs `resume` ("never": from step 0)
    assert checkpoint.resolve_resume(_cfg(cache, tmp_path / "full", resume="never")) is None
    with pytest.raises(ValueError, match="already holds a training run"):
        checkpoint.resolve_resume(_cfg(cache, tmp_path / "full"))
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        train(_cfg(cache, tmp_path / "x", resume=str(tmp_path)), target_model=model, tokenizer=tok)


def test_retention_keeps_the_last_n_checkpoints(setup, tmp_path):
    model, tok, cache = setup
    out = tmp_path / "run"
    train(_cfg(cache, out, save_every=1, keep_last=2), target_model=model, tokenizer=tok)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000005", "checkpoint-000006"]
    assert (out / "latest").read_text().strip() == "checkpoint-000006"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp or half-deleted folder
    # never the one `latest` names, even when it is not among the newest
    for step in (1, 2, 3, 4):
        (tmp_path / "fake" / f"checkpoint-{step:06d}").mkdir(parents=True)
    (tmp_path / "fake" / "latest").write_text("checkpoint-000001\n")
    deleted = apply_retention(tmp_path / "fake", 2)
    assert [p.name for p in deleted] == ["checkpoint-000002"]
    assert sorted(p.name for p in (tmp_path / "fake").iterdir()) == [
        "checkpoint-000001", "checkpoint-000003", "checkpoint-000004", "latest"]
    assert apply_retention(tmp_path / "fake", 0) == []  # 0 keeps everything


def test_training_reduces_loss_and_refuses_another_target(setup, tmp_path):
    model, tok, cache = setup
    train(_cfg(cache, tmp_path / "run", max_steps=12), target_model=model, tokenizer=tok)
    rows = _log(tmp_path / "run")
    assert len(rows) == 12 and rows[-1]["loss"] < rows[0]["loss"]
    assert (tmp_path / "run" / "train_loss.png").stat().st_size > 0
    assert all(r["tok_per_s"] > 0 for r in rows)
    other = LlamaForCausalLM(model.config).eval().requires_grad_(False)
    with pytest.raises(ValueError, match="target"):
        train(_cfg(cache, tmp_path / "other"), target_model=other, tokenizer=tok)


# ------------------------------------------------------------------ resume checks (new-user trial findings)


@pytest.fixture(scope="module")
def six_steps(setup, tmp_path_factory):
    """A finished 6-step run with a step-3 checkpoint; tests copy it before writing into it."""
    model, tok, cache = setup
    out = tmp_path_factory.mktemp("six") / "run"
    train(_cfg(cache, out, save_every=3), target_model=model, tokenizer=tok)
    return out


def _copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_logged_lr_is_the_rate_each_step_used(setup, six_steps):
    """Step 1 runs at lr 0 (transformers' linear warmup starts at 0), then the schedule's value for
    steps 1, 2, ... (not the value after ``scheduler.step()``, which is the next step's)."""
    from transformers import get_cosine_schedule_with_warmup

    cfg = _cfg(setup[2], six_steps)
    sched = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=cfg.lr), num_warmup_steps=2,
                                            num_training_steps=cfg.max_steps)
    expected = [cfg.lr * sched.lr_lambdas[0](i) for i in range(cfg.max_steps)]
    assert expected[0] == 0.0 and expected[2] == cfg.lr  # 2 warmup steps (0.2 x 6, rounded up)
    assert [r["lr"] for r in _log(six_steps)] == pytest.approx(expected, abs=1e-12)


def test_a_second_run_into_a_folder_needs_resume_and_never_replaces_it(setup, six_steps, tmp_path):
    model, tok, cache = setup
    out = _copy_run(six_steps, tmp_path / "run")
    with pytest.raises(ValueError, match=r"train.output_dir: .* already holds a training run .*--resume never"):
        train(_cfg(cache, out, max_steps=2), target_model=model, tokenizer=tok)
    assert (out / "checkpoint-000006").is_dir()  # the refusal touched nothing
    final = train(_cfg(cache, out, max_steps=2, resume="never"), target_model=model, tokenizer=tok)
    assert final.name == "checkpoint-000002" and (out / "latest").read_text().strip() == "checkpoint-000002"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000002"]
    assert [r["step"] for r in _log(out)] == [1, 2]


def test_resume_at_max_steps_does_nothing(setup, six_steps, tmp_path, capsys):
    model, tok, cache = setup
    out = _copy_run(six_steps, tmp_path / "run")
    log_before = (out / "train_log.jsonl").read_text()
    result = train(_cfg(cache, out, resume="auto", save_every=3), target_model=model, tokenizer=tok)
    assert result == out / "checkpoint-000006"
    assert "already complete" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000003", "checkpoint-000006"]
    assert (out / "latest").read_text().strip() == "checkpoint-000006"
    assert (out / "train_log.jsonl").read_text() == log_before


def test_resume_past_max_steps_is_refused(setup, six_steps, tmp_path):
    """Resuming with --max-steps below the checkpoint's step is an error; no checkpoint is written and
    `latest` stays where it was."""
    model, tok, cache = setup
    out = _copy_run(six_steps, tmp_path / "run")
    with pytest.raises(ValueError, match=r"--max-steps 2 .* 6 \("):
        train(_cfg(cache, out, resume="auto", max_steps=2), target_model=model, tokenizer=tok)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000003", "checkpoint-000006"]
    assert (out / "latest").read_text().strip() == "checkpoint-000006"


@pytest.mark.parametrize("change, fields", [
    ({"markov_rank": 4}, ["markov_rank: (8, 4)"]),
    ({"markov_head": "gated", "num_draft_layers": 2}, ["markov_head_type: ('vanilla', 'gated')",
                                                       "num_draft_layers: (1, 2)"]),
    ({"block_size": 5}, ["block_size: (7, 5)"]),
    ({"algorithm": "dflash"}, ["deepspec_algorithm: ('dspark', 'dflash')", "use_markov_head: (True, False)"]),
])
def test_resume_with_another_model_shape_is_refused(setup, six_steps, tmp_path, change, fields):
    """Resuming into another draft shape is a ValueError listing the differing fields, before any state-dict
    load."""
    model, tok, cache = setup
    middle = six_steps / "checkpoint-000003"
    with pytest.raises(ValueError, match="same settings or start a new --output-dir") as info:
        train(_cfg(cache, tmp_path / "x", resume=str(middle), **change), target_model=model, tokenizer=tok)
    message = str(info.value)
    assert f"checkpoint {middle} was trained with" in message
    for field in fields:
        assert field in message


def test_resume_with_a_changed_schedule_or_global_batch_warns(setup, six_steps, tmp_path, capsys):
    model, tok, cache = setup
    middle = six_steps / "checkpoint-000003"
    # same settings: exact resume, no warning
    train(_cfg(cache, tmp_path / "same", resume=str(middle)), target_model=model, tokenizer=tok)
    assert "warning" not in capsys.readouterr().err
    # same global batch split differently (1 x 2 instead of 2 x 1): still exact, no warning
    state = torch.load(middle / "trainer_state.pt", weights_only=False)
    assert state["device"] == "cpu" and state["train_config"]["device"] == "auto"
    assert checkpoint.warn_resume_changes(state, _cfg(cache, tmp_path, batch_size=1, grad_accum_steps=2), 1) == []
    assert checkpoint.warn_resume_changes(state, _cfg(cache, tmp_path, batch_size=1), 2) == []
    train(_cfg(cache, tmp_path / "other", resume=str(middle), max_steps=7, batch_size=1, grad_accum_steps=3),
          target_model=model, tokenizer=tok)
    err = capsys.readouterr().err
    assert ("warning: the checkpoint was trained with max_steps=6; the learning-rate schedule now spans 7 steps"
            in err)
    assert ("warning: global batch was 2 x 1 x 1 = 2, now 1 x 3 x 1 = 3; keep batch_size x grad_accum_steps x "
            "ranks equal to continue exactly") in err
    # the peak lr and weight decay come back with the optimizer state: new values are ignored, say so
    assert checkpoint.warn_resume_changes(state, _cfg(cache, tmp_path, lr=2e-2), 1) == [
        ("the checkpoint was trained with lr=0.01; resume keeps it (restored with the optimizer state), lr=0.02 is "
         "ignored")]
    # another world size with the same per-rank batch changes the global batch
    assert checkpoint.warn_resume_changes(state, _cfg(cache, tmp_path), 2) == [
        ("global batch was 2 x 1 x 1 = 2, now 2 x 1 x 2 = 4; keep batch_size x grad_accum_steps x ranks equal to "
         "continue exactly")]


def test_resume_auto_without_a_checkpoint_and_a_dangling_latest(setup, tmp_path, capsys):
    cache = setup[2]
    assert checkpoint.resolve_resume(_cfg(cache, tmp_path / "new", resume="auto"), log=True) is None
    assert capsys.readouterr().out == f"resume: no checkpoint in {tmp_path / 'new'}; starting from step 0\n"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").write_text("checkpoint-000004\n")
    with pytest.raises(ValueError, match=r"latest.* names checkpoint-000004.*--resume"):
        checkpoint.resolve_resume(_cfg(cache, tmp_path / "run", resume="auto"))


def test_markov_flags_warn_for_drafts_without_a_markov_head(setup, tmp_path, capsys):
    model, tok, cache = setup
    markov = ["--markov-head gated is ignored: a {} draft has no Markov head (only dspark has one)",
              "--markov-rank 8 is ignored: a {} draft has no Markov head (only dspark has one)"]
    # eagle3 has no anchors either (its chains are --num-chains): _cfg's --num-anchors 4 is DSpark's and DFlash's
    anchors = ["--num-anchors 4 is ignored: a eagle3 draft samples no anchors (only dspark and dflash do)"]
    for algorithm, before in (("dflash", []), ("eagle3", anchors)):
        cfg = _cfg(cache, tmp_path, algorithm=algorithm, markov_head="gated")  # markov_rank=8 is not the default
        train_draft.build_draft(model, tok, cfg, LAYER_IDS)
        assert train_draft.warn_ignored_flags(cfg) == before + [m.format(algorithm) for m in markov]
        assert "warning: --markov-head gated is ignored" in capsys.readouterr().err
        defaults = TrainConfig(cache_dir=str(cache), output_dir=str(tmp_path), algorithm=algorithm)
        assert train_draft.warn_ignored_flags(defaults) == []
    cfg = _cfg(cache, tmp_path, markov_head="gated")
    assert train_draft.warn_ignored_flags(cfg) == []
    for algorithm, expected in (("eagle3", ["--chunked-head-loss on is ignored: a eagle3 draft computes no DSpark / "
                                            "DFlash block logits to chunk"]), ("dspark", [])):
        cfg = TrainConfig(cache_dir=str(cache), output_dir=str(tmp_path), algorithm=algorithm, chunked_head_loss="on")
        assert train_draft.warn_ignored_flags(cfg) == expected
    # and the other way round: Eagle3's options are ignored by a DSpark draft
    cfg = TrainConfig(cache_dir=str(cache), output_dir=str(tmp_path), ttt_steps=3, num_chains=8)
    assert train_draft.warn_ignored_flags(cfg) == [
        "--ttt-steps 3 is ignored: a dspark draft has no training-time-test steps (only eagle3 unrolls them)",
        "--num-chains 8 is ignored: a dspark draft has no training-time-test chains (only eagle3 samples them)"]


def test_train_help_lists_the_registered_algorithms():
    from deepspec.algorithms.registry import ALGORITHMS
    from deepspec.cli import build_parser

    stage = build_parser().stage_parsers["train"]
    helps = {a.dest: a.help for a in stage._actions}
    assert all(name in helps["algorithm"] for name in ALGORITHMS), helps["algorithm"]
    # Eagle3's steps are its own flag; --block-size says so
    assert "unrolled" in helps["ttt_steps"] and "--ttt-steps" in " ".join(helps["block_size"].split())


@pytest.mark.parametrize("algorithm", ["dflash", "eagle3"])
def test_same_settings_resume_passes_the_shape_check(setup, tmp_path, algorithm):
    """No false alarm: every algorithm's saved config.json matches the draft the same flags build."""
    model, tok, cache = setup
    steps = "ttt_steps" if algorithm == "eagle3" else "block_size"  # tokens drafted per step
    kw = {"algorithm": algorithm, "markov_rank": 256, "max_steps": 2, "save_every": 1, steps: 3}
    if algorithm == "eagle3":
        kw.update(num_anchors=32, num_chains=4)  # _cfg's anchors are DSpark's; eagle3 samples chains
    train(_cfg(cache, tmp_path / "a", **kw), target_model=model, tokenizer=tok)
    resumed = train(_cfg(cache, tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-000001"), **kw),
                    target_model=model, tokenizer=tok)
    assert resumed.name == "checkpoint-000002"
    with pytest.raises(ValueError, match=f"{steps}: \\(3, 4\\)"):
        train(_cfg(cache, tmp_path / "c", resume=str(tmp_path / "a" / "checkpoint-000001"), **{**kw, steps: 4}),
              target_model=model, tokenizer=tok)


def test_learning_curve_logs_heldout_tau_and_survives_resume(setup, tmp_path, capsys):
    """heldout_every: held-out greedy tau at step 0, every N steps and at the end (log, TensorBoard,
    plot); the reference is made once and reused by a resume; the resumed log is the same curve."""
    model, tok, _ = setup
    cache = setup[2]
    prompts = [("bench", "q0", [0, 5, 9, 17, 4, 8]), ("bench", "q1", [0, 6, 11, 12])]
    out = tmp_path / "curve"
    train(_cfg(cache, out, max_steps=6, heldout_every=4, heldout_max_new_tokens=6), target_model=model,
          tokenizer=tok, heldout_prompts=prompts)
    rows = _log(out)
    curve = [(r["step"], r["heldout_tau"]) for r in rows if "heldout_tau" in r]
    assert [s for s, _ in curve] == [0, 4, 6]
    assert all(1.0 <= t <= 8.0 for _, t in curve)
    assert all("heldout_tau_bench" in r for r in rows if "heldout_tau" in r)
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)
    assert (out / "heldout_reference.pt").is_file() and (out / "train_loss.png").stat().st_size > 0
    assert [s for s, _ in _tb_scalars(out)["heldout/heldout_tau"]] == [0, 4, 6]
    assert "held-out greedy tau" in capsys.readouterr().out
    # a resume (to 8 steps) reuses the stored reference and continues the curve
    stamp = (out / "heldout_reference.pt").stat().st_mtime_ns
    train(_cfg(cache, out, max_steps=8, heldout_every=4, heldout_max_new_tokens=6, resume="auto"),
          target_model=model, tokenizer=tok, heldout_prompts=prompts)
    assert (out / "heldout_reference.pt").stat().st_mtime_ns == stamp
    assert [r["step"] for r in _log(out) if "heldout_tau" in r] == [0, 4, 6, 8]


def test_out_of_memory_names_the_sizes_and_the_flags(setup, tmp_path, monkeypatch):
    from deepspec.algorithms.dspark import DSparkAlgorithm

    model, tok, cache = setup

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(DSparkAlgorithm, "loss", oom)
    with pytest.raises(torch.OutOfMemoryError) as info:
        train(_cfg(cache, tmp_path / "run", draft_vocab_size=0, dtype="fp32"), target_model=model, tokenizer=tok)
    message = str(info.value)
    assert message.startswith("train: out of memory on cpu (step 1, a micro-batch of 2 sequences of up to 40 tokens, "
                              "4 anchors x block 7 each, the full vocabulary, 1 draft layer(s), fp32)")
    for flag in ("--batch-size", "--grad-accum-steps", "--num-anchors", "--draft-vocab-size", "--dtype bf16",
                 "--chunked-head-loss on"):
        assert flag in message
    assert message.endswith("[OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB]")
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    def other_error(*args, **kwargs):
        raise RuntimeError("other")

    monkeypatch.setattr(DSparkAlgorithm, "loss", other_error)
    with pytest.raises(RuntimeError, match="^other$"):  # any other error passes through unchanged
        train(_cfg(cache, tmp_path / "run2"), target_model=model, tokenizer=tok)


def test_bf16_on_a_cpu_without_native_bf16_warns_and_the_decoding_spelling_is_accepted(setup, tmp_path,
                                                                                        monkeypatch, capsys):
    import deepspec.train.loop as loop

    model, tok, cache = setup
    assert _cfg(cache, tmp_path / "a", dtype="bfloat16").dtype == "bf16"
    assert _cfg(cache, tmp_path / "a", dtype="float32").dtype == "fp32"
    with pytest.raises(ValueError, match="train.dtype: expected 'fp32', 'bf16' or 'auto'.*got 'fp16'"):
        _cfg(cache, tmp_path / "a", dtype="fp16")
    monkeypatch.setattr(loop, "cpu_bf16_flags", lambda: ())  # a CPU like the Zen 3 host (AVX2 only)
    train(_cfg(cache, tmp_path / "emulated", dtype="bf16", max_steps=1), target_model=model, tokenizer=tok)
    assert "--dtype bf16 on a CPU without native bf16" in capsys.readouterr().err
    monkeypatch.setattr(loop, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    train(_cfg(cache, tmp_path / "native", dtype="bf16", max_steps=1), target_model=model, tokenizer=tok)
    assert "without native bf16" not in capsys.readouterr().err


# ------------------------------------------------------------------ the input path (stored dtype to the device)


@pytest.fixture(scope="module")
def fp8_cache(setup, tmp_path_factory):
    """The samples of ``setup``'s cache, stored as fp8."""
    model, tok, path = setup
    cache = TargetCache(path)
    samples = [(cache.sample_id(i), *(cache.read(i, ("input_ids", "loss_mask"))[k].tolist()
                                      for k in ("input_ids", "loss_mask"))) for i in range(len(cache))]
    out = tmp_path_factory.mktemp("fp8") / "cache"
    write_target_cache_from_samples(
        samples, out, model, target_layer_ids=LAYER_IDS, target_fingerprint=target_fingerprint(model),
        tokenizer_fingerprint=tokenizer_fingerprint(tok), storage_dtype="fp8", progress=False,
    )
    return out


def _host_converting_collate(samples, indices, **kw):
    """The former input path: fp8 dequantised and every feature upcast to float32 on the host."""
    host = []
    for s in samples:
        s = dict(s)
        if "target_hidden_scale" in s:
            s["target_hidden"] = dequantize_fp8(s["target_hidden"], s.pop("target_hidden_scale"))
        host.append({**s, "target_hidden": s["target_hidden"].float(),
                     "target_last_hidden": s["target_last_hidden"].float()})
    return collate_fn(host, indices, **kw)


def _loader_threads():
    return [t for t in threading.enumerate() if t.name == "deepspec-train-data"]


def test_an_fp8_cache_trains_as_with_host_dequantisation(setup, fp8_cache, tmp_path, monkeypatch):
    """Dequantising on the device changes no number: same losses, gradient norms and weights (bitwise)."""
    model, tok, _ = setup
    kw = dict(max_steps=3, grad_accum_steps=2)
    device = train(_cfg(fp8_cache, tmp_path / "device", **kw), target_model=model, tokenizer=tok)
    assert not _loader_threads()
    monkeypatch.setattr(train_data, "collate", _host_converting_collate)
    host = train(_cfg(fp8_cache, tmp_path / "host", **kw), target_model=model, tokenizer=tok)
    rows_device, rows_host = _log(tmp_path / "device"), _log(tmp_path / "host")
    assert len(rows_device) == 3
    for key in ("loss", "grad_norm", "tau_estimate", "num_tokens"):
        assert [r[key] for r in rows_device] == [r[key] for r in rows_host], key
    a, b = _weights(device), _weights(host)
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_failing_step_stops_the_loader_thread(setup, tmp_path, monkeypatch):
    model, tok, cache = setup
    real_loss, calls = DSparkAlgorithm.loss, []

    def loss_failing_at_step_2(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("step 2 failed")
        return real_loss(self, *args, **kwargs)

    monkeypatch.setattr(DSparkAlgorithm, "loss", loss_failing_at_step_2)
    with pytest.raises(RuntimeError, match="step 2 failed"):
        train(_cfg(cache, tmp_path / "run", max_steps=50), target_model=model, tokenizer=tok)
    assert not _loader_threads()
