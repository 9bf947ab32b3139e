"""What a loop has spent: the sum of its runs' cost, every run (in a cycle or not, the
probe included). Never commits.

The budget rule, the dashboard's overview and loop page, and the ``ratchet_loop_spend_usd``
gauge all read it here, so "spend" is one number wherever it is shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from services.db.models import Loop, Run
from services.db.queries.points import intelligence_per_dollar


@dataclass(frozen=True)
class Spend:
    """Dollars and compute-seconds of a loop's runs."""

    cost_usd: Decimal
    compute_seconds: float


def _spend_select() -> Select[int, Decimal, float]:
    return select(
        Run.loop_id,
        func.coalesce(func.sum(Run.cost_usd), Decimal(0)),
        func.coalesce(func.sum(Run.compute_seconds), 0.0),
    ).group_by(Run.loop_id)


def spend_by_loop(*, session: Session) -> dict[int, Spend]:
    """Every loop's spend, by loop id (a loop that ran nothing is absent: it spent 0)."""
    return {
        loop_id: Spend(Decimal(cost), float(seconds))
        for loop_id, cost, seconds in session.execute(_spend_select())
    }


def loop_spend(*, session: Session, loop_id: int) -> Spend:
    """One loop's spend."""
    found = session.execute(_spend_select().where(Run.loop_id == loop_id)).one_or_none()
    if found is None:
        return Spend(Decimal(0), 0.0)
    return Spend(Decimal(found[1]), float(found[2]))


@dataclass(frozen=True)
class LoopLedger:
    """What the loop spent (for its budget) beside what its accounted cycles bought."""

    spent_usd: float
    points_gained: float
    compute_seconds: float
    cycles: int
    # Intelligence per dollar, cumulative (services.db.queries.points): held-out points
    # over the cost of the accounted cycles, not over ``spent_usd``.
    points_per_dollar: float | None


def loop_ledger(*, session: Session, loop: Loop) -> LoopLedger:
    """The loop's spend and its cumulative intelligence per dollar."""
    spend = loop_spend(session=session, loop_id=loop.id)
    bought = intelligence_per_dollar(session=session, loop_id=loop.id)
    return LoopLedger(
        spent_usd=float(spend.cost_usd),
        points_gained=bought.points,
        compute_seconds=spend.compute_seconds,
        cycles=len(bought.cycles),
        points_per_dollar=bought.points_per_dollar,
    )
