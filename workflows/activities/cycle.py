"""Activities that open, mark and close a cycle: the loop's configuration as the cycle reads
it, the cycle's row, and its accounting at the close.

Every activity here is idempotent: a cycle's row is keyed by (loop, cycle number) and its
updates set absolute values, so a retry changes nothing twice. A loop or cycle that is not
there, or a policy that does not parse, fails for good (a non-retryable ``ApplicationError``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from temporalio import activity

from services.curation.policy import CurationPolicy, CurationPolicyError
from services.db.queries import cycles as q
from services.db.queries.loops import require_loop
from services.db.queries.runs import require_checkpoint
from services.db.session import SessionFactory
from services.logs import log_context
from services.loop.budget import budget_usd, settle_budget
from services.loop.points import LiveSample, cycle_points
from services.loop.policies import parse_policies
from services.metrics import LOOP_CYCLES, LOOP_POINTS_PER_DOLLAR, LOOP_SPEND
from workflows.activities.errors import fails_as
from workflows.activities.serving_ledger import ServingSampler
from workflows.activities.transactions import loop_cycle, transaction
from workflows.payloads.cycle import (
    CloseCycleInput,
    CloseCycleResult,
    StageInput,
    StartCycleInput,
    StartCycleResult,
)
from workflows.payloads.loop import LoopConfig, LoopConfigInput
from workflows.payloads.promote import LiveStats

logger = logging.getLogger(__name__)


class CycleActivities:
    """The cycle's records; a cycle's close also samples the serving ledger."""

    def __init__(self, session_factory: SessionFactory, sampler: ServingSampler) -> None:
        self._sessions = session_factory
        self._sampler = sampler

    @activity.defn(name="load_loop_config")
    def load_loop_config(self, input: LoopConfigInput) -> LoopConfig:
        """Read-only, so trivially idempotent."""
        with transaction(self._sessions) as session:
            loop = require_loop(session=session, name=input.loop)
            with fails_as(
                "InvalidPolicy",
                ValidationError,
                CurationPolicyError,
                context=f"loop {input.loop!r} has an invalid policy",
            ):
                trigger, gate, training, serving = parse_policies(
                    loop.trigger_policy,
                    loop.gate_policy,
                    loop.training_profile,
                    loop.serving_target,
                )
                curation = CurationPolicy.from_json(loop.curation_policy)
            return LoopConfig(
                loop=loop.name,
                loop_id=loop.id,
                status=loop.status,
                environment=loop.environment,
                executor=loop.executor,
                champion_checkpoint_id=loop.champion_checkpoint_id,
                champion_uri=loop.champion.uri if loop.champion is not None else None,
                training_profile=training,
                serving_target=serving,
                trigger_policy=trigger,
                gate_policy=gate,
                curation_policy=curation,
                budget_usd=budget_usd(loop),
                spent_usd=q.loop_ledger(session=session, loop=loop).spent_usd,
                last_cycle_number=q.last_cycle_number(session=session, loop=loop),
            )

    @activity.defn(name="start_cycle")
    def start_cycle(self, input: StartCycleInput) -> StartCycleResult:
        """Keyed by (loop, number): a retry returns the cycle the first attempt opened."""
        with (
            log_context(loop=input.loop, cycle=input.number),
            transaction(self._sessions) as session,
        ):
            loop = require_loop(session=session, name=input.loop, for_update=True)
            cycle = q.open_cycle(
                session=session,
                loop=loop,
                number=input.number,
                trigger=input.trigger,
                trigger_detail=input.trigger_detail,
                workflow_id=input.workflow_id,
            )
            champion_id = cycle.champion_checkpoint_id
            champion_uri = (
                require_checkpoint(session=session, checkpoint_id=champion_id).uri
                if champion_id
                else None
            )
            logger.info("cycle %s started by %s", input.number, input.trigger)
            return StartCycleResult(cycle.id, champion_id, champion_uri)

    @activity.defn(name="set_cycle_stage")
    def set_cycle_stage(self, input: StageInput) -> None:
        """Sets absolute values (stage, ids, the stage's end time)."""
        with transaction(self._sessions) as session:
            _, cycle = loop_cycle(session, input.loop, input.cycle)
            q.set_stage(
                session=session,
                cycle=cycle,
                stage=input.stage,
                dataset_id=input.dataset_id,
                candidate_checkpoint_id=input.candidate_checkpoint_id,
            )

    @activity.defn(name="close_cycle")
    def close_cycle(self, input: CloseCycleInput) -> CloseCycleResult:
        """Sets absolute values from the runs of the cycle; the budget rule reads totals
        (services.loop.budget: a spent budget pauses the loop).

        Records the cycle's three numbers with their intervals (services.loop.points):
        held-out points (the ledger's), the gate's eval-set points, and the live delta of
        the canary's samples.
        """
        with (
            log_context(loop=input.loop, cycle=input.cycle),
            transaction(self._sessions) as session,
        ):
            loop, cycle = loop_cycle(session, input.loop, input.cycle, for_update=True)
            first_close = cycle.ended_at is None
            promotion = q.cycle_promotion(session=session, cycle=cycle)
            points = cycle_points(
                promotion.statistics if promotion is not None else {},
                _sample(input.live_baseline),
                _sample(input.live_canary),
            )
            q.close_cycle(
                session=session,
                cycle=cycle,
                outcome=input.outcome,
                detail=input.detail,
                points_gained=input.points_gained,
                candidate_checkpoint_id=input.candidate_checkpoint_id,
                gate_points=input.gate_points,
                points=points,
            )
            budget = settle_budget(session=session, loop=loop)
            champion = loop.champion_checkpoint_id
            ledger = budget.ledger
            if first_close:
                LOOP_CYCLES.labels(input.loop, input.outcome).inc()
            LOOP_SPEND.labels(input.loop).set(ledger.spent_usd)
            if ledger.points_per_dollar is not None:
                LOOP_POINTS_PER_DOLLAR.labels(input.loop).set(ledger.points_per_dollar)
            result = CloseCycleResult(
                cost_usd=float(cycle.cost_usd),
                compute_seconds=cycle.compute_seconds,
                cumulative_cost_usd=ledger.spent_usd,
                cumulative_points=ledger.points_gained,
                points_per_dollar=ledger.points_per_dollar,
                budget_exhausted=budget.exhausted,
            )
        self._sampler.sample(input.loop, champion)
        return result

    def activities(self) -> list[Callable[..., Any]]:
        return [self.load_loop_config, self.start_cycle, self.set_cycle_stage, self.close_cycle]


def _sample(stats: LiveStats | None) -> LiveSample | None:
    """The canary's live stats as the ledger rules read them."""
    return LiveSample(stats.n, stats.successes) if stats is not None else None
