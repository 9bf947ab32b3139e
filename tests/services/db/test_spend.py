"""A loop's spend (services.db.queries.spend), on real Postgres."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import func, select

from services.db.models import Run
from services.db.queries.loop_overview import loops_overview
from services.db.queries.spend import loop_spend, spend_by_loop
from tests.services.db.conftest import Seeded


def test_one_spend_for_the_loop_page_the_overview_and_the_budget(seeded: Seeded) -> None:
    with seeded.sessions() as session:
        one = loop_spend(session=session, loop_id=seeded.loop_id)
        every = spend_by_loop(session=session)
        overview = {s.name: s.spend_usd for s in loops_overview(session=session)}
        runs = session.execute(
            select(func.sum(Run.cost_usd), func.sum(Run.compute_seconds)).where(
                Run.loop_id == seeded.loop_id
            )
        ).one()
    assert one.cost_usd == Decimal("3.80") == runs[0]
    assert one.compute_seconds == runs[1]
    assert every[seeded.loop_id] == one
    assert overview[seeded.story.loop] == one.cost_usd


def test_a_loop_that_ran_nothing_spent_nothing(seeded: Seeded) -> None:
    with seeded.sessions() as session:
        quiet = loop_spend(session=session, loop_id=seeded.quiet_loop_id)
        every = spend_by_loop(session=session)
        overview = {s.name: s.spend_usd for s in loops_overview(session=session)}
    assert (quiet.cost_usd, quiet.compute_seconds) == (0, 0.0)
    assert seeded.quiet_loop_id not in every
    assert overview[seeded.story.quiet_loop] == 0
