"""LoopWorkflow: one served model improved forever, one cycle per run.

Id ``loop/<name>``. Each run waits for a trigger (workflows/trigger.py: enough new curated
tasks, the maximum interval, a drift signal, an operator's run-now, or a bootstrap), runs one
cycle — curate, probe (only with the curation policy's ``difficulty_filter``), snapshot,
train, evaluate, gate, promote, account; a bootstrap's cycle (workflows/bootstrap.py) trains
a first champion from the loop's successful traces and judges it against the base model —
then continues as new carrying only :class:`LoopState`. Stages run as child workflows with
ids derived from the cycle, so a retry never duplicates work; cycles of one loop never
overlap because one workflow runs them in sequence.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate

with workflow.unsafe.imports_passed_through():
    from services.loop.states import CycleOutcome, CycleStage, Decision, LoopLifecycle, RunStatus
    from workflows.activities.curation import CurationActivities
    from workflows.activities.cycle import CycleActivities
    from workflows.activities.deploy import DeployActivities
    from workflows.bootstrap import BOOTSTRAP_TRIGGER, bootstrap_stages
    from workflows.curate import CurateWorkflow
    from workflows.cycle import (
        CYCLE_ROW_STAGES,
        CycleAborted,
        CycleRun,
        candidate_of,
        champion_of,
        child_stage,
        estimate_stage,
        gate_stage,
        promote_stage,
        roll_back,
    )
    from workflows.evaluate import EvaluateWorkflow
    from workflows.options import LONG_DB_TIMEOUT, db_activity
    from workflows.payloads.bootstrap import BootstrapReadiness, PrepareBootstrapResult
    from workflows.payloads.curation import CurateInput, SnapshotInput, SnapshotResult
    from workflows.payloads.cycle import (
        CloseCycleInput,
        StageInput,
        StartCycleInput,
        StartCycleResult,
    )
    from workflows.payloads.evaluate import EvalTarget, EvaluateInput
    from workflows.payloads.gate import GateResult
    from workflows.payloads.jobs import RunJobResult  # noqa: F401 (see cycle.calibrate)
    from workflows.payloads.loop import (
        ApprovalSignal,
        BootstrapSignal,
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
        WakeSignal,
    )
    from workflows.payloads.probe import ProbeInput
    from workflows.payloads.promote import PromoteResult
    from workflows.payloads.rollback import RollbackInput
    from workflows.payloads.train import TrainInput, TrainResult
    from workflows.probe import ProbeWorkflow
    from workflows.search_attributes import (
        RATCHET_CYCLE,
        RATCHET_LOOP,
        RATCHET_OUTCOME,
        RATCHET_STAGE,
    )
    from workflows.train import TrainWorkflow
    from workflows.trigger import IDLE_PATCH, TriggerCheck, check_trigger, next_check_s

# Results the stage functions of workflows/cycle.py, bootstrap.py and trigger.py decode: the
# workflow sandbox resolves a result's type hints through its module, which it holds only
# when this module (which runs in the sandbox) imports it; those functions' imports do not.
DECODED_RESULTS = (BootstrapReadiness, PrepareBootstrapResult, PromoteResult)

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


@workflow.defn
class LoopWorkflow:
    def __init__(self) -> None:
        self.loop = ""
        self.state = LoopState()
        self.stage = CycleStage.STARTING
        self.waiting_for: str | None = None
        self.next_check_at: str | None = None  # while waiting: when the next check is due
        # The cycle in progress (0 between cycles).
        self.cycle = 0
        self.approval: tuple[str, ApprovalSignal] | None = None
        # A wake signal arrived since the last trigger check began.
        self.woken = False

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

    @workflow.signal
    def bootstrap(self, signal: BootstrapSignal) -> None:
        self.state.bootstrap = signal

    @workflow.signal
    def wake(self, signal: WakeSignal) -> None:
        """Check for a trigger now (traces arrived): ends an idle loop's backoff."""
        self.woken = True
        self.state.idle_checks = 0

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
            next_check_at=self.next_check_at,
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
            self.woken = False
            check = await check_trigger(self.loop, self.state, config)
            if check.trigger is not None:
                self.state.idle_checks = 0
                await self._run_cycle(config, check.trigger, check.detail)
                if input.max_cycles is not None and self.state.cycles_done >= input.max_cycles:
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    return LoopResult(self.loop, self.state.cycles_done, self.state.last_outcome)
                break
            checks += 1
            if checks >= input.checks_per_run or workflow.info().is_continue_as_new_suggested():
                break
            await self._wait_for_next_check(config, check)
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(
            LoopInput(
                loop=input.loop,
                state=self.state,
                max_cycles=input.max_cycles,
                checks_per_run=input.checks_per_run,
            )
        )

    async def _wait_for_next_check(self, config: LoopConfig, check: TriggerCheck) -> None:
        """Wait until the next trigger check is due, or a signal asks for one sooner.

        With the idle backoff (:data:`IDLE_PATCH`) a quiet check lengthens the wait and any
        other check resets it (workflows/trigger.py, :func:`next_check_s`); a ``wake``
        signal (traces arrived) ends the wait at once. Histories before it wait
        ``check_interval_s``."""
        wait_s = config.trigger_policy.check_interval_s
        if workflow.patched(IDLE_PATCH):
            self.state.idle_checks = self.state.idle_checks + 1 if check.quiet else 0
            wait_s = next_check_s(config, self.state.idle_checks, check.until_max_interval_s)
        self.waiting_for = "trigger"
        self.next_check_at = (workflow.now() + timedelta(seconds=wait_s)).isoformat()
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: (
                    self.state.run_now
                    or self.state.paused
                    or self.state.rollback_reason is not None
                    or self.state.bootstrap is not None
                    or self.woken
                ),
                timeout=timedelta(seconds=wait_s),
            )
        self.waiting_for = None
        self.next_check_at = None

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
        bootstrap: BootstrapSignal | None = None
        if trigger == BOOTSTRAP_TRIGGER:
            bootstrap, self.state.bootstrap = self.state.bootstrap, None
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
            run = CycleRun(self.loop, config, cycle, honest)
            if bootstrap is not None:
                ended = await bootstrap_stages(self, run, started, bootstrap)
            else:
                ended = await self._cycle_stages(run, started)
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

    async def _cycle_stages(self, run: CycleRun, started: StartCycleResult) -> CloseCycleInput:
        """Run the stages of a cycle, in order; how it ended, with its numbers (held-out
        points, gate points, the canary's samples), as the accounting stage records it.
        A stage that ends the cycle early raises :class:`CycleAborted`."""
        config = run.config
        await self.curate_stage(run)
        # Checked first so a loop without the filter records no marker: its history is
        # exactly what it was before the stage existed.
        if config.curation_policy.difficulty_filter and workflow.patched(PROBE_PATCH):
            await self._probe(run, started)
        dataset = await self._snapshot_stage(run)
        champion = champion_of(started)
        if workflow.patched(ESTIMATE_PATCH):
            await self.enter(CycleStage.ESTIMATE, run.cycle)
            await estimate_stage(run, dataset, champion)
        trained = await self._train_stage(run, dataset, champion)
        await self._evaluate_stage(run, dataset, champion, trained)
        candidate = candidate_of(trained)
        decided = await gate_stage(
            self, run, baseline=champion, candidate=candidate, previous_id=champion.checkpoint_id
        )
        return await promote_stage(
            self, run, candidate=candidate, previous=champion, decided=decided
        )

    async def enter(
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

    async def curate_stage(self, run: CycleRun) -> None:
        await self.enter(CycleStage.CURATE, run.cycle)
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
        await self.enter(CycleStage.SNAPSHOT, run.cycle)
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
        await self.enter(CycleStage.TRAIN, run.cycle, dataset_id=dataset.dataset_id)
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
        await self.enter(CycleStage.EVALUATE, run.cycle, candidate=candidate.checkpoint_id)
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
        await self.enter(CycleStage.PROBE, run.cycle)
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

    async def await_approval(self, gate: GateResult) -> tuple[Decision, str, str]:
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
        return await db_activity(CycleActivities.load_loop_config, LoopConfigInput(self.loop))

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
