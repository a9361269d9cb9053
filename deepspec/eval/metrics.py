"""Evaluation metrics, pooled over all verify steps / prompts of one benchmark (docs/design/evaluation.md, "Metrics").

Pure functions over :class:`~deepspec.decoding.engine.StepRecord` / ``GenerationResult`` lists; every
figure has a one-line definition in :data:`METRIC_DEFINITIONS`, which the report prints. Every
output is JSON-ready: an undefined figure is None, never NaN.

Counting conventions:
- A verify step is one target forward after the prefill; the first output token (sampled from the
  prefill) is not a verify step. The target-only baseline therefore has tau = 1 exactly.
- Acceptance figures (tau, accept_rate@k, verify_rate, per-position counts) use the step records as
  recorded, i.e. before the final step's tokens beyond ``max_new_tokens`` are dropped: they measure
  the drafter, not the length cap. Throughput figures use the output tokens actually returned.
- An accepted EOS counts as an accepted draft; its step commits no extra token
  (``num_committed == num_accepted``), and the drafts after it are never verified. tau and its histogram
  count the tokens a step committed (``num_committed``: accepted + 1, or accepted when the step ended at an
  accepted EOS, which no bonus token follows), as the original DeepSpec's acceptance length does.

Confidence calibration (DSpark's confidence head, docs/design/draft-models.md, "Markov and confidence
heads": slot k's probability of being
accepted given that slots 1..k-1 were). The evaluated (confidence, label) pairs of a step with
confidence are its slots k = 1..min(num_accepted + 1, num_proposed): the accepted slots (label 1)
and the first rejected one (label 0). Slots after the first rejection were never reached, so the
conditional event the head predicts is undefined there and they are excluded; so is slot
num_accepted + 1 of a step that ended at an accepted EOS (it was not verified either). A draft tree's
step (DSpark with ``--tree-width`` > 1) carries the confidences of its chain, the draft's first choices,
the nodes the head scores: its pairs are the chain's slots up to the first chain node not accepted,
labelled by whether the accepted path went through it (a sibling accepted instead is the chain node's
rejection). A drafter with a
calibrated head (:mod:`deepspec.models.calibration`) reports calibrated confidences, which ``calibration``
measures (what the scheduler consumed); ``calibration_raw`` measures the same pairs with the head's raw
values (the steps' ``raw_confidence``), so the report shows both.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from deepspec.decoding.engine import GenerationResult, StepRecord
from deepspec.decoding.schedule import size_histogram

DEFAULT_NUM_BINS = 10

METRIC_DEFINITIONS: dict[str, str] = {
    "num_prompts": "number of generate() calls pooled: prompts x turns (num_turns 2 runs each two-turn prompt twice)",
    "num_output_tokens": "output tokens returned, summed over prompts (after the max_new_tokens cut)",
    "total_time_s": "wall time of generate() summed over prompts (prefill included)",
    "num_steps": "number of verify steps (target forwards after the prefill), pooled over prompts",
    "tau": "acceptance length: mean over verify steps of the tokens the step committed (accepted drafts + 1, or "
    "the accepted drafts alone when the step ended at an accepted EOS: no bonus token follows it); max = K + 1; "
    "1 for target-only",
    "tau_histogram": "counts of verify steps by acceptance length (tokens committed) = 1, 2, .., K + 1 "
    "(list index i holds length i + 1), pooled over prompts",
    "accept_rate_conditional@k": "P(draft k accepted | drafts 1..k-1 accepted and draft k proposed) "
    "= #steps(accepted >= k) / #steps(accepted >= k-1 and proposed >= k)",
    "accept_rate_prefix@k": "prefix survival: #steps(accepted >= k) / #steps(proposed >= k); in a `<draft>+lookup` "
    "row, k beyond the draft's K counts prompt-lookup steps only",
    "verify_rate": "committed tokens / tokens fed to the target in verify steps (each step feeds anchor + N drafts)",
    "num_accepted_at_k": "number of verify steps whose draft k was accepted (accepted >= k)",
    "num_proposed_at_k": "number of verify steps that proposed at least k drafts",
    "mean_num_proposed": "mean over verify steps of the number of drafts proposed (after position truncation)",
    "frac_steps_truncated": "fraction of verify steps that proposed fewer than K drafts (K = the max_proposal_len "
    "of the proposer that made the step: in a `<draft>+lookup` row the draft's or the lookup's): cut by the "
    "confidence threshold, the target's max positions or, for prompt lookup, a short or missing match; a step "
    "record does not say which (None without steps)",
    "time_ms_per_step": "mean wall time of a verify step (propose + target forward + verify + update), ms",
    "propose_ms_per_step": "mean wall time of proposer.propose per verify step, ms",
    "verify_ms_per_step": "mean wall time of the target forward over [anchor, d_1..d_N] per verify step, ms",
    "overhead_ms_per_step": "mean of (step time - propose time - target forward time) per verify step, ms: "
    "acceptance math, sampling, KV-cache crop, draft context update, bookkeeping",
    "proposal_sizes": "counts of verify steps by the draft tokens the target verified (a tree's nodes; 0: a plain "
    "target step), as {size: count}: with --schedule auto the scheduler's choices, else the proposer's",
    "frac_plain_steps": "fraction of verify steps that verified no draft token (a plain target step)",
    "frac_steps_not_drafted": "fraction of verify steps on which the scheduler did not call the proposer at all",
    "schedule_ms_per_step": "mean wall time of the scheduler's own estimates per verify step, ms (inside the overhead)",
    "tok_per_s": "output tokens / wall time of generate() (prefill included), pooled over prompts",
    "ttft_ms": "time to first token: prefill + first-token sampling, mean over prompts",
    "tpot_ms": "time per output token after the first: sum(total - ttft) / sum(output tokens - 1)",
    "time_per_output_token_ms": "sum(wall time of generate()) / sum(output tokens)",
    "speedup": "target-only time_per_output_token / this proposer's time_per_output_token "
    "(same engine, same prompts, same process, interleaved per prompt)",
    "speedup_median": "median over prompts (and turns) of the per-prompt speedup: target-only's time per output "
    "token on that prompt / this proposer's (robust to one prompt's load spike; pooled speedup weighs long "
    "outputs more)",
    "speedup_first_turn": "multi-turn benchmarks only (e.g. MT-Bench): speedup over the first turns alone, pooled. "
    "A later turn is rendered on each method's own earlier answers, and those part from target-only's at near-ties "
    "(bfloat16), so a later turn can time a different context; the first turns are the same prompts for every "
    "method",
    "speedup_first_turn_median": "multi-turn benchmarks only: speedup_median over the first turns alone",
    "break_even_tau": "the tau at which speculation pays: this method's mean verify-step time / the target-only "
    "mean step time (time_ms_per_step of both, same run). A step commits tau tokens on average and a target-only "
    "step one, so decoding is faster than target-only when tau > break_even_tau (speedup ~ tau / break_even_tau, "
    "prefill aside)",
    "argmax_flips_per_1k_tokens": "target-only row, temperature 0: per 1000 output tokens, how often the target's "
    "argmax over a verify-sized forward (flip_chunk_len = K + 1 tokens at a time, KV cache, the engine's forward) "
    "differs from the token the one-token decode chose at the same position (first output token excluded: it comes "
    "from the prefill in both). Near-ties flip with the forward's shape, mostly in bfloat16; see docs/design/decoding.md",
    "num_argmax_flips": "target-only row: positions counted by argmax_flips_per_1k_tokens",
    "num_flip_positions": "target-only row: output positions compared (output tokens - 1 per prompt)",
    "divergences": "per output of this method that differs from target-only (temperature 0): prompt id, turn, first "
    "differing position, the target-only token and this method's token there, baseline_margin (the target's top-1 "
    "minus top-2 logit at that position in the chunked re-run), at_argmax_flip (the chunked re-run flips there too) "
    "and token_is_runner_up (this method's token is the target's second choice)",
    "num_divergent_at_flip_or_runner_up": "divergent outputs whose first difference sits at an argmax flip or picks "
    "the target's runner-up: a near-tie of the target, not an acceptance error",
    "frac_identical_to_baseline": "fraction of prompts whose output ids equal the target-only output "
    "(expected 1.0 at temperature 0: lossless. At temperature > 0 the outputs differ, only their distribution is the "
    "target's, which the test suite checks with a chi-square test; hf-generate draws from the same random stream as "
    "target-only, so its outputs are identical there too)",
    "frac_steps_from_lookup": "a draft with prompt lookup in front (`<draft>+lookup`, eval.lookup_first) only: "
    "fraction of its verify steps whose proposal came from the n-gram lookup (the rest from the draft); with a "
    "lookup corpus this includes frac_steps_from_corpus",
    "frac_steps_from_corpus": "a lookup with a corpus of the target's answers (`<draft>+lookup` with "
    "eval.lookup_corpus, `ngram+corpus`) only: fraction of its verify steps whose proposal came from the corpus "
    "(the context had no match)",
    "calibration": "confidence-head calibration (None when no step carries confidences). Pairs: per step "
    "with confidence, slots k = 1..min(accepted + 1, proposed), label 1 if k <= accepted else 0 (slots after "
    "the first rejection, and the slot after an accepted EOS, are not reached and excluded; a draft tree: its "
    "chain's slots, accepted = the accepted path's leading chain nodes); figures "
    "`pooled` over all pairs and `per_position` (k = 1..K)",
    "calibration_raw": "the same figures as `calibration` on the confidence head's raw (uncalibrated) values, for a "
    "draft whose confidences were calibrated (its `confidence_calibration.json`, fitted on held-out steps in "
    "training); None otherwise (then `calibration` is the raw head's)",
    "calibration.num_steps": "verify steps that carried confidences",
    "calibration.num_bins": "number of equal-width confidence bins on [0, 1] used by ECE and the reliability bins",
    "calibration.k": "draft position (1-based) of a per_position entry",
    "calibration.num_pairs": "number of evaluated (confidence, label) pairs",
    "calibration.mean_confidence": "mean confidence over the evaluated pairs",
    "calibration.accept_rate": "empirical accept rate: mean label over the evaluated pairs",
    "calibration.brier": "Brier score: mean (confidence - label)^2 (0 is perfect; 0.25 for a constant 0.5)",
    "calibration.ece": "expected calibration error: num_bins equal-width bins [i/B, (i+1)/B) (the last one "
    "closed), sum over bins of (pairs in bin / pairs) * |mean confidence - accept rate| in the bin",
    "calibration.auroc": "area under the ROC curve of confidence vs label = Mann-Whitney P(conf of an accepted "
    "pair > conf of a rejected pair), ties counted 1/2; None when either class is absent",
    "calibration.bins": "reliability bins (pooled): per bin lo, hi, num_pairs, mean_confidence, accept_rate "
    "(None in an empty bin)",
}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def acceptance_length(step: StepRecord) -> int:
    """The acceptance length of one verify step: the tokens it committed, ``num_committed`` (accepted + 1, or
    accepted when it ended at an accepted EOS: no bonus token follows an EOS), before the ``max_new_tokens``
    cut. The figure tau averages, as the original DeepSpec counts it."""
    return step.num_committed


def tau_histogram(steps: Sequence[StepRecord], max_k: int | None = None) -> list[int]:
    """Counts of acceptance length (:func:`acceptance_length`, 1..K+1); index i holds length i + 1.

    ``max_k`` = K fixes the length K + 1 (default: most drafts proposed). Raises ValueError when a
    step accepted more than ``max_k`` drafts (its length would not fit the histogram).
    """
    k_max = max_k if max_k is not None else max((s.num_proposed for s in steps), default=0)
    counts = [0] * (k_max + 1)
    for s in steps:
        if s.num_accepted > k_max:
            raise ValueError(
                f"max_k: a step accepted {s.num_accepted} drafts but max_k is {k_max}; pass the proposer's "
                "max_proposal_len (or None to use the most drafts proposed)."
            )
        counts[acceptance_length(s) - 1] += 1
    return counts


@dataclass(kw_only=True)
class AcceptanceStats:
    """Acceptance figures pooled over verify steps. Per-position lists are indexed by k - 1 (k = 1..K);
    ``tau_histogram`` by acceptance length - 1 (length 1..K+1)."""

    num_steps: int
    tau: float
    verify_rate: float
    tau_histogram: list[int] = field(default_factory=list)
    num_accepted_at_k: list[int] = field(default_factory=list)
    num_proposed_at_k: list[int] = field(default_factory=list)
    accept_rate_conditional: list[float | None] = field(default_factory=list)
    accept_rate_prefix: list[float | None] = field(default_factory=list)
    mean_num_proposed: float | None = None
    frac_steps_truncated: float | None = None


def acceptance_stats(steps: Sequence[StepRecord], max_k: int | None = None) -> AcceptanceStats:
    """Pool acceptance over ``steps``. ``max_k`` fixes the list length (default: most drafts proposed).

    With no steps at all (every prompt ended at its first token) tau and verify_rate are 0.0, never NaN;
    a rate whose denominator is 0 is None, and so are ``mean_num_proposed`` / ``frac_steps_truncated``.
    """
    k_max = max_k if max_k is not None else max((s.num_proposed for s in steps), default=0)
    n = len(steps)
    accepted_at = [sum(s.num_accepted >= k for s in steps) for k in range(1, k_max + 1)]
    proposed_at = [sum(s.num_proposed >= k for s in steps) for k in range(1, k_max + 1)]
    reached_at = [sum(s.num_accepted >= k - 1 and s.num_proposed >= k for s in steps) for k in range(1, k_max + 1)]
    fed = sum(s.num_nodes_verified + 1 for s in steps)
    committed = sum(s.num_committed for s in steps)
    return AcceptanceStats(
        num_steps=n,
        tau=(sum(acceptance_length(s) for s in steps) / n) if n else 0.0,
        verify_rate=(committed / fed) if fed else 0.0,
        tau_histogram=tau_histogram(steps, k_max),
        num_accepted_at_k=accepted_at,
        num_proposed_at_k=proposed_at,
        accept_rate_conditional=[_ratio(a, r) for a, r in zip(accepted_at, reached_at)],
        accept_rate_prefix=[_ratio(a, p) for a, p in zip(accepted_at, proposed_at)],
        mean_num_proposed=_ratio(sum(s.num_proposed for s in steps), n),
        frac_steps_truncated=_ratio(sum(s.num_proposed < (k_max if s.max_proposal_len is None else s.max_proposal_len)
                                         for s in steps), n),
    )


@dataclass(kw_only=True)
class StepTimingStats:
    """Per-verify-step wall-clock breakdown in ms (means over steps; None without steps)."""

    time_ms_per_step: float | None
    propose_ms_per_step: float | None
    verify_ms_per_step: float | None
    overhead_ms_per_step: float | None


def step_timing_stats(steps: Sequence[StepRecord]) -> StepTimingStats:
    """Mean step / propose / target-forward / overhead time per verify step, in ms.

    overhead = ``time_s - propose_s - verify_s`` per step, as measured (not clamped at 0).
    """
    n = len(steps)
    if not n:
        return StepTimingStats(time_ms_per_step=None, propose_ms_per_step=None, verify_ms_per_step=None,
                               overhead_ms_per_step=None)
    total = sum(s.time_s for s in steps)
    propose = sum(s.propose_s for s in steps)
    verify = sum(s.verify_s for s in steps)
    return StepTimingStats(
        time_ms_per_step=1000.0 * total / n,
        propose_ms_per_step=1000.0 * propose / n,
        verify_ms_per_step=1000.0 * verify / n,
        overhead_ms_per_step=1000.0 * (total - propose - verify) / n,
    )


def schedule_stats(steps: Sequence[StepRecord]) -> dict[str, Any]:
    """What the steps verified: ``proposal_sizes`` ({size: count}, a tree's nodes, 0 a plain step),
    ``frac_plain_steps``, ``frac_steps_not_drafted`` and ``schedule_ms_per_step`` (None without steps)."""
    n = len(steps)
    sizes = [s.num_nodes_verified for s in steps]
    return {
        "proposal_sizes": size_histogram(sizes),
        "frac_plain_steps": _ratio(sum(1 for x in sizes if x == 0), n),
        "frac_steps_not_drafted": _ratio(sum(1 for s in steps if not s.drafted), n),
        "schedule_ms_per_step": None if not n else 1000.0 * sum(s.schedule_s for s in steps) / n,
    }


# --- confidence calibration -------------------------------------------------------------------


def calibration_pairs(steps: Sequence[StepRecord], *, raw: bool = False) -> list[tuple[int, float, int]]:
    """The evaluated ``(k, confidence, label)`` triples of ``steps`` (see the module docstring); with
    ``raw``, the confidence is the step's ``raw_confidence`` where it has one (a calibrated drafter's head
    values), else its ``confidence``.

    Steps whose ``confidence`` is None are skipped. Raises ValueError when a step's confidence tuple
    does not have one value per proposed draft, or a value lies outside [0, 1] (NaN included).
    """
    pairs: list[tuple[int, float, int]] = []
    for i, s in enumerate(steps):
        conf = s.raw_confidence if raw and s.raw_confidence is not None else s.confidence
        if conf is None:
            continue
        tree = s.num_scored_accepted is not None  # a draft tree's scored path (DSpark's chain), depth 1 first
        if (len(conf) > s.num_proposed) if tree else (len(conf) != s.num_proposed):
            raise ValueError(
                f"steps[{i}].confidence: expected one value per proposed draft ({s.num_proposed}"
                f"{', at most, along a tree' if tree else ''}), received {len(conf)}."
            )
        accepted = s.num_scored_accepted if tree else s.num_accepted
        # an accepted EOS (on the scored path): nothing after it was verified
        ended_at_eos = s.num_committed == s.num_accepted and accepted == s.num_accepted
        last = min(accepted + (0 if ended_at_eos else 1), len(conf))
        for k in range(1, last + 1):
            c = float(conf[k - 1])
            if not 0.0 <= c <= 1.0:
                raise ValueError(f"steps[{i}].confidence[{k - 1}]: expected a probability in [0, 1], received {c}.")
            pairs.append((k, c, int(k <= accepted)))
    return pairs


def brier_score(confidence: Sequence[float], labels: Sequence[int]) -> float | None:
    """Mean squared error ``(confidence - label)^2``; None for no pairs."""
    return _mean([(c - y) ** 2 for c, y in zip(confidence, labels, strict=True)])


def _bin_index(c: float, num_bins: int) -> int:
    return min(math.floor(c * num_bins), num_bins - 1)


def reliability_bins(confidence: Sequence[float], labels: Sequence[int],
                     num_bins: int = DEFAULT_NUM_BINS) -> list[dict[str, Any]]:
    """Equal-width bins ``[i/B, (i+1)/B)`` on [0, 1] (the last one includes 1.0).

    Returns per bin ``lo``, ``hi``, ``num_pairs``, ``mean_confidence``, ``accept_rate`` (None when empty).
    """
    if num_bins < 1:
        raise ValueError(f"num_bins: expected >= 1, received {num_bins}.")
    conf_in: list[list[float]] = [[] for _ in range(num_bins)]
    label_in: list[list[int]] = [[] for _ in range(num_bins)]
    for c, y in zip(confidence, labels, strict=True):
        b = _bin_index(c, num_bins)
        conf_in[b].append(c)
        label_in[b].append(y)
    return [
        {"lo": b / num_bins, "hi": (b + 1) / num_bins, "num_pairs": len(conf_in[b]),
         "mean_confidence": _mean(conf_in[b]), "accept_rate": _mean(label_in[b])}
        for b in range(num_bins)
    ]


def expected_calibration_error(confidence: Sequence[float], labels: Sequence[int],
                               num_bins: int = DEFAULT_NUM_BINS) -> float | None:
    """ECE over ``num_bins`` equal-width bins, each weighted by its share of the pairs; None for no pairs."""
    n = len(confidence)
    if not n:
        return None
    return sum(b["num_pairs"] / n * abs(b["mean_confidence"] - b["accept_rate"])
               for b in reliability_bins(confidence, labels, num_bins) if b["num_pairs"])


def auroc(confidence: Sequence[float], labels: Sequence[int]) -> float | None:
    """Rank-based AUROC (Mann-Whitney U / (n_pos * n_neg)), tied confidences sharing their mean rank,
    which counts a tied (positive, negative) pair as 1/2. None when either class is absent."""
    n = len(confidence)
    if len(labels) != n:
        raise ValueError(f"labels: expected {n} labels (one per confidence), received {len(labels)}.")
    n_pos = sum(labels)
    n_neg = n - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = sorted(range(n), key=lambda i: confidence[i])
    rank_sum_pos = 0.0
    i = 0
    while i < n:
        j = i
        while j + 1 < n and confidence[order[j + 1]] == confidence[order[i]]:
            j += 1
        mean_rank = (i + j) / 2 + 1  # 1-based ranks i+1 .. j+1 share their mean
        rank_sum_pos += mean_rank * sum(labels[order[t]] for t in range(i, j + 1))
        i = j + 1
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def _calibration_summary(confidence: Sequence[float], labels: Sequence[int], num_bins: int) -> dict[str, Any]:
    return {
        "num_pairs": len(confidence),
        "mean_confidence": _mean(confidence),
        "accept_rate": _mean(labels),
        "brier": brier_score(confidence, labels),
        "ece": expected_calibration_error(confidence, labels, num_bins),
        "auroc": auroc(confidence, labels),
    }


def calibration_stats(steps: Sequence[StepRecord], max_k: int | None = None,
                      num_bins: int = DEFAULT_NUM_BINS, *, raw: bool = False) -> dict[str, Any] | None:
    """Confidence-head calibration over ``steps``; None when no step carries confidences. ``raw``: of the
    head's raw values (:func:`calibration_pairs`).

    Returns ``{"num_steps", "num_bins", "pooled": {num_pairs, mean_confidence, accept_rate, brier, ece,
    auroc, bins}, "per_position": [{k, num_pairs, ...} for k = 1..K]}`` where K = ``max_k`` (default:
    the deepest evaluated slot). Definitions: :data:`METRIC_DEFINITIONS` (``calibration.*``).
    """
    with_conf = [s for s in steps if s.confidence is not None]
    if not with_conf:
        return None
    pairs = calibration_pairs(with_conf, raw=raw)
    k_max = max_k if max_k is not None else max((k for k, _, _ in pairs), default=0)
    conf = [c for _, c, _ in pairs]
    labels = [y for _, _, y in pairs]
    pooled = _calibration_summary(conf, labels, num_bins)
    pooled["bins"] = reliability_bins(conf, labels, num_bins)
    per_position = []
    for k in range(1, k_max + 1):
        at_k = [(c, y) for kk, c, y in pairs if kk == k]
        per_position.append({"k": k, **_calibration_summary([c for c, _ in at_k], [y for _, y in at_k], num_bins)})
    return {"num_steps": len(with_conf), "num_bins": num_bins, "pooled": pooled, "per_position": per_position}


# --- wall clock ---------------------------------------------------------------------------------


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


def median_speedup(baseline: Sequence[GenerationResult], results: Sequence[GenerationResult]) -> float | None:
    """The median over paired results (same prompt and turn, in order) of target-only seconds per output token /
    this proposer's; pairs where either made no token or took no time are left out (None when none is left)."""
    ratios = [(b.total_time_s / b.num_new_tokens) / (r.total_time_s / r.num_new_tokens)
              for b, r in zip(baseline, results)
              if b.num_new_tokens and r.num_new_tokens and b.total_time_s > 0 and r.total_time_s > 0]
    return statistics.median(ratios) if ratios else None


def break_even_tau(steps: Sequence[StepRecord], baseline_steps: Sequence[StepRecord]) -> float | None:
    """Mean step time of ``steps`` / mean step time of the target-only ``baseline_steps``: the tau above
    which speculation beats target-only decoding (None when either has no steps or no time)."""
    spec, base = step_timing_stats(steps).time_ms_per_step, step_timing_stats(baseline_steps).time_ms_per_step
    return spec / base if spec is not None and base else None


def benchmark_metrics(
    results: Sequence[GenerationResult],
    *,
    baseline: Sequence[GenerationResult] | None = None,
    max_k: int | None = None,
    num_bins: int = DEFAULT_NUM_BINS,
) -> dict[str, Any]:
    """All figures for one proposer on one benchmark, as a JSON-ready dict.

    ``baseline``: the target-only results on the same prompts, in the same order (for speedup,
    break-even tau and the identical-output fraction); None for the baseline itself. ``max_k``: the proposer's
    ``max_proposal_len`` K (sizes the per-position lists and the tau histogram, and is the K of
    ``frac_steps_truncated``). ``num_bins``: confidence bins for ECE / reliability.
    """
    steps = [s for r in results for s in r.steps]
    acc = acceptance_stats(steps, max_k)
    tim = timing_stats(results)
    out: dict[str, Any] = {**asdict(tim), **asdict(acc), **asdict(step_timing_stats(steps)), **schedule_stats(steps)}
    out["calibration"] = calibration_stats(steps, max_k, num_bins)
    out["calibration_raw"] = (calibration_stats(steps, max_k, num_bins, raw=True)
                              if any(s.raw_confidence is not None for s in steps) else None)
    if baseline is not None:
        if len(baseline) != len(results):
            raise ValueError(
                f"baseline: expected {len(results)} target-only results (same prompts), received {len(baseline)}."
            )
        out["speedup"] = speedup(timing_stats(baseline), tim)
        out["speedup_median"] = median_speedup(baseline, results)
        out["break_even_tau"] = break_even_tau(steps, [s for r in baseline for s in r.steps])
        same = sum(r.output_ids == b.output_ids for r, b in zip(results, baseline))
        out["frac_identical_to_baseline"] = same / len(results) if results else None
    return out
