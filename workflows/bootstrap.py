"""A bootstrap cycle: a loop's first champion from its own successful traces.

``ratchet loop bootstrap`` (docs/loops.md, "A first champion by bootstrap") signals the loop
(``LoopWorkflow.bootstrap``); a training profile with ``bootstrap.auto`` starts one by itself
when the loop has no champion and at least ``bootstrap.min_successes`` successful train-split
traces. LoopWorkflow runs it as a cycle with trigger ``bootstrap``, through the cycle's own
stages and child workflows, with the base model where a regular cycle has its champion:

1. curate, snapshot: as every cycle (the snapshot freezes the held-out set the gate reads;
   a loop with no held-out task yet cannot judge a bootstrap: ``no_data``);
2. demonstrations: the base model is resolved and recorded, and the train split's
   successful conversations are written as a task file (services.curation.bootstrap); none
   ends the cycle as ``no_data`` with the report of what was seen;
3. estimate, then train: the child TrainWorkflow runs SFT (a LoRA adapter, the bootstrap's
   hyper-parameters) over the base model on that file;
4. evaluate: the base model and the adapter on the frozen held-out set only;
5. gate: the gate's decision (the same function, the policy's confidence and thresholds)
   on the held-out pairs, the base model as the baseline; a manual gate waits for approval;
6. promote: as every cycle; the champion it replaces (None, unless forced) is the one a
   canary's rollback restores.

Workflow code (deterministic, no I/O); imported by workflows/loop.py inside
``imports_passed_through``.
"""

from __future__ import annotations

from typing import Protocol

from temporalio import workflow
from temporalio.exceptions import ActivityError

from services.loop.policies import TrainingProfile
from services.loop.states import BOOTSTRAP_TRIGGER as BOOTSTRAP_TRIGGER
from services.loop.states import CycleOutcome, CycleStage, RunStatus
from workflows.activities.bootstrap import BootstrapActivities
from workflows.activities.curation import CurationActivities
from workflows.cycle import (
    CycleAborted,
    CycleHost,
    CycleRun,
    candidate_of,
    child_stage,
    estimate_stage,
    gate_stage,
    promote_stage,
    root_cause,
)
from workflows.evaluate import EvaluateWorkflow
from workflows.options import LONG_DB_TIMEOUT, db_activity
from workflows.payloads.bootstrap import PrepareBootstrapInput, PrepareBootstrapResult
from workflows.payloads.curation import SnapshotInput, SnapshotResult
from workflows.payloads.cycle import CloseCycleInput, StartCycleResult
from workflows.payloads.evaluate import EvalTarget, EvaluateInput
from workflows.payloads.loop import BootstrapSignal
from workflows.payloads.train import TrainInput
from workflows.train import TrainWorkflow

# LoopWorkflow's workflow.patched id of the bootstrap cycle and of the automatic bootstrap's
# readiness check (histories before it have neither); its trigger is BOOTSTRAP_TRIGGER.
BOOTSTRAP_PATCH = "bootstrap-cycle"


class BootstrapHost(CycleHost, Protocol):
    """What a bootstrap needs of LoopWorkflow beyond the stage functions' needs."""

    async def curate_stage(self, run: CycleRun) -> None:
        """The cycle's curate stage (a child CurateWorkflow)."""
        ...


async def bootstrap_stages(
    host: BootstrapHost, run: CycleRun, started: StartCycleResult, request: BootstrapSignal
) -> CloseCycleInput:
    """The stages of a bootstrap cycle (see the module); how it closes, with its points.
    A stage that ends it early raises :class:`CycleAborted`."""
    await host.curate_stage(run)
    dataset = await _snapshot(host, run)
    prepared = await _demonstrations(host, run, request)
    base = EvalTarget("base", prepared.base_checkpoint_id, prepared.base_uri)
    profile = run.config.training_profile.bootstrap_profile()
    await host.enter(CycleStage.ESTIMATE, run.cycle)
    await estimate_stage(
        run, dataset, None, profile=profile, eval_task_counts=[dataset.heldout_count]
    )
    candidate = await _train(host, run, dataset, prepared, base, profile)
    await _evaluate(host, run, dataset, base, candidate)
    previous = _previous(started)
    decided = await gate_stage(
        host,
        run,
        baseline=base,
        candidate=candidate,
        previous_id=previous.checkpoint_id if previous else None,
        judge=BootstrapActivities.gate,
    )
    return await promote_stage(host, run, candidate=candidate, previous=previous, decided=decided)


def request_detail(request: BootstrapSignal) -> dict[str, object]:
    """What the cycle's row records of the request that started it (``trigger_detail``)."""
    detail: dict[str, object] = {"requested_by": request.by, "force": request.force}
    if request.reason:
        detail["reason"] = request.reason
    if request.base_checkpoint_id:
        detail["base_checkpoint"] = request.base_checkpoint_id
    return detail


async def _snapshot(host: BootstrapHost, run: CycleRun) -> SnapshotResult:
    """The cycle's dataset, for its frozen held-out set: none yet ends the cycle."""
    await host.enter(CycleStage.SNAPSHOT, run.cycle)
    dataset = await db_activity(
        CurationActivities.snapshot_dataset,
        SnapshotInput(run.loop, run.cycle),
        start_to_close=LONG_DB_TIMEOUT,
    )
    if not dataset.heldout_uri or dataset.heldout_count == 0:
        raise CycleAborted(
            CycleOutcome.NO_DATA,
            "the loop has no held-out tasks yet: the gate judges a bootstrap on the frozen "
            "held-out set, which curation draws from all traffic (curation_policy."
            "heldout_fraction)",
        )
    return dataset


async def _demonstrations(
    host: BootstrapHost, run: CycleRun, request: BootstrapSignal
) -> PrepareBootstrapResult:
    """The base model and the demonstrations' task file; none ends the cycle (no_data)."""
    await host.enter(CycleStage.DEMONSTRATIONS, run.cycle)
    try:
        prepared = await db_activity(
            BootstrapActivities.prepare,
            PrepareBootstrapInput(
                loop=run.loop,
                cycle=run.cycle,
                base_checkpoint_id=request.base_checkpoint_id,
                max_demonstrations=run.config.training_profile.bootstrap.max_demonstrations,
            ),
            start_to_close=LONG_DB_TIMEOUT,
        )
    except ActivityError as exc:
        raise CycleAborted.failed(f"bootstrap refused: {root_cause(exc)}") from exc
    workflow.logger.info("bootstrap of %s: %s", run.loop, prepared.summary)
    if prepared.used == 0 or prepared.demonstrations_uri is None:
        raise CycleAborted(
            CycleOutcome.NO_DATA,
            f"no successful train-split traces to learn from: {prepared.summary}",
        )
    return prepared


async def _train(
    host: BootstrapHost,
    run: CycleRun,
    dataset: SnapshotResult,
    prepared: PrepareBootstrapResult,
    base: EvalTarget,
    profile: TrainingProfile,
) -> EvalTarget:
    """SFT-LoRA over the base model on the demonstrations; the adapter, or the cycle fails."""
    await host.enter(CycleStage.TRAIN, run.cycle, dataset_id=dataset.dataset_id)
    trained = await child_stage(
        run.loop,
        TrainWorkflow.run,
        TrainInput(
            loop=run.loop,
            cycle=run.cycle,
            dataset_id=dataset.dataset_id,
            train_uri=prepared.demonstrations_uri or "",
            base_checkpoint_id=base.checkpoint_id,
            base_checkpoint_uri=base.checkpoint_uri,
            environment=run.config.environment,
            profile=profile,
        ),
        CycleStage.TRAIN,
        run.cycle,
    )
    if trained.status != RunStatus.SUCCEEDED or trained.checkpoint_id is None:
        raise CycleAborted.failed(f"training {trained.status}: {trained.error or ''}")
    return candidate_of(trained)


async def _evaluate(
    host: BootstrapHost,
    run: CycleRun,
    dataset: SnapshotResult,
    base: EvalTarget,
    candidate: EvalTarget,
) -> None:
    """The base model and the adapter on the frozen held-out set, sampled as the gate
    policy says; a failed evaluation ends the cycle."""
    await host.enter(CycleStage.EVALUATE, run.cycle, candidate=candidate.checkpoint_id)
    policy = run.config.gate_policy
    evaluated = await child_stage(
        run.loop,
        EvaluateWorkflow.run,
        EvaluateInput(
            loop=run.loop,
            cycle=run.cycle,
            dataset_id=dataset.dataset_id,
            environment=run.config.environment,
            task_sets={"heldout": dataset.heldout_uri or ""},
            targets=[base, candidate],
            samples=policy.eval_samples,
            profile=run.config.training_profile,
            temperature=policy.eval_temperature,
        ),
        CycleStage.EVALUATE,
        run.cycle,
    )
    if evaluated.errors:
        raise CycleAborted.failed("evaluation failed: " + "; ".join(evaluated.errors))


def _previous(started: StartCycleResult) -> EvalTarget | None:
    """The champion a forced bootstrap would replace (None for a first one)."""
    if started.champion_checkpoint_id is None or started.champion_uri is None:
        return None
    return EvalTarget("champion", started.champion_checkpoint_id, started.champion_uri)
