"""Intelligence per dollar (DESIGN §8): held-out points of pass rate gained per dollar, per
cycle and cumulative. Never commits.

The one definition, as docs/design.md §8 and docs/observability.md ("Costs") state it:

- the points are each cycle's **held-out** points gained (``cycles.points_gained``: counted
  only when the candidate serves after the canary; a cycle that claimed none counts 0);
- the dollars are the cost of **every accounted cycle**, rejected, rolled back and failed
  ones included, since that is what the points cost: a cycle's accounted cost
  (``cycles.cost_usd``), or the cost of its runs where the cycle was never accounted (one
  closed as superseded);
- a cycle still open is not counted yet.

The dashboard's chart and table, the demo's report, the serving ledger's $ per held-out
point and the ``ratchet_loop_points_per_dollar`` gauge all read this module, so the figure
is the same wherever it is shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.db.models import Cycle, Run


def points_per_dollar(points: float, cost_usd: float) -> float | None:
    """Points over dollars; None when nothing was spent."""
    return points / cost_usd if cost_usd > 0 else None


def usd_per_point(points: float, cost_usd: float) -> float | None:
    """Dollars over points: what one point cost; None unless points were gained."""
    return cost_usd / points if points > 0 else None


def cycle_cost_usd(accounted: Decimal | None, runs: Decimal | None) -> Decimal:
    """A cycle's cost: its accounted cost once accounted, the cost of its runs until then
    (docs/observability.md, "Costs")."""
    accounted_cost = Decimal(accounted or 0)
    return accounted_cost if accounted_cost > 0 else Decimal(runs or 0)


@dataclass(frozen=True)
class CyclePoints:
    """One accounted cycle's held-out points and cost, and the totals up to it."""

    cycle: int
    points: float
    cost_usd: float
    cumulative_points: float
    cumulative_cost_usd: float

    @property
    def points_per_dollar(self) -> float | None:
        return points_per_dollar(self.points, self.cost_usd)

    @property
    def cumulative_points_per_dollar(self) -> float | None:
        return points_per_dollar(self.cumulative_points, self.cumulative_cost_usd)

    @property
    def usd_per_point(self) -> float | None:
        return usd_per_point(self.points, self.cost_usd)


@dataclass(frozen=True)
class IntelligencePerDollar:
    """A loop's accounted cycles, oldest first, with the loop's totals."""

    cycles: list[CyclePoints] = field(default_factory=list)

    @property
    def points(self) -> float:
        return self.cycles[-1].cumulative_points if self.cycles else 0.0

    @property
    def cost_usd(self) -> float:
        return self.cycles[-1].cumulative_cost_usd if self.cycles else 0.0

    @property
    def points_per_dollar(self) -> float | None:
        return points_per_dollar(self.points, self.cost_usd)

    @property
    def usd_per_point(self) -> float | None:
        return usd_per_point(self.points, self.cost_usd)

    def of_cycle(self, number: int) -> CyclePoints | None:
        """The cycle's entry, or None while it is open (or for a cycle it never had)."""
        return next((c for c in self.cycles if c.cycle == number), None)


def intelligence_per_dollar(*, session: Session, loop_id: int) -> IntelligencePerDollar:
    """The loop's intelligence per dollar, per accounted cycle and cumulative; one query."""
    runs_cost = (
        select(Run.cycle_id, func.sum(Run.cost_usd).label("cost"))
        .where(Run.loop_id == loop_id)
        .group_by(Run.cycle_id)
        .subquery()
    )
    statement = (
        select(Cycle.number, Cycle.points_gained, Cycle.cost_usd, runs_cost.c.cost)
        .outerjoin(runs_cost, runs_cost.c.cycle_id == Cycle.id)
        .where(Cycle.loop_id == loop_id, Cycle.ended_at.is_not(None))
        .order_by(Cycle.number)
    )
    cycles: list[CyclePoints] = []
    total_points = total_cost = 0.0
    for number, points, accounted, runs in session.execute(statement):
        cost = float(cycle_cost_usd(accounted, runs))
        gained = float(points or 0.0)
        total_points, total_cost = total_points + gained, total_cost + cost
        cycles.append(CyclePoints(number, gained, cost, total_points, total_cost))
    return IntelligencePerDollar(cycles)
