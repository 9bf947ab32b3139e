"""Retention: raw trace bodies past RATCHET_TRACE_RETENTION_DAYS are purged, durably."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt

from sqlalchemy import select, update
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.worker import Replayer, Worker

from services.db.models import Trace
from services.db.session import SessionFactory
from tests.services.curation.support import add_traces, make_loop, trace_body
from workflows.activities.retention import RetentionActivities
from workflows.payloads.retention import RETENTION_SCHEDULE_ID, RetentionInput
from workflows.retention import RetentionWorkflow
from workflows.schedules import ensure_retention_schedule


def seed_old_and_new(session_factory: SessionFactory) -> tuple[list[int], list[int]]:
    loop_id = make_loop(session_factory)
    old = add_traces(session_factory, loop_id, [trace_body(f"old-{n}", "2+2?") for n in range(5)])
    new = add_traces(session_factory, loop_id, [trace_body(f"new-{n}", "3+3?") for n in range(3)])
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=40)
    with session_factory.begin() as session:
        session.execute(update(Trace).where(Trace.id.in_(old)).values(received_at=long_ago))
        # One old trace was curated already: its outcome must stay what curation said.
        session.execute(
            update(Trace)
            .where(Trace.id == old[0])
            .values(curated_at=long_ago, curation_outcome="task")
        )
    return old, new


async def test_the_workflow_purges_old_bodies_keeps_rows_and_replays(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory
) -> None:
    old, new = seed_old_and_new(session_factory)
    activities = RetentionActivities(session_factory)
    async with Worker(
        temporal_client,
        task_queue=task_queue,
        workflows=[RetentionWorkflow],
        activities=[activities.purge_trace_bodies],
        activity_executor=concurrent.futures.ThreadPoolExecutor(2),
    ):
        handle = await temporal_client.start_workflow(
            RetentionWorkflow.run,
            RetentionInput(retention_days=30, batch_size=2),  # several batches
            id=f"retention/{task_queue}",
            task_queue=task_queue,
        )
        result = await handle.result()
        again = await temporal_client.execute_workflow(
            RetentionWorkflow.run,
            RetentionInput(retention_days=30),
            id=f"retention/{task_queue}/again",
            task_queue=task_queue,
        )
    assert result.purged == 5 and again.purged == 0  # idempotent
    with session_factory() as session:
        rows = {t.id: t for t in session.scalars(select(Trace))}
    assert set(rows) == set(old) | set(new)  # rows (lineage ids, outcomes) stay
    for trace_id in old:
        assert rows[trace_id].body == {} and rows[trace_id].body_purged_at is not None
        assert rows[trace_id].curated_at is not None  # curation never reads an empty body
    assert rows[old[0]].curation_outcome == "task"
    assert {rows[i].curation_outcome for i in old[1:]} == {"purged"}
    for trace_id in new:
        assert rows[trace_id].body and rows[trace_id].body_purged_at is None
    history = await handle.fetch_history()
    await Replayer(workflows=[RetentionWorkflow]).replay_workflow(history)


async def test_the_schedule_follows_the_setting(temporal_client: Client, task_queue: str) -> None:
    handle = temporal_client.get_schedule_handle(RETENTION_SCHEDULE_ID)
    try:
        await ensure_retention_schedule(temporal_client, 30, task_queue)
        await ensure_retention_schedule(temporal_client, 7, task_queue)  # exists: updated
        described = await handle.describe()
        action = described.schedule.action
        assert action.workflow == "RetentionWorkflow"  # type: ignore[attr-defined]
        (argument,) = action.args  # type: ignore[attr-defined]
        assert argument.data  # the payload of RetentionInput(7)
        assert b"7" in argument.data
        assert described.schedule.spec.intervals[0].every == dt.timedelta(hours=1)
        await ensure_retention_schedule(temporal_client, 0, task_queue)  # off: deleted
        try:
            await handle.describe()
            raise AssertionError("the schedule should be gone")
        except RPCError:
            pass
        await ensure_retention_schedule(temporal_client, 0, task_queue)  # and idempotent
    finally:
        with contextlib.suppress(RPCError):
            await handle.delete()
