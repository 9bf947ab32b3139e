"""The Temporal Schedules Ratchet keeps: the hourly retention purge (workflows/retention.py).

The worker calls :func:`ensure_retention_schedule` at start, so the schedule follows
``RATCHET_TRACE_RETENTION_DAYS``: created when missing, updated when the period changed,
deleted when retention is off (0). Several workers starting at once race benignly: creating
an existing schedule is treated as "already there" and turns into an update.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
)
from temporalio.service import RPCError, RPCStatusCode

from workflows.retention import RetentionWorkflow
from workflows.shared import RETENTION_SCHEDULE_ID, RETENTION_WORKFLOW_ID, RetentionInput

logger = logging.getLogger(__name__)

RETENTION_EVERY = timedelta(hours=1)


def retention_schedule(retention_days: int, task_queue: str) -> Schedule:
    return Schedule(
        action=ScheduleActionStartWorkflow(
            RetentionWorkflow.run,
            RetentionInput(retention_days=retention_days),
            id=RETENTION_WORKFLOW_ID,
            task_queue=task_queue,
            execution_timeout=timedelta(hours=2),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=RETENTION_EVERY)]),
        # A purge still running at the next hour makes that one unnecessary; one missed
        # while the cluster was down runs when it is back.
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP, catchup_window=timedelta(days=1)),
    )


async def ensure_retention_schedule(client: Client, retention_days: int, task_queue: str) -> None:
    handle = client.get_schedule_handle(RETENTION_SCHEDULE_ID)
    if retention_days <= 0:
        try:
            await handle.delete()
            logger.info("trace retention is off; deleted schedule %s", RETENTION_SCHEDULE_ID)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
        return
    schedule = retention_schedule(retention_days, task_queue)
    try:
        await client.create_schedule(RETENTION_SCHEDULE_ID, schedule)
        logger.info("created schedule %s (%d days)", RETENTION_SCHEDULE_ID, retention_days)
        return
    except ScheduleAlreadyRunningError:
        pass

    def replace(_: ScheduleUpdateInput) -> ScheduleUpdate:
        return ScheduleUpdate(schedule=schedule)

    await handle.update(replace)
