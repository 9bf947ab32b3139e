"""Intelligence per dollar: one definition (services.db.queries.points), on real Postgres."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from sqlalchemy import select

from services.db.models import Cycle, Loop, Run
from services.db.queries.points import (
    cycle_cost_usd,
    intelligence_per_dollar,
    points_per_dollar,
    usd_per_point,
)
from services.db.queries.spend import loop_ledger
from tests.services.db.conftest import Seeded


def test_every_accounted_cycle_counts_and_the_open_one_waits(seeded: Seeded) -> None:
    with seeded.sessions() as session:
        bought = intelligence_per_dollar(session=session, loop_id=seeded.loop_id)
    first, second = bought.cycles  # cycle 3 is still open
    assert (first.cycle, first.points, first.cost_usd) == (1, 0.0, 1.4)
    assert first.points_per_dollar == 0.0 and first.usd_per_point is None  # rolled back
    assert (second.cycle, second.points, second.cost_usd) == (2, 58.3, 2.1)
    assert second.points_per_dollar == pytest.approx(58.3 / 2.1)
    assert second.usd_per_point == pytest.approx(2.1 / 58.3)
    # Cumulative: the rolled-back cycle's dollars are what the points cost too.
    assert second.cumulative_points_per_dollar == pytest.approx(58.3 / 3.5)
    assert (bought.points, bought.cost_usd) == (pytest.approx(58.3), pytest.approx(3.5))
    assert bought.points_per_dollar == pytest.approx(58.3 / 3.5)
    assert bought.usd_per_point == pytest.approx(3.5 / 58.3)
    assert bought.of_cycle(3) is None and bought.of_cycle(2) == second


def test_a_cycle_without_points_or_accounting_still_costs(seeded: Seeded) -> None:
    """A cycle that claimed no points counts 0 points and its dollars; one closed without
    accounting (superseded) costs what its runs cost."""
    with seeded.sessions.begin() as session:
        cycle = session.scalars(
            select(Cycle).where(Cycle.loop_id == seeded.loop_id, Cycle.number == 3)
        ).one()
        cycle.ended_at = dt.datetime.now(dt.UTC)
        cycle.outcome = "failed"
        runs_cost = sum(
            (r.cost_usd for r in session.scalars(select(Run).where(Run.cycle_id == cycle.id))),
            Decimal(0),
        )
    assert runs_cost > 0
    with seeded.sessions() as session:
        bought = intelligence_per_dollar(session=session, loop_id=seeded.loop_id)
    third = bought.of_cycle(3)
    assert third is not None
    assert (third.points, third.cost_usd) == (0.0, float(runs_cost))
    assert bought.cost_usd == pytest.approx(3.5 + float(runs_cost))


def test_the_ledger_reads_the_same_figure_and_spend_stays_every_run(seeded: Seeded) -> None:
    with seeded.sessions() as session:
        loop = session.get(Loop, seeded.loop_id)
        assert loop is not None
        ledger = loop_ledger(session=session, loop=loop)
        bought = intelligence_per_dollar(session=session, loop_id=seeded.loop_id)
    assert ledger.points_per_dollar == bought.points_per_dollar
    assert (ledger.points_gained, ledger.cycles) == (bought.points, 2)
    assert ledger.spent_usd == pytest.approx(3.8)  # the budget's: every run, cycle 3's too


def test_a_loop_with_no_cycle_bought_nothing(seeded: Seeded) -> None:
    with seeded.sessions() as session:
        bought = intelligence_per_dollar(session=session, loop_id=seeded.quiet_loop_id)
    assert bought.cycles == []
    assert (bought.points, bought.cost_usd, bought.points_per_dollar) == (0.0, 0.0, None)


def test_the_arithmetic() -> None:
    assert points_per_dollar(10.0, 0.0) is None and points_per_dollar(10.0, 4.0) == 2.5
    assert usd_per_point(0.0, 4.0) is None and usd_per_point(-2.0, 4.0) is None
    assert usd_per_point(8.0, 4.0) == 0.5
    assert cycle_cost_usd(Decimal("1.5"), Decimal("9")) == Decimal("1.5")
    assert cycle_cost_usd(Decimal(0), Decimal("0.3")) == Decimal("0.3")
    assert cycle_cost_usd(None, None) == 0
