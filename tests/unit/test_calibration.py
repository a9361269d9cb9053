"""Confidence calibration (docs/design/decoding.md, "Confidence calibration"): the per-depth Platt fit, its
file beside the draft, the DSpark proposer's calibrated confidences and the eval's raw / calibrated figures."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from deepspec.decoding.engine import StepRecord
from deepspec.eval.metrics import auroc, benchmark_metrics, expected_calibration_error
from deepspec.models.calibration import (CALIBRATION_NAME, ConfidenceCalibration, PlattMap, fit_calibration,
                                         fit_platt, load_calibration, save_calibration)


def overconfident_pairs(n_per_depth: int = 400, depths: int = 3, seed: int = 0) -> list[tuple[int, float, int]]:
    """Synthetic ``(k, c, label)`` pairs whose true accept probability is ``c ** 2 / (1 + k)``: well ranked,
    overconfident everywhere and more so at deeper slots (the shape the DSpark head showed)."""
    rng = random.Random(seed)
    pairs = []
    for k in range(1, depths + 1):
        for _ in range(n_per_depth):
            c = rng.uniform(0.05, 0.95)
            pairs.append((k, c, int(rng.random() < c * c / (1 + k))))
    return pairs


def test_fit_on_overconfident_pairs_is_monotone_and_lowers_ece():
    train, test = overconfident_pairs(seed=0), overconfident_pairs(seed=1)
    cal = fit_calibration(train)
    assert len(cal.per_depth) == 3 and not any(m.pooled for m in cal.per_depth)
    for k in (1, 2, 3, 4):  # depth 4 was never seen: the pooled map
        values = [cal.apply(c / 100, k) for c in range(101)]
        assert all(b > a for a, b in zip(values, values[1:])), k  # strictly increasing
    raw = [c for _, c, _ in test]
    calibrated = [cal.apply(c, k) for k, c, _ in test]
    labels = [y for _, _, y in test]
    ece_raw, ece_cal = expected_calibration_error(raw, labels), expected_calibration_error(calibrated, labels)
    assert ece_raw > 0.25 and ece_cal < 0.05, (ece_raw, ece_cal)
    assert sum(calibrated) / len(calibrated) == pytest.approx(sum(labels) / len(labels), abs=0.03)
    for k in (1, 2, 3):  # the map keeps each depth's ranking
        at_k = [(c, cal.apply(c, kk), y) for kk, c, y in test if kk == k]
        assert auroc([a for a, _, _ in at_k], [y for _, _, y in at_k]) == pytest.approx(
            auroc([b for _, b, _ in at_k], [y for _, _, y in at_k]))


def test_fit_platt_recovers_a_known_map_and_handles_one_class():
    rng = random.Random(3)
    xs = [rng.uniform(0.01, 0.99) for _ in range(4000)]
    true = PlattMap(a=0.5, b=-1.0)
    ys = [int(rng.random() < true(c)) for c in xs]
    fit = fit_platt(xs, ys, prior_strength=1e-3)
    assert fit.a == pytest.approx(0.5, abs=0.08) and fit.b == pytest.approx(-1.0, abs=0.12)
    assert fit.num_pairs == 4000
    all_rejected = fit_platt([0.5, 0.7, 0.9], [0, 0, 0])  # the prior keeps it finite and increasing
    assert all_rejected.a > 0 and math.isfinite(all_rejected.b) and all_rejected(0.9) < 0.9
    with pytest.raises(ValueError, match="one label per confidence"):
        fit_platt([0.5], [1, 0])
    with pytest.raises(ValueError, match="0 or 1"):
        fit_platt([0.5], [2])


def test_depth_with_few_pairs_uses_the_pooled_map():
    pairs = overconfident_pairs(n_per_depth=200, depths=2) + [(3, 0.9, 0), (3, 0.8, 1)]
    cal = fit_calibration(pairs, min_pairs=30)
    assert cal.per_depth[2].pooled and cal.per_depth[2].num_pairs == 2
    assert (cal.per_depth[2].a, cal.per_depth[2].b) == (cal.pooled.a, cal.pooled.b)
    assert fit_calibration([]) is None


def test_save_load_round_trip(tmp_path):
    cal = fit_calibration(overconfident_pairs(), info={"source": "test"})
    path = save_calibration(tmp_path, cal)
    assert path == tmp_path / CALIBRATION_NAME
    loaded = load_calibration(tmp_path)
    assert loaded == cal
    assert [loaded.apply(0.7, k) for k in (1, 2, 3, 9)] == [cal.apply(0.7, k) for k in (1, 2, 3, 9)]
    assert load_calibration(tmp_path / "missing") is None
    d = json.loads(path.read_text())
    d["per_depth"][0]["a"] = -1.0
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="monotone"):
        load_calibration(tmp_path)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="format"):
        load_calibration(tmp_path)


def test_dspark_draft_saves_loads_and_reports_calibrated_confidences(tmp_path):
    from deepspec.algorithms.dspark.model import DSparkDraftModel
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.target.decoding import SamplingParams
    from tests.unit.test_dspark import batch, capture, make_draft

    target, model = make_draft("llama")
    cal = ConfidenceCalibration((PlattMap(0.5, -2.0), PlattMap(0.5, -3.0)), PlattMap(0.5, -4.0), {"source": "test"})
    model.confidence_calibration = cal
    model.save_pretrained(tmp_path / "draft")
    assert (tmp_path / "draft" / CALIBRATION_NAME).is_file()
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "draft").eval()
    assert loaded.confidence_calibration == cal

    ids, _ = batch(B=1, S=20)
    feats, _ = capture(target, ids)
    proposals = {}
    for calibrate in (True, False):
        p = DSparkProposer(loaded, max_positions=128, calibrate=calibrate)
        p.extend_context(feats[0, :12], ids[0, :12].tolist())
        proposals[calibrate] = p.propose(int(ids[0, 12]), 12, sampling=SamplingParams(), generator=None)
    on, off = proposals[True], proposals[False]
    assert off.raw_confidence_N is None and torch.equal(on.draft_ids_N, off.draft_ids_N)
    assert torch.allclose(on.raw_confidence_N, off.confidence_N)
    expected = torch.tensor(cal.apply_all(off.confidence_N.tolist()))
    assert torch.allclose(on.confidence_N, expected, atol=1e-6)
    assert not torch.allclose(on.confidence_N, off.confidence_N)


def test_eval_reports_raw_and_calibrated_figures():
    from deepspec.decoding.engine import GenerationResult

    steps = [StepRecord(num_proposed=2, num_accepted=1, num_committed=2, time_s=0.01, confidence=(0.5, 0.2),
                        raw_confidence=(0.9, 0.8)),
             StepRecord(num_proposed=2, num_accepted=0, num_committed=1, time_s=0.01, confidence=(0.3, 0.1),
                        raw_confidence=(0.7, 0.6))]
    result = GenerationResult(prompt_len=1, output_ids=[1, 2, 3], steps=steps, ttft_s=0.01, total_time_s=0.03)
    m = benchmark_metrics([result], max_k=2)
    assert m["calibration"]["pooled"]["mean_confidence"] == pytest.approx((0.5 + 0.2 + 0.3) / 3)
    assert m["calibration_raw"]["pooled"]["mean_confidence"] == pytest.approx((0.9 + 0.8 + 0.7) / 3)
    plain = [StepRecord(num_proposed=2, num_accepted=1, num_committed=2, time_s=0.01, confidence=(0.5, 0.2))]
    assert benchmark_metrics([GenerationResult(prompt_len=1, output_ids=[1], steps=plain, total_time_s=0.01)],
                             max_k=2)["calibration_raw"] is None


def test_dspark_tree_scores_its_chain_and_the_eval_reads_the_chains_slots():
    """A DSpark tree's confidences are its chain's (node 0 of each level; NaN elsewhere), equal to the chain
    proposer's; a tree step's pairs stop at the first chain node the accepted path left."""
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.decoding.engine import step_confidences
    from deepspec.eval.metrics import calibration_pairs
    from deepspec.target.decoding import SamplingParams
    from tests.unit.test_dspark import batch, capture, make_draft

    target, model = make_draft("llama")
    model.eval()
    ids, _ = batch(B=1, S=20)
    feats, _ = capture(target, ids)
    out = {}
    for width in (1, 3):
        p = DSparkProposer(model, max_positions=128, tree_width=width)
        p.extend_context(feats[0, :12], ids[0, :12].tolist())
        out[width] = p.propose(int(ids[0, 12]), 12, sampling=SamplingParams(), generator=None)
    chain, tree = out[1], out[3]
    path = tree.scored_path()
    assert len(path) == tree.depth == 7 and tree.draft_ids_N[path].tolist() == chain.draft_ids_N.tolist()
    assert torch.allclose(tree.confidence_N[path], chain.confidence_N, atol=1e-6)
    assert torch.isnan(tree.confidence_N).sum() == tree.num_proposed - 7

    # the accepted path follows the chain for j nodes, then a sibling of the chain's node j + 1
    j, sibling = next((j, i) for j in range(6, -1, -1) for i, p in enumerate(tree.parents_N)
                      if p == (path[j - 1] if j else -1) and i != path[j])
    conf, raw, scored_accepted = step_confidences(tree, [*path[:j], sibling])
    assert scored_accepted == j and raw is None and conf == pytest.approx(chain.confidence_N.tolist())
    step = StepRecord(num_proposed=7, num_accepted=j + 1, num_committed=j + 2, time_s=0.0, confidence=conf,
                      num_scored_accepted=scored_accepted, num_draft_nodes=tree.num_proposed)
    assert [(k, y) for k, _, y in calibration_pairs([step])] == [(k, 1) for k in range(1, j + 1)] + [(j + 1, 0)]
