"""The demo's report reads live success from Postgres through the canary's own query."""

from __future__ import annotations

import datetime as dt

from services.db.models import Checkpoint, Loop, Promotion, Trace
from services.db.session import SessionFactory
from services.demo.run import DemoOptions, champion_note, live_before_after

T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.UTC)


def _seed(session_factory: SessionFactory) -> tuple[int, int]:
    with session_factory.begin() as session:
        loop = Loop(name="demo", environment="toolcalc")
        session.add(loop)
        session.flush()
        for name in ("old", "new"):
            session.add(
                Checkpoint(
                    id=name,
                    loop_id=loop.id,
                    uri=f"file:///{name}",
                    format="ratchet.tiny/v1",
                    size_bytes=1,
                    sha256="0" * 64,
                    manifest={},
                )
            )
        session.flush()
        # Before the drift (minute 0-9): the old model does well and is not counted.
        # After it (10-19): the old model fails 3 in 4. After the deploy (20-): 9 in 10 pass.
        outcomes = [("old", m, True) for m in range(10)]
        outcomes += [("old", 10 + m, m % 4 == 0) for m in range(8)]
        outcomes += [("new", 20 + m, m != 0) for m in range(10)]
        for index, (version, minute, success) in enumerate(outcomes):
            session.add(
                Trace(
                    loop_id=loop.id,
                    external_id=f"t{index}",
                    model_version=version,
                    success=success,
                    body={},
                    size_bytes=2,
                    received_at=T0 + dt.timedelta(minutes=minute),
                )
            )
        promotion = Promotion(
            loop_id=loop.id,
            decision="promote",
            status="held",
            reason="win",
            candidate_checkpoint_id="new",
            previous_checkpoint_id="old",
            deployed_at=T0 + dt.timedelta(minutes=20),
        )
        session.add(promotion)
        session.flush()
        return loop.id, promotion.id


def test_live_success_before_and_after_come_from_the_stored_traces(
    session_factory: SessionFactory,
) -> None:
    loop_id, promotion_id = _seed(session_factory)
    with session_factory() as session:
        loop = session.get(Loop, loop_id)
        promotion = session.get(Promotion, promotion_id)
        assert loop is not None and promotion is not None
        measured = live_before_after(session, loop, [promotion], T0 + dt.timedelta(minutes=10))
        assert measured.before == 2 / 8
        assert measured.after == 9 / 10
        # Without a drift there is no "before" to speak of.
        assert live_before_after(session, loop, [promotion], None).before is None


def test_every_report_says_how_the_toy_champion_was_made() -> None:
    assert "pre-exposed to v2's names: 30%" in champion_note(DemoOptions())
    plain = DemoOptions(sft_hyperparameters={"steps": 10})
    assert "not exposed to v2's names" in champion_note(plain)
