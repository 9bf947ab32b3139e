"""What LoopWorkflow's stage methods share about the cycle they run: the cycle itself
(:class:`CycleRun`), how it ends early (:class:`CycleAborted`) and how it closes, and the
steps a regular cycle and a bootstrap (workflows/bootstrap.py) both take: a stage as a child
workflow (:func:`child_stage`), the budget estimate (:func:`estimate_stage`), the gate
(:func:`gate_stage`) and the promotion (:func:`promote_stage`), which ask the workflow
running them (:class:`CycleHost`) only to announce a stage and to wait for an approval; and
the operator rollback (:func:`roll_back`).

Workflow code (deterministic, no I/O); imported by workflows/loop.py inside
``imports_passed_through``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ChildWorkflowError, FailureError

from services.loop.policies import TrainingProfile
from services.loop.states import CycleOutcome, CycleStage, Decision, PromotionStatus, RunStatus
from workflows.activities.deploy import DeployActivities
from workflows.activities.estimate import CalibrationInput, EstimateActivities, EstimateInput
from workflows.activities.gate import GateActivities
from workflows.activities.jobs import run_job_from_workflow
from workflows.ids import cycle_workflow_id, run_id_for
from workflows.options import DEPLOY, db_activity, long_activity
from workflows.payloads.curation import SnapshotResult
from workflows.payloads.cycle import CloseCycleInput, StartCycleResult
from workflows.payloads.evaluate import EvalTarget
from workflows.payloads.gate import GateInput, GateResult, RecordDecisionInput
from workflows.payloads.jobs import cycle_job
from workflows.payloads.loop import LoopConfig
from workflows.payloads.promote import DeployInput, PromoteInput, PromoteResult
from workflows.payloads.rollback import FinishRollbackInput, RollbackInput, RollbackResult
from workflows.payloads.train import TrainInput, TrainResult
from workflows.promote import PromoteWorkflow
from workflows.search_attributes import RATCHET_CYCLE, RATCHET_LOOP, RATCHET_STAGE
from workflows.train import train_job_spec

# workflow.patched id of the calibration pass: a loop with no measured rates runs its train
# job shortened before the estimate, which prices the cycle at that run's rates. Histories
# before it estimated on the defaults.
CALIBRATE_PATCH = "estimate-calibration"
# The longest a calibration pass may run: a couple of steps and one rollout batch.
CALIBRATION_TIMEOUT = timedelta(minutes=30)

InputT = TypeVar("InputT")
ResultT = TypeVar("ResultT")


class CycleAborted(Exception):
    """A stage ended the cycle early with a business outcome (no data, rejected, failed)."""

    def __init__(
        self, outcome: CycleOutcome, detail: str, *, gate_points: float | None = None
    ) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
        self.gate_points = gate_points

    @classmethod
    def failed(cls, detail: str) -> CycleAborted:
        """A stage could not do its work: the cycle ends as ``failed``."""
        return cls(CycleOutcome.FAILED, detail)


# The stages a cycle's row records as it enters them (``set_cycle_stage``); curate and
# estimate are announced in the workflow's status only, as every committed history has it.
CYCLE_ROW_STAGES = frozenset(
    {
        CycleStage.PROBE,
        CycleStage.SNAPSHOT,
        CycleStage.DEMONSTRATIONS,
        CycleStage.TRAIN,
        CycleStage.EVALUATE,
        CycleStage.GATE,
        CycleStage.PROMOTE,
    }
)


@dataclass
class Decided:
    """The gate stage's outcome: a promotion, and the reason (the operator's, if manual)."""

    gate: GateResult
    promotion_id: int
    reason: str


@dataclass
class CycleRun:
    """The cycle being run, as every stage method reads it (workflow-local, not a payload).

    ``honest``: LoopWorkflow's honest-points patch (held-out points, gate points and the
    canary's samples recorded); histories before it claim the gate's points."""

    loop: str
    config: LoopConfig
    cycle: int
    honest: bool

    def gate_points(self, gate: GateResult) -> float | None:
        return as_number(gate.statistics.get("delta_points")) if self.honest else None

    def closed(
        self, promoted: PromoteResult, candidate_id: str, decided: Decided
    ) -> CloseCycleInput:
        """How a cycle that reached the promote stage closes."""
        statistics, reason = decided.gate.statistics, decided.reason
        gate_points = self.gate_points(decided.gate)
        live = {"live_baseline": promoted.live_baseline, "live_canary": promoted.live_canary}
        if promoted.status != PromotionStatus.HELD:
            outcome = (
                CycleOutcome.ROLLED_BACK
                if promoted.status == PromotionStatus.ROLLED_BACK
                else CycleOutcome.FAILED
            )
            return CloseCycleInput(
                self.loop,
                self.cycle,
                outcome,
                promoted.reason,
                0.0,
                candidate_id,
                gate_points,
                **live,
            )
        if not self.honest:
            points = float(statistics.get("delta_points", 0.0))
            return CloseCycleInput(
                self.loop, self.cycle, CycleOutcome.PROMOTED, reason, points, candidate_id
            )
        # Points gained are the held-out set's: the gate's eval set is new failures, on
        # which the champion scores ~0 by construction. No held-out set, no points claimed.
        heldout = as_number(statistics.get("heldout_points"))
        return CloseCycleInput(
            self.loop,
            self.cycle,
            CycleOutcome.PROMOTED,
            reason,
            heldout,
            candidate_id,
            gate_points,
            **live,
        )


def champion_of(started: StartCycleResult) -> EvalTarget:
    """The cycle's champion (what it trains from and is judged against); a loop without
    one cannot run a cycle."""
    if started.champion_checkpoint_id is None or started.champion_uri is None:
        raise CycleAborted.failed("the loop has no champion checkpoint to train from")
    return EvalTarget("champion", started.champion_checkpoint_id, started.champion_uri)


def candidate_of(trained: TrainResult) -> EvalTarget:
    """The trained candidate (``_train_stage`` returns only a succeeded run with one)."""
    assert trained.checkpoint_id is not None
    return EvalTarget("candidate", trained.checkpoint_id, trained.checkpoint_uri or "")


def as_number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def root_cause(error: FailureError) -> str:
    """The innermost failure's message: what actually went wrong in a stage."""
    cause: BaseException = error
    while isinstance(cause, FailureError) and cause.cause is not None:
        cause = cause.cause
    return str(cause)


async def child_stage(
    loop: str,
    run_fn: Callable[[Any, InputT], Awaitable[ResultT]],
    arg: InputT,
    stage: CycleStage,
    cycle: int,
    *,
    fail_cycle: bool = True,
) -> ResultT:
    """Run a stage as a child workflow whose id derives from the cycle.

    A child that fails on purpose (a non-retryable error) ends the cycle as failed; the
    loop itself carries on to the next trigger. ``fail_cycle=False`` lets the failure
    end the loop instead, as the curate stage did in histories before its patch.
    """
    try:
        return await workflow.execute_child_workflow(
            run_fn,
            arg,
            id=cycle_workflow_id(loop, cycle, stage),
            search_attributes=stage_search_attributes(loop, stage, cycle),
        )
    except ChildWorkflowError as exc:
        if not fail_cycle:
            raise
        raise CycleAborted.failed(f"{stage} failed: {root_cause(exc)}") from exc


def stage_search_attributes(loop: str, stage: CycleStage, cycle: int) -> TypedSearchAttributes:
    return TypedSearchAttributes(
        [
            SearchAttributePair(RATCHET_LOOP, loop),
            SearchAttributePair(RATCHET_STAGE, stage),
            SearchAttributePair(RATCHET_CYCLE, cycle),
        ]
    )


async def estimate_stage(
    run: CycleRun,
    dataset: SnapshotResult,
    champion: EvalTarget | None,
    *,
    profile: TrainingProfile | None = None,
    eval_task_counts: list[int] | None = None,
) -> None:
    """Estimate the cycle's train and eval jobs (calibrated first by a short pass of its
    train job when the loop has measured nothing yet and a ``champion`` trains); one over
    what is left of the budget ends the cycle as ``over_budget`` (the loop pauses) before
    anything more is spent. ``profile`` and ``eval_task_counts`` default to a regular
    cycle's: the loop's training profile, the eval and regression sets and the held-out set
    if there is one. A bootstrap passes no champion: its train job distils demonstrations,
    which a regular train job's shortened pass would not measure, so it runs uncalibrated
    and its estimate says so."""
    counts = eval_task_counts
    if counts is None:
        counts = [dataset.eval_count, dataset.regression_count]
        if dataset.heldout_uri:
            counts.append(dataset.heldout_count)
    calibration_run_id = None
    if champion is not None and workflow.patched(CALIBRATE_PATCH):
        calibration_run_id = await calibrate(run, dataset, champion)
    try:
        estimate = await db_activity(
            EstimateActivities.estimate_cycle,
            EstimateInput(
                loop=run.loop,
                cycle=run.cycle,
                profile=profile or run.config.training_profile,
                eval_task_counts=counts,
                samples_per_task=run.config.gate_policy.eval_samples,
                calibration_run_id=calibration_run_id,
                replay_tasks=dataset.replay_count,
            ),
        )
    except ActivityError as exc:
        raise CycleAborted.failed(f"estimate failed: {root_cause(exc)}") from exc
    if not estimate.fits:
        raise CycleAborted(CycleOutcome.OVER_BUDGET, estimate.reason)


class CycleHost(Protocol):
    """What the stage functions need of the workflow running the cycle (LoopWorkflow)."""

    async def enter(
        self,
        stage: CycleStage,
        cycle: int,
        *,
        dataset_id: int | None = None,
        candidate: str | None = None,
    ) -> None:
        """Announce a stage (the workflow's status, search attributes, the cycle's row)."""
        ...

    async def await_approval(self, gate: GateResult) -> tuple[Decision, str, str]:
        """A manual gate's verdict: the decision, its reason and who decided."""
        ...


# The gate's judgement: an activity from GateInput to GateResult (GateActivities.gate, or a
# bootstrap's BootstrapActivities.gate on the held-out set).
Judge = Callable[[Any, GateInput], GateResult]


async def gate_stage(
    host: CycleHost,
    run: CycleRun,
    *,
    baseline: EvalTarget,
    candidate: EvalTarget,
    previous_id: str | None,
    judge: Judge = GateActivities.gate,
) -> Decided:
    """The gate's decision on ``candidate`` against ``baseline`` (or the operator's, with a
    manual gate), recorded with ``previous_id`` as the champion it would replace; a
    decision other than promote ends the cycle as rejected."""
    await host.enter(CycleStage.GATE, run.cycle)
    policy = run.config.gate_policy
    gate = await db_activity(
        judge,
        GateInput(
            loop=run.loop,
            cycle=run.cycle,
            champion_checkpoint_id=baseline.checkpoint_id,
            candidate_checkpoint_id=candidate.checkpoint_id,
            confidence=policy.confidence,
            min_improvement_points=policy.min_improvement_points,
            regression_tolerance_points=policy.regression_tolerance_points,
            min_discordant_pairs=policy.min_discordant_pairs,
        ),
    )
    decision, reason, decided_by = gate.decision, gate.reason, "gate"
    if policy.mode == "manual":
        decision, reason, decided_by = await host.await_approval(gate)
    recorded = await db_activity(
        GateActivities.record_decision,
        RecordDecisionInput(
            loop=run.loop,
            cycle=run.cycle,
            decision=decision,
            reason=reason,
            statistics=gate.statistics,
            candidate_checkpoint_id=candidate.checkpoint_id,
            previous_checkpoint_id=previous_id,
            decided_by=decided_by,
        ),
    )
    if recorded.decision != Decision.PROMOTE:
        raise CycleAborted(CycleOutcome.REJECTED, reason, gate_points=run.gate_points(gate))
    return Decided(gate, recorded.promotion_id, reason)


async def promote_stage(
    host: CycleHost,
    run: CycleRun,
    *,
    candidate: EvalTarget,
    previous: EvalTarget | None,
    decided: Decided,
) -> CloseCycleInput:
    """Deploy the candidate behind a canary (``previous`` is restored on a live regression;
    None: nothing to restore); how the cycle closes, with its points."""
    await host.enter(CycleStage.PROMOTE, run.cycle)
    policy = run.config.gate_policy
    promoted = await child_stage(
        run.loop,
        PromoteWorkflow.run,
        PromoteInput(
            loop=run.loop,
            cycle=run.cycle,
            promotion_id=decided.promotion_id,
            candidate_checkpoint_id=candidate.checkpoint_id,
            candidate_uri=candidate.checkpoint_uri,
            previous_checkpoint_id=previous.checkpoint_id if previous else None,
            previous_uri=previous.checkpoint_uri if previous else None,
            serving_target=run.config.serving_target,
            canary_seconds=policy.canary_seconds,
            canary_check_interval_s=policy.canary_check_interval_s,
            canary_min_traces=policy.canary_min_traces,
            canary_max_drop_points=policy.canary_max_drop_points,
        ),
        CycleStage.PROMOTE,
        run.cycle,
    )
    return run.closed(promoted, candidate.checkpoint_id, decided)


async def calibrate(run: CycleRun, dataset: SnapshotResult, champion: EvalTarget) -> str | None:
    """Run the calibration pass (the cycle's own train job, shortened:
    services.training.calibration) when the loop has no measured rates yet; its run id, or
    None when none was needed. A pass that fails leaves the estimate on the defaults, which
    it then says; it does not end the cycle. Its job result is decoded in LoopWorkflow's
    sandbox, which finds the result's types only because workflows/loop.py passes
    ``workflows.payloads.jobs`` through."""
    need = await db_activity(
        EstimateActivities.calibration_needed, CalibrationInput(run.loop, run.cycle)
    )
    if not need.needed:
        return None
    run_id = run_id_for(run.loop, run.cycle, "calibrate")
    stage = TrainInput(
        loop=run.loop,
        cycle=run.cycle,
        dataset_id=dataset.dataset_id,
        train_uri=dataset.train_uri,
        base_checkpoint_id=champion.checkpoint_id,
        base_checkpoint_uri=champion.checkpoint_uri,
        environment=run.config.environment,
        profile=run.config.training_profile,
    )
    spec = {**train_job_spec(stage, run_id), "calibrate": True}
    job = cycle_job(
        stage,
        "calibrate",
        run_id,
        spec,
        base_checkpoint_id=champion.checkpoint_id,
        dataset_id=dataset.dataset_id,
    )
    try:
        done = await run_job_from_workflow(job, CALIBRATION_TIMEOUT)
    except ActivityError as exc:
        workflow.logger.warning("calibration %s failed: %s", run_id, root_cause(exc))
        return run_id
    if done.status != RunStatus.SUCCEEDED:
        workflow.logger.warning("calibration %s %s: %s", run_id, done.status, done.error or "")
    return run_id


async def roll_back(loop: str, reason: str) -> RollbackResult:
    """Plan (a read), deploy (the ``DEPLOY`` preset: heartbeats, three attempts, no row
    lock held), record. A deploy that fails is recorded and the loop carries on."""
    plan = await db_activity(DeployActivities.plan_rollback, RollbackInput(loop, reason))
    if plan.promotion_id is None or plan.checkpoint_id is None:
        return RollbackResult(False, plan.reason)
    error: str | None = None
    try:
        await long_activity(
            DeployActivities.deploy_checkpoint,
            DeployInput(
                loop,
                plan.serving_target,
                plan.checkpoint_id,
                plan.checkpoint_uri or "",
                purpose="rollback",
            ),
            DEPLOY,
        )
    except ActivityError as exc:
        error = root_cause(exc)
    return await db_activity(
        DeployActivities.finish_rollback,
        FinishRollbackInput(loop, reason, plan.promotion_id, plan.checkpoint_id, error),
    )
