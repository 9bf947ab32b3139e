"""TrainWorkflow: one training job from the champion, then its checkpoint registered.

Id ``loop/<name>/cycle/<n>/train``; the run id is derived from the cycle, so a retried
workflow adopts the job it already started instead of starting a second one.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from services.loop.states import RunStatus
    from workflows.activities.jobs import JobActivities, run_job_from_workflow
    from workflows.ids import run_id_for, uri_path
    from workflows.options import INSTALL, long_activity
    from workflows.payloads.jobs import (
        RegisterCheckpointInput,
        cycle_job,
        job_outcome,
        train_job_document,
    )
    from workflows.payloads.train import TrainInput, TrainResult


def train_job_spec(input: TrainInput, run_id: str) -> dict[str, object]:
    """The job contract's spec for a training run (paths, not URIs: jobs read files)."""
    return train_job_document(
        run_id=run_id,
        environment=input.environment,
        dataset=uri_path(input.train_uri),
        base_checkpoint=uri_path(input.base_checkpoint_uri or ""),
        profile=input.profile.model_dump(mode="json"),
        cycle=input.cycle,
    )


@workflow.defn
class TrainWorkflow:
    @workflow.run
    async def run(self, input: TrainInput) -> TrainResult:
        run_id = run_id_for(input.loop, input.cycle, "train")
        job = await run_job_from_workflow(
            cycle_job(
                input,
                "train",
                run_id,
                train_job_spec(input, run_id),
                base_checkpoint_id=input.base_checkpoint_id,
                dataset_id=input.dataset_id,
            ),
            timedelta(seconds=input.profile.timeout_s),
        )
        result = TrainResult(run_id=run_id, metrics=job.metrics, **job_outcome(job))
        if job.status != RunStatus.SUCCEEDED:
            return result
        checkpoint = await long_activity(
            JobActivities.register_checkpoint,
            RegisterCheckpointInput(
                loop=input.loop,
                run_id=run_id,
                checkpoint_dir_uri=job.output_uri.rstrip("/") + "/checkpoint",
                parent_checkpoint_id=input.base_checkpoint_id,
            ),
            INSTALL,
        )
        result.checkpoint_id, result.checkpoint_uri = checkpoint.checkpoint_id, checkpoint.uri
        return result
