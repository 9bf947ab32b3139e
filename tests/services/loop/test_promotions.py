"""The promotion rows of an operator's action (services.loop.promotions), stored in Postgres."""

from __future__ import annotations

import datetime as dt

from services.db.models import Checkpoint, Loop, Promotion
from services.db.session import SessionFactory
from services.loop.promotions import rollback_promotion

NOW = dt.datetime(2026, 12, 2, 9, 0, tzinfo=dt.UTC)


def test_rollback_rows_done_and_failed(session_factory: SessionFactory) -> None:
    with session_factory.begin() as session:
        loop = Loop(name="rb", environment="toolcalc", serving_target={"kind": "none"})
        session.add(loop)
        session.flush()
        for checkpoint_id in ("old", "new"):
            session.add(
                Checkpoint(
                    id=checkpoint_id,
                    loop_id=loop.id,
                    uri=f"file:///{checkpoint_id}",
                    format="safetensors",
                    size_bytes=0,
                    sha256="0" * 64,
                    manifest={},
                )
            )
        session.flush()
        done = rollback_promotion(
            loop,
            from_checkpoint_id="new",
            to_checkpoint_id="old",
            reason="r",
            failed=False,
            now=NOW,
        )
        failed = rollback_promotion(
            loop, from_checkpoint_id="new", to_checkpoint_id="old", reason="f", failed=True, now=NOW
        )
        session.add_all([done, failed])
    with session_factory.begin() as session:
        rows = session.query(Promotion).order_by(Promotion.id).all()
        assert [
            (r.decision, r.status, r.decided_by, r.cycle_id, r.rolled_back_at) for r in rows
        ] == [
            ("rollback", "rolled_back", "operator", None, NOW),
            ("rollback", "failed", "operator", None, None),
        ]
        assert all(
            (r.candidate_checkpoint_id, r.previous_checkpoint_id) == ("old", "new") for r in rows
        )
        assert all(r.serving_target == {"kind": "none"} for r in rows)
