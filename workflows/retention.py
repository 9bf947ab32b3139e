"""RetentionWorkflow: one purge of raw trace bodies past ``RATCHET_TRACE_RETENTION_DAYS``.

A Temporal Schedule (``ratchet-retention``, set up by the worker, see
workflows.schedules) starts it every hour, so the purge is durable: a worker that is down at
the hour runs it when it is back, and a purge that dies midway is retried. The cutoff is
fixed when the run starts (``workflow.now()``), so retries purge the same set.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.activities.retention import RetentionActivities
    from workflows.options import PURGE, long_activity
    from workflows.payloads.retention import PurgeTraceBodiesInput, RetentionInput, RetentionResult


@workflow.defn(name="RetentionWorkflow")
class RetentionWorkflow:
    @workflow.run
    async def run(self, input: RetentionInput) -> RetentionResult:
        purge = await long_activity(
            RetentionActivities.purge_trace_bodies,
            PurgeTraceBodiesInput(
                retention_days=input.retention_days,
                now=workflow.now().isoformat(),
                batch_size=input.batch_size,
            ),
            PURGE,
        )
        return RetentionResult(purged=purge.purged, cutoff=purge.cutoff)
