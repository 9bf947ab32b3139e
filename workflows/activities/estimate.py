"""The estimate stage's activities: whether the cycle must first calibrate (the loop has
measured nothing yet), then what the cycle about to train will cost, with its range, and
whether the loop's budget has that much left (``services.loop.estimate`` does the
arithmetic).

Idempotent: a cycle keeps the first estimate recorded for it, and a retry answers from the
row. A refused cycle pauses its loop in the same transaction, with the reason the dashboard,
``ratchet loop show`` and ``GET /v1/loops/{loop}`` show as the loop's status reason; the
reason says what the estimate rests on (measured cycles, the calibration pass, or defaults
that are not a measurement).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session
from temporalio import activity

from services.db.models import Dataset
from services.db.queries import cycles as q
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.db.queries.runs import get_run
from services.db.session import SessionFactory
from services.logs import log_context
from services.loop.budget import budget_usd, pause_for_budget
from services.loop.estimate import (
    RATE_CYCLES,
    Prices,
    Rate,
    calibrated_rates,
    default_rates,
    estimate_cycle,
    measured_rates,
    planned_work,
)
from services.loop.policies import TrainingProfile
from services.loop.states import RunStatus
from services.training.config import HyperparameterError
from workflows.activities.errors import fails_as
from workflows.payload import policy_payload

logger = logging.getLogger(__name__)


@policy_payload()
@dataclass
class EstimateInput:
    """The cycle about to train: its training profile and the sizes of its eval task sets."""

    loop: str
    cycle: int
    profile: TrainingProfile
    eval_task_counts: list[int] = field(default_factory=list)
    samples_per_task: int = 1
    # The cycle's calibration run, when it ran one (CalibrationNeed), and how many replay
    # tasks its dataset offers rft.
    calibration_run_id: str | None = None
    replay_tasks: int = 0


@dataclass
class EstimateResult:
    """The estimate in dollars, what the budget had left (None: no budget), the verdict,
    and the estimate's range and what it rests on."""

    estimate_usd: float
    fits: bool
    reason: str = ""
    left_usd: float | None = None
    budget_usd: float | None = None
    low_usd: float | None = None
    high_usd: float | None = None
    basis: str = ""
    calibrated: bool = False


@dataclass
class CalibrationInput:
    loop: str
    cycle: int


@dataclass
class CalibrationNeed:
    """Whether the cycle runs a calibration pass before its estimate: the loop has no run of
    an earlier cycle to measure rates on, and the cycle is not estimated yet."""

    needed: bool


class EstimateActivities:
    """Dependencies come in: the session factory and the configured prices."""

    def __init__(self, session_factory: SessionFactory, prices: Prices) -> None:
        self._sessions = session_factory
        self._prices = prices

    @activity.defn(name="estimate_cycle")
    def estimate_cycle(self, input: EstimateInput) -> EstimateResult:
        """Estimate the cycle from the loop's measured rates and record it on the cycle; a
        cycle estimated already returns its first estimate. Over the budget: the loop is
        paused with the reason."""
        with (
            log_context(loop=input.loop, cycle=input.cycle),
            fails_as("NotFound", NotFound),
            fails_as(
                "InvalidPolicy",
                HyperparameterError,
                context=f"loop {input.loop!r} has an invalid training profile",
            ),
            self._sessions.begin() as session,
        ):
            loop = require_loop(session=session, name=input.loop, for_update=True)
            cycle = q.get_cycle(session=session, loop=loop, number=input.cycle)
            if cycle.estimate_usd is not None:
                return _result_of(float(cycle.estimate_usd), dict(cycle.estimate or {}))
            dataset = session.get(Dataset, cycle.dataset_id) if cycle.dataset_id else None
            work = planned_work(
                input.profile,
                eval_task_counts=input.eval_task_counts,
                samples_per_task=input.samples_per_task,
                train_tasks=dataset.train_count if dataset is not None else 0,
                replay_tasks=input.replay_tasks,
            )
            earlier = q.accounted_cycle_ids(
                session=session, loop=loop, before=input.cycle, limit=RATE_CYCLES
            )
            runs = q.run_records(session=session, cycle_ids=earlier, succeeded_only=True)
            measured = measured_rates(runs)
            calibrated, calibration = _calibration(session, input.calibration_run_id)
            estimate = estimate_cycle(
                work,
                measured=measured,
                defaults=default_rates(input.profile, self._prices),
                measured_cycles=len(earlier) if measured else 0,
                budget_usd=budget_usd(loop),
                spent_usd=q.loop_ledger(session=session, loop=loop).spent_usd,
                calibrated=calibrated,
                calibration=calibration,
            )
            q.record_estimate(
                session=session, cycle=cycle, estimate_usd=estimate.usd, estimate=estimate.to_json()
            )
            if not estimate.fits:
                pause_for_budget(loop, f"cycle {input.cycle} refused: {estimate.reason}")
                logger.warning("cycle %s refused: %s", input.cycle, estimate.reason)
            else:
                logger.info("cycle %s estimated at $%.4f", input.cycle, estimate.usd)
            return _result_of(estimate.usd, estimate.to_json())

    @activity.defn(name="calibration_needed")
    def calibration_needed(self, input: CalibrationInput) -> CalibrationNeed:
        """Whether the cycle runs a calibration pass first: not when it is estimated already
        (a retry), nor when an earlier cycle's runs measure the loop's rates."""
        with (
            log_context(loop=input.loop, cycle=input.cycle),
            fails_as("NotFound", NotFound),
            self._sessions.begin() as session,
        ):
            loop = require_loop(session=session, name=input.loop)
            cycle = q.get_cycle(session=session, loop=loop, number=input.cycle)
            if cycle.estimate_usd is not None:
                return CalibrationNeed(needed=False)
            earlier = q.accounted_cycle_ids(
                session=session, loop=loop, before=input.cycle, limit=RATE_CYCLES
            )
            runs = q.run_records(session=session, cycle_ids=earlier, succeeded_only=True)
            return CalibrationNeed(needed=not measured_rates(runs))

    def activities(self) -> list[Callable[..., Any]]:
        return [self.estimate_cycle, self.calibration_needed]


def _calibration(session: Session, run_id: str | None) -> tuple[dict[str, Rate], str | None]:
    """The rates the cycle's calibration run measured and its name, or none with why (a
    failed or missing pass leaves the defaults, which the estimate then says)."""
    if run_id is None:
        return {}, None
    run = get_run(session=session, run_id=run_id)
    if run is None or run.status != RunStatus.SUCCEEDED:
        status = run.status if run is not None else "missing"
        return {}, f"run {run_id} ({status})"
    rates = calibrated_rates(q.run_record(run))
    return rates, f"run {run_id}"


def _result_of(usd: float, stored: dict[str, Any]) -> EstimateResult:
    left, budget = stored.get("left_usd"), stored.get("budget_usd")
    low, high = stored.get("low_usd"), stored.get("high_usd")
    return EstimateResult(
        estimate_usd=usd,
        fits=bool(stored.get("fits", True)),
        reason=str(stored.get("reason") or ""),
        left_usd=float(left) if isinstance(left, int | float) else None,
        budget_usd=float(budget) if isinstance(budget, int | float) else None,
        low_usd=float(low) if isinstance(low, int | float) else None,
        high_usd=float(high) if isinstance(high, int | float) else None,
        basis=str(stored.get("basis") or ""),
        calibrated=bool(stored.get("calibrated", False)),
    )
