"""Online mode (DESIGN section 4): features computed in the training loop equal those of a cache.

Tiny random Llama / Qwen3 targets, the tiny byte-level ChatML tokenizer, float32 storage, 1 thread.
Shape legend: B batch, S padded length, T tokens of a sample, F features, H hidden.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.data.cache import TargetCache, check_compatible, write_target_cache
from deepspec.data.online import OnlineTargetFeatures
from deepspec.target.load import target_fingerprint, tokenizer_fingerprint
from deepspec.train.data import collate
from deepspec.train.config import TrainConfig
from deepspec.train.loop import train
from tests.unit.test_chat import tiny_chatml_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_IDS = [0, 1]
MAX_SEQ_LEN = 160


def _conversation(k: int, answer_len: int) -> list[dict]:
    return [
        {"role": "user", "content": f"Question number {k}: " + "why? " * (k % 3)},
        {"role": "assistant", "content": ("answer %d. " % k) * answer_len},
    ]


def _rows() -> list[dict]:
    rows = [
        {"id": f"r{k}", "source_index": k, "messages": _conversation(k, n), "truncated": False,
         "truncated_turns": [], "split": "train"}
        for k, n in enumerate([1, 6, 2, 4, 1, 3])
    ]
    rows.append({"id": "held", "source_index": 6, "messages": _conversation(6, 2), "truncated": False,
                 "truncated_turns": [], "split": "heldout"})
    # a prompt longer than max_seq_len: no loss token left after truncation, refused
    rows.append({"id": "long-prompt", "source_index": 7, "truncated": False, "truncated_turns": [], "split": "train",
                 "messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "ok"}]})
    # an answer cut by max_tokens during regeneration, and one truncated to max_seq_len
    rows.append({"id": "cut", "source_index": 8, "messages": _conversation(8, 3), "truncated": True,
                 "truncated_turns": [1], "split": "train"})
    rows.append({"id": "long-answer", "source_index": 9, "messages": _conversation(9, 30), "truncated": False,
                 "truncated_turns": [], "split": "train"})
    return rows


def _target(family: str, vocab_size: int, tok):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    tok = tiny_chatml_tokenizer()
    model = _target(request.param, len(tok), tok)
    d = tmp_path_factory.mktemp(f"online-{request.param}")
    prepared = d / "prepared.jsonl"
    prepared.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    cache_dir = d / "cache"
    write_target_cache(prepared, cache_dir, model, tok, target_layer_ids=LAYER_IDS, max_seq_len=MAX_SEQ_LEN,
                       storage_dtype="float32", shard_size=4, progress=False)
    online = OnlineTargetFeatures(prepared, model, tok, target_layer_ids=LAYER_IDS, max_seq_len=MAX_SEQ_LEN,
                                  feature_dtype="float32")
    return model, tok, prepared, TargetCache(cache_dir), online


def _assert_batches_equal(a, b):
    for name in ("input_ids_BS", "loss_mask_BS", "target_hidden_BSF", "target_last_hidden_BSH"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_online_samples_equal_cache_samples(setup):
    model, tok, _, cache, online = setup
    assert len(online) == len(cache) == 8  # 10 rows - held out - prompt-only after truncation
    assert [online.sample_id(i) for i in range(len(online))] == [cache.sample_id(i) for i in range(len(cache))]
    assert online.manifest["num_heldout"] == 1 and online.manifest["num_refused_empty_mask"] == 1
    assert online.manifest["num_truncated"] == cache.manifest["num_truncated"] >= 2
    check_compatible(online.manifest, target_fingerprint=target_fingerprint(model),
                     tokenizer_fingerprint=tokenizer_fingerprint(tok), target_layer_ids=LAYER_IDS)
    for i in range(len(cache)):
        a, b = online[i], cache[i]
        assert a.keys() == set(b) - {"target_logsumexp", "target_argmax"}  # online mode has no logit stats
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (i, name)
        assert a["input_ids"].shape[0] <= MAX_SEQ_LEN and a["target_hidden"].shape[1] == 32 * len(LAYER_IDS)


def test_batches_equal_online_and_cached_whatever_position_and_padding(setup):
    _, _, _, cache, online = setup
    lengths = [online.sample_length(i) for i in range(len(online))]
    shortest, longest = lengths.index(min(lengths)), lengths.index(max(lengths))
    target = sorted(range(len(lengths)), key=lengths.__getitem__)[len(lengths) // 2]  # a middle-length sample
    assert min(lengths) < lengths[target] < max(lengths)
    groups = [[target], [target, longest], [longest, target], [shortest, target], [target, shortest, longest],
              [longest, shortest, target]]
    T = lengths[target]
    rows = []
    for indices in groups:
        on, off = collate([online[i] for i in indices], indices), collate([cache[i] for i in indices], indices)
        _assert_batches_equal(on, off)
        b = indices.index(target)
        rows.append((on.target_hidden_BSF[b, :T], on.target_last_hidden_BSH[b, :T], on.target_hidden_BSF.shape[1]))
        assert on.target_hidden_BSF[b, T:].abs().sum() == 0  # padding rows are zero
    assert len({S for _, _, S in rows}) > 1  # the sample really saw different padding
    for hidden, last, _ in rows[1:]:
        assert torch.equal(hidden, rows[0][0]) and torch.equal(last, rows[0][1])


def test_reading_ids_runs_no_forward_and_bad_fields_are_refused(setup):
    model, _, _, _, online = setup
    calls = []
    handle = model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        ids = online.read(0, ("input_ids", "loss_mask"))
        assert set(ids) == {"input_ids", "loss_mask"} and not calls
        online.read(0, ("target_hidden",))
        assert calls
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="fields"):
        online.read(0, ("logits",))
    with pytest.raises(IndexError):
        online.read(len(online))


def test_fp8_online_equals_fp8_cache(setup, tmp_path):
    model, tok, prepared, _, _ = setup
    write_target_cache(prepared, tmp_path / "fp8", model, tok, target_layer_ids=LAYER_IDS, max_seq_len=MAX_SEQ_LEN,
                       storage_dtype="fp8", shard_size=4, progress=False)
    cache = TargetCache(tmp_path / "fp8")
    online = OnlineTargetFeatures(prepared, model, tok, target_layer_ids=LAYER_IDS, max_seq_len=MAX_SEQ_LEN,
                                  feature_dtype="fp8")
    for i in (0, len(cache) - 1):
        a, b = online[i], cache[i]
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (i, name)
        # the stored form the trainer reads (payload + scales, dequantised on its device) is the same too
        a, b = online.read(i, dequantize=False), cache.read(i, dequantize=False)
        assert a.keys() <= b.keys() and "target_hidden_scale" in a and a["target_hidden"].dtype == torch.float8_e4m3fn
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))


def _train_cfg(out, **kw):
    base = dict(output_dir=str(out), batch_size=3, num_anchors=4, markov_rank=8, max_steps=4, lr=1e-2,
                warmup_frac=0.25, target_layer_ids=LAYER_IDS, max_seq_len=MAX_SEQ_LEN)
    base.update(kw)
    return TrainConfig(**base)


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_online_training_equals_cache_training(setup, tmp_path):
    model, tok, prepared, cache, _ = setup
    ckpt_cache = train(_train_cfg(tmp_path / "cache", cache_dir=str(cache.path)), target_model=model, tokenizer=tok)
    ckpt_online = train(_train_cfg(tmp_path / "online", online_data=str(prepared)), target_model=model, tokenizer=tok)
    a, b = _log(tmp_path / "cache"), _log(tmp_path / "online")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert all(torch.isfinite(torch.tensor(x[k])) for k in ("loss", "ce", "l1"))
        assert x["loss"] == y["loss"] and x["ce"] == y["ce"] and x["grad_norm"] == y["grad_norm"]
    wa = DSparkDraftModel.from_pretrained(ckpt_cache / "draft").state_dict()
    wb = DSparkDraftModel.from_pretrained(ckpt_online / "draft").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_train_config_needs_exactly_one_data_source(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        TrainConfig(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="exactly one"):
        TrainConfig(output_dir=str(tmp_path), cache_dir="c", online_data="p.jsonl")
    with pytest.raises(ValueError, match="online_feature_dtype"):
        TrainConfig(output_dir=str(tmp_path), online_data="p.jsonl", online_feature_dtype="int8")


def test_online_refuses_data_that_contains_the_mask_token(setup, tmp_path):
    model, tok, _, _, _ = setup
    prepared = tmp_path / "bad.jsonl"
    row = {"id": "bad", "messages": [{"role": "user", "content": "hi <repo_name>"},
                                     {"role": "assistant", "content": "hello"}], "split": "train"}
    prepared.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="mask_token"):
        train(_train_cfg(tmp_path / "out", online_data=str(prepared)), target_model=model, tokenizer=tok)
    with pytest.raises(ValueError, match="target_layer_ids"):
        OnlineTargetFeatures(prepared, model, tok, target_layer_ids=[2], max_seq_len=None)
