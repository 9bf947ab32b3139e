"""EvaluateWorkflow: every target checkpoint on every task set, as parallel eval jobs.

Champion and candidate run on the same task files, and per-task results are stored, so the
gate compares them pairwise. Every task is sampled ``samples`` times at the policy's
temperature (pass@1 is estimated from the samples), and both checkpoints get the same seed:
common random numbers, so two identical checkpoints produce identical results and a
candidate equal to the champion can never look better by luck of the draw.
Id ``loop/<name>/cycle/<n>/evaluate``.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.activities.jobs import run_job_from_workflow
    from workflows.activities.loop import LoopActivities
    from workflows.options import JOB_RETRY, RESULTS_TIMEOUT
    from workflows.shared import (
        EvalTarget,
        EvaluateInput,
        EvaluateResult,
        EvaluationSummary,
        RecordEvaluationInput,
        RunJobInput,
        RunJobResult,
        eval_job_document,
        job_override,
        run_id_for,
        uri_path,
    )


def eval_job_spec(
    input: EvaluateInput, target: EvalTarget, task_set: str, task_uri: str, run_id: str
) -> dict[str, object]:
    return eval_job_document(
        run_id=run_id,
        environment=input.environment,
        checkpoint=uri_path(target.checkpoint_uri),
        dataset=uri_path(task_uri),
        samples=input.samples,
        seed=input.cycle,
        device=input.profile.get("device", "auto"),
        temperature=input.temperature,
    )


@workflow.defn
class EvaluateWorkflow:
    @workflow.run
    async def run(self, input: EvaluateInput) -> EvaluateResult:
        jobs = [
            self._evaluate_one(input, target, task_set, task_uri)
            for target in input.targets
            for task_set, task_uri in sorted(input.task_sets.items())
        ]
        outcomes = await asyncio.gather(*jobs)
        result = EvaluateResult(summaries=[])
        for job, summary in outcomes:
            result.compute_seconds += job.compute_seconds
            result.cost_usd += job.cost_usd
            if summary is None:
                result.errors.append(f"{job.run_id}: {job.status}: {job.error or ''}".strip())
            else:
                result.summaries.append(summary)
        return result

    async def _evaluate_one(
        self, input: EvaluateInput, target: EvalTarget, task_set: str, task_uri: str
    ) -> tuple[RunJobResult, EvaluationSummary | None]:
        run_id = run_id_for(input.loop, input.cycle, "eval", f"{target.role}-{task_set}")
        image, command = job_override(input.profile, "eval_job")
        job = await run_job_from_workflow(
            RunJobInput(
                run_id=run_id,
                loop=input.loop,
                kind="eval",
                job_spec=eval_job_spec(input, target, task_set, task_uri, run_id),
                cycle=input.cycle,
                dataset_id=input.dataset_id,
                base_checkpoint_id=target.checkpoint_id,
                accelerators=int(input.profile.get("eval_accelerators", 0)),
                job_image=image,
                job_command=command,
            ),
        )
        if job.status != "succeeded":
            return job, None
        summary = await workflow.execute_activity_method(
            LoopActivities.record_evaluation,
            RecordEvaluationInput(
                loop=input.loop,
                cycle=input.cycle,
                dataset_id=input.dataset_id,
                role=target.role,
                checkpoint_id=target.checkpoint_id,
                task_set=task_set,
                run_id=run_id,
                output_uri=job.output_uri,
            ),
            start_to_close_timeout=RESULTS_TIMEOUT,
            retry_policy=JOB_RETRY,
        )
        return job, summary
