"""Every figure with its uncertainty: what it counted and its 95 % interval, printed one way.

A pass rate of 90 % on ten tasks and one on four hundred are different claims; printed
bare they look alike. Every place that shows a figure (the loop page, ``ratchet loop show``,
the demo's report, the benchmarks' JSON) builds it here, from the statistics of
:mod:`services.evaluation.stats` (the one implementation of each interval):

- a **rate** (a pass rate, live success): ``k`` of ``n`` with the Wilson interval, or the
  interval an evaluation stored with its pass@1 (Wilson at the mean, ``mean_interval``);
- a **gain** of one model over another on the same tasks (held-out points, the gate's
  points): the paired bootstrap's interval (``compare_paired``), with the number of tasks;
- a **live delta** (the canary's traces of two served versions, independent samples):
  Newcombe's interval, with the traces on each side.

:data:`PRECISION_POINTS` is the widest half-interval a headline may have before its report
says its set is too small to tell such a gain from noise (the demo's held-out set is sized
for it: docs/design.md, "three numbers").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.evaluation.stats import compare_paired, newcombe_interval, proportion_interval

CONFIDENCE = 0.95
PRECISION_POINTS = 15.0
GainMethod = Literal["paired_bootstrap", "newcombe"]


@dataclass(frozen=True)
class Rate:
    """``successes`` of ``n`` (successes may be a sum of pass@1 estimates) and the 95 %
    interval of the rate, as fractions."""

    successes: float
    n: int
    low: float
    high: float

    @property
    def value(self) -> float | None:
        return self.successes / self.n if self.n else None

    @property
    def half_width_points(self) -> float:
        return 50.0 * (self.high - self.low)

    def text(self) -> str:
        """``67% [55, 77] (40/60)``; ``n/a (0)`` with nothing counted."""
        if not self.n:
            return "n/a (0)"
        return (
            f"{100 * (self.value or 0.0):.0f}% [{100 * self.low:.0f}, {100 * self.high:.0f}] "
            f"({_count(self.successes)}/{self.n})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rate": self.value,
            "successes": self.successes,
            "n": self.n,
            "ci95": [self.low, self.high],
            "method": "wilson",
        }


def rate(successes: float, n: int, *, interval: tuple[float, float] | None = None) -> Rate:
    """A rate of ``successes`` in ``n``: Wilson's interval unless the evaluation that
    counted it stored its own (pass@1 over several samples per task)."""
    if interval is None:
        interval = proportion_interval(successes, n, CONFIDENCE)
    return Rate(float(successes), int(n), float(interval[0]), float(interval[1]))


@dataclass(frozen=True)
class Gain:
    """A difference of two pass rates in points, with its 95 % interval in points and what
    it counted: ``n`` tasks (paired), or ``n_before`` and ``n`` traces (live)."""

    points: float
    low: float
    high: float
    n: int
    method: GainMethod = "paired_bootstrap"
    n_before: int | None = None

    @property
    def half_width_points(self) -> float:
        return (self.high - self.low) / 2.0

    @property
    def precise(self) -> bool:
        """Whether the interval is within ±:data:`PRECISION_POINTS`."""
        return self.half_width_points <= PRECISION_POINTS

    def counted(self) -> str:
        if self.method == "newcombe":
            return f"{self.n_before} → {self.n} traces"
        return f"{self.n} tasks"

    def text(self) -> str:
        """``+50.0 [+38.1, +61.9] pts (40 tasks)``; without counts (a figure recorded before
        they were kept) the interval alone."""
        shown = f"{self.points:+.1f} [{self.low:+.1f}, {self.high:+.1f}] pts"
        return f"{shown} ({self.counted()})" if self.n else shown

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "points": self.points,
            "ci95_points": [self.low, self.high],
            "n": self.n,
            "method": self.method,
        }
        if self.n_before is not None:
            out["n_before"] = self.n_before
        return out


def paired_gain(champion: Sequence[float], candidate: Sequence[float], *, seed: int = 0) -> Gain:
    """The candidate's gain over the champion on the same tasks (per-task scores)."""
    comparison = compare_paired(champion, candidate, confidence=CONFIDENCE, seed=seed)
    return Gain(
        100.0 * comparison.delta,
        100.0 * comparison.ci_low,
        100.0 * comparison.ci_high,
        comparison.n,
    )


def live_gain(before: tuple[int, int], after: tuple[int, int]) -> Gain | None:
    """The live delta of two served versions from (successes, traces) on each side, with
    Newcombe's interval; None unless both sides have traces."""
    (k0, n0), (k1, n1) = before, after
    if n0 <= 0 or n1 <= 0:
        return None
    low, high = newcombe_interval(k0, n0, k1, n1, CONFIDENCE)
    return Gain(100.0 * (k1 / n1 - k0 / n0), 100.0 * low, 100.0 * high, n1, "newcombe", n_before=n0)


def gain_from_detail(detail: Mapping[str, Any] | None, *, live: bool = False) -> Gain | None:
    """A number of ``cycles.points_detail`` as a :class:`Gain`: ``gate`` and ``heldout``
    are paired comparisons in points with their tasks (``n``), ``live`` (``live=True``) the
    canary's delta with its traces (``n_before``, ``n_after``). None for a missing or
    malformed entry."""
    if not isinstance(detail, Mapping):
        return None
    points, low, high = (
        _number(detail.get(k)) for k in ("points", "ci_low_points", "ci_high_points")
    )
    if points is None or low is None or high is None:
        return None
    if live:
        before, after = _number(detail.get("n_before")), _number(detail.get("n_after"))
        return Gain(points, low, high, int(after or 0), "newcombe", n_before=int(before or 0))
    return Gain(points, low, high, int(_number(detail.get("n")) or 0))


def imprecise_note(name: str, gain: Gain | None) -> str | None:
    """What a report says when ``gain``'s interval is wider than ±:data:`PRECISION_POINTS`
    (None when it is not, or there is no figure)."""
    if gain is None or gain.precise:
        return None
    return (
        f"the {name} interval is ±{gain.half_width_points:.1f} points on {gain.counted()}: "
        f"wider than ±{PRECISION_POINTS:g}, so the set is too small to tell a gain under "
        "that from noise"
    )


def _number(value: object) -> float | None:
    """A JSON number as a float; None for anything else (bools, NaN, text)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
        return float(value)
    return None


def _count(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
