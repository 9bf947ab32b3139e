"""The estimate stage's activity: what the cycle about to train will cost, and whether the
loop's budget has that much left (``services.loop.estimate`` does the arithmetic).

Idempotent: a cycle keeps the first estimate recorded for it, and a retry answers from the
row. A refused cycle pauses its loop in the same transaction, with the reason the dashboard,
``ratchet loop show`` and ``GET /v1/loops/{loop}`` show as the loop's status reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from temporalio import activity

from services.db.models import Dataset
from services.db.queries import cycles as q
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.logs import log_context
from services.loop.budget import budget_usd, pause_for_budget
from services.loop.estimate import (
    RATE_CYCLES,
    Prices,
    default_rates,
    estimate_cycle,
    measured_rates,
    planned_work,
)
from services.loop.policies import TrainingProfile
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


@dataclass
class EstimateResult:
    """The estimate in dollars, what the budget had left (None: no budget), the verdict."""

    estimate_usd: float
    fits: bool
    reason: str = ""
    left_usd: float | None = None
    budget_usd: float | None = None


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
            )
            earlier = q.accounted_cycle_ids(
                session=session, loop=loop, before=input.cycle, limit=RATE_CYCLES
            )
            runs = q.run_records(session=session, cycle_ids=earlier, succeeded_only=True)
            estimate = estimate_cycle(
                work,
                measured=measured_rates(runs),
                defaults=default_rates(input.profile, self._prices),
                measured_cycles=len(earlier) if runs else 0,
                budget_usd=budget_usd(loop),
                spent_usd=q.loop_ledger(session=session, loop=loop).spent_usd,
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

    def activities(self) -> list[Callable[..., Any]]:
        return [self.estimate_cycle]


def _result_of(usd: float, stored: dict[str, Any]) -> EstimateResult:
    left, budget = stored.get("left_usd"), stored.get("budget_usd")
    return EstimateResult(
        estimate_usd=usd,
        fits=bool(stored.get("fits", True)),
        reason=str(stored.get("reason") or ""),
        left_usd=float(left) if isinstance(left, int | float) else None,
        budget_usd=float(budget) if isinstance(budget, int | float) else None,
    )
