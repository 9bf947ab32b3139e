"""LoopWorkflow's control flow on the real Temporal dev server, with typed activity fakes.

The fakes keep a tiny in-memory world (champion, deployments, decisions) and use the real
Input/Result dataclasses, so a contract change breaks these tests. The real activities are
tested against Postgres in tests/workflows/test_loop_activities.py (and the curation and job
activities in test_curate.py and test_jobs_activity.py), and end to end in tests/e2e.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from tests.support import assert_eventually_async
from workflows.activities.estimate import (
    CalibrationInput,
    CalibrationNeed,
    EstimateInput,
    EstimateResult,
)
from workflows.evaluate import EvaluateWorkflow
from workflows.loop import LoopWorkflow
from workflows.payloads.curation import (
    CurateBatchInput,
    CurateBatchResult,
    CurateInput,
    CurateResult,
    DriftInput,
    DriftResult,
    PendingWorkInput,
    PendingWorkResult,
    SnapshotInput,
    SnapshotResult,
)
from workflows.payloads.cycle import (
    CloseCycleInput,
    CloseCycleResult,
    StageInput,
    StartCycleInput,
    StartCycleResult,
)
from workflows.payloads.evaluate import EvaluationSummary, RecordEvaluationInput
from workflows.payloads.gate import GateInput, GateResult, RecordDecisionInput, RecordDecisionResult
from workflows.payloads.jobs import (
    RegisterCheckpointInput,
    RegisterCheckpointResult,
    RunJobInput,
    RunJobResult,
)
from workflows.payloads.loop import (
    ApprovalSignal,
    LoopConfig,
    LoopConfigInput,
    LoopInput,
    LoopResult,
    PauseSignal,
    ResumeSignal,
    RollbackSignal,
    RunNowSignal,
)
from workflows.payloads.probe import (
    ExportProbeTasksInput,
    ExportProbeTasksResult,
    ProbePassRatesInput,
    ProbePassRatesResult,
    RecordProbesInput,
    RecordProbesResult,
)
from workflows.payloads.promote import (
    DeployInput,
    DeployResult,
    LiveStats,
    LiveStatsInput,
    PromotionStatusInput,
)
from workflows.payloads.rollback import (
    FinishRollbackInput,
    RollbackInput,
    RollbackPlan,
    RollbackResult,
)
from workflows.probe import ProbeWorkflow
from workflows.promote import PromoteWorkflow
from workflows.train import TrainWorkflow

# This module defines workflows (FakeCurateWorkflow), so the sandbox imports it again: the
# services it uses pass through, as they do in workflows/ (the replay package they reach
# defines classes the sandbox refuses to build, e.g. on urllib.request).
with workflow.unsafe.imports_passed_through():
    from services.curation.policy import CurationPolicy
    from services.loop.policies import GatePolicy, ServingTarget, TrainingProfile, TriggerPolicy

BASE_CONFIG = LoopConfig(
    loop="bot",
    loop_id=1,
    status="active",
    environment="toolcalc",
    executor="local",
    champion_checkpoint_id="ckpt-0",
    champion_uri="file:///artifacts/ckpt-0",
    training_profile=TrainingProfile(algorithm="grpo"),
    serving_target=ServingTarget(kind="local"),
    trigger_policy=TriggerPolicy(
        min_new_tasks=8, max_interval_s=3600, check_interval_s=0.2, drift_enabled=False
    ),
    # The policy's defaults but for a quick canary and one greedy eval sample per task.
    gate_policy=GatePolicy(
        canary_seconds=1, canary_check_interval_s=0.3, canary_min_traces=10
    ).model_copy(update={"eval_samples": 1, "eval_temperature": 0.0, "min_discordant_pairs": 0}),
)


def with_gate(config: LoopConfig, **changes: Any) -> LoopConfig:
    """``config`` with some gate policy fields changed."""
    gate = GatePolicy.model_validate({**config.gate_policy.model_dump(), **changes})
    return replace(config, gate_policy=gate)


@dataclass
class World:
    config: LoopConfig = field(default_factory=lambda: BASE_CONFIG)
    new_tasks: int = 0
    champion: str = "ckpt-0"
    gate_decision: str = "promote"
    candidate_live: LiveStats = field(default_factory=lambda: LiveStats(40, 36, 0.9, 0.77, 0.96))
    baseline_live: LiveStats = field(default_factory=lambda: LiveStats(40, 8, 0.2, 0.1, 0.35))
    budget_exhausted: bool = False
    deployed: list[str] = field(default_factory=list)
    decisions: dict[int, str] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)
    outcomes: dict[int, str] = field(default_factory=dict)
    triggers: dict[int, str] = field(default_factory=dict)
    rollbacks: list[str] = field(default_factory=list)
    # The difficulty probe: tasks without a pass rate, how its job ends, what it recorded.
    unprobed: list[int] = field(default_factory=lambda: [11, 12, 13])
    probe_status: str = "succeeded"
    job_inputs: dict[str, RunJobInput] = field(default_factory=dict)
    probes: list[dict[int, float]] = field(default_factory=list)
    snapshots: int = 0
    heldout_count: int = 0
    closes: dict[int, CloseCycleInput] = field(default_factory=dict)
    deploys: list[DeployInput] = field(default_factory=list)
    # Operator rollbacks whose deploy fails (every attempt), and what was recorded of them.
    rollback_deploy_fails: bool = False
    rollback_deploy_attempts: int = 0
    rollback_failures: list[str] = field(default_factory=list)
    # The estimate stage: what a cycle is estimated at, what the budget has left (None: no
    # budget), and the estimates asked for.
    estimate_usd: float = 0.05
    budget_left_usd: float | None = None
    estimates: list[EstimateInput] = field(default_factory=list)
    # Whether a cycle must calibrate first (the loop has measured nothing yet).
    calibration_needed_: bool = False

    @activity.defn(name="calibration_needed")
    def calibration_needed(self, input: CalibrationInput) -> CalibrationNeed:
        return CalibrationNeed(needed=self.calibration_needed_ and not self.estimates)

    @activity.defn(name="estimate_cycle")
    def estimate_cycle(self, input: EstimateInput) -> EstimateResult:
        self.estimates.append(input)
        left = self.budget_left_usd
        if left is not None and self.estimate_usd > left:
            reason = f"estimated ${self.estimate_usd:.2f} exceeds the ${left:.2f} left"
            return EstimateResult(self.estimate_usd, False, reason, left)
        return EstimateResult(self.estimate_usd, True, "", left)

    @activity.defn(name="load_loop_config")
    def load_loop_config(self, input: LoopConfigInput) -> LoopConfig:
        return replace(self.config, champion_checkpoint_id=self.champion)

    @activity.defn(name="curate_batch")
    def curate_batch(self, input: CurateBatchInput) -> CurateBatchResult:
        return CurateBatchResult(more=False)

    @activity.defn(name="pending_work")
    def pending_work(self, input: PendingWorkInput) -> PendingWorkResult:
        return PendingWorkResult(new_train_tasks=self.new_tasks, uncurated_traces=0)

    @activity.defn(name="check_drift")
    def check_drift(self, input: DriftInput) -> DriftResult:
        return DriftResult(failure_rate=0.1, window=100, threshold=0.5, drifted=False)

    @activity.defn(name="start_cycle")
    def start_cycle(self, input: StartCycleInput) -> StartCycleResult:
        self.triggers[input.number] = input.trigger
        return StartCycleResult(input.number, self.champion, f"file:///artifacts/{self.champion}")

    @activity.defn(name="set_cycle_stage")
    def set_cycle_stage(self, input: StageInput) -> None:
        return None

    @activity.defn(name="snapshot_dataset")
    def snapshot_dataset(self, input: SnapshotInput) -> SnapshotResult:
        self.snapshots += 1
        count, self.new_tasks = self.new_tasks, 0
        return SnapshotResult(
            input.cycle,
            "hash",
            count,
            20,
            10,
            "file:///t",
            "file:///e",
            "file:///r",
            heldout_count=self.heldout_count,
            heldout_uri="file:///h" if self.heldout_count else None,
        )

    @activity.defn(name="run_job")
    def run_job(self, input: RunJobInput) -> RunJobResult:
        self.jobs.append(input.run_id)
        self.job_inputs[input.run_id] = input
        status = self.probe_status if input.kind == "probe" else "succeeded"
        return RunJobResult(
            input.run_id,
            status,
            f"file:///runs/{input.run_id}",
            {},
            10.0,
            0.01,
            None if status == "succeeded" else "exit code 1: probe crashed",
        )

    @activity.defn(name="export_probe_tasks")
    def export_probe_tasks(self, input: ExportProbeTasksInput) -> ExportProbeTasksResult:
        assert self.snapshots == 0, "the probe runs before the snapshot"
        uri = f"file:///runs/{input.run_id}/probe-tasks.jsonl" if self.unprobed else None
        return ExportProbeTasksResult(uri, len(self.unprobed), list(self.unprobed))

    @activity.defn(name="probe_pass_rates")
    def probe_pass_rates(self, input: ProbePassRatesInput) -> ProbePassRatesResult:
        rates = dict(zip(input.task_ids, [1.0, 0.0, 0.5], strict=False))
        return ProbePassRatesResult(rates, too_easy=1, too_hard=1, kept=len(rates) - 2)

    @activity.defn(name="record_probes")
    def record_probes(self, input: RecordProbesInput) -> RecordProbesResult:
        self.probes.append(dict(input.pass_rates))
        self.unprobed = [t for t in self.unprobed if t not in input.pass_rates]
        return RecordProbesResult(len(input.pass_rates))

    @activity.defn(name="register_checkpoint")
    def register_checkpoint(self, input: RegisterCheckpointInput) -> RegisterCheckpointResult:
        return RegisterCheckpointResult(f"ckpt-{input.run_id}", f"file:///ck/{input.run_id}", 1)

    @activity.defn(name="record_evaluation")
    def record_evaluation(self, input: RecordEvaluationInput) -> EvaluationSummary:
        rate = 0.9 if input.role == "candidate" else 0.2
        return EvaluationSummary(
            1, input.role, input.checkpoint_id, input.task_set, 20, int(20 * rate), rate, 0, 1
        )

    @activity.defn(name="gate")
    def gate(self, input: GateInput) -> GateResult:
        statistics: dict[str, Any] = {"delta_points": 70.0}
        if self.heldout_count:
            statistics["heldout_points"] = 12.5
        return GateResult(self.gate_decision, f"fake gate says {self.gate_decision}", statistics)

    @activity.defn(name="record_decision")
    def record_decision(self, input: RecordDecisionInput) -> RecordDecisionResult:
        decision = self.decisions.setdefault(input.cycle, input.decision)
        return RecordDecisionResult(input.cycle, decision)

    @activity.defn(name="deploy_checkpoint")
    def deploy_checkpoint(self, input: DeployInput) -> DeployResult:
        if input.purpose == "rollback":
            self.rollback_deploy_attempts += 1
            if self.rollback_deploy_fails:
                raise ApplicationError("the model server did not answer", type="ServingUnavailable")
        self.deployed.append(input.checkpoint_id)
        self.deploys.append(input)
        return DeployResult(input.checkpoint_id, "2026-01-01T00:00:00+00:00")

    @activity.defn(name="live_stats")
    def live_stats(self, input: LiveStatsInput) -> LiveStats:
        return self.baseline_live if input.model_version == self.champion else self.candidate_live

    @activity.defn(name="update_promotion")
    def update_promotion(self, input: PromotionStatusInput) -> None:
        if input.set_champion:
            self.champion = input.set_champion

    @activity.defn(name="rollback_champion")
    def rollback_champion(self, input: RollbackInput) -> RollbackResult:
        self.rollbacks.append(input.reason)
        return RollbackResult(True, input.reason, "ckpt-0")

    @activity.defn(name="plan_rollback")
    def plan_rollback(self, input: RollbackInput) -> RollbackPlan:
        return RollbackPlan(7, checkpoint_id="ckpt-0", checkpoint_uri="file:///ck/ckpt-0")

    @activity.defn(name="finish_rollback")
    def finish_rollback(self, input: FinishRollbackInput) -> RollbackResult:
        if input.error is not None:
            self.rollback_failures.append(input.error)
            return RollbackResult(False, input.error)
        self.rollbacks.append(input.reason)
        return RollbackResult(True, input.reason, input.checkpoint_id)

    @activity.defn(name="close_cycle")
    def close_cycle(self, input: CloseCycleInput) -> CloseCycleResult:
        self.outcomes[input.cycle] = input.outcome
        self.closes[input.cycle] = input
        return CloseCycleResult(
            0.05, 40, 0.05, input.points_gained or 0, None, self.budget_exhausted
        )

    def activities(self) -> list[Any]:
        return [
            getattr(self, name)
            for name in [
                "load_loop_config",
                "curate_batch",
                "pending_work",
                "check_drift",
                "start_cycle",
                "set_cycle_stage",
                "snapshot_dataset",
                "run_job",
                "export_probe_tasks",
                "probe_pass_rates",
                "record_probes",
                "register_checkpoint",
                "record_evaluation",
                "gate",
                "record_decision",
                "deploy_checkpoint",
                "live_stats",
                "update_promotion",
                "rollback_champion",
                "plan_rollback",
                "finish_rollback",
                "close_cycle",
                "estimate_cycle",
                "calibration_needed",
            ]
        ]


@workflow.defn(name="CurateWorkflow")
class FakeCurateWorkflow:
    @workflow.run
    async def run(self, input: CurateInput) -> CurateResult:
        return CurateResult()


@workflow.defn(name="CurateWorkflow")
class FailingCurateWorkflow:
    @workflow.run
    async def run(self, input: CurateInput) -> CurateResult:
        raise ApplicationError("the curation policy is invalid", non_retryable=True)


def make_worker(
    client: Client,
    task_queue: str,
    world: World,
    *,
    curate: type = FakeCurateWorkflow,
    activities: list[Callable[..., Any]] | None = None,
) -> Worker:
    """A worker of the loop's workflows; ``activities`` replaces the world's fakes."""
    import concurrent.futures

    return Worker(
        client,
        task_queue=task_queue,
        workflows=[
            LoopWorkflow,
            ProbeWorkflow,
            TrainWorkflow,
            EvaluateWorkflow,
            PromoteWorkflow,
            curate,
        ],
        activities=world.activities() if activities is None else activities,
        activity_executor=concurrent.futures.ThreadPoolExecutor(8),
    )


async def start_loop(
    client: Client, task_queue: str, name: str = "", **input_fields: Any
) -> WorkflowHandle[Any, LoopResult]:
    """Each test's loop has its own name, so child workflow ids never collide across tests."""
    name = name or f"bot-{uuid.uuid4().hex[:8]}"
    return await client.start_workflow(
        LoopWorkflow.run,
        LoopInput(loop=name, **input_fields),
        id=f"loop/{name}",
        task_queue=task_queue,
    )


async def test_cycle_promotes_when_the_canary_holds(
    temporal_client: Client, task_queue: str
) -> None:
    world = World(new_tasks=12)
    async with make_worker(temporal_client, task_queue, world):
        name = f"bot-{uuid.uuid4().hex[:8]}"
        handle = await start_loop(temporal_client, task_queue, name, max_cycles=1)
        result = await handle.result()
    assert result.cycles_done == 1
    assert world.outcomes == {1: "promoted"}
    assert world.triggers == {1: "min_new_tasks"}
    assert world.champion == f"ckpt-{name}-c1-train"
    assert world.deployed == [f"ckpt-{name}-c1-train"]
    assert sorted(world.jobs) == [
        f"{name}-c1-eval-candidate-eval",
        f"{name}-c1-eval-candidate-regression",
        f"{name}-c1-eval-champion-eval",
        f"{name}-c1-eval-champion-regression",
        f"{name}-c1-train",
    ]


async def test_points_gained_are_the_heldout_sets_and_the_three_numbers_reach_the_ledger(
    temporal_client: Client, task_queue: str
) -> None:
    world = World(
        new_tasks=12,
        heldout_count=40,
        config=with_gate(BASE_CONFIG, eval_samples=4, eval_temperature=0.7, min_discordant_pairs=5),
    )
    async with make_worker(temporal_client, task_queue, world):
        name = f"bot-{uuid.uuid4().hex[:8]}"
        await (await start_loop(temporal_client, task_queue, name, max_cycles=1)).result()
    assert world.outcomes == {1: "promoted"}
    # The frozen held-out set is evaluated for both models, sampled at the policy's
    # temperature with the same seed for both.
    heldout_jobs = [f"{name}-c1-eval-{role}-heldout" for role in ("champion", "candidate")]
    assert set(heldout_jobs) <= set(world.jobs)
    specs = [world.job_inputs[job].job_spec for job in heldout_jobs]
    assert [spec["dataset"] for spec in specs] == ["/h", "/h"]
    assert {spec["samples"] for spec in specs} == {4}
    assert all(spec["hyperparameters"] == {"temperature": 0.7} for spec in specs)
    assert specs[0]["seed"] == specs[1]["seed"]
    closed = world.closes[1]
    # Points gained: the held-out delta, not the gate's eval-set delta (70).
    assert (closed.points_gained, closed.gate_points) == (12.5, 70.0)
    assert closed.live_canary == world.candidate_live
    assert closed.live_baseline == world.baseline_live
    # Every deploy of the promotion names its cycle, so the activity can refuse to slip back.
    assert [(d.cycle, d.purpose) for d in world.deploys] == [(1, "candidate")]


async def test_without_a_heldout_set_no_points_are_claimed(
    temporal_client: Client, task_queue: str
) -> None:
    world = World(new_tasks=12)
    async with make_worker(temporal_client, task_queue, world):
        await (await start_loop(temporal_client, task_queue, max_cycles=1)).result()
    assert world.outcomes == {1: "promoted"}
    assert (world.closes[1].points_gained, world.closes[1].gate_points) == (None, 70.0)


async def test_a_restarted_loop_continues_after_the_last_cycle_in_postgres(
    temporal_client: Client, task_queue: str
) -> None:
    """A new workflow chain (fresh state) for a loop whose Postgres rows reach cycle 3 runs
    cycle 4, never cycle 1 again (issue 15, item 3)."""
    world = World(new_tasks=12, config=replace(BASE_CONFIG, last_cycle_number=3))
    async with make_worker(temporal_client, task_queue, world):
        name = f"bot-{uuid.uuid4().hex[:8]}"
        await (await start_loop(temporal_client, task_queue, name, max_cycles=1)).result()
    assert world.outcomes == {4: "promoted"}
    assert world.triggers == {4: "min_new_tasks"}
    assert f"{name}-c4-train" in world.jobs
    assert not any("-c1-" in job for job in world.jobs)
    assert [d.cycle for d in world.deploys] == [4]


PROBING = replace(
    BASE_CONFIG, curation_policy=CurationPolicy(difficulty_filter=True, probe_attempts=4)
)


async def test_with_the_difficulty_filter_a_probe_job_runs_before_the_snapshot(
    temporal_client: Client, task_queue: str
) -> None:
    world = World(new_tasks=12, config=PROBING)
    async with make_worker(temporal_client, task_queue, world):
        name = f"bot-{uuid.uuid4().hex[:8]}"
        await (await start_loop(temporal_client, task_queue, name, max_cycles=1)).result()
        probe = await temporal_client.get_workflow_handle(f"loop/{name}/cycle/1/probe").result()
    assert world.outcomes == {1: "promoted"}
    assert world.jobs[0] == f"{name}-c1-probe"
    job = world.job_inputs[f"{name}-c1-probe"]
    assert (job.kind, job.cycle, job.base_checkpoint_id) == ("probe", 1, "ckpt-0")
    assert job.job_spec["kind"] == "eval"  # a probe run is an eval job
    assert job.job_spec["samples"] == 4
    assert job.job_spec["hyperparameters"] == {"temperature": 1.0}
    assert job.job_spec["checkpoint"] == "/artifacts/ckpt-0"
    assert job.job_spec["dataset"] == f"/runs/{name}-c1-probe/probe-tasks.jsonl"
    assert world.probes == [{11: 1.0, 12: 0.0, 13: 0.5}]
    assert probe["status"] == "succeeded"
    assert (probe["probed"], probe["recorded"]) == (3, 3)
    assert (probe["kept"], probe["too_easy"], probe["too_hard"]) == (1, 1, 1)
    assert probe["cost_usd"] == 0.01


async def test_with_nothing_unprobed_no_probe_job_runs(
    temporal_client: Client, task_queue: str
) -> None:
    world = World(new_tasks=12, config=PROBING, unprobed=[])
    async with make_worker(temporal_client, task_queue, world):
        await (await start_loop(temporal_client, task_queue, max_cycles=1)).result()
    assert world.outcomes == {1: "promoted"}
    assert not any(job.endswith("-probe") for job in world.jobs)
    assert world.probes == []


async def test_a_failed_probe_job_does_not_stop_the_cycle(
    temporal_client: Client, task_queue: str
) -> None:
    world = World(new_tasks=12, config=PROBING, probe_status="failed")
    async with make_worker(temporal_client, task_queue, world):
        name = f"bot-{uuid.uuid4().hex[:8]}"
        await (await start_loop(temporal_client, task_queue, name, max_cycles=1)).result()
    assert world.outcomes == {1: "promoted"}
    assert f"{name}-c1-probe" in world.jobs and f"{name}-c1-train" in world.jobs
    assert world.probes == []  # nothing recorded: the tasks stay unprobed, so they are kept
    assert world.snapshots == 1


async def test_a_failed_curation_fails_the_cycle_not_the_loop(
    temporal_client: Client, task_queue: str
) -> None:
    """The curate stage runs through the same child helper as every stage."""
    world = World(new_tasks=12)
    async with make_worker(temporal_client, task_queue, world, curate=FailingCurateWorkflow):
        result = await (await start_loop(temporal_client, task_queue, max_cycles=1)).result()
    assert result.cycles_done == 1
    assert world.outcomes == {1: "failed"}
    assert world.closes[1].detail.startswith("curate failed: the curation policy is invalid")
    assert world.jobs == [] and world.snapshots == 0
    assert world.deployed == []


async def test_rejected_candidate_leaves_the_champion(
    temporal_client: Client, task_queue: str
) -> None:
    world = World(new_tasks=12, gate_decision="reject")
    async with make_worker(temporal_client, task_queue, world):
        await (await start_loop(temporal_client, task_queue, max_cycles=1)).result()
    assert world.outcomes == {1: "rejected"}
    assert world.champion == "ckpt-0"
    assert world.deployed == []
    # A rejected cycle gains no points but records the gate's.
    assert (world.closes[1].points_gained, world.closes[1].gate_points) == (None, 70.0)


async def test_live_regression_rolls_back(temporal_client: Client, task_queue: str) -> None:
    world = World(
        new_tasks=12,
        candidate_live=LiveStats(40, 4, 0.1, 0.04, 0.23),
        baseline_live=LiveStats(40, 32, 0.8, 0.65, 0.9),
    )
    async with make_worker(temporal_client, task_queue, world):
        await (await start_loop(temporal_client, task_queue, max_cycles=1)).result()
    assert world.outcomes == {1: "rolled_back"}
    assert len(world.deployed) == 2 and world.deployed[1] == "ckpt-0"
    assert world.champion == "ckpt-0"
    # The rollback's live samples reach the ledger; the restore names its cycle.
    closed = world.closes[1]
    assert (closed.points_gained, closed.live_canary) == (0.0, world.candidate_live)
    assert [(d.cycle, d.purpose) for d in world.deploys] == [(1, "candidate"), (1, "restore")]


async def test_manual_gate_waits_for_approval(temporal_client: Client, task_queue: str) -> None:
    world = World(new_tasks=12, config=with_gate(BASE_CONFIG, mode="manual"))
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=1)

        async def waiting() -> None:
            status = await handle.query(LoopWorkflow.status)
            assert status.stage == "awaiting_approval"
            assert status.waiting_for is not None and "approve" in status.waiting_for

        await assert_eventually_async(waiting, timeout=30)
        assert world.deployed == []
        await handle.signal(LoopWorkflow.approve, ApprovalSignal(by="alice", reason="looks good"))
        await handle.result()
    assert world.outcomes == {1: "promoted"}


async def test_manual_reject(temporal_client: Client, task_queue: str) -> None:
    world = World(new_tasks=12, config=with_gate(BASE_CONFIG, mode="manual"))
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=1)

        async def waiting() -> None:
            assert (await handle.query(LoopWorkflow.status)).stage == "awaiting_approval"

        await assert_eventually_async(waiting, timeout=30)
        await handle.signal(LoopWorkflow.reject, ApprovalSignal(by="bob"))
        await handle.result()
    assert world.outcomes == {1: "rejected"}
    assert world.decisions == {1: "reject"}


async def test_pause_resume_run_now_and_rollback(temporal_client: Client, task_queue: str) -> None:
    world = World(new_tasks=0)
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=1)
        await handle.signal(LoopWorkflow.pause, PauseSignal(reason="maintenance"))

        async def paused() -> None:
            status = await handle.query(LoopWorkflow.status)
            assert status.paused and status.stage == "paused"
            assert status.pause_reason == "maintenance"

        await assert_eventually_async(paused, timeout=30)
        await handle.signal(LoopWorkflow.rollback, RollbackSignal(reason="bad answers"))

        async def rolled_back() -> None:
            assert world.rollbacks == ["bad answers"]

        await assert_eventually_async(rolled_back, timeout=30)
        await handle.signal(LoopWorkflow.resume, ResumeSignal())
        await asyncio.sleep(0.5)
        assert world.outcomes == {}  # no tasks yet: no trigger
        world.new_tasks = 3
        await handle.signal(LoopWorkflow.run_now, RunNowSignal())
        await handle.result()
    assert world.triggers == {1: "operator"}
    assert world.outcomes == {1: "promoted"}


async def test_a_failed_rollback_deploy_is_bounded_recorded_and_the_loop_runs_on(
    temporal_client: Client, task_queue: str
) -> None:
    world = World(new_tasks=0, rollback_deploy_fails=True)
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=1)
        await handle.signal(LoopWorkflow.rollback, RollbackSignal(reason="bad answers"))

        async def recorded() -> None:
            assert world.rollback_failures == [
                "ServingUnavailable: the model server did not answer"
            ]

        await assert_eventually_async(recorded, timeout=60)
        assert world.rollback_deploy_attempts == 3  # the DEPLOY preset's bound
        assert world.rollbacks == []
        status = await handle.query(LoopWorkflow.status)
        assert status.stage != "rollback"
        # The loop is still running: a cycle starts and ends as usual.
        world.new_tasks = 3
        await handle.signal(LoopWorkflow.run_now, RunNowSignal())
        await handle.result()
    assert world.outcomes == {1: "promoted"}


async def test_continue_as_new_keeps_state(temporal_client: Client, task_queue: str) -> None:
    world = World(new_tasks=0)
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=2, checks_per_run=2)
        first_run = (await handle.describe()).run_id

        async def continued() -> None:
            assert (await handle.describe()).run_id != first_run

        await assert_eventually_async(continued, timeout=30)
        world.new_tasks = 10
        # The first cycle ends in continue-as-new; the second completes the workflow.

        async def one_cycle() -> None:
            assert 1 in world.outcomes

        await assert_eventually_async(one_cycle, timeout=60)
        world.new_tasks = 10
        result = await handle.result()
    assert result.cycles_done == 2
    assert world.outcomes == {1: "promoted", 2: "promoted"}


async def test_budget_exhaustion_pauses(temporal_client: Client, task_queue: str) -> None:
    world = World(new_tasks=12, budget_exhausted=True)
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=2)

        async def paused() -> None:
            status = await handle.query(LoopWorkflow.status)
            assert status.paused and status.pause_reason is not None
            assert "budget" in status.pause_reason

        await assert_eventually_async(paused, timeout=60)
        await handle.terminate()
    assert world.outcomes == {1: "promoted"}


async def test_a_cycle_estimated_over_the_budget_is_refused_before_training(
    temporal_client: Client, task_queue: str
) -> None:
    world = World(new_tasks=12, estimate_usd=5.0, budget_left_usd=1.0)
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=2)

        async def refused() -> None:
            status = await handle.query(LoopWorkflow.status)
            assert status.paused and status.pause_reason is not None
            assert "cycle 1 refused" in status.pause_reason
            assert "exceeds the $1.00 left" in status.pause_reason

        await assert_eventually_async(refused, timeout=60)
        await handle.terminate()
    assert world.outcomes == {1: "over_budget"}
    assert "exceeds the $1.00 left" in world.closes[1].detail
    assert world.jobs == [] and world.deployed == []  # nothing was trained or evaluated
    (estimate,) = world.estimates
    # the snapshot's eval and regression sets (no held-out set here), sampled per the policy
    assert estimate.eval_task_counts == [20, 10] and estimate.samples_per_task == 1
    assert estimate.profile.algorithm == "grpo"


async def test_a_cycle_that_fits_the_budget_runs(temporal_client: Client, task_queue: str) -> None:
    world = World(new_tasks=12, estimate_usd=0.5, budget_left_usd=1.0)
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=1)
        result = await handle.result()
    assert result.last_outcome == "promoted"
    assert len(world.estimates) == 1
    assert any(job.endswith("-train") for job in world.jobs)


async def test_a_loop_that_has_measured_nothing_calibrates_before_its_estimate(
    temporal_client: Client, task_queue: str
) -> None:
    """The first cycle runs its train job shortened (a ``calibrate`` run on the training
    resources) after the snapshot and before the estimate, which is told its run; the cycle
    then trains as usual."""
    world = World(new_tasks=12, calibration_needed_=True)
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=1)
        result = await handle.result()
    assert result.last_outcome == "promoted"
    calibration, train = world.jobs[0], world.jobs[1]
    assert calibration.endswith("-c1-calibrate") and train.endswith("-c1-train")
    job = world.job_inputs[calibration]
    assert (job.kind, job.cycle, job.base_checkpoint_id) == ("calibrate", 1, "ckpt-0")
    assert job.job_spec["kind"] == "train" and job.job_spec["calibrate"] is True
    assert job.job_spec["dataset"] == "/t"  # the snapshot's train file, as the train job's
    (estimate,) = world.estimates
    assert estimate.calibration_run_id == calibration
