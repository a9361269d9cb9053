"""Metrics on hand-made step records."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from deepspec.decoding.engine import GenerationResult, StepRecord
from deepspec.eval.metrics import (
    METRIC_DEFINITIONS,
    acceptance_stats,
    auroc,
    benchmark_metrics,
    brier_score,
    calibration_pairs,
    calibration_stats,
    expected_calibration_error,
    reliability_bins,
    speedup,
    step_timing_stats,
    tau_histogram,
    timing_stats,
)


def step(n, a, committed=None, t=0.1, propose=0.0, verify=0.0, conf=None):
    return StepRecord(num_proposed=n, num_accepted=a, num_committed=a + 1 if committed is None else committed,
                      time_s=t, propose_s=propose, verify_s=verify, confidence=conf)


STEPS = [step(3, 0), step(3, 3), step(3, 1), step(2, 2)]


def test_tau_and_verify_rate():
    s = acceptance_stats(STEPS)
    assert s.num_steps == 4
    assert s.tau == pytest.approx((1 + 4 + 2 + 3) / 4)
    # committed 1+4+2+3 = 10 ; fed 4+4+4+3 = 15
    assert s.verify_rate == pytest.approx(10 / 15)


def test_per_position_counts_and_rates():
    s = acceptance_stats(STEPS)
    assert s.num_proposed_at_k == [4, 4, 3]
    assert s.num_accepted_at_k == [3, 2, 1]
    # prefix survival: accepted>=k / proposed>=k
    assert s.accept_rate_prefix == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    # conditional: accepted>=k / (accepted>=k-1 and proposed>=k)
    # k=1: 3/4 ; k=2: reached = steps with a>=1 and n>=2 = 3 -> 2/3 ; k=3: a>=2 and n>=3 = 1 (the 3/3 step) -> 1/1
    assert s.accept_rate_conditional == pytest.approx([3 / 4, 2 / 3, 1.0])


def test_explicit_max_k_and_unreached_positions():
    s = acceptance_stats([step(1, 1)], max_k=3)
    assert s.num_proposed_at_k == [1, 0, 0]
    assert s.accept_rate_prefix[1] is None and s.accept_rate_conditional[2] is None


def test_target_only_has_tau_one_and_verify_rate_one():
    s = acceptance_stats([step(0, 0) for _ in range(5)])
    assert s.tau == 1.0 and s.verify_rate == 1.0 and s.num_proposed_at_k == []


def test_no_steps_no_nan():
    s = acceptance_stats([])
    assert s.tau == 0.0 and s.verify_rate == 0.0


def test_eos_step_commits_accepted_only():
    """A step that ends at an accepted EOS commits the accepted drafts and no bonus token: tau counts what was
    committed (the original DeepSpec's 5.0 for 5 accepted drafts ending at an EOS, not 6.0)."""
    s = acceptance_stats([step(3, 2, committed=2)])
    assert s.tau == 2.0 and s.verify_rate == pytest.approx(2 / 4) and s.tau_histogram == [0, 1, 0, 0]
    s = acceptance_stats([step(7, 5, committed=5)], max_k=7)
    assert s.tau == 5.0 and s.tau_histogram == [0, 0, 0, 0, 1, 0, 0, 0]
    s = acceptance_stats([step(7, 5, committed=5), step(7, 3)], max_k=7)
    assert s.tau == pytest.approx((5 + 4) / 2) and sum((i + 1) * c for i, c in enumerate(s.tau_histogram)) == 9


def _result(n_tokens, total, ttft, steps=(), ids=None):
    return GenerationResult(prompt_len=5, output_ids=ids if ids is not None else list(range(n_tokens)),
                            steps=list(steps), ttft_s=ttft, total_time_s=total, stop_reason="eos")


def test_serve_tau_counts_committed_tokens():
    """``deepspec serve``'s per-request tau counts what the steps committed, as eval does."""
    from deepspec.serve.decoder import ServeResult

    steps = [step(7, 3), step(7, 5, committed=5)]  # 4 tokens, then 5 accepted drafts ending at an EOS
    res = ServeResult.from_generation(_result(10, 1.0, 0.1, steps))
    assert (res.num_verify_steps, res.num_accepted_tokens, res.num_committed_tokens) == (2, 8, 9)
    assert res.tau == pytest.approx(acceptance_stats(steps).tau) == pytest.approx(4.5)
    assert res.acceptance()["tau"] == res.tau and res.finish_reason == "stop"


def test_timing_and_speedup():
    base = [_result(10, 2.0, 0.2), _result(10, 2.0, 0.2)]
    spec = [_result(10, 1.0, 0.2, STEPS), _result(10, 0.6, 0.2, ids=[9] * 10)]
    tb, ts = timing_stats(base), timing_stats(spec)
    assert tb.tok_per_s == pytest.approx(5.0) and ts.tok_per_s == pytest.approx(20 / 1.6)
    assert tb.ttft_ms == pytest.approx(200.0)
    assert tb.tpot_ms == pytest.approx(1000 * 3.6 / 18)
    assert speedup(tb, ts) == pytest.approx(4.0 / 1.6)
    m = benchmark_metrics(spec, baseline=base, max_k=3)
    assert m["speedup"] == pytest.approx(2.5) and m["frac_identical_to_baseline"] == 0.5
    # per prompt 2.0 / 1.0 = 2 and 2.0 / 0.6 = 3.33; with a third prompt the median is the middle one, not the mean
    assert m["speedup_median"] == pytest.approx((2.0 + 2.0 / 0.6) / 2)
    three = benchmark_metrics([*spec, _result(10, 4.0, 0.2)], baseline=[*base, _result(10, 2.0, 0.2)], max_k=3)
    assert three["speedup_median"] == pytest.approx(2.0) and three["speedup"] == pytest.approx(6.0 / 5.6)
    assert m["tau"] == pytest.approx(2.5) and m["num_output_tokens"] == 20
    assert "speedup" not in benchmark_metrics(base)
    with pytest.raises(ValueError, match="baseline"):
        benchmark_metrics(spec, baseline=base[:1])


def test_definitions_cover_reported_figures():
    for key in ("tau", "verify_rate", "speedup", "tok_per_s", "ttft_ms", "tpot_ms",
                "accept_rate_conditional@k", "accept_rate_prefix@k", "tau_histogram", "mean_num_proposed",
                "frac_steps_truncated", "time_ms_per_step", "propose_ms_per_step", "verify_ms_per_step",
                "overhead_ms_per_step", "calibration", "calibration.ece", "calibration.auroc", "calibration.brier"):
        assert key in METRIC_DEFINITIONS
    # Every key benchmark_metrics emits (calibration sub-keys included) has a definition.
    spec = [_result(4, 1.0, 0.1, CAL_STEPS)]
    base = [_result(4, 2.0, 0.1, [step(0, 0)] * 3)]
    m = benchmark_metrics(spec, baseline=base, max_k=3)
    for key in m:
        assert (f"{key}@k" if key in ("accept_rate_conditional", "accept_rate_prefix") else key) in METRIC_DEFINITIONS
    cal = m["calibration"]
    sub = set(cal) | set(cal["pooled"]) | {k for row in cal["per_position"] for k in row}
    for key in sub - {"pooled", "per_position"}:
        assert f"calibration.{key}" in METRIC_DEFINITIONS, key


# --- tau histogram, truncation, per-step timing ------------------------------------------------


def test_tau_histogram_counts_lengths():
    assert tau_histogram(STEPS, 3) == [1, 1, 1, 1]  # lengths 1, 4, 2, 3
    assert tau_histogram([step(3, 1), step(3, 1), step(2, 0)], 3) == [1, 2, 0, 0]
    assert tau_histogram([step(2, 2), step(1, 0)]) == [1, 0, 1]  # K from the most drafts proposed
    assert tau_histogram([], 2) == [0, 0, 0] and tau_histogram([]) == [0]
    assert tau_histogram([step(0, 0)] * 4, 0) == [4]  # target-only: every step has length 1
    with pytest.raises(ValueError, match="max_k"):
        tau_histogram([step(3, 3)], 2)


def test_tau_histogram_agrees_with_tau():
    rng = random.Random(0)
    steps = [step(n, rng.randint(0, n)) for n in (rng.randint(0, 5) for _ in range(200))]
    s = acceptance_stats(steps, 5)
    assert sum(s.tau_histogram) == s.num_steps == 200
    assert sum((i + 1) * c for i, c in enumerate(s.tau_histogram)) / s.num_steps == pytest.approx(s.tau)


def test_truncation_figures():
    s = acceptance_stats(STEPS, 3)
    assert s.mean_num_proposed == pytest.approx(11 / 4)
    assert s.frac_steps_truncated == pytest.approx(1 / 4)  # the step that proposed 2 of K = 3
    assert acceptance_stats(STEPS, 4).frac_steps_truncated == 1.0
    empty = acceptance_stats([], 3)
    assert empty.mean_num_proposed is None and empty.frac_steps_truncated is None
    assert acceptance_stats([step(0, 0)], 0).frac_steps_truncated == 0.0
    # Steps of proposers with different K (a draft with prompt lookup in front): each against its own K.
    mixed = [dataclasses.replace(step(3, 1), max_proposal_len=3), dataclasses.replace(step(3, 3), max_proposal_len=7),
             dataclasses.replace(step(7, 2), max_proposal_len=7)]
    assert acceptance_stats(mixed).frac_steps_truncated == pytest.approx(1 / 3)


def test_step_timing_breakdown():
    t = step_timing_stats([step(3, 1, t=0.010, propose=0.004, verify=0.005),
                           step(3, 0, t=0.020, propose=0.006, verify=0.010)])
    assert t.time_ms_per_step == pytest.approx(15.0)
    assert t.propose_ms_per_step == pytest.approx(5.0)
    assert t.verify_ms_per_step == pytest.approx(7.5)
    assert t.overhead_ms_per_step == pytest.approx((1.0 + 4.0) / 2)
    none = step_timing_stats([])
    assert none.time_ms_per_step is None and none.overhead_ms_per_step is None


# --- confidence calibration ----------------------------------------------------------------------

CAL_STEPS = [
    step(3, 1, conf=(0.9, 0.6, 0.3)),           # pairs (1, .9, 1) (2, .6, 0); slot 3 not reached
    step(3, 3, conf=(0.8, 0.7, 0.5)),           # all accepted: (1, .8, 1) (2, .7, 1) (3, .5, 1)
    step(3, 0, conf=(0.4, 0.9, 0.9)),           # (1, .4, 0)
    step(2, 1, committed=1, conf=(0.95, 0.2)),  # accepted EOS at slot 1: slot 2 never verified
    step(3, 2),                                 # no confidences: skipped
    step(0, 0, conf=()),                        # nothing proposed: no pairs
]
POOLED_CONF = [0.9, 0.6, 0.8, 0.7, 0.5, 0.4, 0.95]
POOLED_LABELS = [1, 0, 1, 1, 1, 0, 1]


def test_calibration_pairs():
    assert calibration_pairs(CAL_STEPS) == [
        (1, 0.9, 1), (2, 0.6, 0), (1, 0.8, 1), (2, 0.7, 1), (3, 0.5, 1), (1, 0.4, 0), (1, 0.95, 1)]


def test_calibration_pairs_validate():
    with pytest.raises(ValueError, match="one value per proposed draft"):
        calibration_pairs([step(3, 1, conf=(0.5, 0.5))])
    for bad in (1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            calibration_pairs([step(2, 1, conf=(0.5, bad))])


def test_calibration_stats_hand_values():
    cal = calibration_stats(CAL_STEPS, max_k=4)
    assert cal["num_steps"] == 5 and cal["num_bins"] == 10
    p = cal["pooled"]
    assert p["num_pairs"] == 7
    assert p["mean_confidence"] == pytest.approx(4.85 / 7)
    assert p["accept_rate"] == pytest.approx(5 / 7)
    assert p["brier"] == pytest.approx((0.01 + 0.36 + 0.04 + 0.09 + 0.25 + 0.16 + 0.0025) / 7)
    # negatives 0.6 and 0.4: 4 + 5 of the 10 (positive, negative) pairs are ordered correctly
    assert p["auroc"] == pytest.approx(0.9)
    # bins 4: .4/0, 5: .5/1, 6: .6/0, 7: .7/1, 8: .8/1, 9: (.9, .95)/(1, 1)
    assert p["ece"] == pytest.approx((0.4 + 0.5 + 0.6 + 0.3 + 0.2 + 2 * 0.075) / 7)
    assert [b["num_pairs"] for b in p["bins"]] == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2]
    assert p["bins"][9]["mean_confidence"] == pytest.approx(0.925) and p["bins"][0]["accept_rate"] is None

    k1, k2, k3, k4 = cal["per_position"]
    assert [r["k"] for r in cal["per_position"]] == [1, 2, 3, 4]
    assert k1["num_pairs"] == 4 and k1["mean_confidence"] == pytest.approx(3.05 / 4)
    assert k1["accept_rate"] == pytest.approx(0.75) and k1["auroc"] == 1.0
    assert k1["brier"] == pytest.approx((0.01 + 0.04 + 0.16 + 0.0025) / 4)
    assert k2["num_pairs"] == 2 and k2["accept_rate"] == 0.5 and k2["auroc"] == 1.0
    assert k2["brier"] == pytest.approx((0.36 + 0.09) / 2)
    assert k3["num_pairs"] == 1 and k3["auroc"] is None and k3["ece"] == pytest.approx(0.5)
    assert k4 == {"k": 4, "num_pairs": 0, "mean_confidence": None, "accept_rate": None, "brier": None,
                  "ece": None, "auroc": None}
    json.dumps(cal, allow_nan=False)
    assert len(calibration_stats(CAL_STEPS)["per_position"]) == 3  # default K: deepest evaluated slot


def test_calibration_none_without_confidences():
    assert calibration_stats(STEPS) is None and calibration_stats([]) is None


def _slow_auroc(conf, labels):
    pos = [c for c, y in zip(conf, labels) if y]
    neg = [c for c, y in zip(conf, labels) if not y]
    if not pos or not neg:
        return None
    return sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg) / (len(pos) * len(neg))


def _slow_ece(conf, labels, num_bins):
    total = 0.0
    for b in range(num_bins):
        lo, hi = b / num_bins, (b + 1) / num_bins
        idx = [i for i, c in enumerate(conf) if lo <= c < hi or (b == num_bins - 1 and c == 1.0)]
        if idx:
            mean_c = sum(conf[i] for i in idx) / len(idx)
            acc = sum(labels[i] for i in idx) / len(idx)
            total += len(idx) / len(conf) * abs(mean_c - acc)
    return total


def test_auroc_ties_and_degenerate():
    assert auroc([0.5, 0.5, 0.5, 0.7], [1, 0, 0, 1]) == pytest.approx(0.75)
    assert auroc([0.3, 0.3], [1, 0]) == 0.5
    assert auroc([0.1, 0.9], [1, 0]) == 0.0
    assert auroc([0.2, 0.4], [1, 1]) is None and auroc([], []) is None
    with pytest.raises(ValueError, match="labels"):
        auroc([0.1, 0.2], [1])


@pytest.mark.parametrize("seed", range(5))
def test_auroc_and_ece_match_slow_loops(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 60)
    conf = [rng.randint(0, 10) / 10 if seed % 2 else rng.random() for _ in range(n)]  # odd seeds: many ties
    labels = [int(rng.random() < c) for c in conf]
    expected = _slow_auroc(conf, labels)
    got = auroc(conf, labels)
    assert (got is None) == (expected is None) and (got is None or got == pytest.approx(expected))
    for num_bins in (1, 5, 10):
        if seed % 2 == 0:  # bin edges are exact only for conf off the edges
            assert expected_calibration_error(conf, labels, num_bins) == pytest.approx(_slow_ece(conf, labels, num_bins))
    assert brier_score(conf, labels) == pytest.approx(sum((c - y) ** 2 for c, y in zip(conf, labels)) / n)


def test_reliability_bins_edges():
    bins = reliability_bins([0.0, 1.0, 0.5], [0, 1, 1], num_bins=4)
    assert [b["num_pairs"] for b in bins] == [1, 0, 1, 1]  # 1.0 goes to the last bin, 0.5 to [0.5, 0.75)
    assert bins[0]["lo"] == 0.0 and bins[3]["hi"] == 1.0
    assert expected_calibration_error([0.0, 1.0], [0, 1]) == 0.0
    assert expected_calibration_error([], []) is None and brier_score([], []) is None
    with pytest.raises(ValueError, match="num_bins"):
        reliability_bins([0.5], [1], num_bins=0)


def test_benchmark_metrics_new_keys_json_ready():
    steps = [step(3, 1, t=0.01, propose=0.004, verify=0.005, conf=(0.9, 0.6, 0.3)),
             step(3, 3, t=0.01, propose=0.004, verify=0.005, conf=(0.8, 0.7, 0.5))]
    m = benchmark_metrics([_result(6, 0.1, 0.01, steps)], max_k=3)
    assert m["tau_histogram"] == [0, 1, 0, 1]
    assert m["propose_ms_per_step"] == pytest.approx(4.0) and m["overhead_ms_per_step"] == pytest.approx(1.0)
    assert m["mean_num_proposed"] == 3.0 and m["frac_steps_truncated"] == 0.0
    assert m["calibration"]["pooled"]["num_pairs"] == 5
    json.dumps(m, allow_nan=False)
    empty = benchmark_metrics([_result(1, 0.1, 0.1)], max_k=3)
    assert empty["calibration"] is None and empty["time_ms_per_step"] is None
    assert empty["tau_histogram"] == [0, 0, 0, 0]
    json.dumps(empty, allow_nan=False)
