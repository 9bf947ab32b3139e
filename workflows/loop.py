"""LoopWorkflow: one served model improved forever, one cycle per run.

Id ``loop/<name>``. Each run waits for a trigger (enough new curated tasks, the maximum
interval, a drift signal, or an operator's run-now), runs one cycle — curate, probe (only
with the curation policy's ``difficulty_filter``), snapshot, train, evaluate, gate,
promote, account — then continues as new carrying only :class:`LoopState`. Stages run as
child workflows with ids derived from the cycle, so a retry never duplicates work; cycles of
one loop never overlap because one workflow runs them in sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import (
    SearchAttributePair,
    SearchAttributeUpdate,
    TypedSearchAttributes,
)
from temporalio.exceptions import ActivityError, ChildWorkflowError, FailureError

with workflow.unsafe.imports_passed_through():
    from workflows.activities.curation import CurationActivities
    from workflows.activities.estimate import EstimateActivities, EstimateInput
    from workflows.activities.loop import LoopActivities
    from workflows.curate import CurateWorkflow, curate_batches
    from workflows.evaluate import EvaluateWorkflow
    from workflows.options import DEPLOY, LONG_DB_TIMEOUT, db_activity, long_activity
    from workflows.probe import ProbeWorkflow
    from workflows.promote import PromoteWorkflow
    from workflows.search_attributes import (
        RATCHET_CYCLE,
        RATCHET_LOOP,
        RATCHET_OUTCOME,
        RATCHET_STAGE,
    )
    from workflows.shared import (
        ApprovalSignal,
        CloseCycleInput,
        CurateInput,
        CurateResult,
        DeployInput,
        DriftInput,
        EvalTarget,
        EvaluateInput,
        FinishRollbackInput,
        GateInput,
        GateResult,
        LoopConfig,
        LoopConfigInput,
        LoopInput,
        LoopResult,
        LoopState,
        LoopStatus,
        PauseSignal,
        PendingWorkInput,
        ProbeInput,
        PromoteInput,
        RecordDecisionInput,
        ResumeSignal,
        RollbackInput,
        RollbackResult,
        RollbackSignal,
        RunNowSignal,
        SnapshotInput,
        SnapshotResult,
        StageInput,
        StartCycleInput,
        StartCycleResult,
        TrainInput,
        cycle_workflow_id,
    )
    from workflows.train import TrainWorkflow

InputT = TypeVar("InputT")
ResultT = TypeVar("ResultT")

# workflow.patched id of the difficulty probe stage (histories before it have no such stage).
PROBE_PATCH = "difficulty-probe-stage"
# workflow.patched id of honest points: cycle numbers continue after Postgres's last cycle,
# the frozen held-out set is evaluated, points gained are held-out points, and the cycle
# records the gate's points and the live delta too. Histories before it do none of this.
HONEST_POINTS_PATCH = "honest-points"
# workflow.patched id of the curate stage through the child helper, like every stage: a
# failed curation ends the cycle as failed. Histories before it let the failure end the loop.
CURATE_STAGE_PATCH = "curate-stage-helper"
# workflow.patched id of the operator rollback in three steps (plan, deploy with the DEPLOY
# preset outside any transaction, record): histories before it ran one rollback_champion.
ROLLBACK_DEPLOY_PATCH = "rollback-deploy"
# workflow.patched id of the estimate stage: before training, the cycle's cost is estimated
# and a cycle over what is left of the budget is refused (the loop pauses). Histories before
# it train without one.
ESTIMATE_PATCH = "cycle-estimate"
# Batches one trigger check curates at most; what is left waits for the next check.
TRIGGER_CHECK_MAX_BATCHES = 100


class CycleAborted(Exception):
    """A stage ended the cycle early with a business outcome (no data, rejected, failed)."""

    def __init__(self, outcome: str, detail: str, *, gate_points: float | None = None) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
        self.gate_points = gate_points


@workflow.defn
class LoopWorkflow:
    def __init__(self) -> None:
        self.loop = ""
        self.state = LoopState()
        self.stage = "starting"
        self.waiting_for: str | None = None
        # The cycle in progress (0 between cycles).
        self.cycle = 0
        self.approval: tuple[str, ApprovalSignal] | None = None

    # Signals, query ----------------------------------------------------------------------

    @workflow.signal
    def pause(self, signal: PauseSignal) -> None:
        self.state.paused = True
        self.state.pause_reason = signal.reason

    @workflow.signal
    def resume(self, signal: ResumeSignal) -> None:
        self.state.paused = False
        self.state.pause_reason = None

    @workflow.signal
    def run_now(self, signal: RunNowSignal) -> None:
        self.state.run_now = True

    @workflow.signal
    def approve(self, signal: ApprovalSignal) -> None:
        if signal.cycle in (0, self.cycle):
            self.approval = ("approve", signal)

    @workflow.signal
    def reject(self, signal: ApprovalSignal) -> None:
        if signal.cycle in (0, self.cycle):
            self.approval = ("reject", signal)

    @workflow.signal
    def rollback(self, signal: RollbackSignal) -> None:
        self.state.rollback_reason = signal.reason

    @workflow.query
    def status(self) -> LoopStatus:
        return LoopStatus(
            loop=self.loop,
            stage=self.stage,
            cycle=self.cycle or self.state.cycle_number,
            paused=self.state.paused,
            pause_reason=self.state.pause_reason,
            waiting_for=self.waiting_for,
            last_outcome=self.state.last_outcome,
            cycles_done=self.state.cycles_done,
        )

    # Main --------------------------------------------------------------------------------

    @workflow.run
    async def run(self, input: LoopInput) -> LoopResult:
        self.loop = input.loop
        if input.state is not None:
            self.state = input.state
        self._set_stage("waiting")
        checks = 0
        while True:
            await self._handle_rollback_request()
            config = await self._load_config()
            if config.status == "paused" and not self.state.paused:
                self.state.paused = True
                self.state.pause_reason = "paused in the database"
            if self.state.paused:
                self._set_stage("paused")
                self.waiting_for = "resume"
                await workflow.wait_condition(
                    lambda: not self.state.paused or self.state.rollback_reason is not None
                )
                self.waiting_for = None
                self._set_stage("waiting")
                continue
            trigger, detail = await self._check_trigger(config)
            if trigger is not None:
                await self._run_cycle(config, trigger, detail)
                if input.max_cycles is not None and self.state.cycles_done >= input.max_cycles:
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    return LoopResult(self.loop, self.state.cycles_done, self.state.last_outcome)
                break
            checks += 1
            if checks >= input.checks_per_run or workflow.info().is_continue_as_new_suggested():
                break
            self.waiting_for = "trigger"
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: (
                        self.state.run_now
                        or self.state.paused
                        or self.state.rollback_reason is not None
                    ),
                    timeout=timedelta(seconds=config.trigger_policy.check_interval_s),
                )
            self.waiting_for = None
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(
            LoopInput(
                loop=input.loop,
                state=self.state,
                max_cycles=input.max_cycles,
                checks_per_run=input.checks_per_run,
            )
        )

    # Trigger -----------------------------------------------------------------------------

    async def _check_trigger(self, config: LoopConfig) -> tuple[str | None, dict[str, object]]:
        """Curate what arrived, then decide whether a cycle starts now and why."""
        await self._curate_pending()
        pending = await db_activity(
            CurationActivities.pending_work,
            PendingWorkInput(self.loop),
        )
        detail: dict[str, object] = {"new_train_tasks": pending.new_train_tasks}
        if self.state.run_now:
            self.state.run_now = False
            return "operator", detail
        if pending.new_train_tasks <= 0:
            return None, detail
        if pending.new_train_tasks >= config.trigger_policy.min_new_tasks:
            detail["min_new_tasks"] = config.trigger_policy.min_new_tasks
            return "min_new_tasks", detail
        if config.trigger_policy.drift_enabled:
            drift = await db_activity(
                CurationActivities.check_drift,
                DriftInput(self.loop),
            )
            if drift.drifted:
                detail.update(
                    failure_rate=drift.failure_rate,
                    threshold=drift.threshold,
                    model_version=drift.model_version,
                )
                return "drift", detail
        if self.state.last_cycle_ended_at is not None:
            elapsed = (workflow.now() - _parse_time(self.state.last_cycle_ended_at)).total_seconds()
            if elapsed >= config.trigger_policy.max_interval_s:
                detail["max_interval_s"] = config.trigger_policy.max_interval_s
                return "max_interval", detail
        return None, detail

    async def _curate_pending(self) -> CurateResult:
        """Curate what arrived, with the batches and settings of the cycle's curate stage."""
        return await curate_batches(CurateInput(self.loop, max_batches=TRIGGER_CHECK_MAX_BATCHES))

    # Cycle -------------------------------------------------------------------------------

    async def _run_cycle(self, config: LoopConfig, trigger: str, detail: dict[str, object]) -> None:
        honest = workflow.patched(HONEST_POINTS_PATCH)
        # A restarted loop (its workflow chain broken, Temporal's data lost while Postgres
        # kept its rows) continues after the last cycle Postgres knows, never replaying one.
        last = max(self.state.cycle_number, config.last_cycle_number if honest else 0)
        cycle = last + 1
        self.state.cycle_number = cycle
        self.cycle = cycle
        self.approval = None
        started = await db_activity(
            LoopActivities.start_cycle,
            StartCycleInput(
                loop=self.loop,
                number=cycle,
                trigger=trigger,
                trigger_detail=dict(detail),
                workflow_id=workflow.info().workflow_id,
            ),
        )
        ended = CloseCycleInput(self.loop, cycle, "failed", "")
        try:
            ended = await self._cycle_stages(config, cycle, started, honest=honest)
        except CycleAborted as aborted:
            ended = CloseCycleInput(
                self.loop, cycle, aborted.outcome, aborted.detail, gate_points=aborted.gate_points
            )
        outcome, reason = ended.outcome, ended.detail
        self._set_stage("account")
        closed = await db_activity(LoopActivities.close_cycle, ended)
        workflow.logger.info(
            "cycle %s of %s ended: %s (%s); cost $%.4f",
            cycle,
            self.loop,
            outcome,
            reason,
            closed.cost_usd,
        )
        self.state.cycles_done += 1
        self.state.last_outcome = outcome
        self.state.last_cycle_ended_at = workflow.now().isoformat()
        self.cycle = 0
        self._set_stage("waiting", outcome=outcome)
        if outcome == "over_budget":
            self.state.paused = True
            self.state.pause_reason = f"cycle {cycle} refused: {reason}"
        elif closed.budget_exhausted:
            self.state.paused = True
            self.state.pause_reason = (
                f"budget spent (${closed.cumulative_cost_usd:.2f} of the loop's budget)"
            )

    async def _cycle_stages(
        self, config: LoopConfig, cycle: int, started: StartCycleResult, *, honest: bool
    ) -> CloseCycleInput:
        """Run the stages of a cycle; how it ended, with its numbers (held-out points, gate
        points, the canary's samples), as the accounting stage records it."""
        self._set_stage("curate", cycle=cycle)
        await self._child(
            CurateWorkflow.run,
            CurateInput(self.loop),
            "curate",
            cycle,
            fail_cycle=workflow.patched(CURATE_STAGE_PATCH),
        )
        # Checked first so a loop without the filter records no marker: its history is
        # exactly what it was before the stage existed.
        if config.curation_policy.difficulty_filter and workflow.patched(PROBE_PATCH):
            await self._probe(config, cycle, started)
        self._set_stage("snapshot", cycle=cycle)
        await self._mark_stage(cycle, "snapshot")
        dataset = await db_activity(
            CurationActivities.snapshot_dataset,
            SnapshotInput(self.loop, cycle),
            start_to_close=LONG_DB_TIMEOUT,
        )
        if dataset.difficulty:
            workflow.logger.info(
                "dataset %s of %s: difficulty %s", dataset.dataset_id, self.loop, dataset.difficulty
            )
        if dataset.train_count == 0 or dataset.eval_count == 0:
            raise CycleAborted(
                "no_data",
                f"dataset has {dataset.train_count} train and {dataset.eval_count} eval tasks",
            )
        if started.champion_checkpoint_id is None or started.champion_uri is None:
            raise CycleAborted("failed", "the loop has no champion checkpoint to train from")
        if workflow.patched(ESTIMATE_PATCH):
            await self._estimate(config, cycle, dataset)

        self._set_stage("train", cycle=cycle)
        await self._mark_stage(cycle, "train", dataset_id=dataset.dataset_id)
        trained = await self._child(
            TrainWorkflow.run,
            TrainInput(
                loop=self.loop,
                cycle=cycle,
                dataset_id=dataset.dataset_id,
                train_uri=dataset.train_uri,
                base_checkpoint_id=started.champion_checkpoint_id,
                base_checkpoint_uri=started.champion_uri,
                environment=config.environment,
                profile=config.training_profile,
            ),
            "train",
            cycle,
        )
        if trained.status != "succeeded" or trained.checkpoint_id is None:
            raise CycleAborted("failed", f"training {trained.status}: {trained.error or ''}")

        self._set_stage("evaluate", cycle=cycle)
        await self._mark_stage(cycle, "evaluate", candidate=trained.checkpoint_id)
        task_sets = {"eval": dataset.eval_uri}
        if dataset.regression_uri and dataset.regression_count > 0:
            task_sets["regression"] = dataset.regression_uri
        if honest and dataset.heldout_uri and dataset.heldout_count > 0:
            task_sets["heldout"] = dataset.heldout_uri
        evaluated = await self._child(
            EvaluateWorkflow.run,
            EvaluateInput(
                loop=self.loop,
                cycle=cycle,
                dataset_id=dataset.dataset_id,
                environment=config.environment,
                task_sets=task_sets,
                targets=[
                    EvalTarget("champion", started.champion_checkpoint_id, started.champion_uri),
                    EvalTarget("candidate", trained.checkpoint_id, trained.checkpoint_uri or ""),
                ],
                samples=config.gate_policy.eval_samples,
                profile=config.training_profile,
                temperature=config.gate_policy.eval_temperature,
            ),
            "evaluate",
            cycle,
        )
        if evaluated.errors:
            raise CycleAborted("failed", "evaluation failed: " + "; ".join(evaluated.errors))

        self._set_stage("gate", cycle=cycle)
        await self._mark_stage(cycle, "gate")
        gate = await db_activity(
            LoopActivities.gate,
            GateInput(
                loop=self.loop,
                cycle=cycle,
                champion_checkpoint_id=started.champion_checkpoint_id,
                candidate_checkpoint_id=trained.checkpoint_id,
                confidence=config.gate_policy.confidence,
                min_improvement_points=config.gate_policy.min_improvement_points,
                regression_tolerance_points=config.gate_policy.regression_tolerance_points,
                min_discordant_pairs=config.gate_policy.min_discordant_pairs,
            ),
        )
        decision, reason, decided_by = gate.decision, gate.reason, "gate"
        if config.gate_policy.mode == "manual":
            decision, reason, decided_by = await self._await_approval(gate)
        recorded = await db_activity(
            LoopActivities.record_decision,
            RecordDecisionInput(
                loop=self.loop,
                cycle=cycle,
                decision=decision,
                reason=reason,
                statistics=gate.statistics,
                candidate_checkpoint_id=trained.checkpoint_id,
                previous_checkpoint_id=started.champion_checkpoint_id,
                decided_by=decided_by,
            ),
        )
        gate_points = _number(gate.statistics.get("delta_points")) if honest else None
        if recorded.decision != "promote":
            raise CycleAborted("rejected", reason, gate_points=gate_points)

        self._set_stage("promote", cycle=cycle)
        await self._mark_stage(cycle, "promote")
        promoted = await self._child(
            PromoteWorkflow.run,
            PromoteInput(
                loop=self.loop,
                cycle=cycle,
                promotion_id=recorded.promotion_id,
                candidate_checkpoint_id=trained.checkpoint_id,
                candidate_uri=trained.checkpoint_uri or "",
                previous_checkpoint_id=started.champion_checkpoint_id,
                previous_uri=started.champion_uri,
                serving_target=config.serving_target,
                canary_seconds=config.gate_policy.canary_seconds,
                canary_check_interval_s=config.gate_policy.canary_check_interval_s,
                canary_min_traces=config.gate_policy.canary_min_traces,
                canary_max_drop_points=config.gate_policy.canary_max_drop_points,
            ),
            "promote",
            cycle,
        )
        live = {"live_baseline": promoted.live_baseline, "live_canary": promoted.live_canary}
        if promoted.status != "held":
            outcome = "rolled_back" if promoted.status == "rolled_back" else "failed"
            return CloseCycleInput(
                self.loop,
                cycle,
                outcome,
                promoted.reason,
                0.0,
                trained.checkpoint_id,
                gate_points,
                **live,
            )
        if not honest:
            points = float(gate.statistics.get("delta_points", 0.0))
            return CloseCycleInput(
                self.loop, cycle, "promoted", reason, points, trained.checkpoint_id
            )
        # Points gained are the held-out set's: the gate's eval set is new failures, on
        # which the champion scores ~0 by construction. No held-out set, no points claimed.
        heldout = _number(gate.statistics.get("heldout_points"))
        return CloseCycleInput(
            self.loop,
            cycle,
            "promoted",
            reason,
            heldout,
            trained.checkpoint_id,
            gate_points,
            **live,
        )

    async def _estimate(self, config: LoopConfig, cycle: int, dataset: SnapshotResult) -> None:
        """Estimate the cycle's train and eval jobs; one over what is left of the budget
        ends the cycle as ``over_budget`` (the loop pauses) before anything is spent on it."""
        self._set_stage("estimate", cycle=cycle)
        counts = [dataset.eval_count, dataset.regression_count]
        if dataset.heldout_uri:
            counts.append(dataset.heldout_count)
        try:
            estimate = await db_activity(
                EstimateActivities.estimate_cycle,
                EstimateInput(
                    loop=self.loop,
                    cycle=cycle,
                    profile=config.training_profile,
                    eval_task_counts=counts,
                    samples_per_task=config.gate_policy.eval_samples,
                ),
            )
        except ActivityError as exc:
            raise CycleAborted("failed", f"estimate failed: {_root_cause(exc)}") from exc
        if not estimate.fits:
            raise CycleAborted("over_budget", estimate.reason)

    async def _probe(self, config: LoopConfig, cycle: int, started: StartCycleResult) -> None:
        """Probe the champion on unprobed train tasks so the snapshot can filter them.

        A probe that fails — its job failed or was lost, or the child workflow failed on a
        bad spec or unreadable results — does not end the cycle: the probe only sharpens
        the train split, and tasks without a pass rate are kept as ``unprobed`` (counted in
        the dataset's difficulty stats). The failed run stays recorded with its error and
        cost, the failure is logged, and the next cycle probes those tasks again.
        """
        if started.champion_checkpoint_id is None or started.champion_uri is None:
            return  # nothing to probe with; the cycle fails for the same reason after the snapshot
        self._set_stage("probe", cycle=cycle)
        await self._mark_stage(cycle, "probe")
        try:
            probed = await self._child(
                ProbeWorkflow.run,
                ProbeInput(
                    loop=self.loop,
                    cycle=cycle,
                    environment=config.environment,
                    champion_checkpoint_id=started.champion_checkpoint_id,
                    champion_uri=started.champion_uri,
                    attempts=config.curation_policy.probe_attempts,
                    profile=config.training_profile,
                ),
                "probe",
                cycle,
            )
        except CycleAborted as exc:
            workflow.logger.warning(
                "%s of %s; the snapshot goes on without it", exc.detail, self.loop
            )
            return
        if probed.status not in ("succeeded", "skipped"):
            workflow.logger.warning(
                "probe run %s %s (%s); the snapshot goes on without it",
                probed.run_id,
                probed.status,
                probed.error or "no reason given",
            )

    async def _await_approval(self, gate: GateResult) -> tuple[str, str, str]:
        """Manual gate: wait for approve/reject; the gate's statistics are shown meanwhile."""
        self._set_stage("awaiting_approval", cycle=self.cycle)
        self.waiting_for = f"approve or reject (gate recommends {gate.decision}: {gate.reason})"
        await workflow.wait_condition(lambda: self.approval is not None)
        self.waiting_for = None
        assert self.approval is not None
        verdict, signal = self.approval
        decision = "promote" if verdict == "approve" else "reject"
        reason = signal.reason or f"{verdict}d by {signal.by}; gate said: {gate.reason}"
        return decision, reason, signal.by

    async def _handle_rollback_request(self) -> None:
        if self.state.rollback_reason is None:
            return
        reason = self.state.rollback_reason
        self.state.rollback_reason = None
        self._set_stage("rollback")
        if workflow.patched(ROLLBACK_DEPLOY_PATCH):
            result = await self._roll_back(reason)
        else:
            result = await db_activity(
                LoopActivities.rollback_champion,
                RollbackInput(self.loop, reason),
                start_to_close=LONG_DB_TIMEOUT,
            )
        workflow.logger.info("rollback of %s: %s", self.loop, result.reason)
        self._set_stage("waiting")

    async def _roll_back(self, reason: str) -> RollbackResult:
        """Plan (a read), deploy (the ``DEPLOY`` preset: heartbeats, three attempts, no row
        lock held), record. A deploy that fails is recorded and the loop carries on."""
        plan = await db_activity(LoopActivities.plan_rollback, RollbackInput(self.loop, reason))
        if plan.promotion_id is None or plan.checkpoint_id is None:
            return RollbackResult(False, plan.reason)
        error: str | None = None
        try:
            await long_activity(
                LoopActivities.deploy_checkpoint,
                DeployInput(
                    self.loop,
                    plan.serving_target,
                    plan.checkpoint_id,
                    plan.checkpoint_uri or "",
                    purpose="rollback",
                ),
                DEPLOY,
            )
        except ActivityError as exc:
            error = _root_cause(exc)
        return await db_activity(
            LoopActivities.finish_rollback,
            FinishRollbackInput(self.loop, reason, plan.promotion_id, plan.checkpoint_id, error),
        )

    # Helpers -----------------------------------------------------------------------------

    async def _child(
        self,
        run_fn: Callable[[Any, InputT], Awaitable[ResultT]],
        arg: InputT,
        stage: str,
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
                id=cycle_workflow_id(self.loop, cycle, stage),
                search_attributes=self._search_attributes(stage, cycle),
            )
        except ChildWorkflowError as exc:
            if not fail_cycle:
                raise
            raise CycleAborted("failed", f"{stage} failed: {_root_cause(exc)}") from exc

    async def _load_config(self) -> LoopConfig:
        return await db_activity(
            LoopActivities.load_loop_config,
            LoopConfigInput(self.loop),
        )

    async def _mark_stage(
        self,
        cycle: int,
        stage: str,
        *,
        dataset_id: int | None = None,
        candidate: str | None = None,
    ) -> None:
        await db_activity(
            LoopActivities.set_cycle_stage,
            StageInput(self.loop, cycle, stage, dataset_id, candidate),
        )

    def _search_attributes(self, stage: str, cycle: int) -> TypedSearchAttributes:
        return TypedSearchAttributes(
            [
                SearchAttributePair(RATCHET_LOOP, self.loop),
                SearchAttributePair(RATCHET_STAGE, stage),
                SearchAttributePair(RATCHET_CYCLE, cycle),
            ]
        )

    def _set_stage(
        self, stage: str, *, cycle: int | None = None, outcome: str | None = None
    ) -> None:
        self.stage = stage
        updates: list[SearchAttributeUpdate[Any]] = [
            RATCHET_LOOP.value_set(self.loop),
            RATCHET_STAGE.value_set(stage),
        ]
        if cycle is not None:
            updates.append(RATCHET_CYCLE.value_set(cycle))
        if outcome is not None:
            updates.append(RATCHET_OUTCOME.value_set(outcome))
        workflow.upsert_search_attributes(updates)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _root_cause(error: FailureError) -> str:
    """The innermost failure's message: what actually went wrong in a stage."""
    cause: BaseException = error
    while isinstance(cause, FailureError) and cause.cause is not None:
        cause = cause.cause
    return str(cause)
