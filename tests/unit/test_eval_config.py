"""`deepspec eval` configuration: benchmark selection, caps, file overrides, sampling flags."""

from __future__ import annotations

import json

import pytest

from deepspec.eval.benchmarks import BENCHMARKS, DEEPSPEC_NUM_SAMPLES
from deepspec.eval.stage import EvalConfig, load_eval_benchmarks


def _cfg(**kw) -> EvalConfig:
    return EvalConfig(draft=["x"], output_dir="out", **kw)


def test_all_expands_to_every_benchmark_without_repeats():
    assert _cfg().benchmark_names() == list(BENCHMARKS)
    assert _cfg(benchmarks=["gsm8k", "all"]).benchmark_names()[0] == "gsm8k"
    assert len(_cfg(benchmarks=["gsm8k", "all"]).benchmark_names()) == len(BENCHMARKS)


def test_caps_and_file_overrides_parse():
    cfg = _cfg(num_prompts_per_benchmark=["original", "gsm8k=7"], benchmark_files=["mbpp=/d/m.jsonl"])
    assert cfg.caps() == {**DEEPSPEC_NUM_SAMPLES, "gsm8k": 7}
    assert cfg.file_overrides() == {"mbpp": "/d/m.jsonl"}
    assert cfg.sampling_params().greedy


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"benchmarks": ["gsm9k"]}, "eval.benchmarks"),
        ({"benchmark_files": ["gsm8k"]}, "eval.benchmark_files"),
        ({"num_prompts_per_benchmark": ["gsm8k=many"]}, "eval.num_prompts_per_benchmark"),
        ({"num_prompts_per_benchmark": ["gsm8k=0"]}, "eval.num_prompts_per_benchmark"),
        ({"num_prompts_per_benchmark": ["nope=3"]}, "'nope' is not a benchmark"),
        ({"benchmark_source": "web"}, "eval.benchmark_source"),
        ({"num_turns": 3}, "eval.num_turns"),
        ({"top_p": 0.0, "temperature": 1.0}, "eval.top_p"),
        ({"temperature": -1.0}, "eval.temperature"),
        ({"num_prompts": 0}, "eval.num_prompts"),
        ({"tree_width": -1}, "eval.tree_width: expected an integer >= 0"),
        ({"tree_width": 2, "confidence_threshold": 0.5}, "eval.tree_width: a draft tree is not cut by confidence"),
        ({"tree_width": 1, "compile": True}, "eval.tree_width: draft trees need the eager target path"),
    ],
)
def test_bad_values_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        _cfg(**kwargs)


def test_all_skips_missing_local_data_but_an_explicit_name_fails(tmp_path):
    (tmp_path / "math500").mkdir()
    (tmp_path / "math500" / "math500.jsonl").write_text(
        "\n".join(json.dumps({"turns": [f"q{i}"]}) for i in range(5)) + "\n")
    logs: list[str] = []
    prompts, skipped = load_eval_benchmarks(
        _cfg(benchmarks=["all"], benchmark_source="local", benchmarks_dir=str(tmp_path), num_prompts=3), logs.append)
    assert list(prompts) == ["math500"] and len(prompts["math500"]) == 3
    assert set(skipped) == set(BENCHMARKS) - {"math500"}
    assert len(logs) == len(BENCHMARKS) - 1 and all("skipping" in line for line in logs)
    with pytest.raises(FileNotFoundError, match="aime25"):
        load_eval_benchmarks(_cfg(benchmarks=["aime25"], benchmark_source="local", benchmarks_dir=str(tmp_path)))


def test_file_override_and_per_benchmark_cap(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) for i in range(10)) + "\n")
    prompts, skipped = load_eval_benchmarks(
        _cfg(benchmarks=["gsm8k"], benchmark_files=[f"gsm8k={path}"], num_prompts_per_benchmark=["gsm8k=4"]))
    assert skipped == {} and len(prompts["gsm8k"]) == 4
    assert all(p.turns[0].startswith("q") and p.turns[0].endswith("\\boxed{}.") for p in prompts["gsm8k"])


def test_named_caps_win_over_original_in_any_order():
    for entries in (["original", "gsm8k=3"], ["gsm8k=3", "original"]):
        caps = _cfg(num_prompts_per_benchmark=entries).caps()
        assert caps["gsm8k"] == 3 and caps["mbpp"] == DEEPSPEC_NUM_SAMPLES["mbpp"]


def test_a_file_for_an_unselected_benchmark_is_refused():
    with pytest.raises(ValueError, match="not among --benchmarks"):
        _cfg(benchmarks=["gsm8k"], benchmark_files=["mt-bench=/d/q.jsonl"])


def test_missing_benchmarks_dir_is_an_error_not_a_silent_fallback(tmp_path):
    with pytest.raises(ValueError, match="--benchmarks-dir"):
        load_eval_benchmarks(_cfg(benchmarks=["gsm8k"], benchmarks_dir=str(tmp_path / "nope")))


def test_turns_given_as_a_string_are_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"turns": "Say hi."}) + "\n")
    with pytest.raises(ValueError, match="single string"):
        load_eval_benchmarks(_cfg(benchmarks=["mt-bench"], benchmark_files=[f"mt-bench={path}"]))


def test_unwritable_output_dir_fails_before_anything_loads(tmp_path):
    from deepspec.eval.stage import run_eval_stage

    blocker = tmp_path / "afile"
    blocker.write_text("")
    with pytest.raises(ValueError, match="output_dir"):
        run_eval_stage(EvalConfig(draft=[str(tmp_path / "no-draft")], output_dir=str(blocker)))


def test_failed_eval_removes_the_output_folder_it_created(tmp_path):
    from deepspec.eval.stage import run_eval_stage

    out = tmp_path / "reports" / "eval"
    with pytest.raises(FileNotFoundError, match="no draft found"):
        run_eval_stage(EvalConfig(draft=[str(tmp_path / "no-draft")], output_dir=str(out)))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # "reports" was created by the stage: gone too
    # a folder that existed before stays, empty or not
    out.mkdir(parents=True)
    with pytest.raises(FileNotFoundError):
        run_eval_stage(EvalConfig(draft=[str(tmp_path / "no-draft")], output_dir=str(out)))
    assert out.is_dir()
    fresh = tmp_path / "reports" / "new"
    with pytest.raises(FileNotFoundError):
        run_eval_stage(EvalConfig(draft=[str(tmp_path / "no-draft")], output_dir=str(fresh)))
    assert not fresh.exists() and out.is_dir()
