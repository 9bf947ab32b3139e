"""Migration 0017 converts a populated installation: bodies and span payloads move into their
partitioned tables, a stopped copy resumes where it stopped, purged traces stay purged."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, text

from services.db.migrate import alembic_config, current_heads, downgrade, upgrade
from services.db.queries.otlp_spans import payloads
from services.db.queries.trace_bodies import trace_body
from services.db.session import make_session_factory
from services.settings import to_sqlalchemy_url

NOW = dt.datetime.now(dt.UTC)
PURGED_AT = NOW - dt.timedelta(days=20)


def migration(url: str) -> ModuleType:
    module = ScriptDirectory.from_config(alembic_config(url)).get_revision("0017").module
    assert module is not None
    return module


def populate(engine: Engine) -> dict[str, Any]:
    """At 0016: 9 traces over 40 days (two purged by the old retention) and two spans."""
    with engine.begin() as connection:
        loop_id = connection.execute(
            text("INSERT INTO loops (name, environment) VALUES ('old', 'toolcalc') RETURNING id")
        ).scalar_one()
        traces = {}
        for n in range(9):
            at = NOW - dt.timedelta(days=40 - 5 * n, hours=n)
            purged = n < 2
            body = {} if purged else {"external_id": f"t{n}", "messages": [{"content": f"m{n}"}]}
            traces[f"t{n}"] = connection.execute(
                text(
                    "INSERT INTO traces (loop_id, external_id, body, size_bytes, received_at, "
                    "body_purged_at, curated_at, curation_outcome) VALUES (:loop, :ext, "
                    "CAST(:body AS jsonb), 10, :at, :purged, :purged, :outcome) RETURNING id"
                ),
                {
                    "loop": loop_id,
                    "ext": f"t{n}",
                    "body": json.dumps(body),
                    "at": at,
                    "purged": PURGED_AT if purged else None,
                    "outcome": "purged" if purged else None,
                },
            ).scalar_one()
        spans = {
            payload: connection.execute(
                text(
                    "INSERT INTO otlp_spans (loop_id, trace_id, record_id, span_id, kind, "
                    "payload) VALUES (:loop, 'abc', :record, 's1', 'genai', :payload) "
                    "RETURNING id"
                ),
                {"loop": loop_id, "record": f"r-{payload}", "payload": payload},
            ).scalar_one()
            for payload in ("p1", "p2")
        }
    return {"loop_id": loop_id, "traces": traces, "spans": spans}


def assert_converted(engine: Engine, seeded: dict[str, Any]) -> None:
    sessions = make_session_factory(engine)
    with sessions() as session:
        for n in range(9):
            body, purged_at = trace_body(session=session, trace_id=seeded["traces"][f"t{n}"])
            if n < 2:
                assert body is None and purged_at == PURGED_AT  # purged before: still purged
            else:
                assert body == {"external_id": f"t{n}", "messages": [{"content": f"m{n}"}]}
                assert purged_at is None
        assert payloads(session=session, row_ids=seeded["spans"].values()) == {
            row_id: payload for payload, row_id in seeded["spans"].items()
        }
        count = session.execute(text("SELECT count(*) FROM trace_bodies")).scalar_one()
        assert count == 7  # each body once, even after a resumed copy
        in_default = session.execute(text("SELECT count(*) FROM trace_bodies_default")).scalar_one()
        assert in_default == 0  # every period holding a body got its partition
        columns = {
            name
            for (name,) in session.execute(
                text(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_name IN ('traces', 'otlp_spans')"
                )
            )
        }
        assert not {"body", "body_purged_at", "payload"} & columns


def test_a_populated_database_is_converted(make_database: Callable[[], str]) -> None:
    url = make_database()
    downgrade(url, "0016")
    engine = create_engine(to_sqlalchemy_url(url))
    seeded = populate(engine)
    upgrade(url)
    assert current_heads(url) == ["0017"]
    assert_converted(engine, seeded)
    downgrade(url, "0016")  # and back: bodies return to their rows
    with engine.connect() as connection:
        bodies = dict(connection.execute(text("SELECT external_id, body FROM traces")).all())
    assert bodies["t5"] == {"external_id": "t5", "messages": [{"content": "m5"}]}
    assert bodies["t0"] == {}
    upgrade(url)
    engine.dispose()


def test_a_stopped_copy_resumes_where_it_stopped(make_database: Callable[[], str]) -> None:
    url = make_database()
    downgrade(url, "0016")
    engine = create_engine(to_sqlalchemy_url(url))
    seeded = populate(engine)
    module = migration(url)
    # A first run that stops after two batches of 3 ids (a crash, a timeout, an operator).
    with engine.begin() as connection:
        module.prepare(connection)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        module.copy_batches(connection, 3, max_batches=2)
    with engine.connect() as connection:
        copied = connection.execute(text("SELECT count(*) FROM trace_bodies")).scalar_one()
        cursor = connection.execute(text("SELECT cursor FROM trace_bodies_copy")).scalar_one()
    assert sorted(seeded["traces"].values())[:6] == [1, 2, 3, 4, 5, 6]
    assert copied == 4 and cursor == 6  # ids 1-6, of which 1 and 2 were purged
    assert current_heads(url) == ["0016"]
    # A trace written by the old version meanwhile is caught up by the final step.
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO traces (loop_id, external_id, body, size_bytes) "
                "VALUES (:loop, 'late', '{\"late\": true}', 10)"
            ),
            {"loop": seeded["loop_id"]},
        )
    upgrade(url)  # runs every step again: the prepared ones are no-ops, the copy resumes
    assert current_heads(url) == ["0017"]
    with engine.connect() as connection:
        late = connection.execute(
            text(
                "SELECT b.body FROM trace_bodies AS b JOIN traces AS t "
                "ON t.id = b.trace_id AND t.received_at = b.received_at "
                "WHERE t.external_id = 'late'"
            )
        ).scalar_one()
        copy_table = connection.execute(text("SELECT to_regclass('trace_bodies_copy')")).scalar()
    assert late == {"late": True} and copy_table is None
    with engine.begin() as connection:  # its body goes with it
        connection.execute(text("DELETE FROM traces WHERE external_id = 'late'"))
    assert_converted(engine, seeded)
    engine.dispose()
