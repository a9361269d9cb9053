"""Cost-aware scheduling of speculative steps: how much of each proposal to verify, or none.

A verify forward over ``n`` tokens costs more than a one-token step, and how much more depends on the
device, dtype and kernels (on the CPUs seen here a verify over 8 tokens costs 1.15x to 3.6x a one-token
step). A fixed K and tree therefore slow decoding wherever the draft's acceptance is low. The
scheduler picks, every step, the part of the proposal whose expected committed tokens per expected
second is best, and a plain target step (no proposal at all) when nothing pays
(docs/design/decoding.md, "Scheduling").

Three parts:

- :class:`StepCostCurve`: the seconds of one target forward over ``n`` tokens, measured once per
  target, device, dtype and thread count (:func:`measure_step_costs`, cached on disk by
  :func:`load_or_measure_step_costs`); the engine keeps its scale current from every step's
  measured verify time (context length and load change it; the shape is the device's).
- :class:`AcceptanceEstimator`: the probability that a draft node is accepted given that its parent
  was, by depth, rank among its siblings and the proposer's own score (DSpark's confidence head),
  as running counts of what the target accepted in past steps (a Beta prior that starts at the
  score, so a calibrated head is trusted at once and a miscalibrated one is corrected by the counts),
  kept over all requests and, on top, for the request at hand (a draft that pays on one kind of prompt
  may not on the next).
- :class:`StepScheduler`: the decision. With ``lam`` the long-run rate (tokens per second) the
  decoding already achieves (at least target-only's), a step is worth its cost when
  ``E[committed] - lam * E[seconds]`` is largest (Dinkelbach's rule for maximising a ratio of
  expectations: the renewal-reward rate of the step sequence).

Lossless: the target's verify rule is unchanged and the choice reads only draft-side information
and past steps' acceptance, never the target's output for the current step. At T = 0 any such
choice leaves the output target-only's (verification compares with the target's argmax). At T > 0
speculative sampling is exact for any proposal whose length is a *stopping time*: whether slot
``k`` is verified may depend on the drafts before it and on what the draft knew before drawing slot
``k`` (its confidence for slot ``k`` is computed before the draw), never on the token drawn at slot
``k`` itself, else the accepted tokens would be conditioned on their own value. So at T > 0 a chain is
cut by a sequential rule that reads slot ``k``'s score only to decide slot ``k``, and a tree by a depth
chosen before it was drawn; at T = 0 a tree keeps the nodes of highest estimated path probability.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import math
import operator
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deepspec.algorithms.protocol import DRAFT_SOURCE, Proposal
from deepspec.utils import atomic_write_json

# Token counts a cost curve is measured at (the engine measures those up to its longest verify).
MEASURED_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# A draft call that first flushes at least this many queued context positions teaches the flush's seconds per
# position (fewer are lost in the call's own noise).
FLUSH_MIN_FEATURES = 16


@dataclass(frozen=True)
class StepCostCurve:
    """Seconds of one target forward over ``n`` tokens fed (a verify: the anchor + ``n - 1`` drafts).

    ``tokens``: increasing token counts starting at 1; ``seconds``: the measured median at each.
    Between points the cost is interpolated linearly, beyond the last extrapolated with the last
    segment's slope (never below the last point).

    Raises ValueError for an empty curve, a curve not starting at 1 token, unsorted counts or a
    non-positive time.
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    _by_n: tuple[float, ...] = field(init=False, repr=False, compare=False)  # seconds_for(1 .. up to 1,024)

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds) or self.tokens[0] != 1:
            raise ValueError(f"StepCostCurve: expected matching token counts starting at 1 and times, got "
                             f"{self.tokens} and {self.seconds}")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or min(self.seconds) <= 0:
            raise ValueError(f"StepCostCurve: expected increasing token counts and positive times, got "
                             f"{self.tokens} and {self.seconds}")
        # the scheduler reads the curve several times a step: the measured range is looked up, not interpolated
        by_n = tuple(self._interpolate(n) for n in range(1, min(self.tokens[-1], 1024) + 1))
        object.__setattr__(self, "_by_n", by_n)

    def seconds_for(self, n: int) -> float:
        """The forward's seconds over ``n >= 1`` tokens."""
        return self._by_n[n - 1] if 1 <= n <= len(self._by_n) else self._interpolate(n)

    def _interpolate(self, n: int) -> float:
        t, s = self.tokens, self.seconds
        if n <= t[0]:
            return s[0]
        for i in range(1, len(t)):
            if n <= t[i]:
                w = (n - t[i - 1]) / (t[i] - t[i - 1])
                return s[i - 1] + w * (s[i] - s[i - 1])
        slope = max((s[-1] - s[-2]) / (t[-1] - t[-2]), 0.0) if len(t) > 1 else 0.0
        return s[-1] + slope * (n - t[-1])

    def relative(self, n: int) -> float:
        """The forward over ``n`` tokens in one-token steps."""
        return self.seconds_for(n) / self.seconds[0]

    def to_dict(self) -> dict[str, list]:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds)}

    @staticmethod
    def from_dict(d: dict) -> "StepCostCurve":
        return StepCostCurve(tuple(int(x) for x in d["tokens"]), tuple(float(x) for x in d["seconds"]))


def measure_step_costs(forward_tokens: Callable[[int], None], max_tokens: int, *, repeats: int = 5,
                       clock: Callable[[], float] = time.perf_counter) -> StepCostCurve:
    """Time ``forward_tokens(n)`` (one target forward over ``n`` tokens, synchronised, its cache rolled back
    after) at the :data:`MEASURED_TOKENS` up to ``max_tokens`` and at ``max_tokens``: one warm-up pass,
    then ``repeats`` interleaved rounds (so a load change hits every size alike), the fastest round per size
    (other work on the machine only ever adds time), then the closest non-decreasing curve (pool adjacent
    violators: a size measured faster than a smaller one is averaged with it, so one slow measurement does
    not raise every larger size).

    Raises ValueError for ``max_tokens < 1`` or ``repeats < 1``.
    """
    if max_tokens < 1 or repeats < 1:
        raise ValueError(f"measure_step_costs: expected max_tokens >= 1 and repeats >= 1, got {max_tokens}, {repeats}")
    sizes = sorted({n for n in MEASURED_TOKENS if n <= max_tokens} | {int(max_tokens)})
    for n in sizes:
        forward_tokens(n)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            t0 = clock()
            forward_tokens(n)
            times[n].append(clock() - t0)
    return StepCostCurve(tuple(sizes), tuple(_non_decreasing([max(min(times[n]), 1e-9) for n in sizes])))


def _non_decreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def step_cost_cache_dir() -> Path:
    """Where measured cost curves are kept: ``$DEEPSPEC_CACHE_DIR/step-costs`` or
    ``~/.cache/deepspec/step-costs``."""
    root = os.environ.get("DEEPSPEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "deepspec")
    return Path(root) / "step-costs"


def load_or_measure_step_costs(key: dict, measure: Callable[[], StepCostCurve], *,
                               cache_dir: Path | None = None) -> tuple[StepCostCurve, bool]:
    """The cost curve stored under ``key`` (JSON-able: target fingerprint, device, dtype, threads, kernels,
    longest verify), else ``measure()`` stored there (atomically). Returns ``(curve, measured_now)``.
    An unreadable stored file is measured again and replaced."""
    folder = cache_dir or step_cost_cache_dir()
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json"
    path = folder / name
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("key") == json.loads(json.dumps(key)):
            return StepCostCurve.from_dict(stored["curve"]), False
    except (OSError, ValueError, KeyError, TypeError):
        pass
    curve = measure()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"key": key, "curve": curve.to_dict()})
    except OSError:  # a read-only home still decodes; the curve is measured again next time
        pass
    return curve, True


def _score_bin(score: float | None, bins: int) -> int:
    return -1 if score is None else min(int(max(score, 0.0) * bins), bins - 1)


@dataclass
class AcceptanceEstimator:
    """Running estimates of ``P(node accepted | its parent accepted)``.

    Cells are keyed by the node's source (:attr:`~deepspec.algorithms.protocol.Proposal.sources_N`: a draft
    model, a prompt-lookup match, a corpus continuation: their acceptance differs by far), its depth (1 for
    the anchor's children; capped at ``max_depth``), its rank among its siblings (0: the draft's first
    choice, a chain's node; capped at ``max_rank``) and, when the proposer scores its nodes (DSpark's
    confidence head), the score's bin of width ``1 / bins``.
    Each cell holds decayed counts (``decay`` per update of that cell: recent steps weigh more); its long-run
    estimate is ``(accepted + strength * prior) / (seen + strength)`` with ``prior`` the node's own score when it
    has one, else the depth's running mean for rank 0, or ``other_prior`` for other ranks. A node of rank ``r > 0``
    (an alternative) is accepted only where every sibling ranked above it is rejected, so its cells count it only
    then (its estimate is for that event; the scheduler multiplies in the chance that its elder siblings are all
    rejected). On top, one factor per source for the request at hand, over its first choices (:meth:`start_request`
    resets it): the request's accepted first choices against the long-run estimates' sum over the same nodes,
    ``r = (accepted + request_strength) / (expected + request_strength)``, scales every first choice's estimate:
    ``p * r`` for a request harder than the long run's mix (``r < 1``), ``1 - (1 - p) / r`` for an easier one (a
    draft that pays on one kind of prompt may not on the next). An alternative is scaled by ``min(r, 1)``: a request
    harder for the first choices is one the draft is off on, alternatives included, but one where the first choices
    do better leaves the alternatives less (through their elder siblings' rejection), not more. One factor learns
    from every first choice the request verifies, so it moves within a few steps without making each cell's own
    estimate rest on a request's few counts (a random effect per request): ``r`` is the posterior mean of a Gamma
    prior of mean 1 worth ``request_strength`` expected acceptances (3: so that a few unlucky steps on a request the
    draft knows do not send it to plain steps for the rest of it). Every request starts at ``r = 1``, from the
    long-run cells, which hold what past requests taught. (A prior that followed the recent requests' factors would
    ratchet down on the few probes of the requests it sends plain, which fail more often than not, and in mixed
    traffic open a request the draft knows with plain steps after a few it does not: docs/design/decoding.md.)
    """

    bins: int = 10
    max_depth: int = 16
    max_rank: int = 4
    strength: float = 2.0
    decay: float = 0.99
    first_prior: float = 0.5
    other_prior: float = 0.1
    request_strength: float = 3.0
    cells: dict[tuple[str, int, int, int], list[float]] = field(default_factory=dict)
    request_counts: dict[str, list[float]] = field(default_factory=dict)  # source: [accepted, expected]
    # depth_means' figures since the counts last changed: {(max_depth, source, width): means}
    _means: dict[tuple[int, str, int], tuple[float, ...]] = field(default_factory=dict, init=False, repr=False,
                                                              compare=False)

    def start_request(self) -> None:
        """Forget the finished request's counts (the long-run counts stay): the next request's factor starts at 1."""
        self.request_counts.clear()
        self._means.clear()

    def depth_means(self, max_depth: int, source: str = DRAFT_SOURCE, width: int = 1) -> tuple[float, ...]:
        """:meth:`estimate` of an unscored first-choice node at depths ``1..max_depth``: what a step plans on
        before a proposal exists; with ``width > 1``, the chance that a draft tree's level of ``width`` nodes
        holds the accepted one, ``1 - (1 - a_0) * prod_{r=1}^{width-1} (1 - a_r)`` over the first choice's
        estimate ``a_0`` and its alternatives' (each given the ones ranked above it rejected; a level's other
        nodes taken as alternatives below the first choice). Kept until the counts next change
        (:meth:`observe`, :meth:`start_request`), so a run of plain steps, which change none, reads them once."""
        key = (max_depth, source, width)
        means = self._means.get(key)
        if means is None:
            means = self._means[key] = tuple(
                self.estimate(d, source=source) if width == 1 else
                1.0 - math.prod(1.0 - self.estimate(d, r, source=source) for r in range(width))
                for d in range(1, max_depth + 1))
        return means

    def request_factor(self, source: str = DRAFT_SOURCE) -> float:
        """The current request's factor for ``source``'s first choices: ``(accepted + request_strength) /
        (expected + request_strength)`` over the first choices it verified (1.0 before it has verified one)."""
        counts = self.request_counts.get(source)
        if counts is None:
            return 1.0
        return (counts[0] + self.request_strength) / (counts[1] + self.request_strength)

    def _key(self, depth: int, rank: int, score: float | None, source: str) -> tuple[str, int, int, int]:
        return (source, min(depth, self.max_depth), min(rank, self.max_rank), _score_bin(score, self.bins))

    def _depth_prior(self, depth: int, source: str) -> float:
        cell = self.cells.get(self._key(depth, 0, None, source))
        prior = self.first_prior * 0.9 ** (depth - 1)
        return prior if cell is None else (cell[0] + self.strength * prior) / (cell[1] + self.strength)

    def estimate(self, depth: int, rank: int = 0, score: float | None = None, source: str = DRAFT_SOURCE) -> float:
        """The acceptance probability of one node from ``source``, in (0, 1) (of rank ``> 0``: given that every
        sibling ranked above it is rejected)."""
        p = min(max(self._long_run(depth, rank, score, source), 1e-6), 1 - 1e-6)
        r = self.request_factor(source)
        if rank:  # a request harder for the first choices is one the draft is off on: its alternatives too
            return p * min(r, 1.0)
        return p * r if r <= 1 else 1 - (1 - p) / r  # a harder request scales acceptance, an easier one rejection

    def _long_run(self, depth: int, rank: int, score: float | None, source: str) -> float:
        if score is not None:
            prior = min(max(float(score), 0.0), 1.0)
        else:
            prior = self._depth_prior(depth, source) if rank == 0 else self.other_prior
        key = self._key(depth, rank, score, source)
        cell = self.cells.get(key)
        return prior if cell is None else (cell[0] + self.strength * prior) / (cell[1] + self.strength)

    def observe(self, depth: int, rank: int, score: float | None, accepted: bool,
                source: str = DRAFT_SOURCE) -> None:
        """Count one verified node from ``source`` whose parent was accepted (and, for a scored node, its
        depth's unscored cell too, the running mean that plans steps before a proposal exists)."""
        if rank == 0:
            counts = self.request_counts.setdefault(source, [0.0, 0.0])
            counts[0] += float(accepted)
            counts[1] += self._long_run(depth, rank, score, source)
        keys = {self._key(depth, rank, score, source)}
        if rank == 0:
            keys.add(self._key(depth, 0, None, source))
        for key in keys:
            self._count(key, float(accepted))

    def count_unverified(self, depth: int, score: float, source: str = DRAFT_SOURCE) -> None:
        """Count a scored first choice that was drafted but not verified (its proposal cut whole by its scores) in
        its depth's unscored cell, as its long-run estimate's fraction of an accepted node: the running mean that
        plans a step before the proposal exists then stands for the proposals the scores keep, and the ones they
        cut, alike (an imputation, unbiased where the scored estimates are calibrated). The request's factor and the
        scored cells, which hold only what the target showed, are left as they were: counting the estimate against
        the unscored expectation, as a verified node is counted, would lower the factor on every cut, since a cut
        happens where the score is low, and each lowered factor makes the next cut likelier."""
        self._count(self._key(depth, 0, None, source), self._long_run(depth, 0, score, source))

    def _count(self, key: tuple[str, int, int, int], accepted: float) -> None:
        self._means.clear()
        cell = self.cells.setdefault(key, [0.0, 0.0])
        cell[0] = cell[0] * self.decay + accepted
        cell[1] = cell[1] * self.decay + 1.0


def _sibling_ranks(parents: Sequence[int]) -> list[int]:
    seen: dict[int, int] = {}
    ranks = []
    for p in parents:
        ranks.append(seen.get(p, 0))
        seen[p] = ranks[-1] + 1
    return ranks


@dataclass
class StepScheduler:
    """Chooses, per step, whether to propose and which part of the proposal the target verifies.

    ``curve``: the target's measured :class:`StepCostCurve`; its scale follows the measured verify times
    (``observe``). ``probe_every``: after this many plain steps in a row (a step whose proposal :meth:`select` cut
    whole counts as one) one step proposes anyway and verifies at least the proposal's first node, so the acceptance
    counts keep up with the text (a plain step teaches nothing); a probe that accepts nothing doubles the interval
    (up to ``max_probe_every``: a draft that is of no use on a request costs ever fewer calls), one that accepts a
    token sets it back. ``probe_budget``: the share of a request's time that probes accepting nothing may cost:
    after such a probe the interval is at least the plain steps whose time, at this share, pays for the probe's
    measured extra seconds over a plain step (its recent median: a draft call, its first one on a request flushing
    the prompt's features through the draft, and the verify of the probed nodes), and a request starts at that
    interval too, so that an expensive draft on prompts it does not know stays within the share (None: the doubling
    alone). A draft call first runs the context positions the proposer queued since its last call through the draft
    (``pending`` in :meth:`plan`: the prompt, at a request's first call); its seconds per position are learned apart
    (:attr:`flush_s_per_position`), and a probe waits until the plain steps pay for that flush as well. A step
    :meth:`plan` expects to pay does not: the flush serves every later draft call of the request, so a plan that
    looks one step ahead would refuse a long prompt's draft for good. ``rate_decay``: the weight of the past in the
    running rate and scale. ``timing_window``: the step timings that price a step (propose call, overheads, verify
    excess, probe cost, flush per position) are each the median of their last this many samples: timings on a shared
    host are skewed (other work only ever adds time, and a kernel's first call at a new shape takes several times
    its steady cost), and a mean that took one slow sample would hold it through the plain steps, which sample none
    of these, and keep refusing proposals that pay. ``serial_draft``: the proposer drafts one token per draft
    forward (Eagle3's chain: a call's cost grows with its depth) and drafts only the depth :meth:`plan` chose, so a
    proposal is priced per drafted token. Use one scheduler per engine; :meth:`reset` starts a request (the long-run
    counts and timings carry over).
    """

    curve: StepCostCurve
    estimator: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)
    probe_every: int = 8
    max_probe_every: int = 64
    probe_budget: float | None = 0.01
    rate_decay: float = 0.9
    timing_window: int = 9
    serial_draft: bool = False
    scale: float = 1.0  # measured verify seconds / the curve's
    propose_s: float = 0.0  # seconds of a propose call, recent median (serial_draft: per drafted token)
    overhead_s: float = 0.0  # seconds of a plain step besides its forward, recent median
    verify_overhead_s: float = 0.0  # the same for a step that verified draft nodes (more features, a KV move)
    verify_excess_s: float = 0.0  # seconds a verify with draft nodes took beyond :meth:`seconds`, recent median
    probe_cost_s: float = 0.0  # extra seconds of a fruitless probe over a plain step (no flush), recent median
    flush_s_per_position: float = 0.0  # seconds a draft call spends per queued context position, recent median
    pending: int = 0  # the queued context positions the current step's draft call flushes (set by plan)
    rate: float = 0.0  # running committed tokens per second
    num_observed: int = 0  # steps observed (the first one sets the rate and scale)
    plain_streak: int = 0
    probe_interval: int = 0  # plain steps before the next probe (set to probe_every at construction and reset)
    probing: bool = False  # the current step proposes only to learn (plan found no gain)
    proposing: bool = False  # plan() called the draft for the current step (select() then ends its plain streak or not)
    depth_limit: int | None = None  # the depth planned before the current proposal (a tree's cut at T > 0)
    _recent: dict[str, collections.deque] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.timing_window < 1:
            raise ValueError(f"StepScheduler.timing_window: expected an integer >= 1, got {self.timing_window}")
        self.probe_interval = self.probe_interval or self.probe_every

    def _sample(self, name: str, seconds: float) -> None:
        """Set the timing attribute ``name`` to the median of its last :attr:`timing_window` samples, ``seconds``
        the newest."""
        recent = self._recent.get(name)
        if recent is None:
            recent = self._recent[name] = collections.deque(maxlen=self.timing_window)
        recent.append(seconds)
        setattr(self, name, statistics.median(recent))

    def reset(self) -> None:
        """Start a request: the plain-step streak, probe interval, plan and the request's own acceptance counts
        are forgotten; the long-run counts and timings kept."""
        self.plain_streak = 0
        self.probe_interval = self._budget_interval(self.probe_every)
        self.probing = self.proposing = False
        self.depth_limit = None
        self.estimator.start_request()

    def forget_acceptance(self) -> None:
        """Start a new workload: the acceptance counts (the long-run cells and the request's) and the running rate
        are forgotten, as if no step had been verified, and a request starts (:meth:`reset`); the cost curve's scale
        and the step timings, which are the host's, not the traffic's, are kept. An evaluation calls it before each
        benchmark, so that a benchmark's figures do not depend on which benchmarks ran before it in the same
        process (a scheduler that learned on math problems opens a chat request with math's counts)."""
        self.estimator = dataclasses.replace(self.estimator, cells={}, request_counts={})
        self.rate = 0.0
        self.reset()

    def _budget_interval(self, interval: int, flush_s: float = 0.0) -> int:
        """``interval``, raised to the plain steps that pay for a fruitless probe at :attr:`probe_budget`
        (``(probe_cost_s + flush_s) / (probe_budget * plain step seconds)``, rounded up; that floor capped at
        :attr:`max_probe_every`)."""
        cost_s = self.probe_cost_s + flush_s
        if not self.probe_budget or cost_s <= 0:
            return interval
        plain_s = self.seconds(1) + self.overhead_s
        return max(interval, min(math.ceil(cost_s / (self.probe_budget * plain_s)), self.max_probe_every))

    def seconds(self, n: int) -> float:
        """Expected seconds of a verify forward over ``n`` tokens now."""
        return self.scale * self.curve.seconds_for(n)

    def lam(self) -> float:
        """The rate a step must beat, tokens per second: the running rate, at least a plain step's."""
        plain = 1.0 / (self.seconds(1) + self.overhead_s)
        return max(plain, self.rate)

    def verify_extra_s(self) -> float:
        """The seconds a step that verifies draft nodes spends beyond a plain step's and the curve's
        difference between their forwards: its bookkeeping (the accepted nodes' features handed to the
        proposer, a tree's KV entries moved) and its forward's measured excess over the curve (a tree mask's
        attention path, kernels for a row count that plain steps leave cold: the curve is timed warm, over
        chains)."""
        return max(self.verify_overhead_s - self.overhead_s + self.verify_excess_s, 0.0)

    def _best_prefix(self, path_probs: Sequence[float], lam: float, base_tokens: int = 1,
                     per_node_s: float = 0.0, width: int = 1) -> tuple[int, float]:
        """The count ``m`` (0..len) maximising ``sum_{j<=m} path_probs_j - lam * (seconds(base + width * m) -
        seconds(base) + m * per_node_s)`` (and, from one token fed, :meth:`verify_extra_s` for any ``m >= 1``): the
        first ``m`` depths' expected accepted tokens (``width`` nodes each: a draft tree's levels) against their
        verify time on top of ``base_tokens`` tokens fed (and ``per_node_s``, the seconds of drafting each
        depth). Returns ``(m, that gain)`` (``(0, 0.0)`` when no prefix gains)."""
        best_m, best, total = 0, 0.0, 0.0
        base = self.seconds(base_tokens) - (self.verify_extra_s() if base_tokens == 1 else 0.0)
        for j, p in enumerate(path_probs, 1):
            total += p
            gain = total - lam * (self.seconds(base_tokens + width * j) - base + j * per_node_s)
            if gain > best:
                best_m, best = j, gain
        return best_m, best

    def plan(self, max_depth: int, pending: int = 0, width: int = 1) -> bool:
        """Before proposing: whether a proposal of up to ``max_depth`` chain tokens (with ``width > 1``, a draft
        tree of ``width`` nodes per depth) is expected to pay for its propose call and verify (from the running
        per-depth acceptance, :meth:`AcceptanceEstimator.depth_means`); a proposer whose call costs
        under 2 % of a token's time always proposes (the proposal itself tells more), and after
        :attr:`probe_interval` plain steps in a row (more while the ``pending`` context positions the call
        would flush cost more than the budget's share of them) one step probes (proposes anyway).
        Sets :attr:`depth_limit` to the planned depth (with :attr:`serial_draft`, the depth worth its
        drafting as well as its verify: the proposer drafts no deeper, a probe one token) and :attr:`probing`."""
        lam = self.lam()
        width = max(int(width), 1)
        path = list(itertools.accumulate(self.estimator.depth_means(max_depth, width=width), operator.mul))
        self.pending = int(pending)
        interval = self.probe_interval
        if self.flush_s_per_position > 0 and self.pending:
            interval = self._budget_interval(interval, self.flush_s_per_position * self.pending)
        self.probing = self.plain_streak >= interval
        if self.serial_draft:  # each drafted node's seconds are priced inside the gain
            m, gain = self._best_prefix(path, lam, per_node_s=self.propose_s, width=width)
            call_s = self.propose_s * max(m, 1)
        else:
            m, gain = self._best_prefix(path, lam, width=width)
            call_s = self.propose_s
            gain -= lam * call_s
        self.depth_limit = max(m, 1)
        # a propose call under 2 % of a token always pays: let select() decide from the proposal itself
        pays = gain > 0 or lam * call_s < 0.02
        self.proposing = pays or self.probing
        if not self.proposing:
            self.plain_streak += 1
        return self.proposing

    def select(self, proposal: Proposal, *, greedy: bool) -> Proposal:
        """The part of ``proposal`` to verify (possibly none: :meth:`Proposal.empty`'s plain step).

        A chain is cut by the sequential rule: slot ``k`` is kept when continuing to some depth
        ``>= k`` has a positive expected gain, reading slot ``k``'s own estimate (its confidence when
        the proposer gives one) and the running means beyond it, and the chain stops at the first
        slot that is not. A tree keeps, at T = 0, the ``m`` nodes of highest estimated path
        probability (each node closed under its ancestors) for the best ``m``; at T > 0 its nodes up
        to the depth :meth:`plan` chose before it was drawn. A probe (:attr:`probing`) keeps at least
        the first node."""
        kept = self._select(proposal, greedy=greedy)
        if self.proposing:  # the draft was called: a step that verifies none of its nodes is a plain step for it
            self.proposing = False
            if _has_draft_node(kept):
                self.plain_streak = 0
            else:
                self.plain_streak += 1
                self._count_cut(proposal)
        return kept

    def _count_cut(self, proposal: Proposal) -> None:
        """A proposal cut whole by its own scores still tells :meth:`plan` what proposing was worth: its first
        node enters the depth's running mean at its estimate (:meth:`AcceptanceEstimator.count_unverified`), so
        :meth:`plan` stops proposing where the draft's scores keep cutting its proposals."""
        if not proposal.num_proposed or proposal.source(0) != DRAFT_SOURCE:
            return
        score = proposal.node_scores()[0]
        if score is not None:
            self.estimator.count_unverified(1, score, DRAFT_SOURCE)

    def _select(self, proposal: Proposal, *, greedy: bool) -> Proposal:
        n = proposal.num_proposed
        if n == 0:
            return proposal
        lam = self.lam()
        min_keep = 1 if self.probing else 0
        if proposal.parents_N is None:
            scores = proposal.node_scores()
            source = proposal.source(0)  # a chain comes from one source
            means = self.estimator.depth_means(n, source)
            path, keep = 1.0, 0
            for k in range(1, n + 1):
                a_k = self.estimator.estimate(k, 0, scores[k - 1], source)
                ahead = itertools.accumulate([a_k, *means[k:]], operator.mul, initial=path)
                _, gain = self._best_prefix(list(ahead)[1:], lam, base_tokens=k)
                if gain <= 0 and k > min_keep:
                    break
                path *= a_k
                keep = k
            return proposal if keep == n else proposal.truncated(keep)
        if not greedy:
            return proposal.truncated(self.depth_limit or proposal.depth)
        ranks, scores = _sibling_ranks(proposal.parents_N), proposal.node_scores()
        depths = proposal.depths_N
        path_N: list[float] = []
        taken: dict[int, float] = {}  # parent: the summed acceptance of its children so far (they exclude each other)
        for i, p in enumerate(proposal.parents_N):
            rank, score, source = _node_key(proposal, i, ranks, scores)
            a = self.estimator.estimate(depths[i], rank, score, source)
            if rank:  # an alternative is accepted only where every sibling ranked above it is rejected
                a *= max(1.0 - taken.get(p, 0.0), 0.0)
            taken[p] = taken.get(p, 0.0) + a
            path_N.append(a * (1.0 if p < 0 else path_N[p]))
        order = sorted(range(n), key=lambda i: (-path_N[i], i))  # a parent never scores below its child
        best_m, _ = self._best_prefix([path_N[i] for i in order], lam)
        best_m = max(best_m, min_keep)
        if best_m == n:
            return proposal
        return proposal.subset(sorted(order[:best_m]))

    def observe(self, proposal: Proposal, num_accepted: int, path: Sequence[int] | None, *, verify_s: float,
                propose_s: float | None, overhead_s: float, num_committed: int, step_s: float,
                num_drafted: int | None = None) -> None:
        """Learn from a verified step: the acceptance of every node whose parent was accepted
        (``path``: a tree's accepted nodes, None for a chain), the verify time against the curve's
        (the scale), the propose time (None: no proposal was made; with :attr:`serial_draft`, divided by
        ``num_drafted``, the draft tokens the call returned), the overhead, the rate and, after a
        probe, the next probe interval."""
        n = proposal.num_proposed
        first = self.num_observed == 0
        self.num_observed += 1

        def running(old: float, new: float) -> float:
            return new if first else self.rate_decay * old + (1 - self.rate_decay) * new

        flush_s = 0.0  # the part of a draft call that flushed queued context positions, apart from its drafting
        drafted_n = max(num_drafted if num_drafted is not None else n, 1) if self.serial_draft else 1
        flushed = propose_s is not None and proposal.sources_N is None and self.pending >= FLUSH_MIN_FEATURES
        if flushed:
            if self.propose_s > 0:  # what the call took beyond its drafting, per position flushed
                self._sample("flush_s_per_position", max(propose_s - self.propose_s * drafted_n, 0.0) / self.pending)
            flush_s = min(self.flush_s_per_position * self.pending, propose_s)
        self.pending = 0

        if self.probing and n:
            if num_accepted:
                self.probe_interval = self.probe_every
            else:  # priced against a plain step as the scheduler knew it before this step; the flush apart
                self._sample("probe_cost_s", max(step_s - flush_s - self.seconds(1) - self.overhead_s, 0.0))
                self.probe_interval = self._budget_interval(min(2 * self.probe_interval, self.max_probe_every))
        self.probing = False

        if verify_s > 0:
            forward_s = verify_s
            if n:  # the excess over the scaled curve, kept apart so that plain steps keep the scale
                self._sample("verify_excess_s", verify_s - self.seconds(n + 1))
                forward_s -= self.verify_excess_s
            self.scale = running(self.scale, max(forward_s, 1e-9) / self.curve.seconds_for(n + 1))
        # a draft model's call (plan weighs it); one that flushed before the flush's cost was known (the first
        # call: the prompt) cannot be told from its drafting and teaches neither
        if propose_s is not None and proposal.sources_N is None and not (flushed and self.flush_s_per_position == 0):
            self._sample("propose_s", (propose_s - flush_s) / drafted_n)
        if first or n:
            self._sample("verify_overhead_s", max(overhead_s, 0.0))
        if first or not n:
            self._sample("overhead_s", max(overhead_s, 0.0))
        step_rate = num_committed / max(step_s, 1e-9)
        self.rate = running(self.rate, step_rate) if self.rate else step_rate  # 0: none yet, or forgotten
        if n == 0:
            return
        est = self.estimator
        if proposal.parents_N is None:
            scores = proposal.node_scores()
            for k in range(1, min(num_accepted + 1, n) + 1):
                est.observe(k, 0, scores[k - 1], k <= num_accepted, proposal.source(0))
            return
        on_path = set(path or ())
        accepted_child = {proposal.parents_N[i]: i for i in on_path}  # at most one child of a node is accepted
        ranks, scores, depths = _sibling_ranks(proposal.parents_N), proposal.node_scores(), proposal.depths_N
        for i, p in enumerate(proposal.parents_N):
            if p < 0 or p in on_path:
                rank, score, source = _node_key(proposal, i, ranks, scores)
                if rank and accepted_child.get(p, i) < i:  # a sibling ranked above it was accepted: it had no chance
                    continue
                est.observe(depths[i], rank, score, i in on_path, source)


def _has_draft_node(proposal: Proposal) -> bool:
    return any(proposal.source(i) == DRAFT_SOURCE for i in range(proposal.num_proposed))


def _node_key(proposal: Proposal, i: int, ranks: Sequence[int], scores: Sequence[float | None]
              ) -> tuple[int, float | None, str]:
    """Node ``i``'s estimator key besides its depth: its sibling rank (a draft's node) or 0 (a lookup's or
    corpus's node, one chain whatever sits beside it), its score (None when the proposer gave none), its
    source."""
    source = proposal.source(i)
    return (ranks[i] if source == DRAFT_SOURCE else 0), scores[i], source


def size_histogram(sizes: Sequence[int]) -> dict[str, int]:
    """``{size: count}`` of chosen proposal sizes (draft tokens verified per step; 0: a plain step), keys as
    strings for JSON, in increasing size."""
    counts: dict[int, int] = {}
    for s in sizes:
        counts[int(s)] = counts.get(int(s), 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}

