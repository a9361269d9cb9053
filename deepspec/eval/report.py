"""Evaluation report: Markdown tables, JSON (config, versions, hardware, figures) and PNG plots,
each written atomically (``deepspec.utils``).

Input is the dict built by :func:`deepspec.eval.run.run_eval`::

    {"config": {...}, "environment": {...}, "definitions": {...},
     "benchmarks": {bench: {"target-only": {...}, "hf-generate": {...} (optional), proposer: {...}}}}

where each method's dict is :func:`deepspec.eval.metrics.benchmark_metrics` (``hf-generate`` keeps
only its wall-clock keys). Files written by :func:`write_report`: ``eval_results.json``,
``eval_report.md``, ``acceptance.png`` (prefix-survival rate per draft position),
``tau_histogram.png`` (acceptance-length distribution), when any method carries confidences
``reliability.png`` (confidence-head reliability diagram) and, when the steps were scheduled
(``--schedule auto``), ``step_costs.png`` (the measured step cost curve).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import deepspec
from deepspec.eval.metrics import METRIC_DEFINITIONS
from deepspec.utils import atomic_write_json, atomic_write_text, pyplot, save_png

BASELINE = "target-only"
HF_GENERATE = "hf-generate"

FILE_NAMES: dict[str, str] = {
    "json": "eval_results.json",
    "markdown": "eval_report.md",
    "png": "acceptance.png",
    "tau_histogram": "tau_histogram.png",
    "reliability": "reliability.png",
    "step_costs": "step_costs.png",
}


def environment_info() -> dict[str, Any]:
    """Versions of torch / transformers / deepspec and the hardware the figures were measured on."""
    import torch
    import transformers

    info: dict[str, Any] = {
        "deepspec": deepspec.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    return info


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _methods(results: Mapping[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for bench, methods in results.get("benchmarks", {}).items():
        for method, m in methods.items():
            yield bench, method, m


def _is_proposer(method: str, m: Mapping[str, Any]) -> bool:
    return method not in (BASELINE, HF_GENERATE) and bool(m.get("num_steps"))


def has_calibration(results: Mapping[str, Any]) -> bool:
    """True when any method on any benchmark carries confidence-calibration figures."""
    return any(m.get("calibration") for _, _, m in _methods(results))


def _sampling_line(cfg: Mapping[str, Any]) -> str:
    sampling = cfg.get("sampling")
    if isinstance(sampling, Mapping):
        text = "sampling " + ", ".join(f"{k} {v}" for k, v in sampling.items())
    else:
        text = f"temperature {cfg.get('temperature')}"
    if cfg.get("num_turns") is not None:
        text += f", turns {cfg['num_turns']}"
    return text


def _main_table(results: Mapping[str, Any]) -> list[str]:
    lines = [
        ("| benchmark | method | prompts | tau | break-even tau | accept_rate_prefix@1..K | verify_rate | tok/s | "
         "TTFT ms | TPOT ms | speedup | median speedup | identical | argmax flips /1k |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for bench, method, m in _methods(results):
        if method == HF_GENERATE:
            lines.append(
                f"| {bench} | {method} | {m.get('num_prompts')} | - | - | - | - | {_fmt(m.get('tok_per_s'), 1)} | - | "
                f"- | {_fmt(m.get('speedup'))} | {_fmt(m.get('speedup_median'))} | "
                f"{_fmt(m.get('frac_identical_to_baseline'))} | - |"
            )
            continue
        rates = " ".join(_fmt(r) for r in m.get("accept_rate_prefix", [])) or "-"
        flips = (f"{_fmt(m['argmax_flips_per_1k_tokens'], 1)} ({m['num_argmax_flips']}/{m['num_flip_positions']})"
                 if m.get("num_flip_positions") is not None else "-")
        lines.append(
            f"| {bench} | {method} | {m.get('num_prompts')} | {_fmt(m.get('tau'))} | {_fmt(m.get('break_even_tau'))} | "
            f"{rates} | {_fmt(m.get('verify_rate'))} | {_fmt(m.get('tok_per_s'), 1)} | {_fmt(m.get('ttft_ms'), 1)} | "
            f"{_fmt(m.get('tpot_ms'), 1)} | {_fmt(m.get('speedup'))} | {_fmt(m.get('speedup_median'))} | "
            f"{_fmt(m.get('frac_identical_to_baseline'))} | {flips} |"
        )
    return lines


def _first_turn_table(results: Mapping[str, Any]) -> list[str]:
    """The speedups over first turns alone, for the benchmarks with later turns (none: no lines)."""
    rows = [(bench, method, m) for bench, method, m in _methods(results) if m.get("speedup_first_turn") is not None]
    if not rows:
        return []
    lines = [("First turns alone: a later turn is rendered on each method's own answers, which part from "
              "target-only's at near-ties, so it can time a different context; the first turns are the same prompts "
              "for every method."), "", "| benchmark | method | speedup, first turns | median speedup, first turns |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {bench} | {method} | {_fmt(m['speedup_first_turn'])} | {_fmt(m.get('speedup_first_turn_median'))} |"
              for bench, method, m in rows]
    return lines


def has_divergences(results: Mapping[str, Any]) -> bool:
    """True when some method's greedy output differs from target-only on some prompt."""
    return any(m.get("divergences") for _, _, m in _methods(results))


def _divergence_table(results: Mapping[str, Any]) -> list[str]:
    lines = [
        "## Outputs that differ from target-only (greedy)",
        "",
        ("Each row is one output whose tokens differ from the target-only output: where they first differ, the "
         "target's top-1 minus top-2 logit margin there (in the chunked re-run that counts argmax flips), whether "
         "that re-run flips there too, and whether this method's token is the target's runner-up. A small margin "
         "and a runner-up token mean a near-tie of the target that the verify forward's shape decided otherwise "
         "(docs/design/decoding.md); a large margin would be an error of the speculative step."),
        "",
        "| benchmark | method | prompt | turn | position | target-only token | token | margin | at flip | runner-up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for bench, method, m in _methods(results):
        for d in m.get("divergences") or []:
            lines.append(
                f"| {bench} | {method} | {d['id']} | {d['turn']} | {d['position']} | {_fmt(d['baseline_token'])} | "
                f"{_fmt(d['token'])} | {_fmt(d['baseline_margin'], 3)} | {'yes' if d['at_argmax_flip'] else 'no'} | "
                f"{'yes' if d['token_is_runner_up'] else 'no'} |"
            )
    return lines


def _tau_histogram_table(results: Mapping[str, Any]) -> list[str]:
    lines = [
        "## Acceptance length (tau) histogram",
        "",
        "Verify steps by acceptance length (accepted drafts + 1) = 1, 2, .., K + 1.",
        "",
        "| benchmark | method | steps | tau | steps at tau = 1..K+1 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for bench, method, m in _methods(results):
        if not _is_proposer(method, m):
            continue
        counts = " ".join(str(c) for c in m.get("tau_histogram", [])) or "-"
        lines.append(f"| {bench} | {method} | {m.get('num_steps')} | {_fmt(m.get('tau'))} | {counts} |")
    return lines


def _timing_table(results: Mapping[str, Any]) -> list[str]:
    lines = [
        "## Per-step timing",
        "",
        "Means over verify steps; overhead = step - propose - target forward.",
        "",
        ("| benchmark | method | steps | step ms | propose ms | verify ms | overhead ms | mean proposed | "
         "truncated |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for bench, method, m in _methods(results):
        if method == HF_GENERATE:
            continue
        lines.append(
            f"| {bench} | {method} | {m.get('num_steps')} | {_fmt(m.get('time_ms_per_step'))} | "
            f"{_fmt(m.get('propose_ms_per_step'))} | {_fmt(m.get('verify_ms_per_step'))} | "
            f"{_fmt(m.get('overhead_ms_per_step'))} | {_fmt(m.get('mean_num_proposed'))} | "
            f"{_fmt(m.get('frac_steps_truncated'))} |"
        )
    return lines


def has_schedule(results: Mapping[str, Any]) -> bool:
    """Whether any method's steps were chosen by the cost-aware scheduler (``--schedule auto``)."""
    return results.get("config", {}).get("step_cost_curve") is not None


def _mean_size(histogram: Mapping[str, int]) -> float | None:
    n = sum(histogram.values())
    return sum(int(k) * v for k, v in histogram.items()) / n if n else None


def _schedule_table(results: Mapping[str, Any]) -> list[str]:
    curve = results["config"]["step_cost_curve"]
    one = curve["seconds"][0]
    lines = [
        "## Scheduling",
        "",
        ("`--schedule auto` (deepspec.decoding.schedule): each step verifies the part of the proposal whose expected "
         "tokens are worth its cost on this machine, or is a plain target step. Step cost curve measured for this "
         "target (tokens fed: ms, and in one-token steps): "
         + ", ".join(f"{n}: {1000 * t:.1f} ({t / one:.2f})" for n, t in zip(curve["tokens"], curve["seconds"]))
         + "."),
        "",
        "| benchmark | method | steps | plain steps | not drafted | mean verified | verified sizes (size: steps) | "
        "schedule ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for bench, method, m in _methods(results):
        sizes = m.get("proposal_sizes")
        if not _is_proposer(method, m) or not sizes:
            continue
        lines.append(
            f"| {bench} | {method} | {m.get('num_steps')} | {_fmt(m.get('frac_plain_steps'))} | "
            f"{_fmt(m.get('frac_steps_not_drafted'))} | {_fmt(_mean_size(sizes))} | "
            f"{' '.join(f'{k}: {v}' for k, v in sizes.items())} | {_fmt(m.get('schedule_ms_per_step'), 3)} |"
        )
    return lines


def _calibration_table(results: Mapping[str, Any]) -> list[str]:
    lines = [
        "## Confidence-head calibration",
        "",
        ("Pairs: per step, slots k = 1..min(accepted + 1, proposed); label 1 if accepted. "
         "Position `all` pools every position; a position with no pairs has no row. Confidence `raw`: the "
         "head's own values; `calibrated`: after the draft's held-out calibration (what the scheduler read)."),
        "",
        "| method | benchmark | confidence | k | n | mean conf | accept rate | ECE | AUROC | Brier |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_method: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for bench, method, m in _methods(results):
        if m.get("calibration"):
            if m.get("calibration_raw"):
                by_method.setdefault(method, []).append((bench, "raw", m["calibration_raw"]))
            by_method.setdefault(method, []).append(
                (bench, "calibrated" if m.get("calibration_raw") else "raw", m["calibration"]))
    for method, entries in by_method.items():
        for bench, kind, cal in entries:
            for k, row in [("all", cal["pooled"])] + [(r["k"], r) for r in cal["per_position"]]:
                if not row["num_pairs"]:
                    continue  # nothing measured there (e.g. a slot past every proposal)
                lines.append(
                    f"| {method} | {bench} | {kind} | {k} | {row['num_pairs']} | {_fmt(row['mean_confidence'], 3)} | "
                    f"{_fmt(row['accept_rate'], 3)} | {_fmt(row['ece'], 3)} | {_fmt(row['auroc'], 3)} | "
                    f"{_fmt(row['brier'], 3)} |"
                )
    return lines


def _draft_dtypes(cfg: Mapping[str, Any]) -> str:
    """``" (drafts in bfloat16)"`` when every proposer model shares one dtype, else each named."""
    dtypes = {n: p.get("dtype") for n, p in (cfg.get("proposers") or {}).items() if p.get("dtype")}
    if not dtypes:
        return ""
    if len(set(dtypes.values())) == 1:
        return f" (drafts in {next(iter(dtypes.values()))})"
    return " (drafts: " + ", ".join(f"{n} {d}" for n, d in dtypes.items()) + ")"


def _tree_note(info: Mapping[str, Any]) -> str:
    """`` (...)`` saying how a method's steps use draft trees (deepspec.decoding.engine), or ''."""
    parts = [f"draft tree {info['tree_width']} per slot"] if info.get("tree_width") else []
    if info.get("lookup_tree"):
        parts.append("match verified beside the draft")
    return f" ({', '.join(parts)})" if parts else ""


def _setup_lines(cfg: Mapping[str, Any]) -> list[str]:
    """Proposal lengths and linear path, the lookup corpus, confidence thresholds, where each benchmark's
    prompts came from, and the benchmarks skipped."""
    lines = []
    proposers = cfg.get("proposers") or {}
    if proposers:
        lines += ["", "Tokens proposed per step (K): " + ", ".join(
            f"{m} {p.get('max_proposal_len')}" + _tree_note(p) for m, p in proposers.items())
            + ("; few-row linear path on (deepspec.target.few_row_linear)" if cfg.get("few_row_linear") else "")
            + ("; exact verify rows on (deepspec.target.exact_rows)" if cfg.get("exact") else "")
            + ("; the target decodes on the compiled path, static KV cache + torch.compile (deepspec.decoding.compiled)"
               if cfg.get("compile") else "")
            + ("; `--schedule fixed`: every step verifies the whole proposal" if cfg.get("schedule") == "fixed" else "")
            + "."]
    if (cfg.get("timing_repeats") or 1) > 1:
        lines += ["", f"Timing: every method ran each prompt {cfg['timing_repeats']} times, each run from the same "
                  "state, and the fastest run is reported (deepspec.eval.run)."]
    corpus = cfg.get("lookup_corpus")
    if isinstance(corpus, Mapping):
        lines += ["", f"Lookup corpus (deepspec.algorithms.ngram.corpus; searched where the context has no match, "
                  f"share of steps in frac_steps_from_corpus): {corpus.get('num_sequences')} answers, "
                  f"{corpus.get('num_tokens')} tokens, from {', '.join(map(str, corpus.get('files') or []))}."]
        answered = corpus.get("prompts_answered") or {}
        if answered:
            lines[-1] += (" It holds the target's own answers to evaluated prompts ("
                          + ", ".join(f"{name} {v['answered']} of {v['of']}" for name, v in answered.items())
                          + "): the rows that read it replay those answers, so their tau is not a held-out figure.")
    if cfg.get("confidence_threshold"):
        lines += ["", "Confidence threshold (proposals cut at the first slot below it; calibration then sees only "
                  "the slots kept): " + ", ".join(f"{m} {t}" for m, t in cfg["confidence_threshold"].items()) + "."]
    decoding = cfg.get("decoding")
    if isinstance(decoding, Mapping):
        ignored = decoding.get("checkpoint_settings_ignored") or {}
        lines += ["", "Decoding (pinned, every method): " + ", ".join(
            f"{k} {v}" for k, v in decoding.items() if k != "checkpoint_settings_ignored")
            + (f"; ignored from the target's generation_config: "
               + ", ".join(f"{k} {v}" for k, v in ignored.items()) if ignored else "") + "."]
    checks = cfg.get("target_check") or {}
    if checks:
        said = {"match": "trained against this target (fingerprint matches)",
                "not_recorded": "no target fingerprint recorded (shape checked only)",
                "mismatch_allowed": "TRAINED AGAINST ANOTHER TARGET (fingerprint differs; --allow-target-mismatch)"}
        lines += ["", "Target check: " + "; ".join(
            f"{m} {said.get(c.get('status'), c.get('status'))}"
            + (f" (draft {str(c.get('draft_target_fingerprint'))[:16]}..., target "
               f"{str(c.get('target_fingerprint'))[:16]}...)" if c.get("status") == "mismatch_allowed" else "")
            for m, c in checks.items()) + "."]
    if cfg.get("benchmark_origins"):
        lines += ["", "Prompts read from: " + "; ".join(f"{b}: `{o}`" for b, o in cfg["benchmark_origins"].items())
                  + "."]
    if cfg.get("benchmarks_skipped"):
        lines += ["", "Skipped (no data): " + "; ".join(f"{b} ({why})" for b, why in cfg["benchmarks_skipped"].items())
                  + "."]
    return lines


def markdown_report(results: dict[str, Any], figures: Mapping[str, str] | None = None) -> str:
    """Render the results as Markdown: the main table (benchmark x method), the tau histogram, the
    per-step timing breakdown, the calibration table (when any method has confidences), links to
    ``figures`` (title -> file name beside the report) and the metric definitions
    (``results["definitions"]``, else :data:`~deepspec.eval.metrics.METRIC_DEFINITIONS`)."""
    cfg = results.get("config", {})
    env = results.get("environment", {})
    lines = [
        "# DeepSpec evaluation",
        "",
        (f"{_sampling_line(cfg)}, max_new_tokens {cfg.get('max_new_tokens')}, seed {cfg.get('seed')}, "
         f"target {cfg.get('target', '?')} in {cfg.get('dtype', '?')}{_draft_dtypes(cfg)}"
         + (f" on {cfg['device']}" if cfg.get("device") else "") + f"; torch {env.get('torch')}, transformers {env.get('transformers')}, "
         f"deepspec {env.get('deepspec')}; {env.get('cuda_device') or env.get('processor')} "
         f"({env.get('cpu_count')} CPUs, {env.get('torch_num_threads')} torch threads), {env.get('platform')}."),
        *_setup_lines(cfg),
        "",
        *_main_table(results),
    ]
    if any(HF_GENERATE in per_method for per_method in results.get("benchmarks", {}).values()):
        lines += [
            "",
            (f"`{HF_GENERATE}`: Hugging Face `generate()` on the same prompts; its speedup column is "
             "target-only time per output token / generate() time per output token (> 1 means generate() is "
             "faster than our target-only loop)."),
        ]
    first_turns = _first_turn_table(results)
    lines += ["", *first_turns] if first_turns else []
    lines += ["", *_tau_histogram_table(results), "", *_timing_table(results)]
    if has_schedule(results):
        lines += ["", *_schedule_table(results)]
    if has_divergences(results):
        lines += ["", *_divergence_table(results)]
    if has_calibration(results):
        lines += ["", *_calibration_table(results)]
    if figures:
        lines += ["", "## Figures"]
        for title, name in figures.items():
            lines += ["", f"![{title}]({name})"]
    lines += ["", "## Definitions", ""]
    for key, text in (results.get("definitions") or METRIC_DEFINITIONS).items():
        lines.append(f"- `{key}`: {text}")
    return "\n".join(lines) + "\n"


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    save_png(fig, path, dpi=110)


MAX_PANEL_COLUMNS = 5  # benchmarks per row of a figure (ten benchmarks make two rows)


def _panel_grid(plt: Any, num_panels: int, *, width: float, height: float,
                height_ratios: tuple[float, ...] = (1.0,)) -> tuple[Any, list[list[Any]]]:
    """A figure with one panel per benchmark, at most :data:`MAX_PANEL_COLUMNS` per row; a panel is
    ``len(height_ratios)`` stacked axes. Returns the figure and each panel's axes (unused cells hidden)."""
    n = max(num_panels, 1)
    ncol = min(n, MAX_PANEL_COLUMNS)
    nrow = -(-n // ncol)
    stack = len(height_ratios)
    fig, axes = plt.subplots(stack * nrow, ncol, figsize=(width * ncol, height * nrow), squeeze=False,
                             gridspec_kw={"height_ratios": list(height_ratios) * nrow})
    panels = [[axes[r * stack + j][c] for j in range(stack)] for r in range(nrow) for c in range(ncol)]
    for panel in panels[n:]:
        for ax in panel:
            ax.axis("off")
    return fig, panels[:n]


def _method_colors(results: Mapping[str, Any]) -> dict[str, Any]:
    """One colour per proposer, the same in every figure (first-seen order, matplotlib's tab10)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    names = list(dict.fromkeys(method for _, method, _ in _methods(results) if method not in (BASELINE, HF_GENERATE)))
    return {name: cmap(i % 10) for i, name in enumerate(names)}


def plot_acceptance(results: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG: prefix-survival acceptance per draft position, one panel per benchmark, one line per proposer."""
    plt = pyplot()
    benches = list(results.get("benchmarks", {}))
    colors = _method_colors(results)
    fig, panels = _panel_grid(plt, len(benches), width=4.0, height=3.2)
    for (ax,), bench in zip(panels, benches):
        for method, m in results["benchmarks"][bench].items():
            rates = m.get("accept_rate_prefix") or []
            if method in (BASELINE, HF_GENERATE) or not rates:
                continue
            ks = [k + 1 for k, r in enumerate(rates) if r is not None]
            ax.plot(ks, [r for r in rates if r is not None], marker="o", color=colors[method],
                    label=f"{method} (tau {m['tau']:.2f})")
        ax.set_title(bench)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.set_ylabel("accepted >= k / proposed >= k")
    fig.tight_layout()
    _save(fig, path)


def plot_tau_histogram(results: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG: acceptance-length distribution, one panel per benchmark, one bar group per proposer.

    Bars are fractions of the method's verify steps (the counts are in the JSON / Markdown), so
    methods with different step counts compare; target-only (always tau = 1) is left out.
    """
    plt = pyplot()
    benches = list(results.get("benchmarks", {}))
    colors = _method_colors(results)
    fig, panels = _panel_grid(plt, len(benches), width=4.5, height=3.2)
    for (ax,), bench in zip(panels, benches):
        shown = [(method, m) for method, m in results["benchmarks"][bench].items()
                 if _is_proposer(method, m) and m.get("tau_histogram")]
        width = 0.8 / max(len(shown), 1)
        for i, (method, m) in enumerate(shown):
            counts = m["tau_histogram"]
            total = sum(counts)
            xs = [t + 1 + (i - (len(shown) - 1) / 2) * width for t in range(len(counts))]
            ax.bar(xs, [c / total for c in counts], width=width, color=colors[method],
                   label=f"{method} (tau {m['tau']:.2f})")
        if shown:
            ax.set_xticks(range(1, max(len(m["tau_histogram"]) for _, m in shown) + 1))
        else:
            ax.text(0.5, 0.5, "no proposer steps", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(bench)
        ax.set_xlabel("acceptance length (accepted + 1)")
        ax.grid(alpha=0.3, axis="y")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.set_ylabel("fraction of verify steps")
    fig.tight_layout()
    _save(fig, path)


def plot_reliability(results: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG reliability diagram of the confidence head, pooled over draft positions: one column per
    benchmark with calibration data; top, accept rate vs mean confidence per bin (one line per method,
    the diagonal is perfect calibration; a calibrated draft's raw head values as a dashed line of the same
    color: before and after its calibration); bottom, pairs per bin. Raises ValueError without data."""
    benches = [b for b, methods in results.get("benchmarks", {}).items()
               if any(m.get("calibration") for m in methods.values())]
    if not benches:
        raise ValueError("results: no method carries confidence-calibration figures; nothing to plot.")
    plt = pyplot()
    colors = _method_colors(results)
    fig, panels = _panel_grid(plt, len(benches), width=4.5, height=6.0, height_ratios=(3, 1.4))
    for (top, bottom), bench in zip(panels, benches):
        top.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1, label="perfect calibration")
        shown = [(method, m["calibration"]) for method, m in results["benchmarks"][bench].items()
                 if m.get("calibration")]
        width = 0.8 / max(len(shown), 1)
        for i, (method, cal) in enumerate(shown):
            bins = [b for b in cal["pooled"]["bins"] if b["num_pairs"]]
            ece = cal["pooled"]["ece"]
            raw = results["benchmarks"][bench][method].get("calibration_raw")
            if raw:
                raw_bins = [b for b in raw["pooled"]["bins"] if b["num_pairs"]]
                top.plot([b["mean_confidence"] for b in raw_bins], [b["accept_rate"] for b in raw_bins], marker="x",
                         linestyle="--", color=colors[method],
                         label=f"{method} raw (ECE {_fmt(raw['pooled']['ece'], 3)})")
            top.plot([b["mean_confidence"] for b in bins], [b["accept_rate"] for b in bins], marker="o",
                     color=colors[method], label=f"{method}{' calibrated' if raw else ''} (ECE {_fmt(ece, 3)}, "
                     f"n {cal['pooled']['num_pairs']})")
            all_bins = cal["pooled"]["bins"]
            bin_w = all_bins[0]["hi"] - all_bins[0]["lo"]
            xs = [(b["lo"] + b["hi"]) / 2 + (i - (len(shown) - 1) / 2) * width * bin_w for b in all_bins]
            bottom.bar(xs, [b["num_pairs"] for b in all_bins], width=width * bin_w, color=colors[method])
        top.set_title(bench)
        top.set_xlim(0, 1)
        top.set_ylim(0, 1.02)
        top.set_ylabel("empirical accept rate")
        top.grid(alpha=0.3)
        top.legend(fontsize=7, loc="upper left")
        bottom.set_xlim(0, 1)
        bottom.set_xlabel("confidence (bin)")
        bottom.set_ylabel("pairs per bin")
        bottom.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    _save(fig, path)


def plot_step_costs(results: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """The scheduler's measured step cost curve: a verify forward's time over the tokens it feeds, in
    one-token steps (``results["config"]["step_cost_curve"]``, from :func:`run_eval`)."""
    plt = pyplot()
    curve = results["config"]["step_cost_curve"]
    one = curve["seconds"][0]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot(curve["tokens"], [t / one for t in curve["seconds"]], marker="o")
    ax.plot(curve["tokens"], curve["tokens"], ls=":", color="gray", label="n one-token steps")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens fed to one target forward (anchor + drafts)")
    ax.set_ylabel("time / one-token forward")
    ax.set_title(f"step cost curve ({1000 * one:.1f} ms per one-token forward)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def write_report(results: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write the report files (:data:`FILE_NAMES`) into ``out_dir`` (created if missing); return their
    paths by key: ``json``, ``markdown``, ``png`` (acceptance), ``tau_histogram`` always,
    ``reliability`` only when some method carries confidences and ``step_costs`` only when the steps were
    scheduled (a stale plot from an earlier run in the same folder is removed otherwise, so the folder never
    shows a plot that does not belong to its report)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = ["json", "markdown", "png", "tau_histogram"] + (["reliability"] if has_calibration(results) else []) + (
        ["step_costs"] if has_schedule(results) else [])
    paths = {k: out / FILE_NAMES[k] for k in keys}
    figures = {"acceptance per position": FILE_NAMES["png"], "acceptance length histogram": FILE_NAMES["tau_histogram"]}
    if "reliability" in paths:
        figures["confidence reliability"] = FILE_NAMES["reliability"]
    atomic_write_json(paths["json"], results)
    plot_acceptance(results, paths["png"])
    plot_tau_histogram(results, paths["tau_histogram"])
    if "step_costs" in paths:
        figures["step cost curve"] = FILE_NAMES["step_costs"]
    for key, plot in (("reliability", plot_reliability), ("step_costs", plot_step_costs)):
        if key in paths:
            plot(results, paths[key])
        else:  # a stale plot of an earlier run in the same folder does not belong to this report
            (out / FILE_NAMES[key]).unlink(missing_ok=True)
    atomic_write_text(paths["markdown"], markdown_report(results, figures))
    return paths
