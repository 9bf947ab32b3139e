"""A client cannot decide the canary with signed ids (issue 43, item 4), on real Postgres.

On main one genuine signed response id, copied onto any number of made-up traces, vouched
for every one of them; and the window of the newest ``limit`` traces was cut before the
attestation filter, so newer unsigned traces pushed every signed one out of it.
"""

from __future__ import annotations

import datetime as dt
from functools import partial
from typing import Any

from services.db.models import Loop, Trace
from services.db.queries.live import live_counts
from services.db.session import SessionFactory
from services.modelserver.attestation import attested, response_id

KEY = b"k" * 32
T0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def make_loop(session_factory: SessionFactory) -> int:
    with session_factory.begin() as session:
        loop = Loop(name="canary", environment="toolcalc")
        session.add(loop)
        session.flush()
        return loop.id


def add(
    session_factory: SessionFactory, loop_id: int, rows: list[tuple[list[str], bool]], *, at: int
) -> None:
    """Traces claiming version ``v-new``, one second apart from ``at`` seconds past T0."""
    with session_factory.begin() as session:
        for index, (ids, success) in enumerate(rows):
            session.add(
                Trace(
                    loop_id=loop_id,
                    external_id=f"t-{at + index}",
                    model_version="v-new",
                    success=success,
                    body={"response_ids": ids},
                    size_bytes=2,
                    received_at=T0 + dt.timedelta(seconds=at + index),
                )
            )


def counts(session_factory: SessionFactory, loop_id: int, **options: Any) -> tuple[int, int, int]:
    with session_factory() as session:
        loop = session.get_one(Loop, loop_id)
        found = live_counts(
            session=session,
            loop=loop,
            model_version="v-new",
            attested=partial(attested, key=KEY),
            **options,
        )
    return found.n, found.successes, found.unattested


def signed() -> str:
    return response_id("chatcmpl", "v-new", KEY)


def test_one_signed_id_vouches_for_one_trace(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory)
    genuine = signed()
    add(session_factory, loop_id, [([genuine], True)], at=0)
    add(session_factory, loop_id, [([genuine], False)] * 50, at=10)  # copies, all failures
    add(session_factory, loop_id, [([signed(), signed()], True)], at=100)  # two calls, one trace

    assert counts(session_factory, loop_id) == (2, 1, 50)


def test_unsigned_traces_cannot_push_signed_ones_out_of_the_window(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory)
    add(session_factory, loop_id, [([signed()], True) for _ in range(10)], at=0)
    add(session_factory, loop_id, [([], False)] * 150, at=100)  # newer, unsigned
    add(session_factory, loop_id, [(["chatcmpl-made-up"], False)] * 150, at=400)

    assert counts(session_factory, loop_id, limit=200) == (10, 10, 300)
    assert counts(session_factory, loop_id, limit=4) == (4, 4, 300)
