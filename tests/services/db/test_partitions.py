"""Trace bodies partitioned by time (services.db.partitions) on a real Postgres: pruning,
retirement by partition, the default partition, partitions made ahead, the maintenance lock."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Executable, select, text, update
from sqlalchemy.orm import Session

from services.db.models import Trace, TraceBody
from services.db.partitions import (
    OTLP_SPAN_PAYLOADS,
    TRACE_BODIES,
    Partition,
    create_partition,
    detached_partitions,
    ensure_partitions,
    lock_table_maintenance,
    missing_ranges,
    partitions,
    period_end,
    period_start,
    wanted_ranges,
)
from services.db.queries.retention import (
    drop_retired,
    make_partitions_ahead,
    retire_trace_bodies,
)
from services.db.queries.trace_bodies import trace_body
from services.db.queries.trace_inserts import insert_trace
from services.db.queries.traces import (
    TraceFilter,
    listing_query,
    lock_uncurated_traces,
)
from services.db.session import SessionFactory
from tests.services.curation.support import add_traces, make_loop
from tests.services.curation.support import trace_body as body_of

UTC = dt.UTC
NOW = dt.datetime.now(UTC)
TODAY = period_start(NOW, "daily")


def day(offset: int) -> dt.datetime:
    return TODAY + dt.timedelta(days=offset)


def make_days(session_factory: SessionFactory, offsets: range) -> None:
    with session_factory.begin() as session:
        existing = partitions(session=session, table=TRACE_BODIES)
        wanted = [(day(o), day(o + 1)) for o in offsets]
        for lower, upper in missing_ranges(wanted, existing):
            create_partition(session=session, table=TRACE_BODIES, lower=lower, upper=upper)


def traces_at(session_factory: SessionFactory, loop_id: int, at: dt.datetime, n: int) -> list[int]:
    prefix = at.strftime("%Y%m%d%H%M%S")
    ids = add_traces(
        session_factory, loop_id, [body_of(f"{prefix}-{i}", "Where is my order?") for i in range(n)]
    )
    with session_factory.begin() as session:
        session.execute(update(Trace).where(Trace.id.in_(ids)).values(received_at=at))
    return ids


def partition_of(session: Session, trace_id: int) -> str:
    return str(
        session.execute(
            text("SELECT tableoid::regclass::text FROM trace_bodies WHERE trace_id = :id"),
            {"id": trace_id},
        ).scalar_one()
    )


def explain(session: Session, statement: Executable) -> str:
    """Postgres's plan of ``statement`` with its parameters' values (as the driver sends
    them, so the planner prunes as it does for the real query)."""
    connection = session.connection()
    compiled = statement.compile(connection)
    cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
    cursor.execute(f"EXPLAIN {compiled.string}", compiled.params)
    return "\n".join(row[0] for row in cursor.fetchall())


def test_the_listing_reads_only_the_partitions_of_its_time_range(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory)
    make_days(session_factory, range(-6, 1))
    for offset in range(-6, 1):
        traces_at(session_factory, loop_id, day(offset) + dt.timedelta(hours=1), 3)
    window = TraceFilter(since=day(-2), until=day(-1))
    with session_factory() as session:
        plan = explain(
            session, listing_query(loop_id=loop_id, filters=window, after=None, limit=50)
        )
        unbounded = explain(
            session, listing_query(loop_id=loop_id, filters=TraceFilter(), after=None, limit=50)
        )
    inside = TRACE_BODIES.partition_name(day(-2))
    assert inside in plan
    for offset in (-6, -5, -4, -3, -1, 0):
        assert TRACE_BODIES.partition_name(day(offset)) not in plan, plan
    assert TRACE_BODIES.partition_name(day(-5)) in unbounded  # no range: every partition


def test_retiring_a_day_detaches_its_partition_then_a_second_transaction_drops_it(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory)
    old_day = day(-40)
    make_days(session_factory, range(-40, -38))
    old = traces_at(session_factory, loop_id, old_day + dt.timedelta(hours=3), 500)
    kept = traces_at(session_factory, loop_id, day(-39) + dt.timedelta(hours=3), 5)
    gone = TRACE_BODIES.partition_name(old_day)
    with session_factory.begin() as session:
        session.execute(text(f"ANALYZE {gone}"))
    with session_factory.begin() as session:
        retired = retire_trace_bodies(session=session, received_before=day(-39), now=NOW)
    assert retired is not None
    assert [(r.name, r.rows) for r in retired] == [(gone, 500)]
    with session_factory() as session:
        assert detached_partitions(session=session, table=TRACE_BODIES) == [gone]
    with session_factory.begin() as session:
        assert drop_retired(session=session, table=TRACE_BODIES) == [gone]
    with session_factory() as session:
        names = {p.name for p in partitions(session=session, table=TRACE_BODIES)}
        assert gone not in names
        assert detached_partitions(session=session, table=TRACE_BODIES) == []
        assert session.execute(text("SELECT to_regclass(:n)"), {"n": gone}).scalar() is None
        assert session.scalar(select(Trace.id).where(Trace.id == old[0])) == old[0]  # row stays
        body, purged_at = trace_body(session=session, trace_id=old[0])
        assert body is None and purged_at == NOW
        assert trace_body(session=session, trace_id=kept[0])[0] is not None
        # Curation reads a purged trace as one with no body (and records it as purged).
        rows = lock_uncurated_traces(session=session, loop_id=loop_id, limit=1000)
        bodies = {row.id: row.body_json for row in rows}
        assert bodies[old[0]] is None and bodies[kept[0]] is not None


def test_a_body_with_no_partition_waits_in_the_default_one_then_moves(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory)
    far = day(300) + dt.timedelta(hours=5)  # beyond every partition made ahead
    (trace_id,) = traces_at(session_factory, loop_id, far, 1)
    with session_factory.begin() as session:
        assert partition_of(session, trace_id) == TRACE_BODIES.default_partition
        made = ensure_partitions(
            session=session, table=TRACE_BODIES, now=far, period="daily", ahead=1
        )
    assert made == [TRACE_BODIES.partition_name(day(300)), TRACE_BODIES.partition_name(day(301))]
    with session_factory() as session:
        assert partition_of(session, trace_id) == TRACE_BODIES.partition_name(day(300))
        body, purged_at = trace_body(session=session, trace_id=trace_id)
        assert body is not None and body["external_id"].endswith("-0") and purged_at is None
        count = session.execute(text("SELECT count(*) FROM trace_bodies_default")).scalar_one()
        assert count == 0


def test_old_rows_in_the_default_partition_are_deleted_by_retention(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory)
    (old,) = traces_at(session_factory, loop_id, day(-500), 1)
    (recent,) = traces_at(session_factory, loop_id, day(-200), 1)  # in the default one too
    with session_factory.begin() as session:
        retired = retire_trace_bodies(session=session, received_before=day(-400), now=NOW)
    assert retired is not None
    assert [(r.name, r.rows) for r in retired] == [(TRACE_BODIES.default_partition, 1)]
    with session_factory() as session:
        assert trace_body(session=session, trace_id=old) == (None, NOW)
        assert trace_body(session=session, trace_id=recent)[0] is not None


def test_partitions_are_made_ahead_for_both_tables_and_idempotently(
    session_factory: SessionFactory,
) -> None:
    later = NOW + dt.timedelta(days=100)
    with session_factory.begin() as session:
        made = make_partitions_ahead(session=session, now=later, period="weekly", ahead=2)
    assert made is not None and len(made) == 6  # this week and two more, of each table
    with session_factory.begin() as session:
        again = make_partitions_ahead(session=session, now=later, period="weekly", ahead=2)
        weeks = [
            p for p in partitions(session=session, table=OTLP_SPAN_PAYLOADS) if p.lower >= later
        ]
    assert again == []
    week = period_start(later, "weekly")
    assert week.weekday() == 0
    assert [(p.upper - p.lower) for p in weeks] == [dt.timedelta(days=7)] * 2


def test_a_second_worker_leaves_maintenance_to_the_one_holding_the_lock(
    session_factory: SessionFactory,
) -> None:
    with session_factory.begin() as first:
        assert lock_table_maintenance(session=first, table=TRACE_BODIES)
        with session_factory.begin() as second:
            assert not lock_table_maintenance(session=second, table=TRACE_BODIES)
            assert make_partitions_ahead(session=second, now=NOW, period="daily", ahead=1) is None
            assert retire_trace_bodies(session=second, received_before=NOW, now=NOW) is None
    with session_factory.begin() as third:  # released with the first's transaction
        assert lock_table_maintenance(session=third, table=TRACE_BODIES)


def test_the_ranges_wanted_and_missing_when_the_period_changes() -> None:
    monday = period_start(dt.datetime(2026, 12, 9, 15, tzinfo=UTC), "weekly")
    assert monday == dt.datetime(2026, 12, 7, tzinfo=UTC)
    assert period_end(monday, "weekly") == dt.datetime(2026, 12, 14, tzinfo=UTC)
    assert wanted_ranges(monday, "daily", 1) == [
        (monday, monday + dt.timedelta(days=1)),
        (monday + dt.timedelta(days=1), monday + dt.timedelta(days=2)),
    ]
    # Daily partitions up to Wednesday, then weekly: the week is made from Wednesday on.
    days = [
        Partition("d", monday + dt.timedelta(days=i), monday + dt.timedelta(days=i + 1))
        for i in range(2)
    ]
    assert missing_ranges(wanted_ranges(monday, "weekly", 0), days) == [
        (monday + dt.timedelta(days=2), monday + dt.timedelta(days=7))
    ]


def test_a_body_moves_with_its_trace_and_goes_with_it(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory)
    make_days(session_factory, range(-3, 1))
    (trace_id,) = traces_at(session_factory, loop_id, day(-3) + dt.timedelta(hours=2), 1)
    with session_factory() as session:
        assert partition_of(session, trace_id) == TRACE_BODIES.partition_name(day(-3))
    with session_factory.begin() as session:
        session.execute(update(Trace).where(Trace.id == trace_id).values(received_at=day(-1)))
    with session_factory() as session:
        assert partition_of(session, trace_id) == TRACE_BODIES.partition_name(day(-1))
    with session_factory.begin() as session:
        session.execute(text("DELETE FROM traces WHERE id = :id"), {"id": trace_id})
    with session_factory() as session:
        assert session.scalars(select(TraceBody).where(TraceBody.trace_id == trace_id)).all() == []


def test_one_trace_stored_through_a_session_gets_its_body_once(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory)
    values = {"external_id": "gw-1", "size_bytes": 12, "body": {"external_id": "gw-1"}}
    with session_factory.begin() as session:
        first = insert_trace(session=session, loop_id=loop_id, source="gateway", values=values)
    with session_factory.begin() as session:  # a close retried after a lost commit
        again = insert_trace(session=session, loop_id=loop_id, source="gateway", values=values)
    assert again == first
    with session_factory() as session:
        assert trace_body(session=session, trace_id=first) == ({"external_id": "gw-1"}, None)
        count = session.execute(text("SELECT count(*) FROM trace_bodies")).scalar_one()
    assert count == 1


def test_ingest_and_listings_never_wait_for_the_drop_of_a_retired_day(
    session_factory: SessionFactory,
) -> None:
    """The drop (its time grows with the day's bytes) locks only the detached table."""
    loop_id = make_loop(session_factory)
    make_days(session_factory, range(-41, 1))
    traces_at(session_factory, loop_id, day(-41) + dt.timedelta(hours=1), 20)
    with session_factory.begin() as session:
        assert retire_trace_bodies(session=session, received_before=day(-40), now=NOW)
    with session_factory.begin() as dropping:
        assert drop_retired(session=dropping, table=TRACE_BODIES) == [
            TRACE_BODIES.partition_name(day(-41))
        ]
        # The drop's transaction is open and holds its lock: a body goes in, a listing reads
        # (a lock wait would fail them after 2 s instead of hanging the test).
        values = {"external_id": "during-drop", "size_bytes": 2, "body": {"a": 1}}
        with session_factory.begin() as other:
            other.execute(text("SET LOCAL lock_timeout = '2s'"))
            new = insert_trace(session=other, loop_id=loop_id, source="webhook", values=values)
            listed = other.execute(
                listing_query(loop_id=loop_id, filters=TraceFilter(), after=None, limit=50)
            ).all()
            assert [row[0] for row in listed][:1] == [new] and len(listed) == 21
            assert partition_of(other, new) == TRACE_BODIES.partition_name(TODAY)


def test_a_day_a_crash_left_detached_is_dropped_by_the_next_run(
    session_factory: SessionFactory,
) -> None:
    make_days(session_factory, range(-50, -47))
    with session_factory.begin() as session:  # detached and committed; the drop never ran
        assert retire_trace_bodies(session=session, received_before=day(-49), now=NOW)
    with session_factory.begin() as session:  # the next run retires the next day ...
        assert retire_trace_bodies(session=session, received_before=day(-48), now=NOW)
    with session_factory.begin() as session:  # ... and drops both
        dropped = drop_retired(session=session, table=TRACE_BODIES)
    assert dropped == [TRACE_BODIES.partition_name(day(-50)), TRACE_BODIES.partition_name(day(-49))]
    with session_factory() as session:
        attached = {p.name for p in partitions(session=session, table=TRACE_BODIES)}
        assert TRACE_BODIES.partition_name(day(-48)) in attached
        assert TRACE_BODIES.default_partition not in detached_partitions(
            session=session, table=TRACE_BODIES
        )
    with session_factory.begin() as session:
        assert drop_retired(session=session, table=TRACE_BODIES) == []  # idempotent


def test_a_worker_leaves_the_drop_to_the_one_holding_the_lock(
    session_factory: SessionFactory,
) -> None:
    with session_factory.begin() as first:
        assert lock_table_maintenance(session=first, table=TRACE_BODIES)
        with session_factory.begin() as second:
            assert drop_retired(session=second, table=TRACE_BODIES) is None
