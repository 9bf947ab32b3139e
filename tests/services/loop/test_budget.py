"""The budget rule (services.loop.budget) against Postgres: a spent budget pauses the loop."""

from __future__ import annotations

from decimal import Decimal

import pytest

from services.db.models import Loop, Run
from services.db.session import SessionFactory
from services.loop.budget import budget_usd, pause_for_budget, settle_budget
from services.loop.states import LoopLifecycle


def loop_that_spent(
    session_factory: SessionFactory, name: str, *, budget: str | None, spent: str
) -> None:
    with session_factory.begin() as session:
        loop = Loop(
            name=name,
            environment="toolcalc",
            budget_usd=Decimal(budget) if budget is not None else None,
        )
        session.add(loop)
        session.flush()
        session.add(
            Run(
                id=f"{name}-run",
                loop_id=loop.id,
                kind="train",
                executor="local",
                spec={},
                status="succeeded",
                cost_usd=Decimal(spent),
            )
        )


@pytest.mark.parametrize(
    ("budget", "spent", "exhausted"),
    [("1.00", "1.00", True), ("1.00", "1.50", True), ("1.00", "0.99", False), (None, "9", False)],
)
def test_a_spent_budget_pauses_the_loop_with_the_reason(
    session_factory: SessionFactory, budget: str | None, spent: str, exhausted: bool
) -> None:
    loop_that_spent(session_factory, "spender", budget=budget, spent=spent)
    with session_factory.begin() as session:
        loop = session.query(Loop).filter_by(name="spender").one()
        check = settle_budget(session=session, loop=loop)
        assert check.exhausted is exhausted
        assert check.ledger.spent_usd == pytest.approx(float(spent))
    with session_factory.begin() as session:
        loop = session.query(Loop).filter_by(name="spender").one()
        assert loop.status == (LoopLifecycle.PAUSED if exhausted else LoopLifecycle.ACTIVE)
        if exhausted:
            assert budget is not None
            assert loop.status_reason == (
                f"budget of ${float(budget):.2f} spent (${float(spent):.2f}); raise the budget "
                "and resume"
            )


def test_an_operators_pause_and_an_archive_are_kept(session_factory: SessionFactory) -> None:
    loop = Loop(name="x", environment="toolcalc", status="paused", status_reason="by hand")
    pause_for_budget(loop, "budget spent")
    assert (loop.status, loop.status_reason) == ("paused", "by hand")
    loop.status = LoopLifecycle.ARCHIVED
    pause_for_budget(loop, "budget spent")
    assert loop.status == "archived"
    active = Loop(name="y", environment="toolcalc", status="active")
    pause_for_budget(active, "cycle 3 refused: over")
    assert (active.status, active.status_reason) == ("paused", "cycle 3 refused: over")


def test_budget_in_dollars() -> None:
    assert budget_usd(Loop(name="b", budget_usd=Decimal("2.50"))) == 2.5
    assert budget_usd(Loop(name="n")) is None
