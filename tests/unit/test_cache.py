"""Tests for deepspec.data.cache (tiny random Llama target, CPU).

Shape legend: T tokens of a sample, H hidden, F = n * H features.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.data import cache as cache_mod
from deepspec.data.cache import (
    FORMAT_VERSION,
    TargetCache,
    cache_bytes_per_token,
    check_compatible,
    sha256_file,
    write_target_cache_from_samples,
)
from deepspec.target.capture import target_forward

LAYER_IDS = [-1, 1]
H = 32


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
        ids = torch.randint(3, 97, (T,), generator=g).tolist()
        mask = [0] * (T // 2) + [1] * (T - T // 2)
        out.append((f"s{k}", ids, mask))
    return out


def _write(samples, out_dir, model, **kw):
    args = dict(target_layer_ids=LAYER_IDS, target_fingerprint="tgt-A", tokenizer_fingerprint="tok-A",
                batch_size=2, shard_size=4, storage_dtype="bfloat16", progress=False, chat_template="chatml")
    args.update(kw)
    return write_target_cache_from_samples(samples, out_dir, model, **args)


def _shard_hashes(d: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(d.glob("shard-*.safetensors"))}


@pytest.mark.parametrize("storage_dtype,batch_size", [("bfloat16", 1), ("float32", 1), ("float16", 3)])
def test_round_trip_matches_direct_forward(model, tmp_path, storage_dtype, batch_size):
    samples = _samples()
    summary = _write(samples, tmp_path, model, storage_dtype=storage_dtype, batch_size=batch_size)
    assert summary.num_samples == 11 and summary.num_shards == 3  # 4 + 4 + 3
    cache = TargetCache(tmp_path)
    assert len(cache) == 11
    dtype = getattr(torch, storage_dtype)
    for i, (sid, ids, mask) in enumerate(samples):
        item = cache[i]
        assert cache.sample_id(i) == sid and cache.sample_length(i) == len(ids)
        assert item["input_ids"].dtype == torch.int32 and item["input_ids"].tolist() == ids
        assert item["loss_mask"].dtype == torch.uint8 and item["loss_mask"].tolist() == mask
        ref = target_forward(model, torch.tensor([ids]), LAYER_IDS)
        assert item["target_hidden"].shape == (len(ids), 2 * H) and item["target_hidden"].dtype == dtype
        want_F, want_H = ref.target_hidden_BTF[0].to(dtype), ref.target_last_hidden_BTH[0].to(dtype)
        if batch_size == 1:  # same shapes as the direct forward -> bit-exact
            assert torch.equal(item["target_hidden"], want_F)
            assert torch.equal(item["target_last_hidden"], want_H)
        else:  # right-padded batches: equal up to kernel rounding
            torch.testing.assert_close(item["target_hidden"].float(), want_F.float(), rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(item["target_last_hidden"].float(), want_H.float(), rtol=2e-3, atol=2e-3)
    assert cache[-1]["input_ids"].tolist() == samples[-1][1]
    with pytest.raises(IndexError):
        cache[11]


def test_manifest_counts_and_shard_format(model, tmp_path):
    samples = _samples()
    samples.insert(5, ("empty-mask", [5, 6, 7], [0, 0, 0]))
    samples.insert(7, ("long", list(range(3, 33)), [1] * 30))  # truncated to 20
    summary = _write(samples, tmp_path, model, max_seq_len=20)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["format"] == FORMAT_VERSION
    assert m["target_fingerprint"] == "tgt-A" and m["tokenizer_fingerprint"] == "tok-A"
    assert m["target_layer_ids"] == LAYER_IDS and m["hidden_size"] == H and m["num_hidden_layers"] == 3
    assert m["dtypes"] == {"input_ids": "int32", "loss_mask": "uint8", "target_hidden": "bfloat16",
                           "target_last_hidden": "bfloat16"}
    assert m["chat_template"] == "chatml" and m["max_seq_len"] == 20
    kept = [s for s in samples if s[0] != "empty-mask"]
    assert m["num_samples"] == summary.num_samples == 12
    assert m["num_refused_empty_mask"] == summary.num_refused_empty_mask == 1
    assert m["num_truncated"] == summary.num_truncated == 1
    assert m["num_tokens"] == summary.num_tokens == sum(min(len(s[1]), 20) for s in kept)
    assert m["num_loss_tokens"] == sum(sum(s[2][:20]) for s in kept)
    assert [s["num_samples"] for s in m["shards"]] == [4, 4, 4]
    for s in m["shards"]:
        assert sha256_file(tmp_path / s["file"]) == s["sha256"]
    assert summary.total_bytes == sum(p.stat().st_size for p in tmp_path.glob("shard-*"))
    assert cache_bytes_per_token(H, 2, "bfloat16") == 5 + 2 * H * 3
    assert cache_bytes_per_token(2560, 5, "bfloat16") == 30725  # Qwen3-4B, DESIGN.md s.4 (+1 there)
    # a standard safetensors file
    with safe_open(str(tmp_path / "shard-00001.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {"offsets", "input_ids", "loss_mask", "target_hidden", "target_last_hidden"}
        offsets = f.get_tensor("offsets")
        assert offsets.dtype == torch.int64 and offsets[0] == 0 and len(offsets) == 5
        assert f.get_slice("target_hidden").get_shape() == [int(offsets[-1]), 2 * H]
        assert json.loads(f.metadata()["deepspec"])["sample_ids"] == [s[0] for s in kept[4:8]]
    assert TargetCache(tmp_path)[6]["input_ids"].tolist() == list(range(3, 23))  # "long" is kept sample 6


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

    assert "safe_open" not in cache_mod.__dict__  # imported lazily inside the reader, so the spy applies
    monkeypatch.setattr(safetensors, "safe_open", Spy)
    item = cache[6]  # middle shard (samples 4..7), its 3rd sample
    assert set(calls["get_tensor"]) <= {"offsets"}  # only the [N+1] offsets are ever read whole
    assert set(calls["get_slice"]) == {"input_ids", "loss_mask", "target_hidden", "target_last_hidden"}
    a, b = offsets[2], offsets[3]
    for k in ("input_ids", "loss_mask", "target_hidden", "target_last_hidden"):
        assert torch.equal(item[k], full[k][a:b])
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
    (tmp_path / "progress.json").write_text("{}")
    with pytest.raises(RuntimeError, match="cache incomplete: run `deepspec cache` again to finish it"):
        TargetCache(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "deepspec-target-cache/99", "shards": []}))
    with pytest.raises(ValueError, match="deepspec-target-cache/99"):
        TargetCache(tmp_path)


class _Boom(RuntimeError):
    pass


def test_interrupted_writer_resumes_to_identical_cache(model, tmp_path, monkeypatch):
    samples = _samples()
    clean = tmp_path / "clean"
    _write(samples, clean, model)

    # interrupt: the target forward raises during shard 1 (batch_size 2, shard_size 4 -> 2 forwards a shard)
    out = tmp_path / "resumed"
    layer0 = model.model.layers[0]
    real_forward = layer0.forward
    num_calls = {"n": 0, "armed": True}

    def flaky_forward(*args, **kwargs):
        num_calls["n"] += 1
        if num_calls["armed"] and num_calls["n"] == 4:  # 2nd batch of shard 1: half of the shard already written to its temp file
            raise _Boom("killed")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(layer0, "forward", flaky_forward)
    with pytest.raises(_Boom):
        _write(samples, out, model)
    assert sorted(p.name for p in out.iterdir()) == ["progress.json", "shard-00000.safetensors"]
    assert not (out / "manifest.json").exists()
    with pytest.raises(RuntimeError, match="cache incomplete"):
        TargetCache(out)
    # a killed process (no exception handling) leaves a temp file; it must never be read as a shard
    (out / ".shard-00001.safetensors.abc.tmp").write_bytes(b"partial")

    num_calls.update(n=0, armed=False)
    summary = _write(samples, out, model)
    assert summary.num_shards_reused == 1 and summary.num_samples == 11
    assert num_calls["n"] == 4  # shards 1 (2 batches) and 2 (2 batches) only
    assert _shard_hashes(out) == _shard_hashes(clean)
    m_clean = json.loads((clean / "manifest.json").read_text())
    m_res = json.loads((out / "manifest.json").read_text())
    assert m_res == m_clean
    assert not list(out.glob(".*.tmp"))

    # killed between the shard rename and the progress write: the final-named shard is adopted
    progress = json.loads((out / "progress.json").read_text())
    progress["shards"] = progress["shards"][:1]
    (out / "progress.json").write_text(json.dumps(progress))
    (out / "manifest.json").unlink()
    num_calls["n"] = 0
    summary = _write(samples, out, model)
    assert num_calls["n"] == 0 and summary.num_shards_reused == 3
    assert json.loads((out / "manifest.json").read_text()) == m_clean

    # a rerun of a complete cache is a no-op; other settings on the same folder are refused
    assert _write(samples, out, model).num_samples == 11
    with pytest.raises(ValueError, match="storage_dtype"):
        _write(samples, out, model, storage_dtype="float32")


def test_bad_inputs(model, tmp_path):
    with pytest.raises(ValueError, match="storage_dtype"):
        _write(_samples(2), tmp_path / "a", model, storage_dtype="int8")
    with pytest.raises(ValueError, match="final norm"):
        _write(_samples(2), tmp_path / "b", model, target_layer_ids=[2])
    with pytest.raises(ValueError, match="equal length"):
        _write([("x", [1, 2, 3], [1, 1])], tmp_path / "c", model)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


class _StandInTokenizer:
    """Enough of a tokenizer for write_target_cache when render_with_loss_mask is stood in."""

    chat_template = "{{ stand-in }}"


def test_write_target_cache_from_jsonl_wiring(model, tmp_path, monkeypatch):
    """The JSONL entry point: read_jsonl -> render_with_loss_mask -> the sample writer (render stood in)."""
    import deepspec.data.chat as chat

    def fake_render(tokenizer, messages, *, max_seq_len=None, cut_turns=()):
        ids = [3 + (ord(c) % 90) for m in messages for c in m["content"]]
        mask = [int(m["role"] == "assistant") for m in messages for _ in m["content"]]
        return ids[:max_seq_len], mask[:max_seq_len]

    monkeypatch.setattr(chat, "render_with_loss_mask", fake_render)
    rows = [{"id": f"r{k}", "messages": [{"role": "user", "content": "hi" * (k + 1)},
                                         {"role": "assistant", "content": "ok!" if k != 2 else ""}]}
            for k in range(5)]
    src = _write_jsonl(tmp_path / "prepared.jsonl", rows)
    summary = cache_mod.write_target_cache(
        src, tmp_path / "cache", model, _StandInTokenizer(), target_layer_ids=LAYER_IDS, max_seq_len=11,
        batch_size=2, shard_size=2, storage_dtype="float32", progress=False,
        target_fingerprint="tgt-A", tokenizer_fingerprint="tok-A")
    # r2: empty answer -> refused; r4: 10 user tokens + 3 answer tokens cut to 11 -> kept, truncated
    assert summary.num_samples == 4 and summary.num_refused_empty_mask == 1 and summary.num_shards == 2
    assert summary.num_truncated == 1 and TargetCache(tmp_path / "cache").sample_length(3) == 11
    cache = TargetCache(tmp_path / "cache")
    assert [cache.sample_id(i) for i in range(4)] == ["r0", "r1", "r3", "r4"]
    assert cache.manifest["chat_template"].startswith("sha256:")
    assert cache.manifest["settings"]["source_fingerprint"] == "sha256:" + sha256_file(src)
    ids, mask = fake_render(None, rows[1]["messages"])
    assert cache[1]["input_ids"].tolist() == ids and cache[1]["loss_mask"].tolist() == mask


@pytest.mark.slow
def test_cache_on_embedded_default_target(tmp_path):
    """Real SmolLM2 target + tokenizer: logits recomputed from the cache equal the target's logits."""
    from deepspec.target.load import load_target, target_fingerprint, tokenizer_fingerprint

    target, tok = load_target("default")
    rows = [{"id": "a", "messages": [{"role": "user", "content": "What is 2+2?"},
                                     {"role": "assistant", "content": "2+2 is 4."}]},
            {"id": "b", "messages": [{"role": "user", "content": "Say hi."},
                                     {"role": "assistant", "content": "Hi!"}]}]
    src = _write_jsonl(tmp_path / "prepared.jsonl", rows)
    layer_ids = [1, 8, 14, 20, 27]
    summary = cache_mod.write_target_cache(src, tmp_path / "cache", target, tok, target_layer_ids=layer_ids,
                                           max_seq_len=64, batch_size=2, shard_size=8,
                                           storage_dtype="float32", progress=False)
    assert summary.num_samples == 2
    cache = TargetCache(tmp_path / "cache")
    check_compatible(cache, target_fingerprint=target_fingerprint(target),
                     tokenizer_fingerprint=tokenizer_fingerprint(tok), target_layer_ids=layer_ids)
    item = cache[0]
    assert item["target_hidden"].shape[-1] == 5 * 576
    with torch.no_grad():
        logits = target(input_ids=item["input_ids"].long()[None]).logits[0]
    torch.testing.assert_close(target.lm_head(item["target_last_hidden"]), logits, rtol=1e-4, atol=1e-4)
