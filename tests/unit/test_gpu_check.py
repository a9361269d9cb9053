"""bench/gpu_check.py, the driver of the prepared GPU check: its deadline, timeouts and skips (no GPU needed)."""

from __future__ import annotations

import io
import json
import sys
import time

from tests.helpers import load_bench_module

gpu_check = load_bench_module("gpu_check")


def test_a_part_past_its_timeout_is_killed_with_its_children():
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('started', flush=True); time.sleep(60)")
    log = io.StringIO()
    t0 = time.monotonic()
    rc, wall, tail = gpu_check.run_part([sys.executable, "-c", code], 3.0, log)
    assert rc == 124 and wall < 10 and time.monotonic() - t0 < 10
    assert "started" in tail and "started" in log.getvalue()


def test_a_part_that_ends_reports_its_status_and_output():
    log = io.StringIO()
    rc, _, tail = gpu_check.run_part([sys.executable, "-c", "print('figure 1.5'); raise SystemExit(3)"], 30.0, log)
    assert rc == 3 and "figure 1.5" in tail


def test_parts_past_the_deadline_are_skipped_and_summary_is_written(tmp_path):
    assert gpu_check.main(["--deadline", "0", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["parts"]) == list(gpu_check.PARTS)
    assert all(p["status"] == "skipped" and "deadline" in p["why"] for p in summary["parts"].values())


def test_a_part_whose_packages_are_missing_is_skipped_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "missing_packages", lambda names=gpu_check.OPTIONAL: ["pytest"])
    assert gpu_check.main(["--parts", "tests_flex,tests", "--out", str(tmp_path)]) == 0
    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert {p["why"] for p in parts.values()} == {"missing packages: pytest"}
    assert "tests_flex: skipped (missing packages: pytest)" in capsys.readouterr().out


def test_unknown_parts_are_refused(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        gpu_check.main(["--parts", "preflight,bogus", "--out", str(tmp_path)])
    assert "--parts: unknown ['bogus']" in capsys.readouterr().err


def test_the_budgets_fit_one_device_call():
    """The parts before the open-ended test run fit a 600-s command with time to spare."""
    first = sum(budget for part, (budget, _) in gpu_check.PARTS.items() if part != "tests")
    assert first <= 600 - 60
