"""The group-commit writer against a real Postgres: grouping, duplicates, bad rows, shutdown."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from sqlalchemy import Engine, text, update

from services.db.models import Trace
from services.db.partitions import TRACE_BODIES, ensure_partitions, partitions, period_start
from services.db.queries.loops import LoopFields, trace_stats
from services.db.queries.trace_bodies import trace_body
from services.db.session import SessionFactory
from services.ingest.provisioning import provision_loop
from services.ingest.schema import validate_trace
from services.ingest.service import conninfo_from_engine
from services.ingest.writer import GroupCommitWriter, StorageUnavailable, TraceRow
from services.metrics import REGISTRY
from services.secrets import SecretBox
from tests.services.api.support import SECRET_KEY, make_trace


@pytest.fixture
def loop_id(session_factory: SessionFactory) -> int:
    with session_factory.begin() as session:
        return provision_loop(
            session,
            fields=LoopFields(name="w", environment="toolcalc"),
            box=SecretBox.from_keys(SECRET_KEY),
        ).loop.id


def row(loop_id: int, external_id: str) -> TraceRow:
    return TraceRow(loop_id, "webhook", validate_trace(make_trace(external_id)))


def writer_for(engine: Engine, **overrides: float) -> GroupCommitWriter:
    options = {"queue_max": 10_000, "max_rows": 1_000, "max_wait_s": 0.002, **overrides}
    return GroupCommitWriter(
        conninfo_from_engine(engine),
        queue_max=int(options["queue_max"]),
        max_rows=int(options["max_rows"]),
        max_wait_s=options["max_wait_s"],
    )


@asynccontextmanager
async def running_writer(engine: Engine, **overrides: float) -> AsyncIterator[GroupCommitWriter]:
    """A started writer, stopped (what is queued written) when the block ends."""
    writer = writer_for(engine, **overrides)
    await writer.start()
    try:
        yield writer
    finally:
        await writer.stop()


def commits() -> float:
    return REGISTRY.get_sample_value("ratchet_ingest_commit_rows_count") or 0.0


async def test_concurrent_writes_share_commits(
    engine: Engine, session_factory: SessionFactory, loop_id: int
) -> None:
    before = commits()
    async with running_writer(engine) as writer:
        writes = (writer.write([row(loop_id, f"t{i}")]) for i in range(300))
        results = await asyncio.gather(*writes)

    assert all(r[0].status == "accepted" and r[0].trace_id for r in results)
    assert commits() - before < 300 / 5  # many traces per transaction
    with session_factory() as session:
        assert trace_stats(session=session, loop_id=loop_id).count == 300


async def test_duplicates_in_and_across_groups(
    engine: Engine, session_factory: SessionFactory, loop_id: int
) -> None:
    async with running_writer(engine) as writer:
        first = await writer.write([row(loop_id, "a"), row(loop_id, "b"), row(loop_id, "a")])
        second = await writer.write([row(loop_id, "b"), row(loop_id, "c")])

    assert [o.status for o in first] == ["accepted", "accepted", "duplicate"]
    assert [o.status for o in second] == ["duplicate", "accepted"]
    # A duplicate names the row it repeats, in its own group or an earlier one.
    a, b = first[0].trace_id, first[1].trace_id
    assert a is not None and b is not None and a != b
    assert (first[2].trace_id, second[0].trace_id) == (a, b)
    with session_factory() as session:
        assert trace_stats(session=session, loop_id=loop_id).count == 3


async def test_a_row_postgres_refuses_is_rejected_alone(
    engine: Engine, session_factory: SessionFactory, loop_id: int
) -> None:
    missing_loop = loop_id + 1000  # a foreign-key violation the validator cannot foresee
    async with running_writer(engine) as writer:
        outcomes = await writer.write(
            [row(loop_id, "ok-1"), row(missing_loop, "orphan"), row(loop_id, "ok-2")]
        )

    assert [o.status for o in outcomes] == ["accepted", "rejected", "accepted"]
    assert outcomes[1].reason is not None and "refused" in outcomes[1].reason
    with session_factory() as session:
        assert trace_stats(session=session, loop_id=loop_id).count == 2


async def test_the_row_by_row_path_names_the_row_a_duplicate_repeats(
    engine: Engine, loop_id: int
) -> None:
    missing_loop = loop_id + 1000  # forces the row-by-row path for the whole group
    async with running_writer(engine) as writer:
        [stored] = await writer.write([row(loop_id, "kept")])
        outcomes = await writer.write(
            [row(loop_id, "kept"), row(missing_loop, "orphan"), row(loop_id, "kept")]
        )

    assert [o.status for o in outcomes] == ["duplicate", "rejected", "duplicate"]
    assert stored.trace_id is not None
    assert [o.trace_id for o in outcomes] == [stored.trace_id, None, stored.trace_id]


async def test_stop_writes_what_is_queued_then_refuses(
    engine: Engine, session_factory: SessionFactory, loop_id: int
) -> None:
    async with running_writer(engine, max_wait_s=0.05) as writer:
        pending = [asyncio.create_task(writer.write([row(loop_id, f"q{i}")])) for i in range(20)]
        await asyncio.sleep(0)
    assert all(task.result()[0].status == "accepted" for task in pending)
    with pytest.raises(StorageUnavailable):
        await writer.write([row(loop_id, "late")])
    with session_factory() as session:
        assert trace_stats(session=session, loop_id=loop_id).count == 20


async def test_an_unreachable_database_refuses_without_acknowledging(loop_id: int) -> None:
    writer = GroupCommitWriter(
        "postgresql://nobody@127.0.0.1:1/none", queue_max=10, max_rows=10, max_wait_s=0
    )
    await writer.start()
    with pytest.raises(StorageUnavailable) as caught:
        await writer.write([row(loop_id, "x")])
    assert caught.value.retry_after_s == 1
    # While it is known to be down, requests are refused at once, without queueing.
    with pytest.raises(StorageUnavailable, match="unreachable"):
        await writer.write([row(loop_id, "y")])
    assert writer.depth == 0
    await writer.stop()


async def test_a_full_queue_refuses_the_whole_request(engine: Engine, loop_id: int) -> None:
    async with running_writer(engine, queue_max=2) as writer:
        with pytest.raises(StorageUnavailable, match="queue is full"):
            await writer.write([row(loop_id, f"r{i}") for i in range(3)])
        outcomes = await writer.write([row(loop_id, "s1"), row(loop_id, "s2")])
    assert [o.status for o in outcomes] == ["accepted", "accepted"]


async def test_an_error_a_retry_cannot_fix_is_not_a_503(
    engine: Engine, session_factory: SessionFactory, loop_id: int
) -> None:
    """A missing table (say, migrations not run) refuses the write for good: StorageRefused
    (500, no Retry-After), not StorageUnavailable, which tells senders to retry for ever."""
    from sqlalchemy import text

    from services.ingest.writer import StorageRefused

    with engine.begin() as connection:
        connection.execute(text("ALTER TABLE traces RENAME TO traces_elsewhere"))
    try:
        async with running_writer(engine) as writer:
            with pytest.raises(StorageRefused) as caught:
                await writer.write([row(loop_id, "x")])
    finally:
        with engine.begin() as connection:
            connection.execute(text("ALTER TABLE traces_elsewhere RENAME TO traces"))
    assert caught.value.status_code == 500 and not caught.value.headers


def test_transient_postgres_errors_are_retryable() -> None:
    import psycopg
    from psycopg import errors as pg_errors

    from services.ingest.writer import retryable

    assert retryable(pg_errors.SerializationFailure())
    assert retryable(pg_errors.DeadlockDetected())
    assert retryable(pg_errors.LockNotAvailable())
    assert retryable(pg_errors.AdminShutdown())
    assert not retryable(pg_errors.UndefinedTable())
    assert not retryable(pg_errors.InsufficientPrivilege())
    assert not retryable(psycopg.ProgrammingError())


def _drop_todays_partition(session_factory: SessionFactory) -> dt.datetime:
    """The partition of today goes (as if the schedule had not made it); its start."""
    today = period_start(dt.datetime.now(dt.UTC), "daily")
    with session_factory.begin() as session:
        for part in partitions(session=session, table=TRACE_BODIES):
            if part.lower <= dt.datetime.now(dt.UTC) < part.upper:
                session.execute(text(f"ALTER TABLE trace_bodies DETACH PARTITION {part.name}"))
                session.execute(text(f"DROP TABLE {part.name}"))
    return today


def _partition_of(session_factory: SessionFactory, trace_id: int) -> str:
    with session_factory() as session:
        return str(
            session.execute(
                text("SELECT tableoid::regclass::text FROM trace_bodies WHERE trace_id = :id"),
                {"id": trace_id},
            ).scalar_one()
        )


async def test_a_period_with_no_partition_lands_in_the_default_one_until_it_is_made(
    engine: Engine, session_factory: SessionFactory, loop_id: int
) -> None:
    today = _drop_todays_partition(session_factory)
    async with running_writer(engine) as writer:
        [stored] = await writer.write([row(loop_id, "no-partition")])
    assert stored.status == "accepted" and stored.trace_id is not None
    assert _partition_of(session_factory, stored.trace_id) == TRACE_BODIES.default_partition
    with session_factory.begin() as session:
        made = ensure_partitions(
            session=session, table=TRACE_BODIES, now=today, period="daily", ahead=0
        )
    assert made == [TRACE_BODIES.partition_name(today)]
    assert _partition_of(session_factory, stored.trace_id) == made[0]
    with session_factory() as session:
        body, purged_at = trace_body(session=session, trace_id=stored.trace_id)
    assert body is not None and body["external_id"] == "no-partition" and purged_at is None


async def test_a_repost_is_a_duplicate_whatever_period_the_first_one_is_in(
    engine: Engine, session_factory: SessionFactory, loop_id: int
) -> None:
    async with running_writer(engine) as writer:
        [first] = await writer.write([row(loop_id, "once")])
        with session_factory.begin() as session:  # the first is now in another period
            session.execute(
                update(Trace)
                .where(Trace.id == first.trace_id)
                .values(received_at=dt.datetime.now(dt.UTC) - dt.timedelta(days=20))
            )
        again = await writer.write([row(loop_id, "once"), row(loop_id, "twice")])
    assert [o.status for o in again] == ["duplicate", "accepted"]
    assert again[0].trace_id == first.trace_id
    with session_factory() as session:
        assert trace_stats(session=session, loop_id=loop_id).count == 2
        count = session.execute(text("SELECT count(*) FROM trace_bodies")).scalar_one()
    assert count == 2
