"""The loop's promotions as every reader reads them (services.db.queries.promotions)."""

from __future__ import annotations

from services.db.queries.promotions import loop_promotions
from tests.services.db.conftest import Seeded


def test_promotions_oldest_first_with_their_cycle(seeded: Seeded) -> None:
    with seeded.sessions() as session:
        rows = loop_promotions(session=session, loop_id=seeded.loop_id)
        held = loop_promotions(session=session, loop_id=seeded.loop_id, held_by_cycles=True)
        quiet = loop_promotions(session=session, loop_id=seeded.quiet_loop_id)
    assert [r.decided_at for r in rows] == sorted(r.decided_at for r in rows)
    by_cycle = {r.cycle_number: r for r in rows}
    rolled_back, holding = by_cycle[1], by_cycle[2]
    assert rolled_back.promoted and rolled_back.rolled_back
    assert rolled_back.candidate_checkpoint_id == seeded.story.rolled_back_checkpoint
    assert holding.promoted and not holding.rolled_back
    assert holding.candidate_checkpoint_id == seeded.story.champion_checkpoint
    # Only the cycles' promotions that held after their canary.
    assert [r.cycle_number for r in held] == [2]
    assert all(r.status == "held" and r.cycle_number is not None for r in held)
    assert quiet == []
