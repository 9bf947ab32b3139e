"""The cycle's three numbers as its row keeps them (``cycles.points_detail``).

Each number is measured on its own set (docs/design.md, "three numbers"): the gate's on the
cycle's new failures (it decides, but is biased toward the candidate by construction), the
held-out points on the frozen set no cycle trains on (the headline, the ledger's), and the
live delta from the canary's traces before and after the deploy. Each is kept with its
interval and its sample sizes, so a reader can tell a real gain from noise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.evaluation.stats import newcombe_interval


@dataclass(frozen=True)
class LiveSample:
    """Live outcomes of one served version in a window: traces and their successes."""

    n: int
    successes: int


@dataclass(frozen=True)
class CyclePoints:
    """The live delta in points (None: no canary with traces on both sides) and every
    number's detail, keyed ``gate``, ``heldout`` and ``live``."""

    live_points: float | None
    detail: dict[str, Any] = field(default_factory=dict)


def cycle_points(
    statistics: Mapping[str, Any], before: LiveSample | None, after: LiveSample | None
) -> CyclePoints:
    """The cycle's numbers from its gate decision's ``statistics`` (paired comparisons
    ``eval`` and ``heldout``, as ``services.evaluation.stats`` writes them) and the canary's
    live samples before and after the deploy."""
    detail: dict[str, Any] = {}
    for name, key in (("gate", "eval"), ("heldout", "heldout")):
        comparison = statistics.get(key)
        if isinstance(comparison, Mapping):
            detail[name] = _comparison_points(comparison)
    live = _live_points(before, after)
    if live is not None:
        detail["live"] = live
    return CyclePoints(live["points"] if live is not None else None, detail)


def _comparison_points(comparison: Mapping[str, Any]) -> dict[str, Any]:
    """A paired comparison (rates as fractions) in points, with its 95 % interval (the
    gate's own comparison also carries one at its policy's confidence: ``ci95_*`` wins)."""
    low = comparison.get("ci95_low", comparison.get("ci_low", 0.0))
    high = comparison.get("ci95_high", comparison.get("ci_high", 0.0))
    return {
        "points": 100.0 * float(comparison.get("delta", 0.0)),
        "ci_low_points": 100.0 * float(low),
        "ci_high_points": 100.0 * float(high),
        "n": int(comparison.get("n", 0)),
        "champion_rate": comparison.get("champion_rate"),
        "candidate_rate": comparison.get("candidate_rate"),
    }


def _live_points(before: LiveSample | None, after: LiveSample | None) -> dict[str, Any] | None:
    """The canary's delta (after minus before, in points) with Newcombe's interval for a
    difference of two independent proportions; None unless both sides have traces."""
    if before is None or after is None or before.n <= 0 or after.n <= 0:
        return None
    points = 100.0 * (after.successes / after.n - before.successes / before.n)
    low, high = newcombe_interval(before.successes, before.n, after.successes, after.n)
    return {
        "points": points,
        "ci_low_points": 100.0 * low,
        "ci_high_points": 100.0 * high,
        "n_before": before.n,
        "successes_before": before.successes,
        "n_after": after.n,
        "successes_after": after.successes,
    }
