"""The Temporal Schedules Ratchet keeps: the hourly retention upkeep (workflows/retention.py:
partitions made ahead, old ones dropped) and the serving ledger's sample (workflows/ledger.py).

The worker calls :func:`ensure_retention_schedule` and :func:`ensure_serving_ledger_schedule`
at start, so each schedule follows its settings (``RATCHET_TRACE_RETENTION_DAYS``,
``RATCHET_PARTITION_PERIOD``, ``RATCHET_PARTITIONS_AHEAD``,
``RATCHET_SERVING_LEDGER_SAMPLE_S``): created when missing, updated when they changed; the
ledger's is deleted when it is off (0). Several workers starting at once race benignly:
creating an existing schedule is treated as "already there" and turns into an update.
"""

from __future__ import annotations

import logging
import math
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

from services.settings import Settings
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


def retention_schedule(retention: RetentionInput, task_queue: str) -> Schedule:
    return Schedule(
        action=ScheduleActionStartWorkflow(
            RetentionWorkflow.run,
            retention,
            id=RETENTION_WORKFLOW_ID,
            task_queue=task_queue,
            execution_timeout=timedelta(hours=2),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=RETENTION_EVERY)]),
        # A purge still running at the next hour makes that one unnecessary; one missed
        # while the cluster was down runs when it is back.
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP, catchup_window=timedelta(days=1)),
    )


async def ensure_retention_schedule(
    client: Client, retention: RetentionInput, task_queue: str
) -> None:
    """Always there: with retention off (``retention_days`` 0) it still makes partitions
    ahead and drops span payloads."""
    await _ensure_schedule(client, RETENTION_SCHEDULE_ID, retention_schedule(retention, task_queue))


def retention_input(settings: Settings) -> RetentionInput:
    """The scheduled upkeep's input, from the settings it follows."""
    return RetentionInput(
        retention_days=settings.trace_retention_days,
        period=settings.partition_period,
        ahead=settings.partitions_ahead,
        # A span still waiting is flushed within the episode's maximum wait: its payload is
        # kept at least that long.
        span_retention_s=max(
            settings.otlp_span_retention_s, math.ceil(settings.otlp_episode_max_wait_s)
        ),
    )


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
