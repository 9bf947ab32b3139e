"""The Temporal Schedules Ratchet keeps: the hourly retention purge (workflows/retention.py)
and the serving ledger's sample (workflows/ledger.py).

The worker calls :func:`ensure_retention_schedule` and :func:`ensure_serving_ledger_schedule`
at start, so each schedule follows its setting (``RATCHET_TRACE_RETENTION_DAYS``,
``RATCHET_SERVING_LEDGER_SAMPLE_S``): created when missing, updated when the period changed,
deleted when it is off (0). Several workers starting at once race benignly: creating an
existing schedule is treated as "already there" and turns into an update.
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

from workflows.ledger import ServingLedgerWorkflow
from workflows.payloads.ledger import (
    SERVING_LEDGER_SCHEDULE_ID,
    SERVING_LEDGER_WORKFLOW_ID,
    ServingLedgerInput,
)
from workflows.payloads.retention import (
    RETENTION_SCHEDULE_ID,
    RETENTION_WORKFLOW_ID,
    RetentionInput,
)
from workflows.retention import RetentionWorkflow

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
    schedule = retention_schedule(retention_days, task_queue) if retention_days > 0 else None
    await _ensure_schedule(client, RETENTION_SCHEDULE_ID, schedule)


def serving_ledger_schedule(every_s: int, task_queue: str) -> Schedule:
    return Schedule(
        action=ScheduleActionStartWorkflow(
            ServingLedgerWorkflow.run,
            ServingLedgerInput(),
            id=SERVING_LEDGER_WORKFLOW_ID,
            task_queue=task_queue,
            execution_timeout=timedelta(minutes=30),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(seconds=every_s))]),
        # The counters are cumulative: a sample missed while the cluster was down is made up
        # by the next one, so none is caught up.
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )


async def ensure_serving_ledger_schedule(client: Client, every_s: int, task_queue: str) -> None:
    schedule = serving_ledger_schedule(every_s, task_queue) if every_s > 0 else None
    await _ensure_schedule(client, SERVING_LEDGER_SCHEDULE_ID, schedule)


async def _ensure_schedule(client: Client, schedule_id: str, schedule: Schedule | None) -> None:
    """Create ``schedule`` under ``schedule_id``, or update it; None deletes it (idempotent)."""
    handle = client.get_schedule_handle(schedule_id)
    if schedule is None:
        try:
            await handle.delete()
            logger.info("deleted schedule %s (its setting is 0: off)", schedule_id)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
        return
    try:
        await client.create_schedule(schedule_id, schedule)
        logger.info("created schedule %s", schedule_id)
        return
    except ScheduleAlreadyRunningError:
        pass

    def replace(_: ScheduleUpdateInput) -> ScheduleUpdate:
        return ScheduleUpdate(schedule=schedule)

    await handle.update(replace)
