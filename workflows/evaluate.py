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
    from services.loop.states import RunStatus
    from workflows.activities.gate import GateActivities
    from workflows.activities.jobs import run_job_from_workflow
    from workflows.ids import run_id_for
    from workflows.options import JOB_RETRY, RESULTS_TIMEOUT, db_activity
    from workflows.payloads.evaluate import (
        EvalTarget,
        EvaluateInput,
        EvaluateResult,
        EvaluationSummary,
        RecordEvaluationInput,
    )
    from workflows.payloads.jobs import RunJobResult, cycle_eval_job_spec, cycle_job


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
        job_spec = cycle_eval_job_spec(
            input,
            run_id,
            checkpoint_uri=target.checkpoint_uri,
            task_uri=task_uri,
            samples=input.samples,
            temperature=input.temperature,
        )
        job = await run_job_from_workflow(
            cycle_job(
                input,
                "eval",
                run_id,
                job_spec,
                base_checkpoint_id=target.checkpoint_id,
                dataset_id=input.dataset_id,
            ),
        )
        if job.status != RunStatus.SUCCEEDED:
            return job, None
        summary = await db_activity(
            GateActivities.record_evaluation,
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
            start_to_close=RESULTS_TIMEOUT,
            retry=JOB_RETRY,
        )
        return job, summary
