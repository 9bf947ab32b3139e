"""Many loops' jobs on one worker and one machine: a job waiting for a local job slot is
followed like any other and starts when the slot frees; the waits on jobs run in the job
activities' own threads; and jobs in flight never take the activity slots another loop's
cycle needs. Real Temporal dev server, real Postgres, real subprocesses."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client

from services.artifacts import ArtifactStore
from services.db.session import SessionFactory
from services.executors.base import Handle, JobRequest, JobStatus
from services.executors.local import LocalExecutor, kill_local_jobs
from services.settings import Settings
from tests.support import assert_eventually_async
from tests.workflows.test_jobs_activity import (
    WAIT_FOR_RELEASE,
    World,
    start_job,
    starts,
    worker,
)
from workflows.activities.jobs import FOLLOW_THREAD_PREFIX, JobActivities
from workflows.registry import WorkerDependencies
from workflows.worker import build_worker


class RecordingExecutor:
    """The local executor, noting which threads wait on its jobs."""

    name = "local"

    def __init__(self, inner: LocalExecutor) -> None:
        self.inner = inner
        self.wait_threads: set[str] = set()

    def submit(self, spec: JobRequest) -> Handle:
        return self.inner.submit(spec)

    def status(self, handle: Handle) -> JobStatus:
        return self.inner.status(handle)

    def wait(self, handle: Handle, timeout_s: float) -> JobStatus:
        self.wait_threads.add(threading.current_thread().name)
        return self.inner.wait(handle, timeout_s)

    def logs(self, handle: Handle, *, tail_lines: int | None = None) -> str:
        return self.inner.logs(handle, tail_lines=tail_lines)

    def cancel(self, handle: Handle) -> None:
        self.inner.cancel(handle)


async def test_a_job_waiting_for_a_slot_is_followed_until_it_runs_and_ends(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory, tmp_path: Path
) -> None:
    world = World(session_factory, tmp_path)
    executor = RecordingExecutor(
        LocalExecutor(
            command=[sys.executable, "-c", textwrap.dedent(WAIT_FOR_RELEASE)],
            poll_interval_s=0.05,
            max_running=1,
            queue_dir=tmp_path / "artifacts" / "local-jobs",
        )
    )
    activities = JobActivities(
        session_factory=session_factory,
        executors={"local": executor},
        artifacts=world.artifacts,
        settings=world.settings,
    )
    first, second = world.job_input("first-run"), world.job_input("second-run")
    try:
        async with worker(temporal_client, task_queue, activities):
            first_handle = await start_job(temporal_client, task_queue, first)

            async def running() -> None:
                assert starts(world, "first-run") == 1

            await assert_eventually_async(running, timeout=60)
            second_handle = await start_job(temporal_client, task_queue, second)

            async def waiting() -> None:
                run = world.run_row("second-run")
                assert run.handle is not None and run.handle.get("queued")
                assert run.status == "pending"

            await assert_eventually_async(waiting, timeout=60)
            assert starts(world, "second-run") == 0
            (world.output_dir("first-run") / "release").write_text("")
            assert (await first_handle.result()).status == "succeeded"

            async def started() -> None:
                assert starts(world, "second-run") == 1
                assert world.run_row("second-run").status == "running"

            await assert_eventually_async(started, timeout=60)
            (world.output_dir("second-run") / "release").write_text("")
            assert (await second_handle.result()).status == "succeeded"
    finally:
        kill_local_jobs(tmp_path / "artifacts")
    first_row, second_row = world.run_row("first-run"), world.run_row("second-run")
    assert first_row.ended_at is not None and second_row.started_at is not None
    assert second_row.started_at >= first_row.ended_at  # its queue time is not run time
    assert executor.wait_threads
    assert all(name.startswith(FOLLOW_THREAD_PREFIX) for name in executor.wait_threads)


RELEASE = asyncio.Event()
HELD: list[str] = []


@activity.defn(name="run_job")
async def held_job(run_id: str) -> str:
    """A job that runs until the test releases it (holding its activity slot meanwhile)."""
    HELD.append(run_id)
    await RELEASE.wait()
    return run_id


@activity.defn(name="load_loop_config")
def quick_lookup(loop: str) -> str:
    """One short database call of a loop's cycle."""
    return loop


@workflow.defn(sandboxed=False)
class FollowJob:
    @workflow.run
    async def run(self, run_id: str) -> str:
        return await workflow.execute_activity(
            "run_job", run_id, result_type=str, start_to_close_timeout=timedelta(minutes=5)
        )


@workflow.defn(sandboxed=False)
class NextCheck:
    @workflow.run
    async def run(self, loop: str) -> list[str]:
        return [
            await workflow.execute_activity(
                "load_loop_config",
                loop,
                result_type=str,
                start_to_close_timeout=timedelta(minutes=1),
            )
            for _ in range(3)
        ]


async def test_jobs_in_flight_never_take_the_slots_another_loops_cycle_needs(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory, tmp_path: Path
) -> None:
    RELEASE.clear()
    HELD.clear()
    deps = WorkerDependencies(
        settings=Settings(state_dir=tmp_path / "state"),
        session_factory=session_factory,
        artifacts=ArtifactStore(tmp_path / "artifacts"),
    )
    # One thread for working activities, three slots for followed jobs: three loops' jobs
    # in flight fill the job slots, and a fourth loop's cycle still gets its turn.
    async with build_worker(
        temporal_client,
        deps,
        task_queue=task_queue,
        workflows=[FollowJob, NextCheck],
        activities=[held_job, quick_lookup],
        max_concurrent_activities=1,
        max_followed_jobs=3,
    ):
        jobs = [
            await temporal_client.start_workflow(
                FollowJob.run,
                f"loop-{i}-train",
                id=f"job-{uuid.uuid4().hex}",
                task_queue=task_queue,
            )
            for i in range(3)
        ]

        async def all_held() -> None:
            assert sorted(HELD) == [f"loop-{i}-train" for i in range(3)]

        await assert_eventually_async(all_held, timeout=60)
        checked: Any = await asyncio.wait_for(
            temporal_client.execute_workflow(
                NextCheck.run, "loop-3", id=f"check-{uuid.uuid4().hex}", task_queue=task_queue
            ),
            timeout=60,
        )
        assert checked == ["loop-3"] * 3
        for job in jobs:  # the jobs still hold their slots
            assert (await job.describe()).status.name == "RUNNING"
        RELEASE.set()
        assert [await job.result() for job in jobs] == [f"loop-{i}-train" for i in range(3)]
