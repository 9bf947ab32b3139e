"""The promotion gate: promote only on a significant paired win with no regression.

Candidate and champion are evaluated on the same eval tasks and the same pinned regression
suite; each task's score is its pass@1 estimated from the eval samples. The gate promotes
when

1. on the eval set at least ``min_discordant_pairs`` tasks tell the two apart, and among
   them the candidate wins significantly at the policy's confidence level (exact one-sided
   sign test; McNemar's with one sample) by at least ``min_improvement_points``, and
2. on the regression suite the candidate's pass rate does not drop by more than
   ``regression_tolerance_points`` with a significant loss: a drop beyond the tolerance
   refuses when the champion's wins on the suite are significant at the same confidence
   (exact one-sided sign test). A suite too small to show a loss is not a reason to refuse:
   the decision says so, with how many tasks it would take. A point estimate alone refused a
   candidate with +32.5 points on its eval set for one task lost of a 7-task suite
   (``benchmarks/foreign_agent.py``, seed 0), which says nothing about forgetting.

The eval set is the loop's new failures, on which the champion scores near zero by
construction: its delta decides, but it is never reported as points gained (the frozen
held-out set measures those, outside the gate). Every decision carries its statistics and a
reason a person can read. The thresholds are the loop's own :class:`GatePolicy`, the class
the admin API validates, so a bound holds in one place.
"""

from __future__ import annotations

import math
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

    summary = (
        f"candidate {main.candidate_rate * 100:.1f}% vs champion {main.champion_rate * 100:.1f}% "
        f"on {main.n} eval tasks ({main.delta_points:+.1f} points, {main.only_candidate} "
        f"better / {main.only_champion} worse, one-sided p={main.p_value_improvement:.3g})"
    )
    regression_note = ""
    if regression is not None:
        check = _regression_check(regression, policy)
        statistics["regression_check"] = check
        if check == "significant_loss":
            return GateDecision(
                Decision.REJECT,
                f"regression suite dropped {_regression_summary(regression, policy)}; {summary}",
                statistics,
            )
        if check == "loss_not_significant":
            regression_note = f"; {_unshown_loss(regression, policy)}"
    decision = _decide_on_eval(main, policy, summary, statistics)
    if not regression_note:
        return decision
    return GateDecision(decision.decision, decision.reason + regression_note, statistics)


def _decide_on_eval(
    main: PairedComparison, policy: GatePolicy, summary: str, statistics: dict[str, Any]
) -> GateDecision:
    alpha = 1.0 - policy.confidence
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


def _regression_check(regression: PairedComparison, policy: GatePolicy) -> str:
    """``within_tolerance``, ``significant_loss`` (refuses) or ``loss_not_significant``."""
    if -regression.delta_points <= policy.regression_tolerance_points:
        return "within_tolerance"
    if regression.p_value_loss < 1.0 - policy.confidence:
        return "significant_loss"
    return "loss_not_significant"


def _regression_summary(regression: PairedComparison, policy: GatePolicy) -> str:
    return (
        f"{-regression.delta_points:.1f} points (tolerance "
        f"{policy.regression_tolerance_points:g}; {regression.only_champion} worse / "
        f"{regression.only_candidate} better of {regression.n} tasks, one-sided "
        f"p={regression.p_value_loss:.3g})"
    )


def _unshown_loss(regression: PairedComparison, policy: GatePolicy) -> str:
    """The note on a drop beyond the tolerance that the suite cannot show: what it would take."""
    needed = losses_to_show(policy.confidence)
    size = (
        f"a suite of {regression.n} tasks cannot show a loss at {policy.confidence:.0%}"
        if regression.n < needed
        else f"it takes {needed} tasks lost and none gained to show one at {policy.confidence:.0%}"
    )
    return (
        f"the regression suite dropped {_regression_summary(regression, policy)}, not a "
        f"significant loss ({size}; pin more tasks with `ratchet tasks pin`)"
    )


def losses_to_show(confidence: float) -> int:
    """The fewest tasks lost, none gained, that make a significant loss: 0.5**k < 1 - confidence."""
    return math.floor(math.log2(1.0 / (1.0 - confidence))) + 1
