"""ProbeWorkflow: the difficulty probe, the champion run K times on each unprobed train task.

Id ``loop/<name>/cycle/<n>/probe``; the loop starts it before the snapshot when its curation
policy has ``difficulty_filter`` on. Four steps, no data in the workflow but ids and URIs:

1. ``export_probe_tasks`` writes the train tasks with no ``probe_pass_rate`` to the run's
   task file; with none, the probe is ``skipped`` and no job runs;
2. ``run_job`` runs the champion on it as a ``probe`` run (an eval job with
   ``samples = attempts`` at temperature 1, so the attempts differ) on the loop's executor;
   its run id derives from the cycle (``<loop>-c<n>-probe``), so the cost is the cycle's;
3. ``probe_pass_rates`` reads the job's per-task results as pass rates of those tasks;
4. ``record_probes`` stores them; the snapshot then keeps only tasks strictly between 0 and 1.

A job that ends without success is a result (``status``), not an error: the loop goes on
without the filter's new evidence. Errors that no retry fixes (a bad spec, unreadable
results) fail this workflow, and the loop decides (it goes on too, see ``LoopWorkflow``).
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from services.loop.states import ProbeStatus, RunStatus
    from workflows.activities.curation import CurationActivities
    from workflows.activities.jobs import run_job_from_workflow
    from workflows.ids import run_id_for
    from workflows.options import (
        LONG_DB_TIMEOUT,
        RESULTS_TIMEOUT,
        db_activity,
    )
    from workflows.payloads.jobs import cycle_eval_job_spec, cycle_job
    from workflows.payloads.probe import (
        ExportProbeTasksInput,
        ProbeInput,
        ProbePassRatesInput,
        ProbeResult,
        RecordProbesInput,
    )

PROBE_TEMPERATURE = 1.0


def probe_job_spec(input: ProbeInput, task_uri: str, run_id: str) -> dict[str, object]:
    """The eval job's spec for a probe: ``attempts`` samples per task, sampled at T=1."""
    return cycle_eval_job_spec(
        input,
        run_id,
        checkpoint_uri=input.champion_uri,
        task_uri=task_uri,
        samples=input.attempts,
        temperature=PROBE_TEMPERATURE,
    )


@workflow.defn
class ProbeWorkflow:
    @workflow.run
    async def run(self, input: ProbeInput) -> ProbeResult:
        run_id = run_id_for(input.loop, input.cycle, "probe")
        exported = await db_activity(
            CurationActivities.export_probe_tasks,
            ExportProbeTasksInput(loop=input.loop, run_id=run_id),
            start_to_close=LONG_DB_TIMEOUT,
        )
        if exported.count == 0 or exported.task_uri is None:
            workflow.logger.info("probe of %s skipped: every train task is probed", input.loop)
            return ProbeResult(status=ProbeStatus.SKIPPED)

        job = await run_job_from_workflow(
            cycle_job(
                input,
                "probe",
                run_id,
                probe_job_spec(input, exported.task_uri, run_id),
                base_checkpoint_id=input.champion_checkpoint_id,
            ),
        )
        result = ProbeResult(
            status=ProbeStatus(job.status),
            run_id=run_id,
            probed=exported.count,
            compute_seconds=job.compute_seconds,
            cost_usd=job.cost_usd,
            error=job.error,
        )
        if job.status != RunStatus.SUCCEEDED:
            workflow.logger.warning("probe %s %s: %s", run_id, job.status, job.error or "")
            return result

        rates = await db_activity(
            CurationActivities.probe_pass_rates,
            ProbePassRatesInput(
                loop=input.loop, output_uri=job.output_uri, task_ids=exported.task_ids
            ),
            start_to_close=RESULTS_TIMEOUT,
        )
        recorded = await db_activity(
            CurationActivities.record_probes,
            RecordProbesInput(loop=input.loop, pass_rates=rates.pass_rates),
            start_to_close=RESULTS_TIMEOUT,
        )
        result.recorded = recorded.updated
        result.too_easy, result.too_hard, result.kept = rates.too_easy, rates.too_hard, rates.kept
        workflow.logger.info(
            "probe %s: %d tasks, %d kept, %d too easy, %d too hard",
            run_id,
            exported.count,
            rates.kept,
            rates.too_easy,
            rates.too_hard,
        )
        return result
