"""The promotion gate: promote only on a significant paired win with no regression.

Candidate and champion are evaluated on the same eval tasks and the same pinned regression
suite. The gate promotes when

1. on the eval set the candidate beats the champion at the policy's confidence level (exact
   one-sided McNemar on the discordant pairs) by at least ``min_improvement_points``, and
2. on the regression suite the candidate's pass rate drops by no more than
   ``regression_tolerance_points`` (point estimate; a suite too small to say is not a
   reason to promote or refuse).

Every decision carries its statistics and a reason a person can read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.evaluation.stats import PairedComparison, compare_paired


@dataclass(frozen=True)
class GatePolicy:
    confidence: float = 0.95
    min_improvement_points: float = 0.0
    regression_tolerance_points: float = 2.0

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError("confidence must be in [0.5, 1)")
        if self.regression_tolerance_points < 0:
            raise ValueError("regression_tolerance_points must be >= 0")


@dataclass(frozen=True)
class GateDecision:
    decision: str  # "promote" | "reject"
    reason: str
    statistics: dict[str, Any] = field(default_factory=dict)


def decide(
    eval_champion: Sequence[bool],
    eval_candidate: Sequence[bool],
    regression_champion: Sequence[bool],
    regression_candidate: Sequence[bool],
    policy: GatePolicy,
    *,
    seed: int = 0,
) -> GateDecision:
    """The decision for one cycle, from per-task results paired by task."""
    if not eval_champion:
        return GateDecision("reject", "no paired eval results to compare", {"n": 0})
    main = compare_paired(eval_champion, eval_candidate, confidence=policy.confidence, seed=seed)
    statistics: dict[str, Any] = {"eval": main.to_dict(), "delta_points": main.delta_points}
    regression: PairedComparison | None = None
    if regression_champion:
        regression = compare_paired(
            regression_champion, regression_candidate, confidence=policy.confidence, seed=seed
        )
        statistics["regression"] = regression.to_dict()

    alpha = 1.0 - policy.confidence
    summary = (
        f"candidate {main.candidate_rate * 100:.1f}% vs champion {main.champion_rate * 100:.1f}% "
        f"on {main.n} eval tasks ({main.delta_points:+.1f} points, one-sided p="
        f"{main.p_value_improvement:.3g})"
    )
    if regression is not None and -regression.delta_points > policy.regression_tolerance_points:
        return GateDecision(
            "reject",
            f"regression suite dropped {-regression.delta_points:.1f} points "
            f"(tolerance {policy.regression_tolerance_points:g}); {summary}",
            statistics,
        )
    if main.p_value_improvement >= alpha:
        return GateDecision(
            "reject",
            f"no significant win at {policy.confidence:.0%} confidence: {summary}",
            statistics,
        )
    if main.delta_points < policy.min_improvement_points:
        return GateDecision(
            "reject",
            f"win below the minimum of {policy.min_improvement_points:g} points: {summary}",
            statistics,
        )
    return GateDecision("promote", f"significant win: {summary}", statistics)
