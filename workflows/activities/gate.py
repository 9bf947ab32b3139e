"""Activities of the evaluate and gate stages: an evaluation's results recorded, the gate's
decision computed from them, and the decision recorded.

Idempotent: an evaluation is unique per (cycle, checkpoint, task set) and a decision per
cycle, so a retry returns what the first attempt stored; the gate itself is a pure function
of stored results. An unreadable results file fails for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session
from temporalio import activity

from services.artifacts import uri_to_path
from services.db.models import Cycle
from services.db.queries import cycles as q
from services.db.session import SessionFactory
from services.evaluation.figures import CONFIDENCE, paired_gain
from services.evaluation.gate import GateDecision, decide, judge_only_count
from services.evaluation.results import ResultsFileError, pass_at_1, read_results
from services.evaluation.stats import compare_paired, mean_interval
from services.logs import log_context
from services.loop.policies import GatePolicy
from services.loop.states import Decision
from services.metrics import LOOP_PASS_RATE, LOOP_PROMOTIONS
from workflows.activities.errors import fails_as
from workflows.activities.transactions import loop_cycle, transaction
from workflows.payloads.evaluate import EvaluationSummary, RecordEvaluationInput
from workflows.payloads.gate import GateInput, GateResult, RecordDecisionInput, RecordDecisionResult

logger = logging.getLogger(__name__)


class GateActivities:
    """Evaluations, the gate and its decision, over the cycle's rows."""

    def __init__(self, session_factory: SessionFactory) -> None:
        self._sessions = session_factory

    @activity.defn(name="record_evaluation")
    def record_evaluation(self, input: RecordEvaluationInput) -> EvaluationSummary:
        """Unique per (cycle, checkpoint, task set): a retry returns the stored evaluation."""
        with fails_as("BadEvaluationOutput", ResultsFileError):
            rows = read_results(uri_to_path(input.output_uri))
        ci = mean_interval([pass_at_1(row) for row in rows]) if rows else (0.0, 0.0)
        with transaction(self._sessions) as session:
            loop, cycle = loop_cycle(session, input.loop, input.cycle)
            record = q.EvaluationRecord(
                checkpoint_id=input.checkpoint_id,
                task_set=input.task_set,
                dataset_id=input.dataset_id,
                run_id=input.run_id,
                results=rows,
                ci=ci,
            )
            evaluation = q.record_evaluation(session=session, loop=loop, cycle=cycle, record=record)
            if input.task_set == "eval":
                LOOP_PASS_RATE.labels(input.loop, input.role).set(evaluation.pass_rate)
            return EvaluationSummary(
                evaluation_id=evaluation.id,
                role=input.role,
                checkpoint_id=input.checkpoint_id,
                task_set=input.task_set,
                n=evaluation.n,
                passed=evaluation.passed,
                pass_rate=evaluation.pass_rate,
                ci_low=evaluation.ci_low,
                ci_high=evaluation.ci_high,
            )

    @activity.defn(name="gate")
    def gate(self, input: GateInput) -> GateResult:
        """A pure function of stored per-task results: the same inputs, the same decision.

        The decision reads the eval set and the regression suite only. The held-out
        comparison (when the cycle evaluated one) rides along in the statistics as
        ``heldout`` and ``heldout_points``: the points a promotion would gain, measured on
        tasks the gate never saw and training never touched.
        """
        with transaction(self._sessions) as session:
            _, cycle = loop_cycle(session, input.loop, input.cycle)
            eval_pairs, regression_pairs, heldout_pairs = (
                _pairs(session, cycle, input, task_set)
                for task_set in ("eval", "regression", "heldout")
            )
            reach = _reach(session, cycle, input)
            eval_specs = q.evaluated_task_specs(
                session=session,
                cycle=cycle,
                checkpoint_id=input.candidate_checkpoint_id,
                task_set="eval",
            )
        policy = GatePolicy(
            confidence=input.confidence,
            min_improvement_points=input.min_improvement_points,
            regression_tolerance_points=input.regression_tolerance_points,
            min_discordant_pairs=input.min_discordant_pairs,
        )
        decision = decide(
            *eval_pairs,
            *regression_pairs,
            policy,
            seed=input.cycle,
            judge_only_tasks=judge_only_count(eval_specs),
        )
        statistics = dict(decision.statistics)
        statistics["pass_at_k"] = reach
        if isinstance(statistics.get("eval"), dict) and eval_pairs[0]:
            # The decision is at the policy's confidence; the figure every page prints is
            # the 95 % one (services.evaluation.figures).
            shown = paired_gain(*eval_pairs, seed=input.cycle)
            statistics["eval"] = {
                **statistics["eval"],
                "ci95_low": shown.low / 100.0,
                "ci95_high": shown.high / 100.0,
            }
        if heldout_pairs[0]:
            # A figure, not a decision: always at 95 %.
            heldout = compare_paired(*heldout_pairs, confidence=CONFIDENCE, seed=input.cycle)
            statistics["heldout"] = heldout.to_dict()
            statistics["heldout_points"] = heldout.delta_points
        return GateResult(decision.decision, decision.reason, statistics)

    @activity.defn(name="record_decision")
    def record_decision(self, input: RecordDecisionInput) -> RecordDecisionResult:
        """At most one decision per cycle (unique key): a retry returns the first decision."""
        with (
            log_context(loop=input.loop, cycle=input.cycle),
            transaction(self._sessions) as session,
        ):
            loop, cycle = loop_cycle(session, input.loop, input.cycle)
            promotion = q.record_decision(
                session=session,
                loop=loop,
                cycle=cycle,
                verdict=GateDecision(input.decision, input.reason, input.statistics),
                candidate_checkpoint_id=input.candidate_checkpoint_id,
                previous_checkpoint_id=input.previous_checkpoint_id,
                decided_by=input.decided_by,
            )
            if promotion.decision == input.decision:
                LOOP_PROMOTIONS.labels(input.loop, input.decision).inc()
            logger.info("gate decided %s: %s", promotion.decision, promotion.reason)
            return RecordDecisionResult(promotion.id, Decision(promotion.decision))

    def activities(self) -> list[Callable[..., Any]]:
        return [self.record_evaluation, self.gate, self.record_decision]


def _pairs(
    session: Session, cycle: Cycle, input: GateInput, task_set: str
) -> tuple[list[float], list[float]]:
    """The champion's and the candidate's per-task results on one task set, paired."""
    return q.paired_results(
        session=session,
        cycle=cycle,
        champion_id=input.champion_checkpoint_id,
        candidate_id=input.candidate_checkpoint_id,
        task_set=task_set,
    )


def _reach(session: Session, cycle: Cycle, input: GateInput) -> dict[str, dict[str, float]]:
    """What sampling still reaches beside pass@1 on the eval set, for both sides."""
    return {
        role: q.pass_at_k_of(
            session=session, cycle=cycle, checkpoint_id=checkpoint, task_set="eval"
        )
        for role, checkpoint in (
            ("champion", input.champion_checkpoint_id),
            ("candidate", input.candidate_checkpoint_id),
        )
    }
