"""Metrics on hand-made step records."""

from __future__ import annotations

import pytest

from deepspec.eval.engine import GenerationResult, StepRecord
from deepspec.eval.metrics import METRIC_DEFINITIONS, acceptance_stats, benchmark_metrics, speedup, timing_stats


def step(n, a, committed=None, t=0.1):
    return StepRecord(num_proposed=n, num_accepted=a, num_committed=a + 1 if committed is None else committed, time_s=t)


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
    s = acceptance_stats([step(3, 2, committed=2)])
    assert s.tau == 3.0 and s.verify_rate == pytest.approx(2 / 4)


def _result(n_tokens, total, ttft, steps=(), ids=None):
    return GenerationResult(prompt_len=5, output_ids=ids if ids is not None else list(range(n_tokens)),
                            steps=list(steps), ttft_s=ttft, total_time_s=total, stop_reason="eos")


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
    assert m["tau"] == pytest.approx(2.5) and m["num_output_tokens"] == 20
    assert "speedup" not in benchmark_metrics(base)
    with pytest.raises(ValueError, match="baseline"):
        benchmark_metrics(spec, baseline=base[:1])


def test_definitions_cover_reported_figures():
    for key in ("tau", "verify_rate", "speedup", "tok_per_s", "ttft_ms", "tpot_ms",
                "accept_rate_conditional@k", "accept_rate_prefix@k"):
        assert key in METRIC_DEFINITIONS
