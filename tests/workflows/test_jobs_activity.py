"""The job activities on a real Temporal dev server and a real Postgres, with real jobs.

A tiny workflow executes the activity by name, as TrainWorkflow does; jobs are small Python
programs honouring the job contract, run by the local executor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker
from temporalio.workflow import ActivityCancellationType

from services.artifacts import ArtifactStore, path_to_uri
from services.db.models import Checkpoint, Loop, Run
from services.db.queries import runs as q
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.executors.base import ExecutorUnavailable, JobStatus
from services.executors.local import LocalExecutor
from services.settings import Settings
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig
from tests.support import assert_eventually_async
from workflows.activities.jobs import JobActivities
from workflows.payloads.jobs import (
    CancelJobInput,
    RegisterCheckpointInput,
    RegisterCheckpointResult,
    RunJobInput,
    RunJobResult,
)

JOB_HEADER = """
import json, os, pathlib, sys, time
out = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"])
with (out / "starts").open("a") as fh:
    fh.write("started\\n")
"""
SUCCEED = (
    JOB_HEADER
    + """
(out / "metrics.json").write_text(json.dumps({"pass_rate": 0.75, "train_tokens_per_s": 123.0}))
"""
)
FAIL = (
    JOB_HEADER
    + """
print("dataset is empty", file=sys.stderr)
sys.exit(1)
"""
)
CONFIG_ERROR = (
    JOB_HEADER
    + """
print("unknown algorithm 'dpo'", file=sys.stderr)
sys.exit(2)
"""
)
NO_METRICS = JOB_HEADER
WAIT_FOR_RELEASE = (
    JOB_HEADER
    + """
release = out / "release"
while not release.exists():
    time.sleep(0.05)
(out / "metrics.json").write_text("{}")
"""
)


@workflow.defn
class RunJobTestWorkflow:
    @workflow.run
    async def run(self, input: RunJobInput) -> RunJobResult:
        return await workflow.execute_activity(
            "run_job",
            input,
            result_type=RunJobResult,
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=timedelta(seconds=2),
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100)),
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )


@workflow.defn
class CancelJobTestWorkflow:
    @workflow.run
    async def run(self, input: CancelJobInput) -> None:
        await workflow.execute_activity(
            "cancel_job", input, start_to_close_timeout=timedelta(minutes=1)
        )


class World:
    """The dependencies of the activities: a loop row, an artifact root, settings."""

    def __init__(self, session_factory: SessionFactory, tmp_path: Path) -> None:
        self.sessions = session_factory
        self.artifacts = ArtifactStore(tmp_path / "artifacts")
        self.settings = Settings(
            state_dir=tmp_path / "state",
            accelerator_hour_price_usd=3.6,
            cpu_hour_price_usd=0.36,
        )
        self.loop = f"bot-{uuid.uuid4().hex[:6]}"
        with session_factory.begin() as session:
            session.add(Loop(name=self.loop, environment="toolcalc", executor="local"))

    def activities(self, script: str) -> JobActivities:
        executor = LocalExecutor(
            command=[sys.executable, "-c", textwrap.dedent(script)],
            poll_interval_s=0.05,
            cancel_grace_s=5,
        )
        return JobActivities(
            session_factory=self.sessions,
            executors={"local": executor},
            artifacts=self.artifacts,
            settings=self.settings,
        )

    def job_input(self, run_id: str = "", **fields: Any) -> RunJobInput:
        run_id = run_id or f"{self.loop}-c1-train"
        return RunJobInput(
            run_id=run_id,
            loop=self.loop,
            kind="train",
            job_spec={"schema": "ratchet.job/v1", "kind": "train", "run_id": run_id},
            cycle=1,
            poll_interval_s=0.2,
            **fields,
        )

    def output_dir(self, run_id: str) -> Path:
        return self.artifacts.run_dir(self.loop, run_id) / "output"

    def run_row(self, run_id: str) -> Run:
        with self.sessions.begin() as session:
            run = q.get_run(session=session, run_id=run_id)
            assert run is not None
            session.expunge(run)
            return run


@pytest.fixture
def world(session_factory: SessionFactory, tmp_path: Path) -> World:
    return World(session_factory, tmp_path)


def worker(client: Client, task_queue: str, activities: JobActivities) -> Worker:
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[RunJobTestWorkflow, CancelJobTestWorkflow],
        activities=activities.activities(),
        activity_executor=concurrent.futures.ThreadPoolExecutor(4),
        workflow_runner=UnsandboxedWorkflowRunner(),
    )


async def run_job(client: Client, task_queue: str, input: RunJobInput) -> RunJobResult:
    return await (await start_job(client, task_queue, input)).result()


async def start_job(
    client: Client, task_queue: str, input: RunJobInput
) -> WorkflowHandle[RunJobTestWorkflow, RunJobResult]:
    return await client.start_workflow(
        RunJobTestWorkflow.run, input, id=f"test-{uuid.uuid4().hex}", task_queue=task_queue
    )


def starts(world: World, run_id: str) -> int:
    path = world.output_dir(run_id) / "starts"
    return path.read_text().count("started") if path.exists() else 0


def application_error(exc: BaseException) -> ApplicationError:
    assert isinstance(exc, WorkflowFailureError)
    assert isinstance(exc.cause, ActivityError)
    assert isinstance(exc.cause.cause, ApplicationError)
    return exc.cause.cause


async def test_a_job_runs_and_its_run_is_recorded_with_cost(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    input = world.job_input(accelerators=2)
    async with worker(temporal_client, task_queue, world.activities(SUCCEED)):
        result = await run_job(temporal_client, task_queue, input)

    assert result.status == "succeeded"
    assert result.error is None
    assert result.metrics == {"pass_rate": 0.75, "train_tokens_per_s": 123.0}
    assert result.output_uri == path_to_uri(world.output_dir(input.run_id))
    run = world.run_row(input.run_id)
    assert run.status == "succeeded"
    assert run.executor == "local"
    assert run.handle is not None and run.handle["executor"] == "local"
    assert run.started_at is not None and run.ended_at is not None
    assert run.accelerators == 2
    assert run.cpu_seconds > 0
    wall = run.compute_seconds / 2  # accelerator-seconds = accelerators x wall
    assert wall > 0
    expected = Decimal(str(2 * wall / 3600 * 3.6 + run.cpu_seconds / 3600 * 0.36))
    assert abs(run.cost_usd - expected) <= Decimal("0.000001")
    assert result.cost_usd == pytest.approx(float(run.cost_usd))
    assert run.logs_uri is not None and run.logs_uri.endswith("/logs/job.log")
    assert (world.artifacts.logs_dir(world.loop, input.run_id) / "job.log").exists()


async def test_the_same_run_id_never_makes_a_second_job(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    input = world.job_input()
    async with worker(temporal_client, task_queue, world.activities(SUCCEED)):
        first = await run_job(temporal_client, task_queue, input)
        again = await run_job(temporal_client, task_queue, input)

    assert again == first
    assert starts(world, input.run_id) == 1


async def test_a_failed_job_is_a_result_with_its_reason(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    input = world.job_input()
    async with worker(temporal_client, task_queue, world.activities(FAIL)):
        result = await run_job(temporal_client, task_queue, input)

    assert result.status == "failed"
    assert result.error is not None and "dataset is empty" in result.error
    assert world.run_row(input.run_id).status == "failed"


async def test_a_job_that_wrote_no_metrics_failed(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    input = world.job_input()
    async with worker(temporal_client, task_queue, world.activities(NO_METRICS)):
        result = await run_job(temporal_client, task_queue, input)
    assert result.status == "failed"
    assert result.error == "the job exited 0 but wrote no metrics.json"


async def test_a_config_exit_code_fails_without_retry(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    input = world.job_input()
    async with worker(temporal_client, task_queue, world.activities(CONFIG_ERROR)):
        with pytest.raises(WorkflowFailureError) as raised:
            await run_job(temporal_client, task_queue, input)

    error = application_error(raised.value)
    assert error.type == "JobConfigError"
    assert error.non_retryable
    assert "unknown algorithm 'dpo'" in str(error)
    assert starts(world, input.run_id) == 1
    assert world.run_row(input.run_id).status == "failed"


async def test_a_bad_spec_and_an_unknown_loop_are_not_retried(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    bad = world.job_input()
    bad.job_spec = {"schema": "ratchet.job/v1", "kind": "deploy", "run_id": bad.run_id}
    unknown = world.job_input()
    unknown.loop = "no-such-loop"
    async with worker(temporal_client, task_queue, world.activities(SUCCEED)):
        with pytest.raises(WorkflowFailureError) as bad_spec:
            await run_job(temporal_client, task_queue, bad)
        with pytest.raises(WorkflowFailureError) as unknown_loop:
            await run_job(temporal_client, task_queue, unknown)

    assert application_error(bad_spec.value).type == "JobRequestError"
    assert "kind must be one of" in str(application_error(bad_spec.value))
    run = world.run_row(bad.run_id)
    assert run.status == "failed" and "kind must be one of" in (run.error or "")
    assert application_error(unknown_loop.value).type == "UnknownLoop"


async def test_cancelling_the_workflow_cancels_the_job(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    input = world.job_input()
    async with worker(temporal_client, task_queue, world.activities(WAIT_FOR_RELEASE)):
        handle = await start_job(temporal_client, task_queue, input)
        await assert_eventually_async(lambda: _running(world, input.run_id))
        job_pid = _job_pid(world, input.run_id)
        await handle.cancel()
        with pytest.raises(WorkflowFailureError) as raised:
            await handle.result()

    assert isinstance(raised.value.cause, CancelledError)
    assert world.run_row(input.run_id).status == "cancelled"
    assert not _alive(job_pid)


async def test_cancel_job_stops_a_running_job(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    input = world.job_input()
    async with worker(temporal_client, task_queue, world.activities(WAIT_FOR_RELEASE)):
        running = await start_job(temporal_client, task_queue, input)
        await assert_eventually_async(lambda: _running(world, input.run_id))
        await temporal_client.execute_workflow(
            CancelJobTestWorkflow.run,
            CancelJobInput(run_id=input.run_id, loop=world.loop),
            id=f"test-{uuid.uuid4().hex}",
            task_queue=task_queue,
        )
        result = await running.result()
        # Cancelling an ended run is a no-op.
        await temporal_client.execute_workflow(
            CancelJobTestWorkflow.run,
            CancelJobInput(run_id=input.run_id, loop=world.loop),
            id=f"test-{uuid.uuid4().hex}",
            task_queue=task_queue,
        )

    assert result.status == "cancelled"
    assert world.run_row(input.run_id).status == "cancelled"


async def test_a_restarted_worker_adopts_the_running_job(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    input = world.job_input()
    first_worker = worker(temporal_client, task_queue, world.activities(WAIT_FOR_RELEASE))
    async with first_worker:
        handle = await start_job(temporal_client, task_queue, input)
        await assert_eventually_async(lambda: _running(world, input.run_id))
    # The first worker is gone; its job is not. A new worker (new executor) takes over.
    assert world.run_row(input.run_id).status == "running"
    (world.output_dir(input.run_id) / "release").touch()
    async with worker(temporal_client, task_queue, world.activities(WAIT_FOR_RELEASE)):
        result = await asyncio.wait_for(handle.result(), timeout=60)

    assert result.status == "succeeded"
    assert starts(world, input.run_id) == 1


class FlakyStatus(LocalExecutor):
    """A local executor whose status backend fails a few times, like an API server blip."""

    def __init__(self, failures: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failures = failures

    def wait(self, handle: dict[str, Any], timeout_s: float) -> JobStatus:
        if self.failures > 0:
            self.failures -= 1
            raise ExecutorUnavailable("the API server answered 503")
        return super().wait(handle, timeout_s)


async def test_status_blips_do_not_end_the_attempt(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    input = world.job_input()
    input.poll_interval_s = 0.05
    flaky = FlakyStatus(
        3, command=[sys.executable, "-c", textwrap.dedent(SUCCEED)], poll_interval_s=0.05
    )
    activities = JobActivities(
        session_factory=world.sessions,
        executors={"local": flaky},
        artifacts=world.artifacts,
        settings=world.settings,
    )
    async with worker(temporal_client, task_queue, activities):
        handle = await start_job(temporal_client, task_queue, input)
        result = await handle.result()

    assert result.status == "succeeded"
    assert flaky.failures == 0
    history = await handle.fetch_history()
    attempts = [
        e.activity_task_started_event_attributes.attempt
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert attempts == [1]


async def _running(world: World, run_id: str) -> None:
    with world.sessions.begin() as session:
        run = q.get_run(session=session, run_id=run_id)
        assert run is not None and run.status == "running"
    assert starts(world, run_id) == 1


def _job_pid(world: World, run_id: str) -> int:
    child = world.artifacts.run_dir(world.loop, run_id) / "executor" / "child.json"
    return int(json.loads(child.read_text())["pid"])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# register_checkpoint ------------------------------------------------------------------------


@pytest.fixture
async def activity_env() -> AsyncIterator[ActivityEnvironment]:
    yield ActivityEnvironment()


def tiny_checkpoint(path: Path, *, seed: int, parent: str | None = None) -> str:
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=1, n_head=1, d_model=8, max_seq_len=16)
    return save_checkpoint(GPT(config), config, path, parent=parent).checkpoint_id


def record_run(world: World, run_id: str) -> None:
    with world.sessions.begin() as session:
        loop_id = require_loop(session=session, name=world.loop).id
        run = q.NewRun(run_id=run_id, loop_id=loop_id, kind="train", executor="local", spec={})
        q.upsert_run(session=session, run=run)


async def register(
    env: ActivityEnvironment, world: World, run_id: str, source: Path, parent: str | None = None
) -> RegisterCheckpointResult:
    activities = world.activities(SUCCEED)
    input = RegisterCheckpointInput(
        loop=world.loop,
        run_id=run_id,
        checkpoint_dir_uri=path_to_uri(source),
        parent_checkpoint_id=parent,
    )
    result: RegisterCheckpointResult = await env.run(activities.register_checkpoint, input)
    return result


async def test_register_checkpoint_copies_verifies_and_records_lineage(
    activity_env: ActivityEnvironment, world: World, tmp_path: Path
) -> None:
    record_run(world, "r1")
    record_run(world, "r2")
    base_id = tiny_checkpoint(tmp_path / "r1" / "checkpoint", seed=0)
    child_id = tiny_checkpoint(tmp_path / "r2" / "checkpoint", seed=1, parent=base_id)

    base = await register(activity_env, world, "r1", tmp_path / "r1" / "checkpoint")
    child = await register(activity_env, world, "r2", tmp_path / "r2" / "checkpoint", base_id)
    again = await register(activity_env, world, "r2", tmp_path / "r2" / "checkpoint", base_id)

    assert base.checkpoint_id == base_id
    assert child.checkpoint_id == child_id
    assert again == child
    stored = world.artifacts.checkpoint_dir(child_id)
    assert child.uri == path_to_uri(stored)
    assert (stored / "manifest.json").is_file()
    assert child.size_bytes == sum(p.stat().st_size for p in stored.iterdir())
    with world.sessions.begin() as session:
        row = session.get(Checkpoint, child_id)
        assert row is not None
        assert (row.parent_id, row.run_id, row.sha256) == (base_id, "r2", child_id)
        base = session.get(Checkpoint, base_id)
        assert base is not None and base.parent_id is None


async def test_a_tampered_checkpoint_is_refused_for_good(
    activity_env: ActivityEnvironment, world: World, tmp_path: Path
) -> None:
    record_run(world, "r1")
    source = tmp_path / "r1" / "checkpoint"
    tiny_checkpoint(source, seed=0)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "n_layer": 2}))

    with pytest.raises(ApplicationError) as raised:
        await register(activity_env, world, "r1", source)
    assert raised.value.type == "CheckpointInvalid"
    assert raised.value.non_retryable
    assert "config.json" in str(raised.value)


async def test_an_unregistered_parent_is_refused(
    activity_env: ActivityEnvironment, world: World, tmp_path: Path
) -> None:
    record_run(world, "r1")
    source = tmp_path / "r1" / "checkpoint"
    tiny_checkpoint(source, seed=0, parent="f" * 64)
    with pytest.raises(ApplicationError) as raised:
        await register(activity_env, world, "r1", source)
    assert raised.value.type == "UnknownParentCheckpoint"


async def test_a_job_runs_on_the_executor_its_cycle_started_with(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    """An executor change made while the cycle runs applies from the next cycle only."""
    from services.db.models import Cycle
    from services.db.queries.loops import (
        config_document,
        record_config_version,
        require_loop,
        update_loop_config,
    )

    with world.sessions.begin() as session:
        loop = require_loop(session=session, name=world.loop)
        record_config_version(session=session, loop=loop, changes=[], changed_by="test")
    with world.sessions.begin() as session:
        loop = require_loop(session=session, name=world.loop)
        session.add(Cycle(loop_id=loop.id, number=1, trigger="operator"))
    with world.sessions.begin() as session:
        loop = require_loop(session=session, name=world.loop)
        config = {**config_document(loop), "executor": "kubernetes"}
        update_loop_config(session=session, loop=loop, config=config, changed_by="test")

    input = world.job_input()
    async with worker(temporal_client, task_queue, world.activities(SUCCEED)):
        result = await run_job(temporal_client, task_queue, input)
    # Only "local" is configured here: the job ran on the executor of the cycle's version.
    assert result.status == "succeeded"
    assert world.run_row(input.run_id).executor == "local"


def _replace_log_with_link(target: Path, *, then: str) -> str:
    """A job that swaps its own log for a symbolic link to ``target``, then ``then``."""
    return (
        JOB_HEADER
        + f"""
log = out.parent / "logs" / "job.log"
print("the real last line", flush=True)
log.unlink()
os.symlink({str(target)!r}, log)
{then}
"""
    )


async def test_a_job_planted_dangling_log_link_is_not_written_through(
    temporal_client: Client, task_queue: str, world: World, tmp_path: Path
) -> None:
    """The worker saves a job's logs where none are: never through a dangling link."""
    target = tmp_path / "outside" / "planted.txt"
    target.parent.mkdir()
    script = _replace_log_with_link(target, then='(out / "metrics.json").write_text("{}")')
    input = world.job_input()
    async with worker(temporal_client, task_queue, world.activities(script)):
        result = await run_job(temporal_client, task_queue, input)

    assert result.status == "succeeded"
    assert not target.exists()
    assert (world.artifacts.logs_dir(world.loop, input.run_id) / "job.log").is_symlink()


async def test_a_job_planted_log_link_is_not_read_into_the_run(
    temporal_client: Client, task_queue: str, world: World, tmp_path: Path
) -> None:
    """A failed job's reason is its log's last line, read without following a link."""
    secret = tmp_path / "secret.key"
    secret.write_text("the-fernet-key\n")
    script = _replace_log_with_link(secret, then="sys.exit(1)")
    input = world.job_input()
    async with worker(temporal_client, task_queue, world.activities(script)):
        result = await run_job(temporal_client, task_queue, input)

    assert result.status == "failed"
    assert "the-fernet-key" not in (result.error or "")
    assert "the-fernet-key" not in (world.run_row(input.run_id).error or "")


async def test_a_loop_command_the_local_executor_refuses_fails_the_run_for_good(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    activities = JobActivities(
        session_factory=world.sessions,
        executors={"local": LocalExecutor(poll_interval_s=0.05)},
        artifacts=world.artifacts,
        settings=world.settings,
    )
    input = world.job_input(job_command=[sys.executable, "-c", "print('ran')"])
    async with worker(temporal_client, task_queue, activities):
        with pytest.raises(WorkflowFailureError) as failed:
            await run_job(temporal_client, task_queue, input)
    error = application_error(failed.value)
    assert error.non_retryable
    assert "RATCHET_LOCAL_JOB_COMMANDS_ENABLED" in str(error)
    run = world.run_row(input.run_id)
    assert run.status == "failed"
    assert "RATCHET_LOCAL_JOB_COMMANDS_ENABLED" in (run.error or "")


async def test_a_job_past_its_deadline_is_stopped_and_its_run_fails(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    """The deadline counts from the run's first start (stored), so an attempt that adopts
    the job gets no fresh bound: one cycle's job cannot outlive its ``timeout_s``."""
    input = world.job_input(deadline_s=1.0)
    async with worker(temporal_client, task_queue, world.activities(WAIT_FOR_RELEASE)):
        result = await run_job(temporal_client, task_queue, input)

    assert result.status == "failed"
    assert result.error is not None and "ran past its timeout of 1 s" in result.error
    job_pid = _job_pid(world, input.run_id)
    run = world.run_row(input.run_id)
    assert run.status == "failed" and run.error == result.error
    assert not _alive(job_pid)
    assert starts(world, input.run_id) == 1


async def test_a_calibration_pass_is_its_own_run_kind_and_keeps_nothing(
    temporal_client: Client, task_queue: str, world: World
) -> None:
    """A calibration pass (services.training.calibration) runs the train job as a
    ``calibrate`` run: recorded with its kind and cost (the cycle's), and handed none of a
    train run's extras (no demonstrations to keep, no replay)."""
    run_id = f"{world.loop}-c1-calibrate"
    spec = {"schema": "ratchet.job/v1", "kind": "train", "run_id": run_id, "calibrate": True}
    input = replace(world.job_input(run_id), kind="calibrate", job_spec=spec)
    async with worker(temporal_client, task_queue, world.activities(SUCCEED)):
        result = await run_job(temporal_client, task_queue, input)
    assert result.status == "succeeded"
    run = world.run_row(run_id)
    assert run.kind == "calibrate" and run.cost_usd > 0
    handed = json.loads((world.artifacts.run_dir(world.loop, run_id) / "spec.json").read_text())
    assert handed["calibrate"] is True and handed["kind"] == "train"
    assert not {"keep_episodes", "demonstrations", "replay_dataset"} & set(handed)
