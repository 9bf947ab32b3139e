"""The cycles table (services.db.queries.cycle_history): what the dashboard and the demo's
report read, with the same cost as intelligence per dollar counts, on real Postgres."""

from __future__ import annotations

from services.db.queries.cycle_history import cycle_run_spans, loop_cycles
from services.db.queries.points import intelligence_per_dollar
from services.demo.report import demo_cycles
from tests.services.db.conftest import Seeded


def test_newest_first_with_a_cost_per_cycle_that_points_per_dollar_shares(seeded: Seeded) -> None:
    with seeded.sessions() as session:
        cycles = loop_cycles(session=session, loop_id=seeded.loop_id)
        oldest_first = demo_cycles(session=session, loop_id=seeded.loop_id)
        bought = intelligence_per_dollar(session=session, loop_id=seeded.loop_id)
        spans = cycle_run_spans(session=session, loop_id=seeded.loop_id)
    assert [c.number for c in cycles] == [3, 2, 1]
    assert [c.number for c in oldest_first] == [1, 2, 3]
    open_cycle, *ended = cycles
    assert open_cycle.is_open and open_cycle.cost_usd == open_cycle.runs_cost_usd > 0
    for cycle in ended:
        accounted = bought.of_cycle(cycle.number)
        assert accounted is not None
        assert float(cycle.cost_usd) == accounted.cost_usd
        assert float(cycle.points_gained or 0) == accounted.points
    assert sorted(spans) == [1, 2, 3]
    assert spans[1][0].kind == "train"


def test_a_loop_without_cycles_has_an_empty_table(seeded: Seeded) -> None:
    with seeded.sessions() as session:
        assert loop_cycles(session=session, loop_id=seeded.quiet_loop_id) == []
        assert cycle_run_spans(session=session, loop_id=seeded.quiet_loop_id) == {}
