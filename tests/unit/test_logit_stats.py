"""The cache's target-logit statistics and the losses' W-logit path they enable.

A reduced-vocabulary draft's losses (DSpark/DFlash, Eagle3) read the target's probabilities of the
W draft tokens; with the cache's per-position logsumexp and argmax they compute W target logits
instead of V. These tests check that the statistics are what they claim, that both paths give the
same losses, diagnostics and gradients, and that a cache of format 2 (without them) is refused.

Shape legend: B batch, S sequence length, T tokens of a sample, V target vocabulary, W draft vocabulary.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepspec.algorithms.dspark.config import dflash_knobs, draft_config_from_target
from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.registry import get_algorithm
from deepspec.data.cache import TargetCache, verify_target_cache, write_target_cache_from_samples
from deepspec.data.cache.format import LOGIT_STAT_FIELDS, MANIFEST_NAME, sha256_file
from deepspec.target.capture import target_draft_probs, target_logit_stats, target_logits
from deepspec.train.data import collate
from tests.unit.test_dspark import MASK, V, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER_IDS = [0, 1]
D2T = torch.arange(2, V, 2)  # a reduced draft vocabulary of W = 31 target ids


def _samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        T = int(torch.randint(12, 30, (1,), generator=g))
        ids = torch.randint(6, V, (T,), generator=g).tolist()
        out.append((f"s{k}", ids, [0] * 5 + [1] * (T - 5)))
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=0)


@pytest.fixture(scope="module")
def cache_dir(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    write_target_cache_from_samples(_samples(), out, target, target_layer_ids=LAYER_IDS, target_fingerprint="t",
                                    tokenizer_fingerprint="k", shard_size=4, storage_dtype="bfloat16",
                                    progress=False)
    return out


def test_stored_stats_are_the_target_logits_of_the_stored_hidden_state(target, cache_dir):
    cache = TargetCache(cache_dir)
    assert cache.fields[-2:] == LOGIT_STAT_FIELDS
    for i in range(len(cache)):
        s = cache[i]
        logits_TV = target_logits(target, s["target_last_hidden"].float()).float()
        read_T = torch.zeros_like(s["loss_mask"], dtype=torch.bool)
        read_T[:-1] = s["loss_mask"][1:].bool()  # position p is read iff loss_mask[p + 1]
        assert s["target_logsumexp"].dtype == torch.float32 and s["target_argmax"].dtype == torch.int32
        torch.testing.assert_close(s["target_logsumexp"][read_T], torch.logsumexp(logits_TV, -1)[read_T])
        assert torch.equal(s["target_argmax"][read_T].long(), logits_TV.argmax(-1)[read_T])
        assert torch.isnan(s["target_logsumexp"][~read_T]).all() and (s["target_argmax"][~read_T] == -1).all()
    verify_target_cache(cache_dir, log=None)


def test_target_draft_probs_cached_path_equals_the_full_softmax(target):
    g = torch.Generator().manual_seed(3)
    hidden_NH = torch.randn(9, 32, generator=g)
    lse_N, argmax_N = target_logit_stats(target, torch.cat([hidden_NH, hidden_NH[:1]]), [1] * 10)
    full = target_draft_probs(hidden_NH, target.lm_head.weight, D2T, None)
    fast = target_draft_probs(hidden_NH, target.lm_head.weight, D2T, None, logsumexp_N=lse_N[:9],
                              argmax_N=argmax_N[:9])
    for a, b in zip(full, fast):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    p_NV = torch.softmax(target.lm_head(hidden_NH), -1)
    torch.testing.assert_close(full[0], p_NV[:, D2T])
    torch.testing.assert_close(full[1], 1 - p_NV[:, D2T].sum(-1))
    with pytest.raises(ValueError, match="loss_mask_T"):
        target_logit_stats(target, hidden_NH, [1] * 4)


def _drafts(target):
    dspark_cfg = draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                          mask_token_id=MASK, markov_rank=8, block_size=4,
                                          draft_vocab_size=int(D2T.numel()))
    dflash_cfg = draft_config_from_target(target.config, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                          mask_token_id=MASK, block_size=4, draft_vocab_size=int(D2T.numel()),
                                          **dflash_knobs())
    from tests.unit.test_eagle3 import reduced_eagle3

    torch.manual_seed(1)
    return {"dspark": DSparkDraftModel.from_target(target, dspark_cfg, d2t=D2T),
            "dflash": DSparkDraftModel.from_target(target, dflash_cfg, d2t=D2T),
            "eagle3": reduced_eagle3(target, D2T)}


@pytest.mark.parametrize("name", ["dspark", "dflash", "eagle3"])
def test_losses_with_and_without_the_stats_agree(target, cache_dir, name):
    """Same loss, diagnostics, acceptance counts and gradients whether the target side computes V
    logits (online) or W logits and the cached statistics."""
    cache = TargetCache(cache_dir)
    draft = _drafts(target)[name]
    algo = get_algorithm(name)
    samples = [cache[i] for i in range(4)]
    with_stats = collate(samples, [0, 1, 2, 3])
    without = collate([{k: v for k, v in s.items() if k not in LOGIT_STAT_FIELDS} for s in samples], [0, 1, 2, 3])
    assert with_stats.target_logsumexp_BS is not None and without.target_logsumexp_BS is None
    cfg = algo.Options(**{"num_chains" if name == "eagle3" else "num_anchors": 6})
    nullctx = torch.autocast("cpu", enabled=False)
    runs = []
    for batch in (without, with_stats):
        prepared = algo.prepare(draft, batch, torch.Generator().manual_seed(0), cfg)
        draft.zero_grad()
        out = algo.loss(draft, prepared, weight_sum=algo.weight(draft, prepared), autocast=nullctx)
        out.loss.backward()
        runs.append((out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = runs
    torch.testing.assert_close(b.loss, a.loss, atol=1e-6, rtol=1e-5)
    for key, value in a.scalars().items():
        assert float(b.scalars()[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), key
    assert a.acceptance is not None and b.acceptance.greedy_tau() == a.acceptance.greedy_tau()
    assert b.acceptance.tau() == pytest.approx(a.acceptance.tau(), rel=1e-5)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-6, rtol=1e-4)
    # statistics missing at a supervised position are an error, never a silent NaN loss
    for bad in (float("nan"), float("inf")):
        broken = collate(samples, [0, 1, 2, 3])
        broken.target_logsumexp_BS[:] = bad
        prepared = algo.prepare(draft, broken, torch.Generator().manual_seed(0), cfg)
        with pytest.raises(ValueError, match="target_logsumexp_BS is not finite.*--verify"):
            algo.loss(draft, prepared, weight_sum=algo.weight(draft, prepared), autocast=nullctx)


FORMAT_2 = "deepspec-target-cache/2"


def _format_2_copy(cache_dir, old):
    """``cache_dir`` in format 2: no statistics in the shards, the format-2 run key."""
    from deepspec.data.cache.writer import _run_key

    old.mkdir()
    manifest = json.loads((cache_dir / MANIFEST_NAME).read_text())
    manifest["settings"]["format"] = FORMAT_2
    manifest["run_key"] = _run_key(manifest["settings"])
    for entry in manifest["shards"]:
        with safe_open(str(cache_dir / entry["file"]), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k not in LOGIT_STAT_FIELDS}
            meta = f.metadata()
        meta = {"deepspec": json.dumps({**json.loads(meta["deepspec"]), "format": FORMAT_2,
                                        "run_key": manifest["run_key"]}, sort_keys=True)}
        save_file(tensors, str(old / entry["file"]), metadata=meta)
        entry["num_bytes"] = (old / entry["file"]).stat().st_size
        entry["sha256"] = sha256_file(old / entry["file"])
    manifest["format"] = FORMAT_2
    for key in LOGIT_STAT_FIELDS:
        manifest["dtypes"].pop(key)
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    return old


def test_a_format_2_cache_is_refused_with_the_fix(target, cache_dir, tmp_path):
    """A cache of format 2 (no target-logit statistics) is refused by the reader, ``--verify`` and a
    `deepspec cache` rerun on its folder, each naming the manifest's "format" and ``deepspec cache``."""
    old = _format_2_copy(cache_dir, tmp_path / "old")
    for read in (TargetCache, lambda p: verify_target_cache(p, log=None)):
        with pytest.raises(ValueError, match=r'"format": .deepspec-target-cache/2. \(format 2: shards without '
                                             r"target_logsumexp / target_argmax\).*deepspec cache --input"):
            read(old)
    before = {p.name: p.stat().st_mtime_ns for p in old.iterdir()}
    args = dict(target_layer_ids=LAYER_IDS, target_fingerprint="t", tokenizer_fingerprint="k", shard_size=4,
                storage_dtype="bfloat16", progress=False)
    with pytest.raises(ValueError, match=r'"format": .deepspec-target-cache/2.*`deepspec cache` again into a new '
                                         r"--output-dir"):
        write_target_cache_from_samples(_samples(), old, target, **args)
    assert {p.name: p.stat().st_mtime_ns for p in old.iterdir()} == before  # nothing rewritten


def test_verify_checks_the_stats_cover_exactly_the_read_positions(cache_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(cache_dir, broken)
    shard = broken / "shard-00000.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    read = torch.nonzero(torch.isfinite(tensors["target_logsumexp"]))[0, 0]
    tensors["target_logsumexp"][read] = float("nan")
    save_file(tensors, str(shard), metadata=meta)
    manifest = json.loads((broken / MANIFEST_NAME).read_text())  # a consistent file: only its statistics are off
    manifest["shards"][0].update(sha256=sha256_file(shard), num_bytes=shard.stat().st_size)
    (broken / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="shard-00000.*target_logsumexp / target_argmax: not finite"):
        verify_target_cache(broken, log=None)
