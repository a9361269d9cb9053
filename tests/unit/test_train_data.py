"""The trainer's data order and input path: collate in the storage dtype, conversion on the device,
prefetching. Tiny random Llama target (hidden 32, 3 layers), caches of a few samples, 1 thread.
Shape legend: B batch, S padded length, T tokens of a sample, F features, H hidden, n target layers."""

import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepspec.algorithms.dspark import DSparkAlgorithm
from deepspec.data.cache import TargetCache, write_target_cache_from_samples
from deepspec.train.data import (
    Prefetcher,
    batch_to_device,
    collate,
    epoch_order,
    micro_batch_seed,
    rank_micro_batches,
    step_sample_indices,
    to_device,
)

LAYER_IDS = [0, 1]


def test_each_epoch_sees_every_sample_once_and_order_is_reproducible():
    # 10 samples, global batch 4: steps straddle epochs; the stream is the epoch orders concatenated
    stream = [i for step in range(5) for i in step_sample_indices(10, 4, seed=5, step=step)]
    assert stream[:10] == epoch_order(10, seed=5, epoch=0) and stream[10:] == epoch_order(10, seed=5, epoch=1)
    assert sorted(stream[:10]) == list(range(10)) and stream[10:] != stream[:10]
    assert step_sample_indices(10, 4, seed=5, step=3) == step_sample_indices(10, 4, seed=5, step=3)
    assert step_sample_indices(10, 4, seed=6, step=0) != step_sample_indices(10, 4, seed=5, step=0)
    with pytest.raises(ValueError, match="no samples"):
        step_sample_indices(0, 4, seed=5, step=0)


def test_ranks_take_disjoint_shares_that_match_one_process_with_accumulation():
    for step in range(4):
        one = rank_micro_batches(10, batch_size=2, grad_accum_steps=4, seed=1, step=step)
        two = [p for r in range(2) for p in rank_micro_batches(10, batch_size=2, grad_accum_steps=2, seed=1,
                                                               step=step, rank=r, world_size=2)]
        four = [p for r in range(4) for p in rank_micro_batches(10, batch_size=2, grad_accum_steps=1, seed=1,
                                                                step=step, rank=r, world_size=4)]
        assert one == two == four  # same micro-batches, same slots (so the same anchor seeds)
        assert [p.slot for p in one] == [0, 2, 4, 6]
        assert [i for p in one for i in p.indices] == step_sample_indices(10, 8, seed=1, step=step)
    assert micro_batch_seed(0, 3, 2) == micro_batch_seed(0, 3, 2) != micro_batch_seed(0, 3, 4)
    with pytest.raises(ValueError, match="rank"):
        rank_micro_batches(10, batch_size=2, grad_accum_steps=1, seed=1, step=0, rank=2, world_size=2)


def test_collate_keeps_the_stored_dtype_and_right_pads_with_zeros():
    def sample(n):
        return {
            "input_ids": torch.arange(1, n + 1, dtype=torch.int32),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "target_hidden": torch.randn(n, 6, dtype=torch.bfloat16),
            "target_last_hidden": torch.randn(n, 3),
        }

    a, b = sample(3), sample(5)
    batch = collate([a, b], [0, 1])
    assert batch.input_ids_BS.shape == (2, 5) and batch.input_ids_BS.dtype == torch.long
    assert batch.loss_mask_BS[0].tolist() == [1, 1, 1, 0, 0]
    assert batch.target_hidden_BSF.dtype == torch.bfloat16  # not upcast on the host
    assert batch.target_last_hidden_BSH.dtype == torch.float32
    assert torch.equal(batch.target_hidden_BSF[0, :3], a["target_hidden"])
    assert batch.target_hidden_BSF[0, 3:].abs().sum() == 0 and batch.target_hidden_scale_BSn is None
    on_device = batch_to_device(batch, "cpu")
    assert on_device.target_hidden_BSF.dtype == torch.float32
    assert torch.equal(on_device.target_hidden_BSF[1], b["target_hidden"].float())


# ------------------------------------------------------------------ the input path on real caches


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def caches(target, tmp_path_factory):
    """One cache per storage dtype, of the same 7 samples (lengths 3..15, so batches pad)."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(7):
        T = 3 + 2 * k
        samples.append((f"s{k}", torch.randint(3, 90, (T,), generator=g).tolist(), [0] * (T // 2) + [1] * (T - T // 2)))
    out = {}
    for dtype in ("float32", "bfloat16", "fp8"):
        path = tmp_path_factory.mktemp(dtype) / "cache"
        write_target_cache_from_samples(samples, path, target, target_layer_ids=LAYER_IDS, target_fingerprint="t",
                                        tokenizer_fingerprint="k", shard_size=3, storage_dtype=dtype, progress=False)
        out[dtype] = TargetCache(path)
    return out


def _host_path(samples):
    """The trainer's former input path, the obvious way: every sample's features as the reader returns
    them by default (fp8 dequantised on the host) upcast to float32, right-padded with zeros."""
    S = max(s["input_ids"].shape[0] for s in samples)
    hidden_BSF = torch.zeros(len(samples), S, samples[0]["target_hidden"].shape[-1])
    last_BSH = torch.zeros(len(samples), S, samples[0]["target_last_hidden"].shape[-1])
    for b, s in enumerate(samples):
        T = s["input_ids"].shape[0]
        hidden_BSF[b, :T] = s["target_hidden"].float()
        last_BSH[b, :T] = s["target_last_hidden"].float()
    return hidden_BSF, last_BSH


@pytest.mark.parametrize("storage_dtype, stored", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                                   ("fp8", torch.float8_e4m3fn)])
def test_features_converted_on_the_device_equal_the_host_conversion(caches, storage_dtype, stored):
    cache = caches[storage_dtype]
    indices = [6, 0, 3, 5]
    batch = collate([cache.read(i, dequantize=False) for i in indices], indices)
    # the host batch holds the stored bytes: fp8 payload + float32 scales, bfloat16, float32
    assert batch.target_hidden_BSF.dtype == stored
    assert (batch.target_hidden_scale_BSn is not None) == (storage_dtype == "fp8")
    assert batch.target_last_hidden_BSH.dtype == (torch.bfloat16 if storage_dtype == "fp8" else stored)
    on_device = batch_to_device(batch, "cpu")
    want_hidden_BSF, want_last_BSH = _host_path([cache[i] for i in indices])
    assert on_device.target_hidden_BSF.dtype == on_device.target_last_hidden_BSH.dtype == torch.float32
    assert torch.equal(on_device.target_hidden_BSF, want_hidden_BSF)  # bitwise, padding included
    assert torch.equal(on_device.target_last_hidden_BSH, want_last_BSH)
    assert on_device.target_hidden_scale_BSn is None
    for name in ("input_ids_BS", "loss_mask_BS", "target_logsumexp_BS", "target_argmax_BS"):
        torch.testing.assert_close(getattr(on_device, name), getattr(batch, name), rtol=0, atol=0, equal_nan=True)


def test_the_reader_keeps_the_fp8_payload_when_asked(caches):
    """``read(dequantize=False)``: the payload and scales; the default read dequantises them (same values)."""
    cache = caches["fp8"]
    raw, default = cache.read(2, dequantize=False), cache[2]
    assert raw["target_hidden"].dtype == torch.float8_e4m3fn and raw["target_hidden_scale"].shape == (7, 2)
    assert "target_hidden_scale" not in default and default["target_hidden"].dtype == torch.float32
    assert torch.equal(batch_to_device(collate([raw], [2]), "cpu").target_hidden_BSF[0], default["target_hidden"])
    assert cache.read(2, ("input_ids",), dequantize=False).keys() == {"input_ids"}


def test_the_trainers_to_device_converts_a_batch_inside_an_algorithms_micro_batch(caches):
    """``to_device`` finds the TrainBatch inside a prepared micro-batch and dequantises it."""
    cache = caches["fp8"]
    batch = collate([cache.read(i, dequantize=False) for i in (1, 4)], [1, 4])
    anchors_BA = torch.tensor([[1, 2], [0, 3]])
    prepared = to_device({"batch": batch, "anchor_pos_BA": anchors_BA}, torch.device("cpu"))
    assert torch.equal(prepared["anchor_pos_BA"], anchors_BA)
    assert torch.equal(prepared["batch"].target_hidden_BSF, _host_path([cache[1], cache[4]])[0])


# ------------------------------------------------------------------ prefetching


def _steps(cache, step):
    """The trainer's load of one step: 2 micro-batches of 2 samples, read in the storage dtype and collated."""
    plans = rank_micro_batches(len(cache), batch_size=2, grad_accum_steps=2, seed=3, step=step)
    return [collate([cache.read(i, dequantize=False) for i in p.indices], p.indices) for p in plans]


def _same_batches(a, b) -> bool:
    fields = ("input_ids_BS", "loss_mask_BS", "target_hidden_BSF", "target_last_hidden_BSH", "target_hidden_scale_BSn",
              "target_logsumexp_BS", "target_argmax_BS")
    return a.sample_indices == b.sample_indices and all(
        (getattr(a, f) is None and getattr(b, f) is None)
        or (getattr(a, f).dtype == getattr(b, f).dtype
            and torch.equal(getattr(a, f).view(torch.uint8), getattr(b, f).view(torch.uint8)))  # bits (NaN, fp8)
        for f in fields)


def _prefetch_threads(name="test-prefetch"):
    return [t for t in threading.enumerate() if t.name == name]


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetched_batches_equal_the_batches_loaded_in_order(caches, depth):
    cache = caches["fp8"]
    plain = [_steps(cache, step) for step in range(3, 9)]  # a resume at step 3: steps 3..8
    threads = []

    def load(step):
        threads.append(threading.current_thread().name)
        return _steps(cache, step)

    with Prefetcher(load, range(3, 9), depth=depth, name="test-prefetch") as steps:
        fetched = list(steps)
    assert len(fetched) == len(plain) == 6
    for got, want in zip(fetched, plain):
        assert len(got) == len(want) == 2 and all(_same_batches(g, w) for g, w in zip(got, want))
    assert threads == ["test-prefetch"] * 6  # loaded in the background, each step once
    assert not _prefetch_threads()
    assert [len(x) for x in Prefetcher(load, range(3, 9), depth=0)] == [2] * 6
    assert threads[6:] == [threading.current_thread().name] * 6  # depth 0: in the caller's thread


def test_prefetch_loads_at_most_depth_items_ahead_and_stops_when_closed():
    loaded = []

    def load(key):
        loaded.append(key)
        return key

    steps = Prefetcher(load, range(100), depth=1, name="test-prefetch")
    deadline = time.monotonic() + 10
    while len(loaded) < 2 and time.monotonic() < deadline:  # item 0 queued, item 1 loaded and waiting
        time.sleep(0.01)
    time.sleep(0.1)
    assert loaded == [0, 1]
    assert next(steps) == 0
    deadline = time.monotonic() + 10
    while len(loaded) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert loaded == [0, 1, 2]  # one taken, one more loaded
    steps.close()  # early exit: the thread ends, nothing more is loaded or returned
    assert not _prefetch_threads() and loaded == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(steps)


@pytest.mark.parametrize("depth", [0, 1])
def test_a_load_error_reaches_the_consumer_after_the_items_before_it(depth):
    boom = ValueError("sample 3 is unreadable")

    def load(key):
        if key == 3:
            raise boom
        return key

    steps = Prefetcher(load, range(10), depth=depth, name="test-prefetch")
    assert [next(steps) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError) as info:
        next(steps)
    assert info.value is boom
    assert not _prefetch_threads()
    with pytest.raises(StopIteration):
        next(steps)


def test_an_error_in_the_consumer_stops_the_prefetch_thread():
    with pytest.raises(RuntimeError, match="step failed"):
        with Prefetcher(lambda key: key, range(1000), depth=2, name="test-prefetch") as steps:
            for key in steps:
                if key == 5:
                    raise RuntimeError("step failed")
    assert not _prefetch_threads()
    with pytest.raises(ValueError, match="depth: expected >= 0"):
        Prefetcher(lambda key: key, range(3), depth=-1)
