"""Tests for deepspec.data.cache and deepspec.data.estimate (tiny random Llama target, CPU).

Shape legend: T tokens of a sample, H hidden, n target layers, F = n * H features.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.data.cache import reader as reader_mod
from deepspec.data.cache import samples as samples_mod
from deepspec.data.cache import writer as writer_mod
from deepspec.data.cache import (
    FORMAT_VERSION,
    TargetCache,
    cache_bytes_per_token,
    check_compatible,
    dequantize_fp8,
    quantize_fp8,
    sha256_file,
    verify_target_cache,
    write_target_cache_from_samples,
)
from deepspec.target.capture import capture_sample_features

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_IDS = [-1, 1]
H = 32
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=H, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def _samples(n: int = 11, seed: int = 0) -> list[tuple[str, list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        T = int(torch.randint(3, 15, (1,), generator=g))
        ids = torch.randint(3, 90, (T,), generator=g).tolist()  # never 90..96 (NaN test token)
        mask = [0] * (T // 2) + [1] * (T - T // 2)
        out.append((f"s{k}", ids, mask))
    return out


def _write(samples, out_dir, model, **kw):
    args = dict(target_layer_ids=LAYER_IDS, target_fingerprint="tgt-A", tokenizer_fingerprint="tok-A",
                shard_size=4, storage_dtype="bfloat16", progress=False, chat_template="chatml")
    args.update(kw)
    return write_target_cache_from_samples(samples, out_dir, model, **args)


def _shard_hashes(d: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(d.glob("shard-*.safetensors"))}


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float32", "float16"])
def test_round_trip_equals_the_one_capture_rule(model, tmp_path, storage_dtype):
    """Stored features are exactly capture_sample_features cast to the storage dtype (bitwise), for any
    shard size: each sample is captured alone, so batching/sharding cannot change a bit."""
    samples = _samples()
    summary = _write(samples, tmp_path / "a", model, storage_dtype=storage_dtype)
    _write(samples, tmp_path / "b", model, storage_dtype=storage_dtype, shard_size=3)
    assert summary.num_samples == 11 and summary.num_shards == 3  # 4 + 4 + 3
    cache, other = TargetCache(tmp_path / "a"), TargetCache(tmp_path / "b")
    assert len(cache) == len(other) == 11
    dtype = getattr(torch, storage_dtype)
    for i, (sid, ids, mask) in enumerate(samples):
        item = cache[i]
        assert cache.sample_id(i) == sid and cache.sample_length(i) == len(ids)
        assert item["input_ids"].dtype == torch.int32 and item["input_ids"].tolist() == ids
        assert item["loss_mask"].dtype == torch.uint8 and item["loss_mask"].tolist() == mask
        want_F, want_H = capture_sample_features(model, ids, LAYER_IDS)
        assert item["target_hidden"].shape == (len(ids), 2 * H) and item["target_hidden"].dtype == dtype
        assert torch.equal(item["target_hidden"], want_F.to(dtype))
        assert torch.equal(item["target_last_hidden"], want_H.to(dtype))
        assert torch.equal(other[i]["target_hidden"], item["target_hidden"])
    assert cache[-1]["input_ids"].tolist() == samples[-1][1]
    with pytest.raises(IndexError):
        cache[11]


def test_manifest_counts_and_shard_format(model, tmp_path):
    samples = _samples()
    samples.insert(5, ("empty-mask", [5, 6, 7], [0, 0, 0]))
    samples.insert(7, ("long", list(range(3, 33)), [1] * 30))  # truncated to 20
    summary = _write(samples, tmp_path, model, max_seq_len=20)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["format"] == FORMAT_VERSION == "deepspec-target-cache/3"
    assert m["target_fingerprint"] == "tgt-A" and m["tokenizer_fingerprint"] == "tok-A"
    assert m["target_layer_ids"] == LAYER_IDS and m["hidden_size"] == H and m["num_hidden_layers"] == 3
    assert m["storage_dtype"] == "bfloat16"
    assert m["dtypes"] == {"input_ids": "int32", "loss_mask": "uint8", "target_hidden": "bfloat16",
                           "target_last_hidden": "bfloat16", "target_logsumexp": "float32", "target_argmax": "int32"}
    assert m["chat_template"] == "chatml" and m["max_seq_len"] == 20
    assert m["capture"] == {"device": "cpu", "dtype": "float32"}  # where the target ran
    kept = [s for s in samples if s[0] != "empty-mask"]
    assert m["num_inputs"] == 13 and m["num_samples"] == summary.num_samples == 12
    assert m["num_refused_empty_mask"] == summary.num_refused_empty_mask == 1
    assert m["refused"] == [{"id": "empty-mask", "reason": "empty_mask",
                             "detail": "no loss token (after truncation to max_seq_len)"}]
    assert m["num_refused_nonfinite"] == 0 and m["num_heldout"] == 0
    assert m["num_truncated"] == summary.num_truncated == 1
    assert m["num_tokens"] == summary.num_tokens == sum(min(len(s[1]), 20) for s in kept)
    assert m["num_loss_tokens"] == sum(sum(s[2][:20]) for s in kept)
    # shards by INPUT index: shard 1 = inputs 4..7 minus the refused one
    assert [(s["first_input"], s["num_inputs"], s["num_samples"]) for s in m["shards"]] == [
        (0, 4, 4), (4, 4, 3), (8, 4, 4), (12, 1, 1)]
    for s in m["shards"]:
        assert sha256_file(tmp_path / s["file"]) == s["sha256"]
    assert summary.total_bytes == sum(p.stat().st_size for p in tmp_path.glob("shard-*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "manifest.json", "progress-rank0.json", *[f"shard-0000{k}.safetensors" for k in range(4)]]
    # a standard safetensors file
    with safe_open(str(tmp_path / "shard-00001.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {"offsets", "input_ids", "loss_mask", "target_hidden", "target_last_hidden",
                                 "target_logsumexp", "target_argmax"}
        offsets = f.get_tensor("offsets")
        assert offsets.dtype == torch.int64 and offsets[0] == 0 and len(offsets) == 4
        assert f.get_slice("target_hidden").get_shape() == [int(offsets[-1]), 2 * H]
        meta = json.loads(f.metadata()["deepspec"])
        assert meta["sample_ids"] == ["s4", "s5", "long"] and meta["refused"][0]["id"] == "empty-mask"
    assert TargetCache(tmp_path)[6]["input_ids"].tolist() == list(range(3, 23))  # "long" is kept sample 6


def test_cache_bytes_per_token():
    assert cache_bytes_per_token(H, 2, "bfloat16") == 13 + 2 * H * 3
    assert cache_bytes_per_token(H, 2, "float32") == 13 + 4 * H * 3
    assert cache_bytes_per_token(H, 2, "fp8") == 13 + 2 * H + 4 * 2 + 2 * H
    assert cache_bytes_per_token(2560, 5, "bfloat16") == 30733
    assert cache_bytes_per_token(2560, 5, "bfloat16", layout="original") == 30726  # docs/design/cache.md
    with pytest.raises(ValueError, match="layout"):
        cache_bytes_per_token(2560, 5, "bfloat16", layout="other")


def test_bytes_per_token_matches_the_files(model, tmp_path):
    """The formula is the real per-token cost: shard bytes = headers + 8*(N+1) + tokens * formula."""
    for mode in ("float32", "bfloat16", "fp8"):
        s = _write(_samples(), tmp_path / mode, model, storage_dtype=mode)
        overhead = 0
        for p in sorted((tmp_path / mode).glob("shard-*")):
            with open(p, "rb") as f:
                overhead += 8 + int.from_bytes(f.read(8), "little")
            with safe_open(str(p), framework="pt") as f:
                overhead += 8 * f.get_slice("offsets").get_shape()[0]
        assert s.total_bytes - overhead == s.num_tokens * cache_bytes_per_token(H, 2, mode)


def test_estimate_reproduces_qwen3_4b(capsys):
    """`deepspec estimate` on the real Qwen3-4B config.json: 30,726 bytes/token in the original layout
    (5 layers, bf16), and ~38 TB for 1.2 M conversations of 1,030 tokens (assumed mean length)."""
    from deepspec.cli import main
    from deepspec.data.estimate import EstimateConfig, run_estimate

    cfg = json.loads((FIXTURES / "qwen3-4b-config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["model_type"]) == (2560, 36, "qwen3")
    rep = run_estimate(EstimateConfig(target=str(FIXTURES / "qwen3-4b-config.json"), num_conversations=1_200_000,
                                      tokens_per_conversation=1030), log=lambda s: None)
    rows = {(r.storage_dtype, r.layout): r for r in rep.rows}
    assert rep.num_target_layers == 5 and rep.num_tokens == 1_236_000_000
    assert rows["bfloat16", "original"].bytes_per_token == 30726
    assert round(rows["bfloat16", "original"].total_bytes / 1e12) == 38
    assert rows["bfloat16", "deepspec"].bytes_per_token == 30733
    assert rows["float32", "deepspec"].bytes_per_token == 61453
    assert rows["fp8", "deepspec"].bytes_per_token == 17953
    assert main(["estimate", "--target", str(FIXTURES / "qwen3-4b-config.json"), "--num-tokens", "1000"]) == 0
    out = capsys.readouterr().out
    assert "30,726" in out and "original DeepSpec layout" in out and "fp8" in out and "float32" in out
    # sizes in binary units, as the cache summary (and so the demo) prints them: 30,726 kB = 29.3 MiB
    assert "29.3 MiB" in out and " MB" not in out and "1 MiB = 2^20 bytes" in out
    with pytest.raises(ValueError, match="at most one dataset size"):
        EstimateConfig(num_tokens=5, num_conversations=3, tokens_per_conversation=2)


def test_format_bytes_is_binary():
    from deepspec.utils import format_bytes

    assert [format_bytes(n) for n in (512, 1536, 2**20, 37 * 2**20 + 2**19, 38 * 10**12)] == [
        "512 B", "1.5 KiB", "1.0 MiB", "37.5 MiB", "34.6 TiB"]


def test_estimate_measures_prepared_jsonl(tmp_path, monkeypatch):
    """Token count measured through render_prepared_row (held-out rows skipped, truncation applied)."""
    from deepspec.data.estimate import EstimateConfig, run_estimate

    monkeypatch.setattr(samples_mod, "render_training_samples", _fake_render_training_samples)
    rows = _rows(5)
    rows[1]["split"] = "heldout"
    src = _write_jsonl(tmp_path / "p.jsonl", rows)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 6}))
    rep = run_estimate(EstimateConfig(target=str(tmp_path / "t"), input=str(src), max_seq_len=11,
                                      target_layer_ids=[1, 2]), tokenizer=object(), log=lambda s: None)
    want = sum(min(len(s.input_ids), 11) for r in rows if r.get("split") != "heldout"
               for s in _fake_render_training_samples(None, r["messages"]) if any(s.loss_mask[:11]))
    assert rep.num_tokens == want and rep.num_target_layers == 2
    assert rep.rows[1].total_bytes == want * (13 + 2 * 8 * 3)


def test_reader_uses_get_slice_never_whole_shard(model, tmp_path, monkeypatch):
    samples = _samples()
    _write(samples, tmp_path, model)
    cache = TargetCache(tmp_path)
    full = {}
    with safe_open(str(tmp_path / "shard-00001.safetensors"), framework="pt") as f:
        for k in f.keys():
            full[k] = f.get_tensor(k)
        offsets = full["offsets"].tolist()

    calls = {"get_tensor": [], "get_slice": []}
    import safetensors

    real_safe_open = safetensors.safe_open

    class Spy:
        def __init__(self, path, framework):
            self._f = real_safe_open(path, framework=framework)

        def get_tensor(self, name):
            calls["get_tensor"].append(name)
            return self._f.get_tensor(name)

        def get_slice(self, name):
            calls["get_slice"].append(name)
            return self._f.get_slice(name)

        def metadata(self):
            return self._f.metadata()

    assert "safe_open" not in reader_mod.__dict__  # imported lazily inside the reader, so the spy applies
    monkeypatch.setattr(safetensors, "safe_open", Spy)
    item = cache[6]  # middle shard (samples 4..7), its 3rd sample
    assert set(calls["get_tensor"]) <= {"offsets"}  # only the [N+1] offsets are ever read whole
    assert set(calls["get_slice"]) == set(cache.fields) == {"input_ids", "loss_mask", "target_hidden",
                                                            "target_last_hidden", "target_logsumexp",
                                                            "target_argmax"}
    a, b = offsets[2], offsets[3]
    for k in cache.fields:  # bitwise (the logsumexp is NaN where no loss reads it)
        torch.testing.assert_close(item[k], full[k][a:b], rtol=0, atol=0, equal_nan=True)
    calls["get_slice"].clear()
    only_ids = cache.read(6, ("input_ids",))
    assert list(only_ids) == ["input_ids"] and calls["get_slice"] == ["input_ids"]
    assert torch.equal(only_ids["input_ids"], item["input_ids"])
    # bounded number of open shards, still correct when reopening
    small = TargetCache(tmp_path, max_open_shards=1)
    for i in (0, 6, 10, 6, 0):
        assert torch.equal(small[i]["target_hidden"], cache[i]["target_hidden"])
        assert len(small._handles) == 1
    # picklable for DataLoader workers
    import pickle

    clone = pickle.loads(pickle.dumps(cache))
    assert torch.equal(clone[6]["target_hidden"], item["target_hidden"])


def test_check_compatible(model, tmp_path):
    _write(_samples(3), tmp_path, model)
    cache = TargetCache(tmp_path)
    check_compatible(cache, target_fingerprint="tgt-A", tokenizer_fingerprint="tok-A", target_layer_ids=LAYER_IDS)
    with pytest.raises(ValueError, match="target_fingerprint") as e:
        check_compatible(cache, target_fingerprint="tgt-B", tokenizer_fingerprint="tok-A",
                         target_layer_ids=LAYER_IDS)
    assert "tgt-A" in str(e.value) and "tgt-B" in str(e.value) and "rebuild" in str(e.value)
    with pytest.raises(ValueError, match="tokenizer_fingerprint"):
        check_compatible(cache.manifest, target_fingerprint="tgt-A", tokenizer_fingerprint="tok-B",
                         target_layer_ids=LAYER_IDS)
    with pytest.raises(ValueError, match="target_layer_ids") as e:
        check_compatible(cache, target_fingerprint="tgt-A", tokenizer_fingerprint="tok-A", target_layer_ids=[0, 1])
    assert "[-1, 1]" in str(e.value) and "[0, 1]" in str(e.value) and "rebuild" in str(e.value)


def test_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        TargetCache(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"is not a target cache \(no manifest.json, no shards\)"):
        TargetCache(tmp_path)  # an empty folder
    (tmp_path / "progress-rank0.json").write_text("{}")
    with pytest.raises(RuntimeError, match="cache incomplete: run `deepspec cache` again to finish it"):
        TargetCache(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "deepspec-target-cache/99", "shards": []}))
    with pytest.raises(ValueError, match="deepspec-target-cache/99"):
        TargetCache(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "deepspec-target-cache/1", "shards": []}))
    with pytest.raises(ValueError, match=r"format 1.*Rebuild the cache") as e:
        TargetCache(tmp_path)
    assert "deepspec cache --input" in str(e.value)


class _Boom(RuntimeError):
    pass


def test_interrupted_writer_resumes_to_identical_cache(model, tmp_path, monkeypatch):
    samples = _samples()
    clean = tmp_path / "clean"
    _write(samples, clean, model)

    # interrupt: the capture raises in the middle of shard 1 (shard_size 4: the 6th capture)
    out = tmp_path / "resumed"
    real_capture = writer_mod.capture_sample_features
    num_calls = {"n": 0, "armed": True}

    def flaky_capture(*args, **kwargs):
        num_calls["n"] += 1
        if num_calls["armed"] and num_calls["n"] == 6:
            raise _Boom("killed")
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "capture_sample_features", flaky_capture)
    with pytest.raises(_Boom):
        _write(samples, out, model)
    assert sorted(p.name for p in out.iterdir()) == ["progress-rank0.json", "shard-00000.safetensors"]
    with pytest.raises(RuntimeError, match="cache incomplete"):
        TargetCache(out)
    # a killed process (no exception handling) leaves a temp file; it must never be read as a shard
    (out / ".shard-00001.safetensors.abc.tmp").write_bytes(b"partial")

    num_calls.update(n=0, armed=False)
    summary = _write(samples, out, model)
    assert summary.num_shards_reused == 1 and summary.num_samples == 11
    assert num_calls["n"] == 7  # shards 1 (4 samples) and 2 (3 samples) only
    assert _shard_hashes(out) == _shard_hashes(clean)
    m_clean = json.loads((clean / "manifest.json").read_text())
    assert json.loads((out / "manifest.json").read_text()) == m_clean
    assert (out / "manifest.json").read_bytes() == (clean / "manifest.json").read_bytes()
    assert not list(out.glob(".*.tmp"))

    # killed between the shard rename and the progress write: the final-named shard is adopted
    progress = json.loads((out / "progress-rank0.json").read_text())
    progress["shards"] = progress["shards"][:1]
    (out / "progress-rank0.json").write_text(json.dumps(progress))
    (out / "manifest.json").unlink()
    num_calls["n"] = 0
    summary = _write(samples, out, model)
    assert num_calls["n"] == 0 and summary.num_shards_reused == 3
    assert json.loads((out / "manifest.json").read_text()) == m_clean

    # a rerun of a complete cache is a no-op; other settings on the same folder are refused
    assert _write(samples, out, model).num_samples == 11 and num_calls["n"] == 0
    with pytest.raises(ValueError, match="storage_dtype"):
        _write(samples, out, model, storage_dtype="float32")


NAN_TOKEN = 93


@pytest.fixture
def nan_model(model):
    """The tiny target with a hook that writes NaN into the embedding of token NAN_TOKEN."""

    def hook(module, args, output):
        output = output.clone()
        output[args[0] == NAN_TOKEN] = float("nan")
        return output

    handle = model.model.embed_tokens.register_forward_hook(hook)
    yield model
    handle.remove()


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "fp8"])
def test_nonfinite_features_are_refused_never_written(nan_model, tmp_path, storage_dtype):
    samples = _samples()
    bad = [("nan-a", [5, 6, NAN_TOKEN, 7], [0, 1, 1, 1]), ("nan-b", [NAN_TOKEN, 8], [0, 1])]
    samples.insert(5, bad[0])
    samples.insert(7, bad[1])  # both in shard 1 (inputs 4..7)
    s1 = _write(samples, tmp_path / "a", nan_model, storage_dtype=storage_dtype)
    _write(samples, tmp_path / "b", nan_model, storage_dtype=storage_dtype)
    assert s1.num_refused_nonfinite == 2 and s1.refused_nonfinite_ids == ["nan-a", "nan-b"]
    assert s1.num_samples == 11 and s1.num_inputs == 13
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["num_refused_nonfinite"] == 2 and [r["id"] for r in m["refused"]] == ["nan-a", "nan-b"]
    assert [s["num_samples"] for s in m["shards"]] == [4, 2, 4, 1]
    assert _shard_hashes(tmp_path / "a") == _shard_hashes(tmp_path / "b")  # deterministic
    assert not list((tmp_path / "a").glob(".*"))  # no temp file left
    cache = TargetCache(tmp_path / "a")
    assert [cache.sample_id(i) for i in range(len(cache))] == [s[0] for s in samples if not s[0].startswith("nan")]
    ref = TargetCache(_write([s for s in samples if not s[0].startswith("nan")], tmp_path / "c", nan_model,
                             storage_dtype=storage_dtype, shard_size=100).out_dir)
    for i in range(len(cache)):
        item = cache[i]
        assert all(torch.isfinite(item[k].float()).all() for k in ("target_hidden", "target_last_hidden"))
        assert torch.equal(item["target_hidden"], ref[i]["target_hidden"])  # copied rows are exact
        assert torch.equal(item["input_ids"], ref[i]["input_ids"])
    verify_target_cache(tmp_path / "a", log=None)


def test_float16_overflow_is_refused(model, tmp_path):
    def hook(module, args, output):
        output = output.clone()
        output[args[0] == NAN_TOKEN] = 1e6  # finite in float32, inf in float16
        return output

    handle = model.model.embed_tokens.register_forward_hook(hook)
    try:
        s = _write([("big", [4, NAN_TOKEN], [0, 1]), ("ok", [4, 5], [0, 1])], tmp_path, model,
                   storage_dtype="float16")
    finally:
        handle.remove()
    assert s.refused_nonfinite_ids == ["big"] and s.num_samples == 1


def test_verify_names_a_corrupted_shard_and_rerun_repairs_it(model, tmp_path, capsys):
    samples = _samples()
    _write(samples, tmp_path, model)
    good = _shard_hashes(tmp_path)
    checks = verify_target_cache(tmp_path)
    assert [c.ok for c in checks] == [True, True, True]
    assert "shard-00001.safetensors: OK" in capsys.readouterr().out
    path = tmp_path / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # a bit in the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard-00001.safetensors") as e:
        verify_target_cache(tmp_path)
    out = capsys.readouterr().out
    assert "shard-00000.safetensors: OK" in out and "shard-00001.safetensors: FAIL" in out and "sha256" in out
    assert "delete" in str(e.value) and "rerun `deepspec cache`" in str(e.value)
    # the CLI form: `deepspec cache --verify true --output-dir ...` exits non-zero
    from deepspec.cli import main

    assert main(["cache", "--verify", "true", "--output-dir", str(tmp_path)]) == 2
    # the fix the message gives: delete the shard, rerun with the same settings
    path.unlink()
    s = _write(samples, tmp_path, model)
    assert s.num_shards_reused == 2 and _shard_hashes(tmp_path) == good
    verify_target_cache(tmp_path, log=None)
    # a broken header is reported as such
    data = bytearray(path.read_bytes())
    data[8:9] = b"["  # the header JSON no longer parses
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="header unreadable"):
        verify_target_cache(tmp_path, log=None)


def test_fp8_quantisation_error_bound():
    """Every element: |dequant - x| <= absmax(token, layer) / 28: scaled values lie in [-448, 448], where
    the widest e4m3 ulp is 32 (binade [256, 448]), so round to nearest errs by at most 16 * scale =
    absmax * 16 / 448. Relative to the element it is at most 2**-4 (3 mantissa bits) for normal values."""
    g = torch.Generator().manual_seed(0)
    n, Hs = 3, 64
    x = torch.randn(50, n * Hs, generator=g) * torch.logspace(-3, 3, 50)[:, None]
    x[3, :Hs] = 0.0  # an all-zero (token, layer) block
    x[4, 5] = 300.0  # an outlier
    q, scale = quantize_fp8(x, n)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (50, n)
    y = dequantize_fp8(q, scale)
    absmax = x.reshape(50, n, Hs).abs().amax(-1)
    err = (y - x).abs().reshape(50, n, Hs)
    assert (err <= absmax[..., None] / 28 * (1 + 1e-6)).all()
    normal = y.abs() / scale.repeat_interleave(Hs, dim=1) >= 2**-6  # e4m3 normal range
    assert ((y - x).abs()[normal] <= x.abs()[normal] * 2**-4 * (1 + 1e-6)).all()
    assert torch.equal(y[3, :Hs], torch.zeros(Hs))
    rel = (y - x).norm() / x.norm()
    assert rel < 2**-4
    # the absmax element of every block is represented exactly (it maps to 448)
    assert torch.allclose(y.reshape(50, n, Hs).abs().amax(-1), absmax, rtol=1e-6)


def test_fp8_storage_round_trip(model, tmp_path):
    samples = _samples()
    s = _write(samples, tmp_path, model, storage_dtype="fp8")
    cache = TargetCache(tmp_path)
    assert cache.storage_dtype == "fp8" and cache.manifest["dtypes"]["target_hidden"] == "float8_e4m3fn"
    assert cache.manifest["dtypes"]["target_hidden_scale"] == "float32"
    with safe_open(str(tmp_path / "shard-00000.safetensors"), framework="pt") as f:
        assert f.get_slice("target_hidden").get_dtype() == "F8_E4M3"
        assert f.get_slice("target_hidden_scale").get_shape() == [s.num_tokens and
                                                                 cache.manifest["shards"][0]["num_tokens"], 2]
    for i, (_, ids, _) in enumerate(samples):
        item = cache[i]
        want_F, want_H = capture_sample_features(model, ids, LAYER_IDS)
        assert item["target_hidden"].dtype == torch.float32
        q, scale = quantize_fp8(want_F, 2)
        assert torch.equal(item["target_hidden"], dequantize_fp8(q, scale))
        assert torch.equal(item["target_last_hidden"], want_H.to(torch.bfloat16))
    verify_target_cache(tmp_path, log=None)


def test_bad_inputs(model, tmp_path):
    with pytest.raises(ValueError, match="storage_dtype"):
        _write(_samples(2), tmp_path / "a", model, storage_dtype="int8")
    with pytest.raises(ValueError, match="final norm"):
        _write(_samples(2), tmp_path / "b", model, target_layer_ids=[2])
    with pytest.raises(ValueError, match="equal length"):
        _write([("x", [1, 2, 3], [1, 1])], tmp_path / "c", model)
    from deepspec.stages import CacheConfig

    with pytest.raises(ValueError, match="cache.input"):
        CacheConfig(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="storage_dtype"):
        CacheConfig(input="x", output_dir=str(tmp_path), storage_dtype="int8")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _rows(n: int) -> list[dict]:
    return [{"id": f"r{k}", "source_index": k, "split": "train",
             "messages": [{"role": "user", "content": "hi" * (k + 1)},
                          {"role": "assistant", "content": "ok!" if k != 2 else ""}]}
            for k in range(n)]


def _fake_render_training_samples(tokenizer, messages, *, max_seq_len=None, cut_turns=(), chat_template_kwargs=None,
                                  generated_ids=None, stop_ids=None, counts=None):
    """Stand-in for chat.render_training_samples: one char = one token; a row whose user text is
    "hihihihi" gives two samples (suffixes "" and "/b")."""
    from deepspec.data.chat import RenderedSample

    ids = [3 + (ord(c) % 80) for m in messages for c in m["content"]]
    mask = [int(m["role"] == "assistant") for m in messages for _ in m["content"]]
    if chat_template_kwargs:
        ids = [4] + ids
        mask = [0] + mask
    out = [RenderedSample(ids, mask, "")]
    if messages[0]["content"] == "hihihihi":
        out.append(RenderedSample(ids[:-1], mask[:-1], "/b"))
    return out


class _StandInTokenizer:
    chat_template = "{{ stand-in }}"


def test_write_target_cache_from_jsonl_wiring(model, tmp_path, monkeypatch):
    """The JSONL entry point: read_jsonl -> render_training_samples -> the writer (render stood in)."""

    seen = []

    def spy(tokenizer, messages, **kw):
        seen.append(kw)
        return _fake_render_training_samples(tokenizer, messages, **kw)

    monkeypatch.setattr(samples_mod, "render_training_samples", spy)
    rows = _rows(6)
    rows[1]["split"] = "heldout"
    rows[4]["chat_template_kwargs"] = {"enable_thinking": False}
    rows[4]["truncated_turns"] = [1]
    src = _write_jsonl(tmp_path / "prepared.jsonl", rows)
    summary = writer_mod.write_target_cache(
        src, tmp_path / "cache", model, _StandInTokenizer(), target_layer_ids=LAYER_IDS, max_seq_len=13,
        shard_size=2, storage_dtype="float32", progress=False,
        target_fingerprint="tgt-A", tokenizer_fingerprint="tok-A", target="/models/tiny")
    seen = [{k: kw[k] for k in ("cut_turns", "chat_template_kwargs", "generated_ids")} for kw in seen]
    assert {"cut_turns": [1], "chat_template_kwargs": {"enable_thinking": False}, "generated_ids": None} in seen
    assert {"cut_turns": [], "chat_template_kwargs": None, "generated_ids": None} in seen
    assert len(seen) == 5  # heldout not rendered
    # r1 held out; r2 empty answer -> refused; r3 gives 2 samples (r3, r3/b); r4 (14 tokens), r5 (15): cut to 13
    assert summary.num_inputs == 6 and summary.num_heldout == 1 and summary.num_refused_empty_mask == 1
    cache = TargetCache(tmp_path / "cache")
    assert [cache.sample_id(i) for i in range(len(cache))] == ["r0", "r3", "r3/b", "r4", "r5"]
    assert [s["num_samples"] for s in cache.manifest["shards"]] == [1, 2, 2]  # rows (0,1), (2,3), (4,5)
    assert summary.num_truncated == 2 and cache.sample_length(3) == 13
    assert cache.manifest["chat_template"].startswith("sha256:")
    assert cache.manifest["target"] == "/models/tiny"  # `deepspec train` without --target uses it
    assert cache.manifest["settings"]["source_fingerprint"] == "sha256:" + sha256_file(src)
    want = _fake_render_training_samples(None, rows[3]["messages"])[1]
    assert cache[2]["input_ids"].tolist() == want.input_ids and cache[2]["loss_mask"].tolist() == want.loss_mask


@pytest.mark.slow
def test_cache_on_embedded_default_target(tmp_path):
    """Real SmolLM2 target + tokenizer: logits recomputed from the cache equal the target's logits; fp8
    reconstruction error of the real features stays within the e4m3 bound (figures: docs/design/cache.md, "Cache size and fp8 storage")."""
    from deepspec.target.load import load_target, target_fingerprint, tokenizer_fingerprint

    target, tok = load_target("default")
    rows = [{"id": "a", "messages": [{"role": "user", "content": "What is 2+2?"},
                                     {"role": "assistant", "content": "2+2 is 4."}]},
            {"id": "b", "messages": [{"role": "user", "content": "Say hi."},
                                     {"role": "assistant", "content": "Hi!"}]}]
    src = _write_jsonl(tmp_path / "prepared.jsonl", rows)
    layer_ids = [1, 8, 14, 20, 27]
    summary = writer_mod.write_target_cache(src, tmp_path / "cache", target, tok, target_layer_ids=layer_ids,
                                           max_seq_len=64, shard_size=8, storage_dtype="float32", progress=False)
    assert summary.num_samples == 2
    cache = TargetCache(tmp_path / "cache")
    check_compatible(cache, target_fingerprint=target_fingerprint(target),
                     tokenizer_fingerprint=tokenizer_fingerprint(tok), target_layer_ids=layer_ids)
    item = cache[0]
    assert item["target_hidden"].shape[-1] == 5 * 576
    with torch.no_grad():
        logits = target(input_ids=item["input_ids"].long()[None]).logits[0]
    torch.testing.assert_close(target.lm_head(item["target_last_hidden"]), logits, rtol=1e-4, atol=1e-4)
    # fp8 on real features: relative L2 per layer below 2**-4 (the e4m3 worst case; measured ~2-3 %)
    x = torch.cat([cache[i]["target_hidden"] for i in range(len(cache))])
    y = dequantize_fp8(*quantize_fp8(x, 5))
    for layer in range(5):
        xs, ys = x[:, layer * 576:(layer + 1) * 576], y[:, layer * 576:(layer + 1) * 576]
        assert (ys - xs).norm() / xs.norm() < 2**-4
        assert ((ys - xs).abs() <= xs.abs().amax(-1, keepdim=True) / 28 * (1 + 1e-6)).all()
        assert ((ys - xs).norm(dim=-1) / xs.norm(dim=-1)).max() < 2**-4  # every token


def test_rerun_on_complete_cache_checks_each_shard_by_size_and_header(model, tmp_path):
    """A rerun over a complete cache does not re-hash shards, but a shard whose header no longer
    parses (same size) is rewritten; a flipped data bit is left to `--verify` (documented)."""
    samples = _samples()
    _write(samples, tmp_path, model)
    good = _shard_hashes(tmp_path)
    again = _write(samples, tmp_path, model)
    assert again.already_complete and again.num_shards_reused == 3
    path = tmp_path / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[8:9] = b"["  # the header JSON no longer parses; the size is unchanged
    path.write_bytes(bytes(data))
    repaired = _write(samples, tmp_path, model)
    assert not repaired.already_complete and repaired.num_shards_reused == 2
    assert _shard_hashes(tmp_path) == good
    verify_target_cache(tmp_path, log=None)
    # a header from another shard (same size is not enough: index and counts must match the entry)
    other = tmp_path / "shard-00000.safetensors"
    if other.stat().st_size == path.stat().st_size:
        path.write_bytes(other.read_bytes())
        assert not _write(samples, tmp_path, model).already_complete
        assert _shard_hashes(tmp_path) == good
    # a flipped bit in tensor data passes the cheap check: the rerun says so, --verify finds it
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01
    path.write_bytes(bytes(data))
    assert _write(samples, tmp_path, model).already_complete
    with pytest.raises(ValueError, match="shard-00001.safetensors"):
        verify_target_cache(tmp_path, log=None)


def test_cache_stage_says_already_complete_instead_of_wrote(model, tmp_path, monkeypatch, capsys):
    from deepspec.stages import CacheConfig, run_cache_stage
    from deepspec.target import load

    monkeypatch.setattr(samples_mod, "render_training_samples", _fake_render_training_samples)
    monkeypatch.setattr(load, "tokenizer_fingerprint", lambda tok: "tok-A")
    src = _write_jsonl(tmp_path / "prepared.jsonl", _rows(5))
    cfg = CacheConfig(input=str(src), output_dir=str(tmp_path / "cache"), target_layer_ids=LAYER_IDS, shard_size=2)
    run_cache_stage(cfg, target_model=model, tokenizer=_StandInTokenizer())
    first = capsys.readouterr().out
    assert "cache: wrote" in first and "(0 reused)" in first
    run_cache_stage(cfg, target_model=model, tokenizer=_StandInTokenizer())
    second = capsys.readouterr().out
    assert "wrote" not in second and "reused" not in second
    assert ("cache already complete (manifest.json present); nothing written. Run "
            f"`deepspec cache --output-dir {tmp_path / 'cache'} --verify` to check every shard's checksum") in second


def test_cache_stage_captures_in_its_dtype_keyed_and_fingerprinted_as_loaded(model, tmp_path, monkeypatch):
    """``cache --dtype bfloat16``: the features are the bf16 target's (the one capture rule on a bf16 copy),
    the manifest records the capture dtype, the fingerprint is the float32 target's as loaded (train and
    eval take that one), the caller's target keeps its dtype, and a float32 rerun into the folder is refused."""
    from deepspec.stages import CacheConfig, run_cache_stage
    from deepspec.target import load

    monkeypatch.setattr(samples_mod, "render_training_samples", _fake_render_training_samples)
    monkeypatch.setattr(load, "tokenizer_fingerprint", lambda tok: "tok-A")
    src = _write_jsonl(tmp_path / "prepared.jsonl", _rows(3))
    out = tmp_path / "cache"
    kw = dict(input=str(src), output_dir=str(out), target_layer_ids=LAYER_IDS, shard_size=2, storage_dtype="float32")
    run_cache_stage(CacheConfig(**kw, dtype="bfloat16"), target_model=model, tokenizer=_StandInTokenizer())
    assert next(model.parameters()).dtype == torch.float32  # a copy was cast
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["capture"]["dtype"] == "bfloat16"
    assert manifest["target_fingerprint"] == load.target_fingerprint(model)
    cache = TargetCache(out)
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    for i in range(len(cache)):
        sample = cache[i]
        ids = sample["input_ids"].long()
        hidden_TF, last_TH = capture_sample_features(bf16_model, ids, LAYER_IDS)
        assert torch.equal(sample["target_hidden"], hidden_TF.float())
        assert torch.equal(sample["target_last_hidden"], last_TH.float())
        fp32_hidden_TF, _ = capture_sample_features(model, ids, LAYER_IDS)
        assert not torch.equal(sample["target_hidden"], fp32_hidden_TF)  # the dtype did change the features
    with pytest.raises(ValueError, match="settings"):
        run_cache_stage(CacheConfig(**kw, dtype="float32"), target_model=model, tokenizer=_StandInTokenizer())
    with pytest.raises(ValueError, match="cache.dtype"):
        CacheConfig(**kw, dtype="half")


def test_failed_run_leaves_no_empty_output_folder(model, tmp_path, monkeypatch):

    monkeypatch.setattr(samples_mod, "render_training_samples", _fake_render_training_samples)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"id": "r0", "text": "no messages"}])
    kw = dict(target_layer_ids=LAYER_IDS, max_seq_len=16, shard_size=2, progress=False,
              target_fingerprint="tgt-A", tokenizer_fingerprint="tok-A")
    with pytest.raises(ValueError, match="messages"):
        writer_mod.write_target_cache(bad, tmp_path / "new" / "cache", model, _StandInTokenizer(), **kw)
    assert not (tmp_path / "new" / "cache").exists()
    with pytest.raises(ValueError, match="equal length"):
        _write([("x", [1, 2, 3], [1, 1])], tmp_path / "c", model)
    assert not (tmp_path / "c").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made is kept, even empty
    with pytest.raises(ValueError, match="messages"):
        writer_mod.write_target_cache(bad, tmp_path / "mine", model, _StandInTokenizer(), **kw)
    assert (tmp_path / "mine").is_dir()
    # a run that wrote shards before failing keeps them (resume)
    rows = _rows(4) + [{"id": "r4", "text": "no messages"}]
    with pytest.raises(ValueError, match="messages"):
        writer_mod.write_target_cache(_write_jsonl(tmp_path / "late.jsonl", rows), tmp_path / "late", model,
                                     _StandInTokenizer(), **kw)
    assert len(list((tmp_path / "late").glob("shard-*.safetensors"))) == 2


def test_cache_and_estimate_default_to_bfloat16_and_the_demo_pins_float32(tmp_path, monkeypatch):
    from deepspec import demo
    from deepspec.data.estimate import EstimateConfig
    from deepspec.stages import CacheConfig
    from deepspec.target import load

    assert CacheConfig(input="x", output_dir="y").storage_dtype == "bfloat16" == EstimateConfig().storage_dtype
    seen = []

    class _Stop(Exception):
        pass

    def fake_cache_stage(cfg, **kw):
        seen.append(cfg)
        raise _Stop

    monkeypatch.setattr(load, "load_target", lambda spec: (None, None))
    monkeypatch.setattr(demo, "run_cache_stage", fake_cache_stage)
    cfg = demo.DemoConfig(output_dir=str(tmp_path))
    (tmp_path / "prepared.jsonl").write_text("")  # reused: its summary holds the mix this demo asks for
    (tmp_path / "prepared.jsonl.summary.json").write_text(json.dumps(
        {"parts": {n: {"conversations_asked": c} for n, c in demo.demo_data_plan(cfg)}}))
    with pytest.raises(_Stop):
        demo.run_demo(cfg)
    assert seen[0].storage_dtype == "float32"
    assert seen[0].dtype == cfg.dtype == "auto"  # features computed in the dtype the demo decodes in


def test_estimate_input_without_tokenizer_files_is_a_clear_error(tmp_path):
    from deepspec.data.estimate import EstimateConfig, run_estimate

    folder = tmp_path / "cfg-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "hidden_size": 8, "num_hidden_layers": 24, "vocab_size": 100}))
    src = _write_jsonl(tmp_path / "p.jsonl", _rows(2))
    for target in (folder, folder / "config.json"):
        with pytest.raises(ValueError, match=r"--input needs the target's tokenizer; .*cfg-only has no tokenizer "
                                             r"files .* pass the model folder or use --num-tokens"):
            run_estimate(EstimateConfig(target=str(target), input=str(src)), log=lambda s: None)


def test_cache_stage_with_no_sample_fails_with_the_counts(model, tmp_path, monkeypatch):
    """A prepared file that gives no sample (here: empty, as a prepare run that kept nothing writes)
    is an error naming the counts, not a 0-sample cache and exit 0."""
    from deepspec.stages import CacheConfig, run_cache_stage
    from deepspec.target import load

    monkeypatch.setattr(samples_mod, "render_training_samples", _fake_render_training_samples)
    monkeypatch.setattr(load, "tokenizer_fingerprint", lambda tok: "tok-A")
    src = tmp_path / "prepared.jsonl"
    src.write_text("")
    cfg = CacheConfig(input=str(src), output_dir=str(tmp_path / "cache"), target_layer_ids=LAYER_IDS)
    with pytest.raises(ValueError, match=r"cache: no sample to train on .*\(0 inputs: held out 0, refused 0 with no "
                                         r"loss token and 0 with non-finite features\); check .*prepared.jsonl"):
        run_cache_stage(cfg, target_model=model, tokenizer=_StandInTokenizer())


def test_cache_stage_warns_at_once_about_a_family_train_will_refuse(model, tmp_path, monkeypatch, capsys):
    """A target whose family has no draft builder is cached (the stage works) with a warning first,
    not only refused hours later by train; a supported family gets no warning."""
    from deepspec.stages import CacheConfig, run_cache_stage
    from deepspec.target import load

    monkeypatch.setattr(samples_mod, "render_training_samples", _fake_render_training_samples)
    monkeypatch.setattr(load, "tokenizer_fingerprint", lambda tok: "tok-A")
    src = _write_jsonl(tmp_path / "prepared.jsonl", _rows(3))
    run_cache_stage(CacheConfig(input=str(src), output_dir=str(tmp_path / "llama"), target_layer_ids=LAYER_IDS),
                    target_model=model, tokenizer=_StandInTokenizer())
    assert "warning" not in capsys.readouterr().out
    monkeypatch.setattr(model.config, "model_type", "gemma4_text")
    run_cache_stage(CacheConfig(input=str(src), output_dir=str(tmp_path / "gemma"), target_layer_ids=LAYER_IDS),
                    target_model=model, tokenizer=_StandInTokenizer())
    out = capsys.readouterr().out
    assert out.startswith("cache: warning: the target's model_type 'gemma4_text' is not a family DeepSpec builds "
                          "drafts for (llama, qwen3, qwen2, mistral, gemma3_text)")
    assert "cache: wrote" in out
