"""A configuration change is picked up by the next cycle, never by the one running.

LoopWorkflow on the real Temporal dev server with the real ``load_loop_config`` activity
over Postgres; the other activities are the typed fakes of ``test_loop``. While cycle 1's
train job runs, the loop is changed the way ``PATCH /v1/loops`` changes it (a new version):
cycle 1 finishes with the settings it started with, cycle 2 runs with the new ones.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from temporalio import activity
from temporalio.client import Client

from services.artifacts import path_to_uri
from services.db.models import Checkpoint, Loop
from services.db.queries.loops import config_document, require_loop, update_loop_config
from services.db.session import SessionFactory
from tests.workflows.test_loop import World, make_worker, start_loop
from workflows.activities.stages import StageActivities
from workflows.payloads.gate import GateInput, GateResult
from workflows.payloads.jobs import RunJobInput, RunJobResult


@dataclass
class ChangingWorld(World):
    """The fake world, but the train job of cycle 1 waits until the test has changed the loop."""

    train_started: threading.Event = field(default_factory=threading.Event)
    release_train: threading.Event = field(default_factory=threading.Event)
    gate_inputs: dict[int, GateInput] = field(default_factory=dict)

    @activity.defn(name="run_job")
    def run_job(self, input: RunJobInput) -> RunJobResult:
        if input.kind == "train" and input.cycle == 1:
            self.train_started.set()
            assert self.release_train.wait(60), "the test never released the train job"
        return super().run_job(input)

    @activity.defn(name="gate")
    def gate(self, input: GateInput) -> GateResult:
        self.gate_inputs[input.cycle] = input
        return super().gate(input)


def loop_with_champion(session_factory: SessionFactory, name: str, tmp: Any) -> None:
    with session_factory.begin() as session:
        loop = Loop(
            name=name,
            environment="toolcalc",
            training_profile={"hyperparameters": {"steps": 10}},
            gate_policy={"confidence": 0.9, "canary_seconds": 0},
            trigger_policy={"min_new_tasks": 8, "check_interval_s": 0.2, "drift_enabled": False},
            serving_target={"kind": "none"},
        )
        session.add(loop)
        session.flush()
        checkpoint = Checkpoint(
            id="ckpt-0",
            loop_id=loop.id,
            uri=path_to_uri(tmp),
            format="safetensors",
            size_bytes=0,
            sha256="0" * 64,
            manifest={},
        )
        session.add(checkpoint)
        session.flush()
        loop.champion_checkpoint_id = checkpoint.id


async def test_a_change_during_a_cycle_applies_from_the_next_cycle(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory, tmp_path: Any
) -> None:
    name = f"cfg-{uuid.uuid4().hex[:8]}"
    loop_with_champion(session_factory, name, tmp_path)
    world = ChangingWorld(new_tasks=12)
    real = StageActivities.build(session_factory, lambda target, checkpoint_id, uri: checkpoint_id)
    fakes = [a for a in world.activities() if a.__name__ != "load_loop_config"]
    worker = make_worker(
        temporal_client, task_queue, world, activities=[*fakes, real.cycle.load_loop_config]
    )

    def change_the_loop() -> None:
        with session_factory.begin() as session:
            loop = require_loop(session=session, name=name)
            config = config_document(loop)
            config["gate_policy"] = {**config["gate_policy"], "confidence": 0.99}
            config["training_profile"] = {"hyperparameters": {"steps": 20}}
            config["trigger_policy"] = {**config["trigger_policy"], "min_new_tasks": 4}
            update = update_loop_config(
                session=session, loop=loop, config=config, changed_by="test"
            )
            assert update.version is not None and update.version.version == 2
        world.new_tasks = 5  # enough for the new trigger (4), not for the old one (8)

    async with worker:
        handle = await start_loop(temporal_client, task_queue, name, max_cycles=2)
        started = await asyncio.to_thread(world.train_started.wait, 60)
        assert started, "cycle 1's train job never started"
        await asyncio.to_thread(change_the_loop)
        world.release_train.set()
        result = await handle.result()

    assert result.cycles_done == 2
    assert world.triggers == {1: "min_new_tasks", 2: "min_new_tasks"}
    # Cycle 1 kept the settings it started with, though the change landed while it ran.
    assert world.gate_inputs[1].confidence == 0.9
    train_1 = world.job_inputs[f"{name}-c1-train"].job_spec
    assert train_1["hyperparameters"] == {"steps": 10}
    # Cycle 2 runs with version 2: the new gate, hyper-parameters and trigger.
    assert world.gate_inputs[2].confidence == 0.99
    train_2 = world.job_inputs[f"{name}-c2-train"].job_spec
    assert train_2["hyperparameters"] == {"steps": 20}
