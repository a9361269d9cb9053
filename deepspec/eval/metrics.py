"""Evaluation metrics, pooled over all verify steps / prompts of one benchmark (DESIGN.md s.6).

Pure functions over :class:`~deepspec.eval.engine.StepRecord` / ``GenerationResult`` lists; every
figure has a one-line definition in :data:`METRIC_DEFINITIONS`, which the report prints.

Counting conventions:
- A verify step is one target forward after the prefill; the first output token (sampled from the
  prefill) is not a verify step. The target-only baseline therefore has tau = 1 exactly.
- Acceptance figures (tau, accept_rate@k, verify_rate, per-position counts) use the step records as
  recorded, i.e. before the final step's tokens beyond ``max_new_tokens`` are dropped: they measure
  the drafter, not the length cap. Throughput figures use the output tokens actually returned.
- An accepted EOS counts as an accepted draft; its step commits no extra token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from deepspec.eval.engine import GenerationResult, StepRecord

METRIC_DEFINITIONS: dict[str, str] = {
    "tau": "acceptance length: mean over verify steps of (accepted drafts + 1); max = K + 1; 1 for target-only",
    "accept_rate_conditional@k": "P(draft k accepted | drafts 1..k-1 accepted and draft k proposed) "
    "= #steps(accepted >= k) / #steps(accepted >= k-1 and proposed >= k)",
    "accept_rate_prefix@k": "prefix survival: #steps(accepted >= k) / #steps(proposed >= k)",
    "verify_rate": "committed tokens / tokens fed to the target in verify steps (each step feeds anchor + N drafts)",
    "num_accepted_at_k": "number of verify steps whose draft k was accepted (accepted >= k)",
    "num_proposed_at_k": "number of verify steps that proposed at least k drafts",
    "tok_per_s": "output tokens / wall time of generate() (prefill included), pooled over prompts",
    "ttft_ms": "time to first token: prefill + first-token sampling, mean over prompts",
    "tpot_ms": "time per output token after the first: sum(total - ttft) / sum(output tokens - 1)",
    "time_per_output_token_ms": "sum(wall time of generate()) / sum(output tokens)",
    "speedup": "target-only time_per_output_token / this proposer's time_per_output_token "
    "(same engine, same prompts, same process, interleaved per prompt)",
    "frac_identical_to_baseline": "fraction of prompts whose output ids equal the target-only output "
    "(expected 1.0 at temperature 0: lossless; not expected at temperature > 0)",
}


@dataclass(kw_only=True)
class AcceptanceStats:
    """Acceptance figures pooled over verify steps. Lists are indexed by k - 1 (k = 1..K)."""

    num_steps: int
    tau: float
    verify_rate: float
    num_accepted_at_k: list[int] = field(default_factory=list)
    num_proposed_at_k: list[int] = field(default_factory=list)
    accept_rate_conditional: list[float | None] = field(default_factory=list)
    accept_rate_prefix: list[float | None] = field(default_factory=list)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def acceptance_stats(steps: Sequence[StepRecord], max_k: int | None = None) -> AcceptanceStats:
    """Pool acceptance over ``steps``. ``max_k`` fixes the list length (default: most drafts proposed).

    With no steps at all (every prompt ended at its first token) tau and verify_rate are 0.0, never NaN;
    a rate whose denominator is 0 is None.
    """
    k_max = max_k if max_k is not None else max((s.num_proposed for s in steps), default=0)
    n = len(steps)
    accepted_at = [sum(s.num_accepted >= k for s in steps) for k in range(1, k_max + 1)]
    proposed_at = [sum(s.num_proposed >= k for s in steps) for k in range(1, k_max + 1)]
    reached_at = [sum(s.num_accepted >= k - 1 and s.num_proposed >= k for s in steps) for k in range(1, k_max + 1)]
    fed = sum(s.num_proposed + 1 for s in steps)
    committed = sum(s.num_committed for s in steps)
    return AcceptanceStats(
        num_steps=n,
        tau=(sum(s.num_accepted + 1 for s in steps) / n) if n else 0.0,
        verify_rate=(committed / fed) if fed else 0.0,
        num_accepted_at_k=accepted_at,
        num_proposed_at_k=proposed_at,
        accept_rate_conditional=[_ratio(a, r) for a, r in zip(accepted_at, reached_at)],
        accept_rate_prefix=[_ratio(a, p) for a, p in zip(accepted_at, proposed_at)],
    )


@dataclass(kw_only=True)
class TimingStats:
    """Wall-clock figures pooled over prompts."""

    num_prompts: int
    num_output_tokens: int
    total_time_s: float
    tok_per_s: float
    ttft_ms: float
    tpot_ms: float | None
    time_per_output_token_ms: float


def timing_stats(results: Sequence[GenerationResult]) -> TimingStats:
    """Pool wall-clock figures over ``results`` (see :data:`METRIC_DEFINITIONS`)."""
    tokens = sum(r.num_new_tokens for r in results)
    total = sum(r.total_time_s for r in results)
    after_first = sum(max(r.num_new_tokens - 1, 0) for r in results)
    return TimingStats(
        num_prompts=len(results),
        num_output_tokens=tokens,
        total_time_s=total,
        tok_per_s=tokens / total if total > 0 else 0.0,
        ttft_ms=1000.0 * sum(r.ttft_s for r in results) / len(results) if results else 0.0,
        tpot_ms=(1000.0 * sum(r.total_time_s - r.ttft_s for r in results) / after_first) if after_first else None,
        time_per_output_token_ms=1000.0 * total / tokens if tokens else 0.0,
    )


def speedup(baseline: TimingStats, spec: TimingStats) -> float | None:
    """Target-only time per output token / speculative time per output token."""
    if spec.time_per_output_token_ms <= 0 or baseline.time_per_output_token_ms <= 0:
        return None
    return baseline.time_per_output_token_ms / spec.time_per_output_token_ms


def benchmark_metrics(
    results: Sequence[GenerationResult],
    *,
    baseline: Sequence[GenerationResult] | None = None,
    max_k: int | None = None,
) -> dict[str, Any]:
    """All figures for one proposer on one benchmark, as a JSON-ready dict.

    ``baseline``: the target-only results on the same prompts, in the same order (for speedup and
    the identical-output fraction); None for the baseline itself.
    """
    steps = [s for r in results for s in r.steps]
    acc = acceptance_stats(steps, max_k)
    tim = timing_stats(results)
    out: dict[str, Any] = {**asdict(tim), **asdict(acc)}
    if baseline is not None:
        if len(baseline) != len(results):
            raise ValueError(
                f"baseline: expected {len(results)} target-only results (same prompts), received {len(baseline)}."
            )
        out["speedup"] = speedup(timing_stats(baseline), tim)
        same = sum(r.output_ids == b.output_ids for r, b in zip(results, baseline))
        out["frac_identical_to_baseline"] = same / len(results) if results else None
    return out
