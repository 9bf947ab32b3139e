"""RetentionWorkflow: one run of upkeep of the tables partitioned by time (services.db.partitions):
partitions made ahead, span payloads and raw trace bodies past their retention dropped.

A Temporal Schedule (``ratchet-retention``, set up by the worker, see
workflows.schedules) starts it every hour, so the upkeep is durable: a worker that is down at
the hour runs it when it is back, and a run that dies midway is retried. The time is fixed
when the run starts (``workflow.now()``), so retries make and drop the same partitions.
Runs scheduled before partitioning (histories without the ``partitions`` patch) only purge.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.activities.retention import RetentionActivities
    from workflows.options import LONG_DB_TIMEOUT, PURGE, db_activity, long_activity
    from workflows.payloads.retention import (
        MaintainPartitionsInput,
        MaintainPartitionsResult,
        PurgeTraceBodiesInput,
        RetentionInput,
        RetentionResult,
    )

PARTITIONS_PATCH = "partitions"


@workflow.defn(name="RetentionWorkflow")
class RetentionWorkflow:
    @workflow.run
    async def run(self, input: RetentionInput) -> RetentionResult:
        upkeep = MaintainPartitionsResult()
        if workflow.patched(PARTITIONS_PATCH):
            upkeep = await db_activity(
                RetentionActivities.maintain_partitions,
                MaintainPartitionsInput(
                    now=workflow.now().isoformat(),
                    period=input.period,
                    ahead=input.ahead,
                    span_retention_s=input.span_retention_s,
                ),
                start_to_close=LONG_DB_TIMEOUT,
            )
        purge = await long_activity(
            RetentionActivities.purge_trace_bodies,
            PurgeTraceBodiesInput(
                retention_days=input.retention_days,
                now=workflow.now().isoformat(),
                batch_size=input.batch_size,
            ),
            PURGE,
        )
        return RetentionResult(
            purged=purge.purged,
            cutoff=purge.cutoff,
            partitions_made=upkeep.made,
            partitions_retired=[*upkeep.retired, *purge.retired],
        )
