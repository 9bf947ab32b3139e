"""CurateWorkflow: curate every uncurated trace of a loop, one batch activity at a time.

The caller gives the id (``loop/<name>/cycle/<n>/curate`` from the loop, or its own for an
on-demand run), so a retried parent never starts a second curation. The workflow holds no
data: each ``curate_batch`` activity reads, writes and commits its own batch, and the
workflow only adds up the counts. It stops when a batch reports nothing more to do or after
``max_batches``, whichever comes first.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.shared import CurateBatchInput, CurateBatchResult, CurateInput, CurateResult

# A batch is one transaction of a few seconds that heartbeats between its steps, so a worker
# that died mid-batch is noticed within the heartbeat timeout and the batch retried elsewhere.
BATCH_START_TO_CLOSE = timedelta(minutes=10)
BATCH_HEARTBEAT = timedelta(seconds=10)
BATCH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(minutes=1),
    non_retryable_error_types=["InvalidInput", "InvalidPolicy", "NotFound", "UnknownEnvironment"],
)


@workflow.defn(name="CurateWorkflow")
class CurateWorkflow:
    @workflow.run
    async def run(self, input: CurateInput) -> CurateResult:
        if input.max_batches < 1:
            raise ApplicationError("max_batches must be at least 1", non_retryable=True)
        total = CurateResult()
        for _ in range(input.max_batches):
            batch = await workflow.execute_activity(
                "curate_batch",
                CurateBatchInput(loop=input.loop, batch_size=input.batch_size),
                result_type=CurateBatchResult,
                start_to_close_timeout=BATCH_START_TO_CLOSE,
                heartbeat_timeout=BATCH_HEARTBEAT,
                retry_policy=BATCH_RETRY,
            )
            total.traces_seen += batch.traces_seen
            total.tasks_created += batch.tasks_created
            total.duplicates += batch.duplicates
            total.rejected += batch.rejected
            total.skipped += batch.skipped
            total.new_train_tasks += batch.new_train_tasks
            if not batch.more:
                break
        workflow.logger.info(
            "curated %d traces of %s: %d tasks (%d train), %d duplicates, %d rejected",
            total.traces_seen,
            input.loop,
            total.tasks_created,
            total.new_train_tasks,
            total.duplicates,
            total.rejected,
        )
        return total
