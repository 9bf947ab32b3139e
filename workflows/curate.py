"""CurateWorkflow: curate every uncurated trace of a loop, one batch activity at a time.

The caller gives the id (``loop/<name>/cycle/<n>/curate`` from the loop, or its own for an
on-demand run), so a retried parent never starts a second curation. The workflow holds no
data: each ``curate_batch`` activity reads, writes and commits its own batch, and the
workflow only adds up the counts. It stops when a batch reports nothing more to do or after
``max_batches``, whichever comes first. The loop's trigger check curates what arrived with
the same :func:`curate_batches` (inline: it runs before any cycle exists to name a child).
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.activities.curation import CurationActivities
    from workflows.options import CURATE_BATCH, long_activity
    from workflows.payloads.curation import CurateBatchInput, CurateInput, CurateResult


@workflow.defn(name="CurateWorkflow")
class CurateWorkflow:
    @workflow.run
    async def run(self, input: CurateInput) -> CurateResult:
        if input.max_batches < 1:
            raise ApplicationError("max_batches must be at least 1", non_retryable=True)
        total = await curate_batches(input)
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


async def curate_batches(input: CurateInput) -> CurateResult:
    """Run ``curate_batch`` until nothing is left or ``max_batches`` ran; the counts summed.

    Workflow code: call it from a workflow's run, never from an activity.
    """
    total = CurateResult()
    for _ in range(input.max_batches):
        batch = await long_activity(
            CurationActivities.curate_batch,
            CurateBatchInput(loop=input.loop, batch_size=input.batch_size),
            CURATE_BATCH,
        )
        total.add(batch)
        if not batch.more:
            break
    return total
