"""Retention: partitions are made ahead, and raw trace bodies past
RATCHET_TRACE_RETENTION_DAYS go with their partition, durably."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt

from sqlalchemy import select, update
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.worker import Replayer, Worker

from services.db.models import Trace
from services.db.partitions import (
    TRACE_BODIES,
    create_partition,
    detached_partitions,
    partitions,
    period_end,
    period_start,
)
from services.db.queries.trace_bodies import trace_purge_state
from services.db.session import SessionFactory
from services.settings import Settings
from tests.services.curation.support import add_traces, make_loop, trace_body
from workflows.activities.retention import RetentionActivities
from workflows.payloads.retention import RETENTION_SCHEDULE_ID, RetentionInput
from workflows.retention import RetentionWorkflow
from workflows.schedules import ensure_retention_schedule, retention_input


def seed_old_and_new(session_factory: SessionFactory) -> tuple[list[int], list[int]]:
    """Five traces 40 days old (two in a partition of their own day, three in the default
    partition, whose day has none) and three new ones."""
    loop_id = make_loop(session_factory)
    old = add_traces(session_factory, loop_id, [trace_body(f"old-{n}", "2+2?") for n in range(5)])
    new = add_traces(session_factory, loop_id, [trace_body(f"new-{n}", "3+3?") for n in range(3)])
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=40)
    day = period_start(long_ago, "daily")
    with session_factory.begin() as session:
        create_partition(
            session=session, table=TRACE_BODIES, lower=day, upper=period_end(day, "daily")
        )
        session.execute(update(Trace).where(Trace.id.in_(old)).values(received_at=long_ago))
        session.execute(
            update(Trace)
            .where(Trace.id.in_(old[3:]))
            .values(received_at=day - dt.timedelta(days=2))
        )
        # One old trace was curated already: its outcome must stay what curation said.
        session.execute(
            update(Trace)
            .where(Trace.id == old[0])
            .values(curated_at=long_ago, curation_outcome="task")
        )
    return old, new


async def test_the_workflow_makes_partitions_drops_old_bodies_keeps_rows_and_replays(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory
) -> None:
    old, new = seed_old_and_new(session_factory)
    activities = RetentionActivities(session_factory)
    async with Worker(
        temporal_client,
        task_queue=task_queue,
        workflows=[RetentionWorkflow],
        activities=[activities.maintain_partitions, activities.purge_trace_bodies],
        activity_executor=concurrent.futures.ThreadPoolExecutor(2),
    ):
        handle = await temporal_client.start_workflow(
            RetentionWorkflow.run,
            RetentionInput(retention_days=30, ahead=6),
            id=f"retention/{task_queue}",
            task_queue=task_queue,
        )
        result = await handle.result()
        again = await temporal_client.execute_workflow(
            RetentionWorkflow.run,
            RetentionInput(retention_days=30, ahead=6),
            id=f"retention/{task_queue}/again",
            task_queue=task_queue,
        )
    # The partition of the old day went whole; the default partition's old rows went too.
    dropped = [name for name in result.partitions_retired if name.startswith("trace_bodies_p")]
    assert len(dropped) == 1
    assert "trace_bodies_default" in result.partitions_retired
    assert len(result.partitions_made) >= 2 * 3  # days 4..6 ahead of both tables
    assert again.partitions_made == [] and again.partitions_retired == []  # idempotent
    with session_factory() as session:
        rows = {t.id: t for t in session.scalars(select(Trace))}
        made = partitions(session=session, table=TRACE_BODIES)
        left_detached = detached_partitions(session=session, table=TRACE_BODIES)
        purged_at = {
            trace_id: trace_purge_state(
                session=session,
                loop_id=rows[trace_id].loop_id,
                external_id=rows[trace_id].external_id,
            )
            for trace_id in rows
        }
    assert left_detached == []  # detached, then dropped in a transaction of its own
    assert set(rows) == set(old) | set(new)  # rows (lineage ids, outcomes) stay
    for trace_id in old:
        assert rows[trace_id].body == {} and purged_at[trace_id] is not None
        assert purged_at[trace_id][1] is not None
    assert rows[old[0]].curation_outcome == "task"
    for trace_id in new:
        assert rows[trace_id].body and purged_at[trace_id] == (trace_id, None)
    today = period_start(dt.datetime.now(dt.UTC), "daily")
    assert made[-1].upper >= today + dt.timedelta(days=7)  # today and 6 days ahead
    history = await handle.fetch_history()
    await Replayer(workflows=[RetentionWorkflow]).replay_workflow(history)


async def test_the_schedule_follows_the_settings(temporal_client: Client, task_queue: str) -> None:
    handle = temporal_client.get_schedule_handle(RETENTION_SCHEDULE_ID)
    try:
        await ensure_retention_schedule(temporal_client, RetentionInput(30), task_queue)
        await ensure_retention_schedule(  # exists: updated
            temporal_client, RetentionInput(7, period="weekly", ahead=2), task_queue
        )
        described = await handle.describe()
        action = described.schedule.action
        assert action.workflow == "RetentionWorkflow"  # type: ignore[attr-defined]
        (argument,) = action.args  # type: ignore[attr-defined]
        assert b'"retention_days":7' in argument.data.replace(b" ", b"")
        assert b"weekly" in argument.data
        assert described.schedule.spec.intervals[0].every == dt.timedelta(hours=1)
        # Retention off: bodies are kept for ever, but partitions are still made ahead.
        await ensure_retention_schedule(temporal_client, RetentionInput(0), task_queue)
        (argument,) = (await handle.describe()).schedule.action.args  # type: ignore[attr-defined]
        assert b'"retention_days":0' in argument.data.replace(b" ", b"")
    finally:
        with contextlib.suppress(RPCError):
            await handle.delete()


def test_the_input_follows_the_settings() -> None:
    settings = Settings(
        trace_retention_days=9,
        partition_period="weekly",
        partitions_ahead=2,
        otlp_span_retention_s=60,
        otlp_episode_max_wait_s=600.5,
    )
    assert retention_input(settings) == RetentionInput(
        retention_days=9, period="weekly", ahead=2, span_retention_s=601
    )
