"""Evaluation report: Markdown table, JSON (config, versions, hardware, figures) and a PNG of
per-position acceptance, each written atomically (``deepspec.utils``).

Input is the dict built by :func:`deepspec.eval.run.run_eval`::

    {"config": {...}, "environment": {...}, "definitions": {...},
     "benchmarks": {bench: {"target-only": {...}, "hf-generate": {...} (optional), proposer: {...}}}}
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from deepspec.utils import atomic_path, atomic_write_json, atomic_write_text

BASELINE = "target-only"
HF_GENERATE = "hf-generate"


def environment_info() -> dict[str, Any]:
    """Versions of torch / transformers / deepspec and the hardware the figures were measured on."""
    import torch
    import transformers

    import deepspec

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


def markdown_report(results: dict[str, Any]) -> str:
    """Render the results as Markdown: one table (benchmark x method) plus the metric definitions."""
    cfg = results.get("config", {})
    env = results.get("environment", {})
    lines = [
        "# DeepSpec evaluation",
        "",
        f"temperature {cfg.get('temperature')}, max_new_tokens {cfg.get('max_new_tokens')}, seed {cfg.get('seed')}, "
        f"target {cfg.get('target', '?')}; torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"deepspec {env.get('deepspec')}; {env.get('cuda_device') or env.get('processor')} "
        f"({env.get('cpu_count')} CPUs), {env.get('platform')}.",
        "",
        "| benchmark | method | prompts | tau | accept_rate_prefix@1..K | verify_rate | tok/s | TTFT ms | TPOT ms | "
        "speedup | identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for bench, methods in results.get("benchmarks", {}).items():
        for method, m in methods.items():
            if method == HF_GENERATE:
                lines.append(
                    f"| {bench} | {method} | {m.get('num_prompts')} | - | - | - | {_fmt(m.get('tok_per_s'), 1)} | - | - | "
                    f"{_fmt(m.get('speedup'))} | {_fmt(m.get('frac_identical_to_baseline'))} |"
                )
                continue
            rates = " ".join(_fmt(r) for r in m.get("accept_rate_prefix", [])) or "-"
            lines.append(
                f"| {bench} | {method} | {m.get('num_prompts')} | {_fmt(m.get('tau'))} | {rates} | "
                f"{_fmt(m.get('verify_rate'))} | {_fmt(m.get('tok_per_s'), 1)} | {_fmt(m.get('ttft_ms'), 1)} | "
                f"{_fmt(m.get('tpot_ms'), 1)} | {_fmt(m.get('speedup'))} | {_fmt(m.get('frac_identical_to_baseline'))} |"
            )
    if any(HF_GENERATE in per_method for per_method in results["benchmarks"].values()):
        lines += [
            "",
            f"`{HF_GENERATE}`: Hugging Face `generate()` on the same prompts; its speedup column is "
            "target-only time per output token / generate() time per output token (> 1 means generate() is "
            "faster than our target-only loop).",
        ]
    lines += ["", "## Definitions", ""]
    for key, text in results.get("definitions", {}).items():
        lines.append(f"- `{key}`: {text}")
    return "\n".join(lines) + "\n"


def plot_acceptance(results: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG: prefix-survival acceptance per draft position, one panel per benchmark, one line per proposer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(results.get("benchmarks", {}))
    fig, axes = plt.subplots(1, max(len(benches), 1), figsize=(4 * max(len(benches), 1), 3.2), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        for method, m in results["benchmarks"][bench].items():
            rates = m.get("accept_rate_prefix") or []
            if method in (BASELINE, HF_GENERATE) or not rates:
                continue
            ks = [k + 1 for k, r in enumerate(rates) if r is not None]
            ax.plot(ks, [r for r in rates if r is not None], marker="o", label=f"{method} (tau {m['tau']:.2f})")
        ax.set_title(bench)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0][0].set_ylabel("accepted >= k / proposed >= k")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def write_report(results: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write ``eval_results.json``, ``eval_report.md`` and ``acceptance.png`` into ``out_dir``
    (created if missing); return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "eval_results.json", "markdown": out / "eval_report.md", "png": out / "acceptance.png"}
    atomic_write_json(paths["json"], results)
    atomic_write_text(paths["markdown"], markdown_report(results))
    plot_acceptance(results, paths["png"])
    return paths
