"""Evaluation driver: target-only baseline + every proposer on the same prompts, then the report.

For each benchmark and each prompt (in order) the methods run back to back, interleaved per prompt
(target-only first, then each proposer, on the next prompt the other way round: over an even number of
prompts each method's time spans the rounds alike, so a slow drift of the machine within a round (thermal,
other load) favours no method; then optionally Hugging Face ``generate()``). Each method gets a fresh
``torch.Generator`` on the target's device, seeded with ``seed + prompt_index`` (shared by that
method's turns of the prompt), so sampling runs are reproducible and the methods see the same seed
on the same prompt. Speedup is measured in this one process. Each benchmark starts its engines' schedulers
from no acceptance history (:meth:`~deepspec.decoding.schedule.StepScheduler.forget_acceptance`; the measured
step costs and timings kept), as a server devoted to that kind of prompt would, so a benchmark's figures do
not depend on which benchmarks ran before it.

With ``timing_repeats`` R >= 2, every method runs each prompt R times (the repeats in the reverse order
of the one before, so each method's runs sit alike in the round), each from the same state (the
scheduler's acceptance counts and timings, the proposer's step counters), and the fastest run is
kept, as if it were the only one (its outputs, steps and times; the state it left): other work on a
shared machine only ever adds time, so the fastest of R runs is the least disturbed measure of each
method, and no run learns from another's pass over the same prompt.

Multi-turn (``num_turns >= 2``, e.g. MT-Bench): turn ``t`` of a prompt is rendered on that method's
own conversation so far, ``[user_1, assistant_1, .., user_t]``, where ``assistant_j`` is the method's
decoded answer to turn ``j`` (``skip_special_tokens``, EOS removed) -- the second turn is built on
the model's own first answer, as MT-Bench prescribes. A prompt with fewer turns runs the turns it
has. The steps and outputs of every turn are pooled in the metrics (one ``GenerationResult`` per
turn, in the order prompt 0 turn 1, prompt 0 turn 2, prompt 1 turn 1, ...); ``samples`` holds one
record per (prompt, turn).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import torch

from deepspec.algorithms.dspark.compiled import compile_proposer
from deepspec.algorithms.ngram.proposer import DEFAULT_NUM_TOKENS, corpus_lookup
from deepspec.algorithms.protocol import NullProposer, Proposer
from deepspec.data.chat import render_prompt, target_stop_token_ids
from deepspec.decoding.compiled import CompiledTarget
from deepspec.decoding.engine import GenerationResult, SpeculativeEngine
from deepspec.decoding.flips import argmax_flip_positions, chunked_argmax, divergence_record, first_divergence, flip_rate
from deepspec.decoding.settings import DecodeSettings
from deepspec.device import dtype_name, is_out_of_memory, out_of_memory_error
from deepspec.eval.benchmarks import BenchmarkPrompt
from deepspec.eval.metrics import METRIC_DEFINITIONS, benchmark_metrics, median_speedup, speedup, timing_stats
from deepspec.eval.report import BASELINE, HF_GENERATE, environment_info, write_report
from deepspec.target.capture import target_forward
from deepspec.target.decoding import SamplingParams, decoding_record, pinned_generate
from deepspec.target.exact_rows import PROBE_ROWS, ExactRows, exact_target_forward
from deepspec.target.few_row_linear import few_row_linear as few_row_linear_context
from deepspec.target.few_row_linear import few_row_linear_applies


def eos_token_ids_of(target_model: Any, tokenizer: Any) -> list[int]:
    """The ids that end generation: the one stop rule (:func:`deepspec.data.chat.target_stop_token_ids`:
    the target's ``generation_config.eos_token_id``, the tokenizer's eos and the chat template's
    end-of-turn token), the same set prepare stops on and the cache's loss mask ends on."""
    return target_stop_token_ids(target_model, tokenizer)


def hf_generate(model: Any, prompt_ids: list[int], *, max_new_tokens: int, sampling: SamplingParams,
                eos: list[int], pad: int) -> GenerationResult:
    """Time HF ``generate()`` on one prompt with the same sampling, pinned
    (:func:`deepspec.target.decoding.pinned_generate`: greedy, or temperature + the same top-k /
    top-p, and nothing from the target's ``generation_config``). Seeding is the caller's
    (``torch.manual_seed``). Returns a GenerationResult with ``output_ids`` (cut after the first EOS)
    and ``total_time_s``; no steps, no TTFT."""
    device = next(model.parameters()).device
    ids_BT = torch.tensor([prompt_ids], device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = pinned_generate(model, ids_BT, torch.ones_like(ids_BT), max_new_tokens=max_new_tokens,
                          temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                          stop_token_ids=eos, pad_token_id=pad)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total = time.perf_counter() - t0
    new = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(new):  # generate pads after EOS only in batches; cut defensively
        if t in eos:
            new = new[: i + 1]
            break
    return GenerationResult(prompt_len=len(prompt_ids), output_ids=new, total_time_s=total, stop_reason="hf")


def answer_text(tokenizer: Any, output_ids: Sequence[int], eos_token_ids: Collection[int]) -> str:
    """A generated answer as the next turn's assistant message: the trailing EOS removed, decoded with
    ``skip_special_tokens=True``."""
    ids = list(output_ids)
    while ids and ids[-1] in eos_token_ids:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=True)


def _run_turns(generate: Callable[[list[int]], GenerationResult], tokenizer: Any, prompt: BenchmarkPrompt, *,
               num_turns: int, eos: list[int], first_ids: list[int],
               chat_template_kwargs: Mapping[str, Any] | None) -> tuple[list[list[int]], list[GenerationResult]]:
    """One method's conversation on ``prompt``: turn 1 on ``first_ids`` (already rendered), each later
    turn on ``[user_1, own answer_1, .., user_t]``. Returns the prompt ids and the result of each turn run."""
    turns = prompt.turns[:num_turns]
    messages: list[dict[str, str]] = []
    prompt_ids: list[list[int]] = []
    results: list[GenerationResult] = []
    for t, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        ids = first_ids if t == 0 else render_prompt(tokenizer, messages, chat_template_kwargs=chat_template_kwargs)
        prompt_ids.append(list(ids))
        results.append(generate(ids))
        if t + 1 < len(turns):
            messages.append({"role": "assistant", "content": answer_text(tokenizer, results[-1].output_ids, eos)})
    return prompt_ids, results


def render_benchmark_prompts(tokenizer: Any, benchmarks: Mapping[str, Sequence[BenchmarkPrompt]], *,
                             chat_template_kwargs: Mapping[str, Any] | None = None) -> dict[str, list[list[int]]]:
    """Prompt ids of every benchmark prompt: bench -> [ids], via ``deepspec.data.chat.render_prompt``,
    the rule training uses (so with ``enable_thinking=False`` the empty think block is in the prompt)."""
    return {b: [render_prompt(tokenizer, p.messages, chat_template_kwargs=chat_template_kwargs) for p in prompts]
            for b, prompts in benchmarks.items()}


def _proposer_info(proposer: Proposer) -> dict[str, Any]:
    """A proposer's entry in the report config: type, K, dtype of its model (None without one) and,
    for the n-gram baseline and a draft with prompt lookup in front, the n-gram range; for the latter
    also each part's K (``lookup_num_tokens``, ``draft_max_proposal_len``; ``max_proposal_len`` is the
    larger) and whether the match is verified beside the draft (``lookup_tree``); ``tree_width`` for a
    draft that proposes draft trees."""
    lookup = getattr(proposer, "lookup", None)  # LookupFirstProposer: the draft's model, the lookup's range
    model = getattr(getattr(proposer, "draft", proposer), "model", None)
    info: dict[str, Any] = {"type": type(proposer).__name__, "max_proposal_len": proposer.max_proposal_len,
                            "dtype": dtype_name(next(model.parameters()).dtype) if model is not None else None}
    for key in ("ngram_max", "ngram_min"):
        if hasattr(lookup or proposer, key):
            info[key] = getattr(lookup or proposer, key)
    if lookup is not None:
        info["lookup_num_tokens"] = lookup.max_proposal_len
        info["draft_max_proposal_len"] = proposer.draft.max_proposal_len
        info["lookup_tree"] = bool(getattr(proposer, "tree", False))
    width = getattr(getattr(proposer, "draft", proposer), "tree_width", 1)
    if width > 1:
        info["tree_width"] = width
    return info


def argmax_flip_figures(target_model: Any, prompts: Sequence[Sequence[int]], baseline: Sequence[GenerationResult],
                        runs: Mapping[str, Sequence[GenerationResult]], results: Mapping[str, dict[str, Any]],
                        *, chunk_len: int, turn_of: Sequence[tuple[str, int]],
                        forward_fn: Callable[..., Any] = target_forward) -> None:
    """Greedy only: measure argmax flips on the target-only outputs and explain each divergent output.

    ``prompts[i]`` and ``baseline[i]`` are the prompt ids and target-only result of pooled generation
    ``i``; ``runs`` maps each proposer to its results in the same order; ``results`` maps
    (``results[name]``) each method to its metrics dict, updated in place: the target-only dict gets
    ``num_flip_positions``, ``num_argmax_flips``, ``argmax_flips_per_1k_tokens`` and
    ``flip_chunk_len``; each proposer's gets ``divergences`` (one
    :func:`~deepspec.decoding.flips.divergence_record` per output that differs from target-only, with
    its prompt ``id`` and ``turn``) and ``num_divergent_at_flip_or_runner_up``. See
    :mod:`deepspec.decoding.flips`. ``forward_fn``: the target forward of the re-run (the engines' own:
    with exact rows, :func:`deepspec.target.exact_rows.exact_target_forward`).
    """
    chunks, flips = [], []
    for ids, base in zip(prompts, baseline):
        chunk = chunked_argmax(target_model, ids, base.output_ids, chunk_len=chunk_len, forward_fn=forward_fn)
        chunks.append(chunk)
        flips.append(argmax_flip_positions(chunk.argmax, base.output_ids))
    num_positions = sum(max(len(b.output_ids) - 1, 0) for b in baseline)
    num_flips = sum(len(f) for f in flips)
    results[BASELINE].update(num_flip_positions=num_positions, num_argmax_flips=num_flips,
                             argmax_flips_per_1k_tokens=flip_rate(num_flips, num_positions), flip_chunk_len=chunk_len)
    for name, res in runs.items():
        records = []
        for (pid, turn), r, base, chunk, f in zip(turn_of, res, baseline, chunks, flips):
            d = first_divergence(r.output_ids, base.output_ids)
            if d is not None:
                records.append({"id": pid, "turn": turn, **divergence_record(d, r.output_ids, base.output_ids, chunk, f)})
        results[name]["divergences"] = records
        results[name]["num_divergent_at_flip_or_runner_up"] = sum(
            rec["at_argmax_flip"] or rec["token_is_runner_up"] for rec in records)


@dataclass
class _Run:
    """What every prompt of a :func:`run_eval` call shares: the target, the engines (target-only first),
    the proposers they drive and the decoding settings."""

    target_model: Any
    tokenizer: Any
    proposers: Mapping[str, Proposer]
    engines: dict[str, SpeculativeEngine]
    sampling: SamplingParams
    max_new_tokens: int
    seed: int
    num_turns: int
    eos: list[int]
    pad: int
    chat_template_kwargs: Mapping[str, Any] | None
    compare_hf_generate: bool
    few_row_linear: bool
    timing_repeats: int = 1

    @property
    def device(self) -> torch.device:
        return next(self.target_model.parameters()).device

    @property
    def methods(self) -> list[str]:
        return list(self.engines) + ([HF_GENERATE] if self.compare_hf_generate else [])

    def new_generator(self, seed: int) -> torch.Generator:
        # On the target's device, so proposers can sample device tensors with it (no host copies).
        return torch.Generator(device=self.device).manual_seed(seed)


def run_eval(
    target_model: Any,
    tokenizer: Any,
    target_layer_ids: Sequence[int],
    proposers: Mapping[str, Proposer],
    benchmarks: Mapping[str, Sequence[BenchmarkPrompt]],
    *,
    settings: DecodeSettings = DecodeSettings(),
    max_new_tokens: int,
    sampling: SamplingParams,
    seed: int,
    out_dir: str | os.PathLike[str] | None,
    num_turns: int = 1,
    compare_hf_generate: bool = True,
    warmup: bool = True,
    progress: bool = True,
    config_extra: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    measure_argmax_flips: bool = True,
    timing_repeats: int = 1,
) -> dict[str, Any]:
    """Run the target-only baseline and each proposer on every benchmark prompt; write the report.

    Args:
        target_model, tokenizer: the target (eval mode, in its decoding dtype and device) and its tokenizer;
            prompts are rendered with ``deepspec.data.chat.render_prompt`` (the training-time template rule).
        target_layer_ids: layers whose features the proposers read.
        proposers: name -> proposer (names must differ from ``"target-only"`` / ``"hf-generate"``;
            :func:`deepspec.decoding.settings.build_proposers` builds them).
        benchmarks: name -> prompts (see ``deepspec.eval.benchmarks.load_benchmarks``).
        settings: the decoding set-up (:class:`~deepspec.decoding.settings.DecodeSettings`); this reads its
            ``few_row_linear`` (every engine, the baseline too, and the argmax-flip re-run use the few-row
            linear path, :mod:`deepspec.target.few_row_linear`, where it applies to the target) and
            ``compile`` (every engine runs the target's decode steps on one shared compiled path,
            :class:`deepspec.decoding.compiled.CompiledTarget`, compiled untimed before each generation's
            clock, and DSpark / DFlash chain drafts propose through compiled graphs,
            :func:`deepspec.algorithms.dspark.compiled.compile_proposer`; the few-row path is then off).
            Both are recorded in the report's config.
        max_new_tokens, sampling, seed: decoding settings shared by every method (per turn:
            ``max_new_tokens`` bounds each turn's answer).
        out_dir: where the report goes (None: no files).
        num_turns: user turns run per prompt (>= 1; 1 = the first turn only, the default). With 2,
            prompts that have a second turn (MT-Bench) run it on the method's own first answer
            (see the module docstring); every turn's steps are pooled in the metrics.
        compare_hf_generate: also time HF ``generate()`` on the same prompts with the same sampling
            params, so the target-only baseline is shown not to be slow by construction.
        warmup: one short untimed generation per method before measuring.
        config_extra: extra entries for the report's ``config`` (e.g. target path, checkpoint).
        chat_template_kwargs: template variables for the prompts (e.g. ``{"enable_thinking": False}``),
            the same ones the training data was rendered with (see :func:`render_benchmark_prompts`).
        measure_argmax_flips: at temperature 0, re-run the target over each target-only output in
            verify-sized chunks (K + 1 tokens, K the largest proposal length) and report how often
            that forward's argmax differs from the one-token decode, and where each divergent
            output first differs (:func:`argmax_flip_figures`). Untimed; about one verify forward per
            K + 1 output tokens.
        timing_repeats: runs of every (prompt, method), each from the same state, the fastest kept (the
            module docstring); 1 = one run each.

    Returns the results dict (``config``, ``environment``, ``definitions``, ``benchmarks``:
    bench -> method -> metrics, ``samples``: bench -> method -> one record per (prompt, turn), with
    ``prompt`` the turn's rendered prompt text (its ids decoded, template tokens kept) and ``output``
    the generated text (:func:`answer_text`)).
    Raises ValueError for a reserved proposer name, ``max_new_tokens < 1``, ``num_turns < 1``,
    ``timing_repeats < 1`` or a ``sampling`` that is not a SamplingParams.
    """
    from tqdm.auto import tqdm

    _check_run_args(proposers, max_new_tokens=max_new_tokens, num_turns=num_turns, sampling=sampling,
                    timing_repeats=timing_repeats)
    run = _new_run(target_model, tokenizer, target_layer_ids, proposers, settings, sampling=sampling,
                   max_new_tokens=max_new_tokens, seed=seed, num_turns=num_turns,
                   chat_template_kwargs=chat_template_kwargs, compare_hf_generate=compare_hf_generate,
                   timing_repeats=timing_repeats)
    max_k = {n: e.proposer.max_proposal_len for n, e in run.engines.items()}
    flip_chunk_len = (max(max_k.values()) or DEFAULT_NUM_TOKENS) + 1  # a verify forward: anchor + K drafts
    measure_flips = measure_argmax_flips and sampling.greedy
    flip_forward = (exact_target_forward(ExactRows(target_model, max_rows=min(flip_chunk_len, PROBE_ROWS)))
                    if settings.exact and measure_flips else target_forward)
    rendered = render_benchmark_prompts(tokenizer, benchmarks, chat_template_kwargs=chat_template_kwargs)
    first = next((ids for ids in rendered.values() if ids), [None])[0]
    if warmup and first is not None:  # one short untimed generation per engine
        for engine in run.engines.values():
            engine.generate(first, max_new_tokens=min(8, max_new_tokens), sampling=sampling,
                            generator=run.new_generator(seed))

    total = sum(len(v) for v in rendered.values()) * len(run.methods) * timing_repeats
    bar = tqdm(total=total, desc="eval", disable=not progress, unit="run")  # one method on one prompt, once
    figures: dict[str, dict[str, Any]] = {}
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for bench, prompts in benchmarks.items():
        for engine in run.engines.values():  # each benchmark from no acceptance history (the module docstring)
            if engine.scheduler is not None:
                engine.scheduler.forget_acceptance()
        counts = _proposal_counts(run.proposers)
        runs, prompts_of, turn_of = _run_benchmark(run, bench, prompts, rendered[bench], bar)
        figures[bench] = _benchmark_figures(run, runs, counts, max_k=max_k, turn_of=turn_of)
        if measure_flips:
            with few_row_linear_context(target_model) if run.few_row_linear else contextlib.nullcontext():
                argmax_flip_figures(target_model, prompts_of[BASELINE], runs[BASELINE],
                                    {n: runs[n] for n in run.proposers}, figures[bench], chunk_len=flip_chunk_len,
                                    turn_of=turn_of, forward_fn=flip_forward)
        samples[bench] = _sample_records(run, runs, prompts_of, turn_of)
        (bar.write if log is print and progress else log)(_summary_line(run, bench, figures[bench], measure_flips))
    bar.close()

    results: dict[str, Any] = {
        "config": {
            **_run_config(run, settings, target_layer_ids=target_layer_ids,
                          flip_chunk_len=flip_chunk_len if measure_flips else None,
                          num_prompts={b: len(v) for b, v in benchmarks.items()}),
            **dict(config_extra or {}),
        },
        "environment": environment_info(),
        "definitions": METRIC_DEFINITIONS,
        "benchmarks": figures,
        "samples": samples,
    }
    if out_dir is not None:
        paths = write_report(results, out_dir)
        log(f"[eval] report: {paths['markdown']} ({', '.join(p.name for k, p in paths.items() if k != 'markdown')})")
    return results


def _check_run_args(proposers: Mapping[str, Proposer], *, max_new_tokens: int, num_turns: int,
                    sampling: SamplingParams, timing_repeats: int) -> None:
    """:func:`run_eval`'s ValueErrors, before any work."""
    for name in proposers:
        if name in (BASELINE, HF_GENERATE):
            raise ValueError(f"proposers: the name {name!r} is reserved for a baseline; rename that proposer.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, received {max_new_tokens}.")
    if isinstance(num_turns, bool) or not isinstance(num_turns, int) or num_turns < 1:
        raise ValueError(f"num_turns: expected an integer >= 1, received {num_turns!r}.")
    if isinstance(timing_repeats, bool) or not isinstance(timing_repeats, int) or timing_repeats < 1:
        raise ValueError(f"timing_repeats: expected an integer >= 1, received {timing_repeats!r}.")
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling: expected a SamplingParams, received {type(sampling).__name__}.")


def _new_run(target_model: Any, tokenizer: Any, target_layer_ids: Sequence[int], proposers: Mapping[str, Proposer],
             settings: DecodeSettings, **shared: Any) -> _Run:
    """The engines of a run: target-only first, then one per proposer, on the compiled target path
    (proposers compiled too) or the eager one, with the few-row linear path where ``settings`` asks."""
    eos = eos_token_ids_of(target_model, tokenizer)
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else eos[0]
    few_rows = few_row_linear_applies(settings.few_row_linear, target_model) and not settings.compile
    compiled = None
    if settings.compile:
        proposers = {n: compile_proposer(p) for n, p in proposers.items()}
        compiled = CompiledTarget.for_proposers(target_model, proposers.values())
    engines = {n: SpeculativeEngine(target_model, target_layer_ids, p, eos, few_row_linear=few_rows, compiled=compiled,
                                    exact=settings.exact, schedule=settings.schedule)
               for n, p in {BASELINE: NullProposer(), **proposers}.items()}
    return _Run(target_model=target_model, tokenizer=tokenizer, proposers=proposers, engines=engines, eos=eos, pad=pad,
                few_row_linear=few_rows, **shared)


def _run_benchmark(
    run: _Run, bench: str, prompts: Sequence[BenchmarkPrompt], rendered: Sequence[list[int]], bar: Any,
) -> tuple[dict[str, list[GenerationResult]], dict[str, list[list[int]]], list[tuple[str, int]]]:
    """Every method on every prompt of ``bench``, interleaved per prompt, the fastest of ``timing_repeats``
    runs kept (the module docstring). Returns each method's results (one per (prompt, turn), pooled in
    order), the prompt ids of each, and the (prompt id, turn 1..) of each pooled result."""
    runs: dict[str, list[GenerationResult]] = {m: [] for m in run.methods}
    prompts_of: dict[str, list[list[int]]] = {m: [] for m in run.methods}
    turn_of: list[tuple[str, int]] = []
    turns_kw = dict(num_turns=run.num_turns, eos=run.eos, chat_template_kwargs=run.chat_template_kwargs)
    engines = list(run.engines.items())
    repeats = run.timing_repeats
    for i, (prompt, ids) in enumerate(zip(prompts, rendered)):
        turn_of.extend((prompt.id, t + 1) for t in range(min(run.num_turns, len(prompt.turns))))

        def run_once(name: str, engine: SpeculativeEngine) -> tuple[float, tuple[list, list[GenerationResult]]]:
            bar.set_postfix_str(f"{bench} {name}")
            gen = run.new_generator(run.seed + i)

            def generate(x: list[int]) -> GenerationResult:
                return _generate_or_explain(run, engine, x, gen, where=f"{bench} prompt {prompt.id}, {name}")

            turn_ids, results = _run_turns(generate, run.tokenizer, prompt, first_ids=ids, **turns_kw)
            bar.update(1)
            return sum(res.total_time_s for res in results), (turn_ids, results)

        order = engines if i % 2 == 0 else engines[::-1]  # ABBA order (the module docstring)
        for name, (turn_ids, results) in run_fastest(order, run_once, repeats).items():
            prompts_of[name].extend(turn_ids)
            runs[name].extend(results)
        if run.compare_hf_generate:
            fastest: tuple[float, list[list[int]], list[GenerationResult]] | None = None
            for _ in range(repeats):
                torch.manual_seed(run.seed + i)
                turn_ids, results = _run_turns(
                    lambda x: hf_generate(run.target_model, x, max_new_tokens=run.max_new_tokens,
                                           sampling=run.sampling, eos=run.eos, pad=run.pad),
                    run.tokenizer, prompt, first_ids=ids, **turns_kw)
                seconds = sum(res.total_time_s for res in results)
                if fastest is None or seconds < fastest[0]:
                    fastest = (seconds, turn_ids, results)
                bar.update(1)
            prompts_of[HF_GENERATE].extend(fastest[1])
            runs[HF_GENERATE].extend(fastest[2])
    return runs, prompts_of, turn_of


R = TypeVar("R")


def run_fastest(order: Sequence[tuple[str, SpeculativeEngine]],
                run_once: Callable[[str, SpeculativeEngine], tuple[float, R]], repeats: int = 1) -> dict[str, R]:
    """Time every engine of ``order`` on one piece of work ``repeats`` times and keep each one's fastest run.

    ``run_once(name, engine)`` does the work once and returns ``(seconds, result)``. Repeat ``r`` runs the
    engines in ``order`` for even ``r`` and in the reverse order for odd ``r`` (so each engine's runs sit alike
    in the round), every repeat from the state the engine had before the first (:class:`EngineState`: the
    scheduler's counts and timings, the proposer's step counters), so no run learns from another's pass over
    the same work; afterwards each engine carries on from the state its fastest run left. Other work on a
    shared machine only ever adds time, so the fastest of ``repeats`` runs is the least disturbed measure.
    Returns ``{name: result of the fastest run}`` in ``order``'s order. Raises ValueError when ``repeats < 1``."""
    if repeats < 1:
        raise ValueError(f"repeats: expected an integer >= 1, got {repeats}")
    start = {name: EngineState.of(engine) for name, engine in order} if repeats > 1 else {}
    best: dict[str, tuple[float, R, EngineState | None]] = {}
    for r in range(repeats):
        for name, engine in order if r % 2 == 0 else order[::-1]:
            if r:
                start[name].restore(engine)
            seconds, result = run_once(name, engine)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, result, EngineState.of(engine) if repeats > 1 else None)
    kept: dict[str, R] = {}
    for name, engine in order:
        _, result, state = best[name]
        if state is not None:
            state.restore(engine)  # carry on from the kept run's state
        kept[name] = result
    return kept


@dataclass
class EngineState:
    """What a generation changes in an engine besides its outputs: its scheduler (acceptance counts,
    timings) and its proposer's step counters (prompt lookup, corpus), as :meth:`of` copies them;
    :meth:`restore` puts them back."""

    scheduler: Any
    counters: list[tuple[Any, str, int]]  # (object, attribute, value)

    @classmethod
    def of(cls, engine: SpeculativeEngine) -> "EngineState":
        p, corpus = engine.proposer, corpus_lookup(engine.proposer)
        counted = [(p, a) for a in ("steps_from_lookup", "steps_from_draft") if hasattr(p, a)]
        counted += [(corpus, "steps_from_corpus")] if corpus is not None else []
        return cls(copy.deepcopy(engine.scheduler), [(o, a, getattr(o, a)) for o, a in counted])

    def restore(self, engine: SpeculativeEngine) -> None:
        engine.scheduler = copy.deepcopy(self.scheduler)
        for obj, attr, value in self.counters:
            setattr(obj, attr, value)


def _generate_or_explain(run: _Run, engine: SpeculativeEngine, prompt_ids: list[int], generator: torch.Generator, *,
                         where: str) -> GenerationResult:
    """``engine.generate`` on one turn; out of memory becomes an error naming the prompt, sizes and fixes."""
    try:
        return engine.generate(prompt_ids, max_new_tokens=run.max_new_tokens, sampling=run.sampling,
                               generator=generator)
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(exc):
            raise
        dtype = dtype_name(next(run.target_model.parameters()).dtype)
        sizes = f"{where}: {len(prompt_ids)} prompt tokens + up to {run.max_new_tokens} new, {dtype}"
        fix = ("lower --max-new-tokens or --num-draft-tokens, or evaluate fewer or shorter-prompt "
               "--benchmarks" + (", or decode in --dtype bfloat16" if dtype == "float32" else ""))
        raise out_of_memory_error("eval", run.device, sizes, fix, exc) from exc


def _proposal_counts(proposers: Mapping[str, Proposer]) -> dict[str, dict[str, int]]:
    """Each counting proposer's counters now (a draft with prompt lookup in front: steps from the lookup and
    from the draft; a lookup with a corpus: steps from the corpus), to take a benchmark's share after it."""
    counts: dict[str, dict[str, int]] = {}
    for name, p in proposers.items():
        if hasattr(p, "steps_from_lookup"):
            counts.setdefault(name, {}).update(lookup=p.steps_from_lookup, draft=p.steps_from_draft)
        corpus = corpus_lookup(p)
        if corpus is not None:
            counts.setdefault(name, {})["corpus"] = corpus.steps_from_corpus
    return counts


def _benchmark_figures(run: _Run, runs: Mapping[str, Sequence[GenerationResult]],
                       counts: Mapping[str, Mapping[str, int]], *, max_k: Mapping[str, int],
                       turn_of: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """Each method's metrics on one benchmark (:func:`benchmark_metrics` against target-only; Hugging Face
    ``generate()``'s throughput and identity only), with the shares of steps a lookup in front of a draft
    (``frac_steps_from_lookup``) and a corpus (``frac_steps_from_corpus``) proposed, from the counters
    before it (:func:`_proposal_counts`), and, on a benchmark with later turns (``turn_of``: the (prompt id,
    turn) of each pooled result), the speedups over first turns alone (``speedup_first_turn`` and its median)."""
    base = runs[BASELINE]
    figures = {name: benchmark_metrics(res, baseline=None if name == BASELINE else base, max_k=max_k.get(name, 0))
               for name, res in runs.items()}
    if any(turn > 1 for _, turn in turn_of):  # later turns are built on each method's own answers
        first = [i for i, (_, turn) in enumerate(turn_of) if turn == 1]
        base_first = [base[i] for i in first]
        for name in run.proposers:
            res_first = [runs[name][i] for i in first]
            figures[name]["speedup_first_turn"] = speedup(timing_stats(base_first), timing_stats(res_first))
            figures[name]["speedup_first_turn_median"] = median_speedup(base_first, res_first)
    for name, before in counts.items():
        p = run.proposers[name]
        if "lookup" in before:
            n_lookup = p.steps_from_lookup - before["lookup"]
            n_all = n_lookup + p.steps_from_draft - before["draft"]
            figures[name]["frac_steps_from_lookup"] = n_lookup / n_all if n_all else None
        if "corpus" in before:
            n_all = sum(len(r.steps) for r in runs[name])
            figures[name]["frac_steps_from_corpus"] = (
                (corpus_lookup(p).steps_from_corpus - before["corpus"]) / n_all if n_all else None)
    if HF_GENERATE in figures:  # throughput and identity only: generate() records no steps
        figures[HF_GENERATE] = {k: figures[HF_GENERATE][k] for k in (
            "num_prompts", "num_output_tokens", "total_time_s", "tok_per_s", "time_per_output_token_ms",
            "speedup", "speedup_median", "frac_identical_to_baseline")}
    return figures


def _sample_records(run: _Run, runs: Mapping[str, Sequence[GenerationResult]],
                    prompts_of: Mapping[str, Sequence[list[int]]],
                    turn_of: Sequence[tuple[str, int]]) -> dict[str, list[dict[str, Any]]]:
    """One record per (prompt, turn) and method: sizes, stop reason, time, identity with target-only, and
    the prompt and output texts."""
    base = runs[BASELINE]
    return {
        name: [
            {"id": pid, "turn": turn, "prompt_len": r.prompt_len, "num_new_tokens": r.num_new_tokens,
             "stop_reason": r.stop_reason, "num_steps": len(r.steps), "total_time_s": r.total_time_s,
             "identical_to_baseline": r.output_ids == b.output_ids,
             "prompt": run.tokenizer.decode(prompt_ids), "output": answer_text(run.tokenizer, r.output_ids, run.eos)}
            for (pid, turn), prompt_ids, r, b in zip(turn_of, prompts_of[name], res, base)
        ]
        for name, res in runs.items()
    }


def _summary_line(run: _Run, bench: str, figures: Mapping[str, Any], measure_flips: bool) -> str:
    """The log line of one benchmark: target-only tok/s, each proposer's tau, break-even tau and speedup,
    and the argmax flips when measured."""
    summary = ", ".join(
        f"{name}: tau {figures[name]['tau']:.2f} (break-even {figures[name]['break_even_tau'] or 0:.2f}) "
        f"speedup {figures[name]['speedup'] or 0:.2f}x"
        for name in run.proposers
    )
    if measure_flips:
        base_fig = figures[BASELINE]
        summary += (f"; argmax flips {base_fig['num_argmax_flips']}/{base_fig['num_flip_positions']} tokens "
                    f"({dtype_name(next(run.target_model.parameters()).dtype)})")
    return f"[eval] {bench}: baseline {figures[BASELINE]['tok_per_s']:.1f} tok/s; {summary or 'no proposers'}"


def _run_config(run: _Run, settings: DecodeSettings, *, target_layer_ids: Sequence[int], flip_chunk_len: int | None,
                num_prompts: Mapping[str, int]) -> dict[str, Any]:
    """The report config's record of the run's decoding (its ``config`` beside the caller's entries)."""
    sampling = run.sampling
    return {
        "max_new_tokens": run.max_new_tokens,
        "sampling": dataclasses.asdict(sampling),
        "temperature": sampling.temperature,
        "num_turns": run.num_turns,
        "seed": run.seed,
        "target_layer_ids": list(target_layer_ids),
        "eos_token_ids": run.eos,
        "decoding": decoding_record(max_new_tokens=run.max_new_tokens, temperature=sampling.temperature,
                                    top_k=sampling.top_k, top_p=sampling.top_p, stop_token_ids=run.eos,
                                    checkpoint_generation_config=getattr(run.target_model, "generation_config", None)),
        "proposers": {n: _proposer_info(p) for n, p in run.proposers.items()},
        "dtype": dtype_name(next(run.target_model.parameters()).dtype),
        "few_row_linear": run.few_row_linear,
        "compile": settings.compile,
        "exact": settings.exact,
        "schedule": settings.schedule,
        # the step cost curve the scheduler measured for this target (every engine reads the same cached one)
        "step_cost_curve": next((e.scheduler.curve.to_dict() for e in run.engines.values() if e.scheduler), None),
        "flip_chunk_len": flip_chunk_len,
        "num_prompts": dict(num_prompts),
        "compare_hf_generate": run.compare_hf_generate,
        "timing_repeats": run.timing_repeats,
        "batch_size": 1,
        "target": str(getattr(run.target_model.config, "_name_or_path", "") or type(run.target_model).__name__),
    }
