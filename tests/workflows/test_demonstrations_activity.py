"""The job activity keeps every success: a probe job is asked to keep its episodes, what
its listing vouches for is stored as demonstrations of the task, a tampered file stores
nothing and says why on the run; the next train job's spec names the stored episodes.
Real Temporal dev server, real Postgres, real jobs through the local executor."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from temporalio.client import Client

from services.db.models import Demonstration, Loop, Task
from services.db.session import SessionFactory
from services.environments.toolcalc import ToolcalcEnvironment
from services.training.episode_file import (
    EpisodeRecord,
    read_demonstrations,
    write_demonstrations,
)
from tests.workflows.test_jobs_activity import World, run_job, worker
from workflows.payloads.jobs import RunJobInput

# The job writes one success and one failure of the task named by TASK_HASH, lists them in
# metrics.json, and records the spec it was given; TAMPER rewrites the file afterwards.
PROBE_JOB = """
import hashlib, json, os, pathlib
out = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"])
spec = json.loads(pathlib.Path(os.environ["RATCHET_JOB_SPEC"]).read_text())
(out / "seen-spec.json").write_text(json.dumps(spec))
lines = [
    {"task_id": TASK_HASH, "passed": passed, "reward": float(passed), "text": text,
     "sequences": [[[1, 2, 3], [False, True, True]]], "checkpoint_id": "ck", "family": "tiny"}
    for passed, text in ((True, "fmt(date='10/11/2026')"), (False, "fmt(10)"))
]
data = "".join(json.dumps(line) + "\\n" for line in lines).encode()
(out / "episodes.jsonl").write_bytes(data)
listing = {"file": "episodes.jsonl", "bytes": len(data), "count": 2,
           "sha256": hashlib.sha256(data).hexdigest(), "kinds": ["failure", "success"]}
if TAMPER:
    (out / "episodes.jsonl").write_bytes(data.replace(b"10/11", b"11/10"))
(out / "metrics.json").write_text(json.dumps({"episode_file": listing}))
"""


@pytest.fixture
def world(session_factory: SessionFactory, tmp_path: Path) -> World:
    return World(session_factory, tmp_path)


def train_task(world: World) -> tuple[int, str]:
    spec = ToolcalcEnvironment().generate_tasks(1, seed=3, api_version="v1")[0]
    with world.sessions.begin() as session:
        loop = session.query(Loop).filter_by(name=world.loop).one()
        task = Task(
            loop_id=loop.id,
            content_hash=spec.task_id,
            environment="toolcalc",
            spec=spec.to_dict(),
            cluster_id="c0",
            split="train",
        )
        session.add(task)
        session.flush()
        return task.id, spec.task_id


def probe_input(world: World, run_id: str) -> RunJobInput:
    return RunJobInput(
        run_id=run_id,
        loop=world.loop,
        kind="probe",
        job_spec={"schema": "ratchet.job/v1", "kind": "eval", "run_id": run_id},
        cycle=1,
        poll_interval_s=0.2,
    )


def script(task_hash: str, *, tamper: bool) -> str:
    body = textwrap.dedent(PROBE_JOB)
    return f"TASK_HASH = {task_hash!r}\nTAMPER = {tamper!r}\n" + body


async def test_a_probe_keeps_its_episodes_as_demonstrations(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    task_id, task_hash = train_task(world)
    run_id = f"{world.loop}-c1-probe"
    activities = world.activities(script(task_hash, tamper=False))
    async with worker(temporal_client, task_queue, activities):
        result = await run_job(temporal_client, task_queue, probe_input(world, run_id))

    assert result.status == "succeeded" and result.error is None
    seen = json.loads((world.output_dir(run_id) / "seen-spec.json").read_text())
    assert seen["keep_episodes"] == world.settings.demonstrations_per_task
    with world.sessions() as session:
        rows = session.query(Demonstration).filter_by(task_id=task_id).all()
        assert sorted(r.passed for r in rows) == [False, True]
        assert {r.run_id for r in rows} == {run_id} and {r.source for r in rows} == {"probe"}


async def test_a_tampered_episode_file_stores_nothing_and_says_why(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    task_id, task_hash = train_task(world)
    run_id = f"{world.loop}-c1-probe"
    activities = world.activities(script(task_hash, tamper=True))
    async with worker(temporal_client, task_queue, activities):
        result = await run_job(temporal_client, task_queue, probe_input(world, run_id))

    assert result.status == "succeeded"
    assert result.error is not None and "episodes rejected" in result.error
    assert "sha256" in result.error
    with world.sessions() as session:
        assert session.query(Demonstration).filter_by(task_id=task_id).count() == 0


def test_stored_records_round_trip_to_the_next_train_spec(world: World) -> None:
    """What the worker writes for a train run reads back as the records it stored."""
    record = EpisodeRecord(
        task_id="a" * 64,
        passed=True,
        reward=1.0,
        text="t",
        sequences=[([1, 2], [False, True])],
        checkpoint_id=None,
        family="tiny",
    )
    path = world.artifacts.run_dir(world.loop, "r") / "demonstrations.jsonl"
    assert write_demonstrations(path, [record]) == 1
    assert read_demonstrations(path) == [record]
