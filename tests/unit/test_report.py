"""The evaluation report: Markdown tables, JSON and PNG files from a hand-built results dict."""

from __future__ import annotations

import json

import pytest

from deepspec.decoding.engine import GenerationResult, StepRecord
from deepspec.eval.metrics import METRIC_DEFINITIONS, benchmark_metrics
from deepspec.eval.report import (
    BASELINE,
    FILE_NAMES,
    HF_GENERATE,
    has_calibration,
    markdown_report,
    plot_reliability,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step(n, a, conf=None, committed=None):
    return StepRecord(num_proposed=n, num_accepted=a, num_committed=a + 1 if committed is None else committed,
                      time_s=0.010, propose_s=0.003, verify_s=0.006, confidence=conf)


def result(steps, n_tokens, total):
    return GenerationResult(prompt_len=4, output_ids=list(range(n_tokens)), steps=steps, ttft_s=0.01,
                            total_time_s=total, stop_reason="eos")


CURVE = {"tokens": [1, 2, 4, 8], "seconds": [0.010, 0.011, 0.013, 0.020]}


def results_dict(*, with_confidence: bool, scheduled: bool = False) -> dict:
    conf = (lambda *c: c) if with_confidence else (lambda *c: None)
    base = [result([step(0, 0)] * 5, 6, 0.06)]
    dspark = [result([step(3, 1, conf(0.9, 0.6, 0.3)), step(3, 3, conf(0.8, 0.7, 0.5)), step(2, 0, conf(0.4, 0.2))],
                     8, 0.04)]
    dflash = [result([step(3, 2), step(3, 0)], 5, 0.03)]
    hf = benchmark_metrics([result([], 6, 0.05)], baseline=base)
    bench = {
        BASELINE: benchmark_metrics(base, max_k=0),
        "dspark": benchmark_metrics(dspark, baseline=base, max_k=3),
        "dflash": benchmark_metrics(dflash, baseline=base, max_k=3),
        HF_GENERATE: {k: hf[k] for k in ("num_prompts", "num_output_tokens", "total_time_s", "tok_per_s",
                                         "time_per_output_token_ms", "speedup", "frac_identical_to_baseline")},
    }
    return {
        "config": {"max_new_tokens": 8, "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 0.9}, "seed": 0,
                   "target": "tiny", "step_cost_curve": CURVE if scheduled else None},
        "environment": {"torch": "x"},
        "definitions": METRIC_DEFINITIONS,
        "benchmarks": {"gsm8k": bench, "mt-bench": dict(bench)},
    }


def test_markdown_tables_and_definitions():
    md = markdown_report(results_dict(with_confidence=True))
    assert "sampling temperature 1.0, top_k 0, top_p 0.9" in md
    # tau (2 + 4 + 1) / 3; break-even tau 10 ms per step / 10 ms per target-only step
    assert "| gsm8k | dspark | 1 | 2.33 | 1.00 | 0.67 0.33 0.50 | " in md
    # tau histogram: lengths 2, 4, 1 -> counts 1 1 0 1
    assert "| gsm8k | dspark | 3 | 2.33 | 1 1 0 1 |" in md
    assert "| gsm8k | target-only | 5 |" in md  # timing table keeps the baseline
    assert "| gsm8k | dspark | 3 | 10.00 | 3.00 | 6.00 | 1.00 | 2.67 | 0.33 |" in md
    assert "## Confidence-head calibration" in md
    # pooled pairs: (.9,1) (.6,0) (.8,1) (.7,1) (.5,1) (.4,0): AUROC 7/8, accept rate 4/6
    assert "| dspark | gsm8k | raw | all | 6 | 0.650 | 0.667 |" in md and "| 0.875 |" in md
    assert "| dspark | mt-bench | raw | 3 | 1 | 0.500 | 1.000 | 0.500 | - | 0.250 |" in md
    assert "| dflash | gsm8k |" not in md  # no confidences, no calibration rows
    for key in METRIC_DEFINITIONS:
        assert f"- `{key}`: " in md


def test_calibration_table_skips_positions_without_pairs():
    from deepspec.eval.metrics import calibration_stats

    res = results_dict(with_confidence=True)
    steps = [step(3, 1, (0.9, 0.6, 0.3)), step(2, 0, (0.4, 0.2))]  # pairs at k = 1, 2 only
    cal = calibration_stats(steps, max_k=5)
    assert [r["num_pairs"] for r in cal["per_position"]] == [2, 1, 0, 0, 0]
    gsm8k = res["benchmarks"]["gsm8k"]
    gsm8k["dspark"] = {**gsm8k["dspark"], "calibration": cal}  # mt-bench keeps the shared metrics
    md = markdown_report(res)
    assert "| dspark | gsm8k | raw | all | 3 |" in md and "| dspark | gsm8k | raw | 2 | 1 |" in md
    assert "| dspark | gsm8k | raw | 3 |" not in md and "| dspark | gsm8k | raw | 5 |" not in md
    assert "| dspark | mt-bench | raw | 3 | 1 |" in md  # positions with pairs keep their rows


def test_markdown_without_calibration_or_definitions_key():
    res = results_dict(with_confidence=False)
    del res["definitions"]
    md = markdown_report(res)
    assert not has_calibration(res)
    assert "calibration" not in md.split("## Definitions")[0]
    assert "- `tau_histogram`: " in md  # falls back to METRIC_DEFINITIONS


def _listing(path):
    return sorted(p.name for p in path.iterdir())


def test_scheduling_table_and_cost_curve():
    md = markdown_report(results_dict(with_confidence=False, scheduled=True))
    section = md.split("## Scheduling")[1].split("##")[0]
    assert "1: 10.0 (1.00), 2: 11.0 (1.10), 4: 13.0 (1.30), 8: 20.0 (2.00)" in section
    # dspark verified 3, 3, 2 tokens; no plain step; the target-only row is not a proposer
    assert "| gsm8k | dspark | 3 | 0.00 | 0.00 | 2.67 | 2: 1 3: 2 |" in section
    assert "| gsm8k | target-only |" not in section
    assert "## Scheduling" not in markdown_report(results_dict(with_confidence=False))


def test_write_report_files(tmp_path):
    res = results_dict(with_confidence=True, scheduled=True)
    paths = write_report(res, tmp_path / "out")
    assert set(paths) == {"json", "markdown", "png", "tau_histogram", "reliability", "step_costs"}
    assert _listing(tmp_path / "out") == sorted(FILE_NAMES.values())  # no temporary files left behind
    for key in ("png", "tau_histogram", "reliability", "step_costs"):
        assert paths[key].read_bytes()[:8] == PNG_MAGIC
    loaded = json.loads(paths["json"].read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert loaded["benchmarks"]["gsm8k"]["dspark"]["tau_histogram"] == [1, 1, 0, 1]
    md = paths["markdown"].read_text()
    assert "![confidence reliability](reliability.png)" in md and "(tau_histogram.png)" in md

    # Same folder, no confidences and no schedule now: no reliability or cost plot, and the stale ones are gone.
    paths = write_report(results_dict(with_confidence=False), tmp_path / "out")
    assert "reliability" not in paths and not (tmp_path / "out" / "reliability.png").exists()
    assert "step_costs" not in paths and not (tmp_path / "out" / "step_costs.png").exists()
    assert "reliability.png" not in paths["markdown"].read_text()
    assert paths["tau_histogram"].read_bytes()[:8] == PNG_MAGIC


def test_plot_reliability_needs_data(tmp_path):
    with pytest.raises(ValueError, match="calibration"):
        plot_reliability(results_dict(with_confidence=False), tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()


def test_markdown_break_even_flips_and_divergences():
    res = results_dict(with_confidence=False)
    res["config"]["dtype"] = "bfloat16"
    bench = res["benchmarks"]["gsm8k"]
    bench[BASELINE].update(num_flip_positions=2000, num_argmax_flips=3, argmax_flips_per_1k_tokens=1.5,
                           flip_chunk_len=8)
    bench["dspark"]["divergences"] = [{"id": "q7", "turn": 1, "position": 12, "baseline_token": 5, "token": 9,
                                       "baseline_margin": 0.0625, "at_argmax_flip": True, "token_is_runner_up": True}]
    md = markdown_report(res)
    assert "target tiny in bfloat16" in md
    assert "| 1.5 (3/2000) |" in md  # the target-only row's flip column
    assert "## Outputs that differ from target-only (greedy)" in md
    assert "| gsm8k | dspark | q7 | 1 | 12 | 5 | 9 | 0.062 | yes | yes |" in md
    # break-even tau: the step time over the target-only step time (both 10 ms here)
    assert bench["dspark"]["break_even_tau"] == pytest.approx(1.0)
    assert "| mt-bench | dspark |" in md and "## Outputs" in md


def test_demo_summary_table_shows_every_proposer_with_break_even_tau():
    from deepspec.demo import summary_table

    res = results_dict(with_confidence=False)
    res["config"]["dtype"] = "float32"
    res["benchmarks"]["gsm8k"]["dspark"]["speedup_median"] = 1.5
    text = summary_table(res)
    header = text.splitlines()[1]
    assert "dspark tau" in header and "dflash tau" in header and "break-even" in header
    assert "target-only" not in header and HF_GENERATE not in header
    assert text.splitlines()[0].startswith("dtype float32")
    row = next(line for line in text.splitlines() if line.startswith("gsm8k"))
    assert "2.33" in row and "1.00" in row  # dspark tau, break-even tau (10 ms / 10 ms)
    assert "2.00x   1.50x" in row  # the speedup pooled over the prompts, then their median
    # a long method name keeps its columns apart, and each row lines up with the header
    for per_method in res["benchmarks"].values():
        per_method["dspark-trained+lookup"] = per_method["dspark"]
    lines = summary_table(res).splitlines()
    assert "speedup  median  dspark-trained+lookup tau break-even" in lines[1]
    assert all(len(line) == len(lines[1]) for line in lines[3:])
