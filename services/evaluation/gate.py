"""The promotion gate: promote only on a significant paired win with no regression.

Candidate and champion are evaluated on the same eval tasks and the same pinned regression
suite; each task's score is its pass@1 estimated from the eval samples. The gate promotes
when

1. on the eval set at least ``min_discordant_pairs`` tasks tell the two apart, and among
   them the candidate wins significantly at the policy's confidence level (exact one-sided
   sign test; McNemar's with one sample) by at least ``min_improvement_points``, and
2. on the regression suite the candidate's pass rate drops by no more than
   ``regression_tolerance_points`` (point estimate; a suite too small to say is not a
   reason to promote or refuse).

The eval set is the loop's new failures, on which the champion scores near zero by
construction: its delta decides, but it is never reported as points gained (the frozen
held-out set measures those, outside the gate). Every decision carries its statistics and a
reason a person can read. The thresholds are the loop's own :class:`GatePolicy`, the class
the admin API validates, so a bound holds in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.evaluation.stats import PairedComparison, compare_paired
from services.loop.policies import GatePolicy
from services.loop.states import Decision


@dataclass(frozen=True)
class GateDecision:
    decision: Decision  # PROMOTE or REJECT
    reason: str
    statistics: dict[str, Any] = field(default_factory=dict)


def decide(
    eval_champion: Sequence[float],
    eval_candidate: Sequence[float],
    regression_champion: Sequence[float],
    regression_candidate: Sequence[float],
    policy: GatePolicy,
    *,
    seed: int = 0,
    judge_only_tasks: int = 0,
) -> GateDecision:
    """The decision for one cycle, from per-task scores (pass/fail or pass@1) paired by task.

    ``judge_only_tasks``: how many of the eval tasks only an LLM judge scores (replay tasks
    with ``verifier_kind: judge``, see :func:`judge_only_count`); the report says so, since a
    judge's verdict is the least trusted reward a task can have.
    """
    decision = _decide(
        eval_champion, eval_candidate, regression_champion, regression_candidate, policy, seed
    )
    if judge_only_tasks <= 0:
        return decision
    n = len(eval_champion)
    statistics = {**decision.statistics, "judge_only_tasks": judge_only_tasks}
    note = f"; {judge_only_tasks} of {n} eval tasks are scored by an LLM judge only"
    return GateDecision(decision.decision, decision.reason + note, statistics)


def judge_only_count(task_specs: Sequence[Mapping[str, Any]]) -> int:
    """How many of these tasks (``ratchet.task/v1`` objects) only an LLM judge scores."""
    return sum(
        1
        for spec in task_specs
        if isinstance(spec.get("metadata"), Mapping)
        and spec["metadata"].get("verifier_kind") == "judge"
    )


def _decide(
    eval_champion: Sequence[float],
    eval_candidate: Sequence[float],
    regression_champion: Sequence[float],
    regression_candidate: Sequence[float],
    policy: GatePolicy,
    seed: int,
) -> GateDecision:
    if not eval_champion:
        return GateDecision(Decision.REJECT, "no paired eval results to compare", {"n": 0})
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
        f"on {main.n} eval tasks ({main.delta_points:+.1f} points, {main.only_candidate} "
        f"better / {main.only_champion} worse, one-sided p={main.p_value_improvement:.3g})"
    )
    if regression is not None and -regression.delta_points > policy.regression_tolerance_points:
        return GateDecision(
            Decision.REJECT,
            f"regression suite dropped {-regression.delta_points:.1f} points "
            f"(tolerance {policy.regression_tolerance_points:g}); {summary}",
            statistics,
        )
    if main.discordant < policy.min_discordant_pairs:
        return GateDecision(
            Decision.REJECT,
            f"only {main.discordant} eval tasks tell the models apart (the policy needs "
            f"{policy.min_discordant_pairs}): {summary}",
            statistics,
        )
    if main.p_value_improvement >= alpha:
        return GateDecision(
            Decision.REJECT,
            f"no significant win at {policy.confidence:.0%} confidence: {summary}",
            statistics,
        )
    if main.delta_points < policy.min_improvement_points:
        return GateDecision(
            Decision.REJECT,
            f"win below the minimum of {policy.min_improvement_points:g} points: {summary}",
            statistics,
        )
    return GateDecision(Decision.PROMOTE, f"significant win: {summary}", statistics)
