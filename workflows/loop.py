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
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import (
    SearchAttributeUpdate,
)

with workflow.unsafe.imports_passed_through():
    from services.loop.states import CycleOutcome, CycleStage, Decision, LoopLifecycle, RunStatus
    from workflows.activities.curation import CurationActivities
    from workflows.activities.cycle import CycleActivities
    from workflows.activities.deploy import DeployActivities
    from workflows.activities.gate import GateActivities
    from workflows.curate import CurateWorkflow, curate_batches
    from workflows.cycle import (
        CYCLE_ROW_STAGES,
        CycleAborted,
        CycleRun,
        Decided,
        candidate_of,
        champion_of,
        child_stage,
        estimate_stage,
        roll_back,
    )
    from workflows.evaluate import EvaluateWorkflow
    from workflows.options import LONG_DB_TIMEOUT, db_activity
    from workflows.payloads.curation import (
        CurateInput,
        CurateResult,
        DriftInput,
        PendingWorkInput,
        SnapshotInput,
        SnapshotResult,
    )
    from workflows.payloads.cycle import (
        CloseCycleInput,
        StageInput,
        StartCycleInput,
        StartCycleResult,
    )
    from workflows.payloads.evaluate import EvalTarget, EvaluateInput
    from workflows.payloads.gate import GateInput, GateResult, RecordDecisionInput
    from workflows.payloads.jobs import RunJobResult  # noqa: F401 (see cycle.calibrate)
    from workflows.payloads.loop import (
        ApprovalSignal,
        LoopConfig,
        LoopConfigInput,
        LoopInput,
        LoopResult,
        LoopState,
        LoopStatus,
        PauseSignal,
        ResumeSignal,
        RollbackSignal,
        RunNowSignal,
    )
    from workflows.payloads.probe import ProbeInput
    from workflows.payloads.promote import PromoteInput
    from workflows.payloads.rollback import RollbackInput
    from workflows.payloads.train import TrainInput, TrainResult
    from workflows.probe import ProbeWorkflow
    from workflows.promote import PromoteWorkflow
    from workflows.search_attributes import (
        RATCHET_CYCLE,
        RATCHET_LOOP,
        RATCHET_OUTCOME,
        RATCHET_STAGE,
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
# and refused over what is left of the budget (the loop pauses); earlier histories have none.
ESTIMATE_PATCH = "cycle-estimate"
# Batches one trigger check curates at most; what is left waits for the next check.
TRIGGER_CHECK_MAX_BATCHES = 100


@workflow.defn
class LoopWorkflow:
    def __init__(self) -> None:
        self.loop = ""
        self.state = LoopState()
        self.stage = CycleStage.STARTING
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
        self._set_stage(CycleStage.WAITING)
        checks = 0
        while True:
            await self._handle_rollback_request()
            config = await self._load_config()
            if config.status == LoopLifecycle.PAUSED and not self.state.paused:
                self.state.paused = True
                self.state.pause_reason = "paused in the database"
            if self.state.paused:
                self._set_stage(CycleStage.PAUSED)
                self.waiting_for = "resume"
                await workflow.wait_condition(
                    lambda: not self.state.paused or self.state.rollback_reason is not None
                )
                self.waiting_for = None
                self._set_stage(CycleStage.WAITING)
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
            ended = datetime.fromisoformat(self.state.last_cycle_ended_at)
            elapsed = (workflow.now() - ended).total_seconds()
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
            CycleActivities.start_cycle,
            StartCycleInput(
                loop=self.loop,
                number=cycle,
                trigger=trigger,
                trigger_detail=dict(detail),
                workflow_id=workflow.info().workflow_id,
            ),
        )
        ended = CloseCycleInput(self.loop, cycle, CycleOutcome.FAILED, "")
        try:
            ended = await self._cycle_stages(config, cycle, started, honest=honest)
        except CycleAborted as aborted:
            ended = CloseCycleInput(
                self.loop, cycle, aborted.outcome, aborted.detail, gate_points=aborted.gate_points
            )
        outcome, reason = ended.outcome, ended.detail
        self._set_stage(CycleStage.ACCOUNT)
        closed = await db_activity(CycleActivities.close_cycle, ended)
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
        self._set_stage(CycleStage.WAITING, outcome=outcome)
        if outcome == CycleOutcome.OVER_BUDGET:
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
        """Run the stages of a cycle, in order; how it ended, with its numbers (held-out
        points, gate points, the canary's samples), as the accounting stage records it.
        A stage that ends the cycle early raises :class:`CycleAborted`."""
        run = CycleRun(self.loop, config, cycle, honest)
        await self._curate_stage(run)
        # Checked first so a loop without the filter records no marker: its history is
        # exactly what it was before the stage existed.
        if config.curation_policy.difficulty_filter and workflow.patched(PROBE_PATCH):
            await self._probe(run, started)
        dataset = await self._snapshot_stage(run)
        champion = champion_of(started)
        if workflow.patched(ESTIMATE_PATCH):
            await self._enter(CycleStage.ESTIMATE, run.cycle)
            await estimate_stage(run, dataset, champion)
        trained = await self._train_stage(run, dataset, champion)
        await self._evaluate_stage(run, dataset, champion, trained)
        decided = await self._gate_stage(run, champion, trained)
        return await self._promote_stage(run, champion, trained, decided)

    async def _enter(
        self,
        stage: CycleStage,
        cycle: int,
        *,
        dataset_id: int | None = None,
        candidate: str | None = None,
    ) -> None:
        """Announce a cycle's stage: the workflow's status and search attributes, and, for
        the stages the cycle's row records (``CYCLE_ROW_STAGES``), the row too."""
        self._set_stage(stage, cycle=cycle)
        if stage in CYCLE_ROW_STAGES:
            await db_activity(
                CycleActivities.set_cycle_stage,
                StageInput(self.loop, cycle, stage, dataset_id, candidate),
            )

    async def _curate_stage(self, run: CycleRun) -> None:
        await self._enter(CycleStage.CURATE, run.cycle)
        await child_stage(
            self.loop,
            CurateWorkflow.run,
            CurateInput(self.loop),
            CycleStage.CURATE,
            run.cycle,
            fail_cycle=workflow.patched(CURATE_STAGE_PATCH),
        )

    async def _snapshot_stage(self, run: CycleRun) -> SnapshotResult:
        """Freeze the cycle's dataset; too few train or eval tasks end the cycle (no_data)."""
        await self._enter(CycleStage.SNAPSHOT, run.cycle)
        dataset = await db_activity(
            CurationActivities.snapshot_dataset,
            SnapshotInput(self.loop, run.cycle),
            start_to_close=LONG_DB_TIMEOUT,
        )
        if dataset.difficulty:
            workflow.logger.info(
                "dataset %s of %s: difficulty %s", dataset.dataset_id, self.loop, dataset.difficulty
            )
        if dataset.train_count == 0 or dataset.eval_count == 0:
            raise CycleAborted(
                CycleOutcome.NO_DATA,
                f"dataset has {dataset.train_count} train and {dataset.eval_count} eval tasks",
            )
        return dataset

    async def _train_stage(
        self, run: CycleRun, dataset: SnapshotResult, champion: EvalTarget
    ) -> TrainResult:
        await self._enter(CycleStage.TRAIN, run.cycle, dataset_id=dataset.dataset_id)
        trained = await child_stage(
            self.loop,
            TrainWorkflow.run,
            TrainInput(
                loop=self.loop,
                cycle=run.cycle,
                dataset_id=dataset.dataset_id,
                train_uri=dataset.train_uri,
                base_checkpoint_id=champion.checkpoint_id,
                base_checkpoint_uri=champion.checkpoint_uri,
                environment=run.config.environment,
                profile=run.config.training_profile,
            ),
            CycleStage.TRAIN,
            run.cycle,
        )
        if trained.status != RunStatus.SUCCEEDED or trained.checkpoint_id is None:
            raise CycleAborted.failed(f"training {trained.status}: {trained.error or ''}")
        return trained

    async def _evaluate_stage(
        self, run: CycleRun, dataset: SnapshotResult, champion: EvalTarget, trained: TrainResult
    ) -> None:
        """Evaluate champion and candidate on the eval set, the regression set, and (honest
        points) the frozen held-out set; a failed evaluation ends the cycle."""
        candidate = candidate_of(trained)
        await self._enter(CycleStage.EVALUATE, run.cycle, candidate=candidate.checkpoint_id)
        task_sets = {"eval": dataset.eval_uri}
        if dataset.regression_uri and dataset.regression_count > 0:
            task_sets["regression"] = dataset.regression_uri
        if run.honest and dataset.heldout_uri and dataset.heldout_count > 0:
            task_sets["heldout"] = dataset.heldout_uri
        gate_policy = run.config.gate_policy
        evaluated = await child_stage(
            self.loop,
            EvaluateWorkflow.run,
            EvaluateInput(
                loop=self.loop,
                cycle=run.cycle,
                dataset_id=dataset.dataset_id,
                environment=run.config.environment,
                task_sets=task_sets,
                targets=[champion, candidate],
                samples=gate_policy.eval_samples,
                profile=run.config.training_profile,
                temperature=gate_policy.eval_temperature,
            ),
            CycleStage.EVALUATE,
            run.cycle,
        )
        if evaluated.errors:
            raise CycleAborted.failed("evaluation failed: " + "; ".join(evaluated.errors))

    async def _gate_stage(
        self, run: CycleRun, champion: EvalTarget, trained: TrainResult
    ) -> Decided:
        """The gate's decision (or the operator's, with a manual gate), recorded; a decision
        other than promote ends the cycle as rejected."""
        candidate = candidate_of(trained)
        await self._enter(CycleStage.GATE, run.cycle)
        policy = run.config.gate_policy
        gate = await db_activity(
            GateActivities.gate,
            GateInput(
                loop=self.loop,
                cycle=run.cycle,
                champion_checkpoint_id=champion.checkpoint_id,
                candidate_checkpoint_id=candidate.checkpoint_id,
                confidence=policy.confidence,
                min_improvement_points=policy.min_improvement_points,
                regression_tolerance_points=policy.regression_tolerance_points,
                min_discordant_pairs=policy.min_discordant_pairs,
            ),
        )
        decision, reason, decided_by = gate.decision, gate.reason, "gate"
        if policy.mode == "manual":
            decision, reason, decided_by = await self._await_approval(gate)
        recorded = await db_activity(
            GateActivities.record_decision,
            RecordDecisionInput(
                loop=self.loop,
                cycle=run.cycle,
                decision=decision,
                reason=reason,
                statistics=gate.statistics,
                candidate_checkpoint_id=candidate.checkpoint_id,
                previous_checkpoint_id=champion.checkpoint_id,
                decided_by=decided_by,
            ),
        )
        if recorded.decision != Decision.PROMOTE:
            raise CycleAborted(CycleOutcome.REJECTED, reason, gate_points=run.gate_points(gate))
        return Decided(gate, recorded.promotion_id, reason)

    async def _promote_stage(
        self,
        run: CycleRun,
        champion: EvalTarget,
        trained: TrainResult,
        decided: Decided,
    ) -> CloseCycleInput:
        """Deploy the candidate behind a canary; how the cycle closes, with its points."""
        candidate = candidate_of(trained)
        await self._enter(CycleStage.PROMOTE, run.cycle)
        policy = run.config.gate_policy
        promoted = await child_stage(
            self.loop,
            PromoteWorkflow.run,
            PromoteInput(
                loop=self.loop,
                cycle=run.cycle,
                promotion_id=decided.promotion_id,
                candidate_checkpoint_id=candidate.checkpoint_id,
                candidate_uri=candidate.checkpoint_uri,
                previous_checkpoint_id=champion.checkpoint_id,
                previous_uri=champion.checkpoint_uri,
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

    async def _probe(self, run: CycleRun, started: StartCycleResult) -> None:
        """Probe the champion on unprobed train tasks so the snapshot can filter them.

        A probe that fails — its job failed or was lost, or the child workflow failed on a
        bad spec or unreadable results — does not end the cycle: the probe only sharpens
        the train split, and tasks without a pass rate are kept as ``unprobed`` (counted in
        the dataset's difficulty stats). The failed run stays recorded with its error and
        cost, the failure is logged, and the next cycle probes those tasks again.
        """
        if started.champion_checkpoint_id is None or started.champion_uri is None:
            return  # nothing to probe with; the cycle fails for the same reason after the snapshot
        await self._enter(CycleStage.PROBE, run.cycle)
        try:
            probed = await child_stage(
                self.loop,
                ProbeWorkflow.run,
                ProbeInput(
                    loop=self.loop,
                    cycle=run.cycle,
                    environment=run.config.environment,
                    champion_checkpoint_id=started.champion_checkpoint_id,
                    champion_uri=started.champion_uri,
                    attempts=run.config.curation_policy.probe_attempts,
                    profile=run.config.training_profile,
                ),
                CycleStage.PROBE,
                run.cycle,
            )
        except CycleAborted as exc:
            workflow.logger.warning(
                "%s of %s; the snapshot goes on without it", exc.detail, self.loop
            )
            return
        if not probed.status.clean:
            workflow.logger.warning(
                "probe run %s %s (%s); the snapshot goes on without it",
                probed.run_id,
                probed.status,
                probed.error or "no reason given",
            )

    async def _await_approval(self, gate: GateResult) -> tuple[Decision, str, str]:
        """Manual gate: wait for approve/reject; the gate's statistics are shown meanwhile."""
        self._set_stage(CycleStage.AWAITING_APPROVAL, cycle=self.cycle)
        self.waiting_for = f"approve or reject (gate recommends {gate.decision}: {gate.reason})"
        await workflow.wait_condition(lambda: self.approval is not None)
        self.waiting_for = None
        assert self.approval is not None
        verdict, signal = self.approval
        decision = Decision.PROMOTE if verdict == "approve" else Decision.REJECT
        reason = signal.reason or f"{verdict}d by {signal.by}; gate said: {gate.reason}"
        return decision, reason, signal.by

    async def _handle_rollback_request(self) -> None:
        if self.state.rollback_reason is None:
            return
        reason = self.state.rollback_reason
        self.state.rollback_reason = None
        self._set_stage(CycleStage.ROLLBACK)
        if workflow.patched(ROLLBACK_DEPLOY_PATCH):
            result = await roll_back(self.loop, reason)
        else:
            result = await db_activity(
                DeployActivities.rollback_champion,
                RollbackInput(self.loop, reason),
                start_to_close=LONG_DB_TIMEOUT,
            )
        workflow.logger.info("rollback of %s: %s", self.loop, result.reason)
        self._set_stage(CycleStage.WAITING)

    # Helpers -----------------------------------------------------------------------------

    async def _load_config(self) -> LoopConfig:
        return await db_activity(
            CycleActivities.load_loop_config,
            LoopConfigInput(self.loop),
        )

    def _set_stage(
        self, stage: CycleStage, *, cycle: int | None = None, outcome: str | None = None
    ) -> None:
        self.stage = stage
        updates: list[SearchAttributeUpdate[Any]] = [RATCHET_LOOP.value_set(self.loop)]
        updates.append(RATCHET_STAGE.value_set(stage))
        if cycle is not None:
            updates.append(RATCHET_CYCLE.value_set(cycle))
        if outcome is not None:
            updates.append(RATCHET_OUTCOME.value_set(outcome))
        workflow.upsert_search_attributes(updates)
