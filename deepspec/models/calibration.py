"""Calibration of a draft's confidence head: a monotone map per draft depth, fitted on held-out steps
(docs/design/decoding.md, "Confidence calibration").

A confidence ``c`` for draft slot ``k`` (1-based) estimates P(slot k accepted | slots 1..k-1 accepted).
The map is Platt scaling per depth (Platt 1999; Guo et al. 2017 for its use on neural scores):
``c' = sigmoid(a_k * logit(c) + b_k)`` with ``a_k > 0``, so it is strictly increasing in ``c`` (the
ranking, hence AUROC at each depth, is unchanged; only the values move). It is fitted by maximum
likelihood on ``(k, c, label)`` pairs (the eval's calibration pairs: slots up to the first rejection,
:func:`deepspec.eval.metrics.calibration_pairs`) with a weak Gaussian prior towards the identity
``(a, b) = (1, 0)``, so a depth with few pairs moves little. A depth with fewer than ``min_pairs`` pairs or
a single class uses the map fitted on all pairs pooled; depths beyond the fitted ones use the pooled map.

Stored as ``confidence_calibration.json`` beside a draft's ``config.json`` (:func:`save_calibration`,
:func:`load_calibration`); a draft without the file reports its raw confidences.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deepspec.utils import atomic_write_json

CALIBRATION_NAME = "confidence_calibration.json"
CALIBRATION_FORMAT = "deepspec-confidence-calibration/1"
_EPS = 1e-6


def _logit(c: float) -> float:
    c = min(max(float(c), _EPS), 1.0 - _EPS)
    return math.log(c / (1.0 - c))


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


@dataclass(frozen=True)
class PlattMap:
    """``c' = sigmoid(a * logit(c) + b)``; ``a > 0`` (strictly increasing). ``num_pairs``: the pairs it was
    fitted on; ``pooled``: True when it is the all-depths map standing in for a depth with too few pairs."""

    a: float = 1.0
    b: float = 0.0
    num_pairs: int = 0
    pooled: bool = False

    def __call__(self, c: float) -> float:
        """The calibrated value of a confidence ``c`` in [0, 1] (clamped to [1e-6, 1 - 1e-6] first)."""
        return _sigmoid(self.a * _logit(c) + self.b)


def fit_platt(confidence: Sequence[float], labels: Sequence[int], *, prior_strength: float = 1.0,
              min_slope: float = 1e-3, max_iter: int = 100) -> PlattMap:
    """Fit :class:`PlattMap` ``(a, b)`` by Newton's method on the mean-free negative log-likelihood
    ``sum_i BCE(sigmoid(a x_i + b), y_i) + prior_strength / 2 * ((a - 1)^2 + b^2)``, ``x = logit(c)``.

    ``confidence``: floats in [0, 1]; ``labels``: 0/1, one per confidence. The prior (strength > 0) keeps the
    problem strictly convex, so it converges for any data, one class included. ``a`` is clamped to at
    least ``min_slope`` (> 0: the map stays strictly increasing). Raises ValueError for mismatched lengths,
    a label other than 0/1, or ``prior_strength <= 0``.
    """
    if len(confidence) != len(labels):
        raise ValueError(f"fit_platt: expected one label per confidence, received {len(confidence)} confidences "
                         f"and {len(labels)} labels.")
    if prior_strength <= 0:
        raise ValueError(f"fit_platt.prior_strength: expected > 0, received {prior_strength}.")
    if any(y not in (0, 1) for y in labels):
        raise ValueError("fit_platt.labels: expected 0 or 1 only.")
    xs = [_logit(c) for c in confidence]
    ys = [float(y) for y in labels]
    lam = float(prior_strength)

    def objective(a: float, b: float) -> float:
        total = 0.0
        for x, y in zip(xs, ys):
            z = a * x + b
            total += max(z, 0.0) - z * y + math.log1p(math.exp(-abs(z)))  # BCE with logits, stable
        return total + 0.5 * lam * ((a - 1.0) ** 2 + b * b)

    a, b = 1.0, 0.0
    f = objective(a, b)
    for _ in range(max_iter):
        ga, gb = lam * (a - 1.0), lam * b
        haa, hab, hbb = lam, 0.0, lam
        for x, y in zip(xs, ys):
            p = _sigmoid(a * x + b)
            r, s = p - y, p * (1.0 - p)
            ga += r * x
            gb += r
            haa += s * x * x
            hab += s * x
            hbb += s
        det = haa * hbb - hab * hab
        da = (hbb * ga - hab * gb) / det
        db = (haa * gb - hab * ga) / det
        step = 1.0
        while step > 1e-8:  # backtracking: the Newton step, halved until the objective does not grow
            na, nb = a - step * da, b - step * db
            nf = objective(na, nb)
            if nf <= f + 1e-12:
                break
            step *= 0.5
        else:
            break
        converged = abs(na - a) + abs(nb - b) < 1e-10
        a, b, f = na, nb, nf
        if converged:
            break
    return PlattMap(a=max(a, min_slope), b=b, num_pairs=len(xs))


@dataclass(frozen=True)
class ConfidenceCalibration:
    """Per-depth :class:`PlattMap` s (``per_depth[k - 1]`` for draft slot ``k``) and the ``pooled`` map used
    beyond them. ``info``: JSON-able notes on the fit (where its pairs came from, figures before and after)."""

    per_depth: tuple[PlattMap, ...]
    pooled: PlattMap
    info: dict[str, Any] = field(default_factory=dict)

    def map_for(self, depth: int) -> PlattMap:
        """The map of draft slot ``depth`` (1-based); raises ValueError for ``depth < 1``."""
        if depth < 1:
            raise ValueError(f"ConfidenceCalibration.map_for: expected a depth >= 1, received {depth}.")
        return self.per_depth[depth - 1] if depth <= len(self.per_depth) else self.pooled

    def apply(self, confidence: float, depth: int) -> float:
        """The calibrated confidence of slot ``depth`` (1-based) whose raw confidence is ``confidence``."""
        return self.map_for(depth)(confidence)

    def apply_all(self, confidence: Sequence[float], first_depth: int = 1) -> list[float]:
        """Calibrate a chain's confidences, the first at ``first_depth``, the next one deeper, and so on."""
        return [self.apply(c, first_depth + i) for i, c in enumerate(confidence)]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``format``, ``method``, ``per_depth``, ``pooled``, ``info``)."""
        return {"format": CALIBRATION_FORMAT, "method": "platt-per-depth",
                "per_depth": [asdict(m) for m in self.per_depth], "pooled": asdict(self.pooled), "info": self.info}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ConfidenceCalibration:
        """Inverse of :meth:`to_dict`; raises ValueError for another format or a map with ``a <= 0``."""
        if d.get("format") != CALIBRATION_FORMAT:
            raise ValueError(f"confidence calibration: expected format {CALIBRATION_FORMAT!r}, received "
                             f"{d.get('format')!r}. Refit it (train with the held-out curve on).")
        maps = [PlattMap(**m) for m in d["per_depth"]]
        pooled = PlattMap(**d["pooled"])
        if any(m.a <= 0 for m in [*maps, pooled]):
            raise ValueError("confidence calibration: expected every slope a > 0 (a monotone map).")
        return ConfidenceCalibration(tuple(maps), pooled, dict(d.get("info") or {}))


def fit_calibration(pairs: Sequence[tuple[int, float, int]], *, min_pairs: int = 30, prior_strength: float = 1.0,
                    info: dict[str, Any] | None = None) -> ConfidenceCalibration | None:
    """Fit a :class:`ConfidenceCalibration` on ``(k, confidence, label)`` pairs (k 1-based); None without pairs.

    The pooled map is fitted on every pair; depth k gets its own map when it has at least ``min_pairs``
    pairs of both classes, else the pooled one (marked ``pooled``). Raises ValueError for ``k < 1``.
    """
    if not pairs:
        return None
    if min(k for k, _, _ in pairs) < 1:
        raise ValueError("fit_calibration: expected depths k >= 1.")
    pooled = fit_platt([c for _, c, _ in pairs], [y for _, _, y in pairs], prior_strength=prior_strength)
    per_depth = []
    for k in range(1, max(k for k, _, _ in pairs) + 1):
        conf = [c for kk, c, _ in pairs if kk == k]
        labels = [y for kk, _, y in pairs if kk == k]
        if len(conf) >= min_pairs and 0 < sum(labels) < len(labels):
            per_depth.append(fit_platt(conf, labels, prior_strength=prior_strength))
        else:
            per_depth.append(PlattMap(pooled.a, pooled.b, len(conf), pooled=True))
    return ConfidenceCalibration(tuple(per_depth), pooled, dict(info or {}))


def save_calibration(folder: str | Path, calibration: ConfidenceCalibration) -> Path:
    """Write ``folder/confidence_calibration.json`` atomically; returns its path."""
    path = Path(folder) / CALIBRATION_NAME
    atomic_write_json(path, calibration.to_dict())
    return path


def load_calibration(folder: str | Path) -> ConfidenceCalibration | None:
    """The calibration stored in ``folder`` (None when there is none); ValueError for a malformed file."""
    path = Path(folder) / CALIBRATION_NAME
    if not path.is_file():
        return None
    try:
        return ConfidenceCalibration.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a confidence calibration ({exc}); delete it or refit.") from exc
