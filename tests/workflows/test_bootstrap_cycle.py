"""A bootstrap cycle's control flow on the real Temporal dev server, with typed activity
fakes (the world of test_loop.py, without a champion): SFT over the base model on the
demonstrations, the base model and the adapter on the held-out set only, the gate judging
them there, a manual gate's approval, the automatic bootstrap, its refusals, and no other
cycle before the first champion."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from temporalio import activity
from temporalio.client import Client

from services.loop.policies import TrainingProfile
from tests.support import assert_eventually_async
from tests.workflows.test_loop import BASE_CONFIG, World, make_worker, start_loop, with_gate
from workflows.loop import LoopWorkflow
from workflows.payloads.bootstrap import (
    BootstrapReadiness,
    BootstrapReadinessInput,
    PrepareBootstrapInput,
    PrepareBootstrapResult,
)
from workflows.payloads.curation import PendingWorkInput, PendingWorkResult
from workflows.payloads.cycle import StartCycleInput, StartCycleResult
from workflows.payloads.gate import GateInput, GateResult, RecordDecisionInput, RecordDecisionResult
from workflows.payloads.loop import ApprovalSignal, BootstrapSignal, LoopConfig, LoopConfigInput
from workflows.payloads.promote import LiveStats, LiveStatsInput

BASE_ID = "a" * 64
DEMONSTRATIONS = "file:///artifacts/runs/bootstrap.jsonl"
BOOTSTRAP_PROFILE = TrainingProfile(
    family="hf",
    algorithm="grpo",
    base_checkpoint=BASE_ID,
    bootstrap={"hyperparameters": {"steps": 3, "lora_r": 4}},
)
NO_CHAMPION = replace(
    BASE_CONFIG,
    environment="replay",
    champion_checkpoint_id=None,
    champion_uri=None,
    training_profile=BOOTSTRAP_PROFILE,
)


@dataclass
class BootstrapWorld(World):
    """The loop's world with no champion, a base model and the bootstrap's activities."""

    config: LoopConfig = field(default_factory=lambda: NO_CHAMPION)
    champion: str | None = None  # type: ignore[assignment]
    heldout_count: int = 40
    used: int = 12
    # Readiness of the automatic bootstrap: the looks it answered and how many it waits.
    ready_after: int = 2
    looks: list[BootstrapReadinessInput] = field(default_factory=list)
    prepared: list[PrepareBootstrapInput] = field(default_factory=list)
    judged: list[GateInput] = field(default_factory=list)
    recorded: list[RecordDecisionInput] = field(default_factory=list)
    trigger_details: dict[int, dict[str, Any]] = field(default_factory=dict)

    @activity.defn(name="load_loop_config")
    def load_loop_config(self, input: LoopConfigInput) -> LoopConfig:
        uri = f"file:///artifacts/{self.champion}" if self.champion else None
        return replace(self.config, champion_checkpoint_id=self.champion, champion_uri=uri)

    @activity.defn(name="start_cycle")
    def start_cycle(self, input: StartCycleInput) -> StartCycleResult:
        self.triggers[input.number] = input.trigger
        self.trigger_details[input.number] = dict(input.trigger_detail)
        uri = f"file:///artifacts/{self.champion}" if self.champion else None
        return StartCycleResult(input.number, self.champion, uri)

    @activity.defn(name="bootstrap_readiness")
    def readiness(self, input: BootstrapReadinessInput) -> BootstrapReadiness:
        self.looks.append(input)
        ready = len(self.looks) >= self.ready_after
        return BootstrapReadiness(ready, curated=10 * len(self.looks), used=self.used)

    @activity.defn(name="prepare_bootstrap")
    def prepare(self, input: PrepareBootstrapInput) -> PrepareBootstrapResult:
        self.prepared.append(input)
        return PrepareBootstrapResult(
            base_checkpoint_id=input.base_checkpoint_id or BASE_ID,
            base_uri="file:///artifacts/checkpoints/base",
            demonstrations_uri=DEMONSTRATIONS if self.used else None,
            used=self.used,
            summary=f"{self.used} successes used",
        )

    @activity.defn(name="bootstrap_gate")
    def bootstrap_gate(self, input: GateInput) -> GateResult:
        self.judged.append(input)
        statistics = {"delta_points": 30.0, "heldout_points": 30.0, "decided_on": "heldout"}
        return GateResult(self.gate_decision, "bootstrap judged on the held-out set", statistics)

    @activity.defn(name="record_decision")
    def record_decision(self, input: RecordDecisionInput) -> RecordDecisionResult:
        self.recorded.append(input)
        decision = self.decisions.setdefault(input.cycle, input.decision)
        return RecordDecisionResult(input.cycle, decision)

    @activity.defn(name="live_stats")
    def live_stats(self, input: LiveStatsInput) -> LiveStats:
        return self.baseline_live if input.model_version is None else self.candidate_live

    def activities(self) -> list[Any]:
        return [*super().activities(), self.readiness, self.prepare, self.bootstrap_gate]


async def _run(client: Client, task_queue: str, world: BootstrapWorld, signal: Any = None) -> str:
    """One cycle of a fresh loop, bootstrapped by ``signal`` (None: left to the profile)."""
    name = f"boot-{uuid.uuid4().hex[:8]}"
    async with make_worker(client, task_queue, world):
        handle = await start_loop(client, task_queue, name, max_cycles=1)
        if signal is not None:
            await handle.signal(LoopWorkflow.bootstrap, signal)
        await handle.result()
    return name


async def test_a_bootstrap_trains_over_the_base_and_is_judged_on_the_heldout_set(
    temporal_client: Client, task_queue: str
) -> None:
    world = BootstrapWorld()
    request = BootstrapSignal(by="ops", reason="first champion")
    name = await _run(temporal_client, task_queue, world, request)

    assert world.outcomes == {1: "promoted"} and world.triggers == {1: "bootstrap"}
    assert world.trigger_details[1]["requested_by"] == "ops"
    assert world.champion == f"ckpt-{name}-c1-train"
    assert [p.max_demonstrations for p in world.prepared] == [2000]
    train = world.job_inputs[f"{name}-c1-train"]
    assert train.job_spec["algorithm"] == "sft"
    assert train.job_spec["dataset"] == "/artifacts/runs/bootstrap.jsonl"
    assert train.job_spec["base_checkpoint"] == "/artifacts/checkpoints/base"
    assert train.job_spec["hyperparameters"] == {"steps": 3, "lora_r": 4}
    assert train.base_checkpoint_id == BASE_ID
    # The base model and the adapter, on the frozen held-out set only.
    assert sorted(job for job in world.jobs if "-eval-" in job) == [
        f"{name}-c1-eval-base-heldout",
        f"{name}-c1-eval-candidate-heldout",
    ]
    assert world.job_inputs[f"{name}-c1-eval-base-heldout"].job_spec["dataset"] == "/h"
    [judged] = world.judged
    assert (judged.champion_checkpoint_id, judged.candidate_checkpoint_id) == (
        BASE_ID,
        f"ckpt-{name}-c1-train",
    )
    assert judged.confidence == BASE_CONFIG.gate_policy.confidence
    [recorded] = world.recorded
    assert recorded.previous_checkpoint_id is None and recorded.decided_by == "gate"
    # Points gained: the held-out comparison, which is the gate's too.
    assert (world.closes[1].points_gained, world.closes[1].gate_points) == (30.0, 30.0)


async def test_a_manual_gate_waits_for_the_operators_approval(
    temporal_client: Client, task_queue: str
) -> None:
    world = BootstrapWorld(config=with_gate(NO_CHAMPION, mode="manual"))
    name = f"boot-{uuid.uuid4().hex[:8]}"
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, name, max_cycles=1)
        await handle.signal(LoopWorkflow.bootstrap, BootstrapSignal())

        async def waiting() -> None:
            status = await handle.query(LoopWorkflow.status)
            assert status.stage == "awaiting_approval"

        await assert_eventually_async(waiting, timeout=60)
        assert world.champion is None
        await handle.signal(LoopWorkflow.approve, ApprovalSignal(by="lead", reason="looks right"))
        await handle.result()
    assert world.outcomes == {1: "promoted"}
    assert world.recorded[0].decided_by == "lead"
    assert world.champion == f"ckpt-{name}-c1-train"


async def test_no_demonstrations_or_no_heldout_set_ends_the_cycle_as_no_data(
    temporal_client: Client, task_queue: str
) -> None:
    empty = BootstrapWorld(used=0)
    await _run(temporal_client, task_queue, empty, BootstrapSignal())
    assert empty.outcomes == {1: "no_data"}
    assert "no successful train-split traces" in empty.closes[1].detail
    assert not any(job.endswith("-train") for job in empty.jobs)

    blind = BootstrapWorld(heldout_count=0)
    await _run(temporal_client, task_queue, blind, BootstrapSignal())
    assert blind.outcomes == {1: "no_data"} and blind.prepared == []
    assert "held-out" in blind.closes[1].detail


async def test_the_profile_bootstraps_by_itself_once_ready(
    temporal_client: Client, task_queue: str
) -> None:
    auto = BOOTSTRAP_PROFILE.model_copy(
        update={"bootstrap": BOOTSTRAP_PROFILE.bootstrap.model_copy(update={"auto": True})}
    )
    world = BootstrapWorld(config=replace(NO_CHAMPION, training_profile=auto))
    await _run(temporal_client, task_queue, world)

    assert world.triggers == {1: "bootstrap"} and world.outcomes == {1: "promoted"}
    assert world.trigger_details[1]["requested_by"] == "policy"
    # Each look tells the next what curation had seen, so an unchanged loop is not re-read.
    assert [look.curated_seen for look in world.looks] == [-1, 10]
    assert {look.min_successes for look in world.looks} == {16}


async def test_new_tasks_start_no_cycle_before_the_first_champion(
    temporal_client: Client, task_queue: str
) -> None:
    """A history posted before the bootstrap (more new train tasks than ``min_new_tasks``)
    starts no cycle on a loop with no champion, which would only fail for want of one; the
    bootstrap is the first cycle, and once it made a champion new tasks start the next."""
    world = BootstrapWorld(new_tasks=BASE_CONFIG.trigger_policy.min_new_tasks + 4)
    looked: list[int] = []

    @activity.defn(name="pending_work")
    def pending_work(input: PendingWorkInput) -> PendingWorkResult:
        looked.append(world.new_tasks)
        return PendingWorkResult(new_train_tasks=world.new_tasks, uncurated_traces=0)

    activities = [a for a in world.activities() if a.__name__ != "pending_work"]
    name = f"boot-{uuid.uuid4().hex[:8]}"
    async with make_worker(
        temporal_client, task_queue, world, activities=[*activities, pending_work]
    ):
        handle = await start_loop(temporal_client, task_queue, name, max_cycles=2)

        async def checked_thrice() -> None:
            assert len(looked) >= 3

        await assert_eventually_async(checked_thrice, timeout=60)
        assert world.triggers == {}  # three checks with tasks pending, and no cycle
        await handle.signal(LoopWorkflow.bootstrap, BootstrapSignal(by="ops"))

        async def bootstrapped() -> None:
            assert world.outcomes.get(1) == "promoted"

        await assert_eventually_async(bootstrapped, timeout=60)
        world.new_tasks = BASE_CONFIG.trigger_policy.min_new_tasks
        await handle.result()
    assert world.triggers == {1: "bootstrap", 2: "min_new_tasks"}
    assert world.outcomes == {1: "promoted", 2: "promoted"}
