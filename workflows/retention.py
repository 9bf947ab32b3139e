"""RetentionWorkflow: one purge of raw trace bodies past ``RATCHET_TRACE_RETENTION_DAYS``.

A Temporal Schedule (``ratchet-retention``, set up by the worker, see
workflows.schedules) starts it every hour, so the purge is durable: a worker that is down at
the hour runs it when it is back, and a purge that dies midway is retried. The cutoff is
fixed when the run starts (``workflow.now()``), so retries purge the same set.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from workflows.activities.retention import RetentionActivities
    from workflows.shared import (
        PurgeTraceBodiesInput,
        PurgeTraceBodiesResult,
        RetentionInput,
        RetentionResult,
    )

PURGE_START_TO_CLOSE = timedelta(hours=1)
PURGE_HEARTBEAT = timedelta(minutes=2)
PURGE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=5),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(minutes=5),
    maximum_attempts=10,
)


@workflow.defn(name="RetentionWorkflow")
class RetentionWorkflow:
    @workflow.run
    async def run(self, input: RetentionInput) -> RetentionResult:
        purge: PurgeTraceBodiesResult = await workflow.execute_activity_method(
            RetentionActivities.purge_trace_bodies,
            PurgeTraceBodiesInput(
                retention_days=input.retention_days,
                now=workflow.now().isoformat(),
                batch_size=input.batch_size,
            ),
            start_to_close_timeout=PURGE_START_TO_CLOSE,
            heartbeat_timeout=PURGE_HEARTBEAT,
            retry_policy=PURGE_RETRY,
        )
        return RetentionResult(purged=purge.purged, cutoff=purge.cutoff)
