"""The local executor's job slots (services.executors.local_queue): jobs past the slots wait,
start when a slot frees, in an order fair between loops, survive a worker restart, and a
cancelled waiting job never starts. Real subprocesses, state in files."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.executors.base import Handle, JobRequest, JobStatus
from services.executors.local import LocalExecutor, kill_local_jobs
from tests.support import assert_eventually

# Runs until the test writes ``release`` into its output directory.
WAIT_FOR_RELEASE = """
import os, pathlib, time
out = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"])
with (out / "starts").open("a") as fh:
    fh.write("started\\n")
while not (out / "release").exists():
    time.sleep(0.05)
"""


@pytest.fixture
def queue_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "artifacts" / "local-jobs"
    kill_local_jobs(tmp_path / "artifacts")


def slots(queue_dir: Path, count: int = 1) -> LocalExecutor:
    return LocalExecutor(
        command=[sys.executable, "-c", textwrap.dedent(WAIT_FOR_RELEASE)],
        poll_interval_s=0.05,
        max_running=count,
        queue_dir=queue_dir,
    )


def job(
    make_spec: Callable[..., JobRequest], loop: str, run_id: str, secret: str | None = None
) -> JobRequest:
    extra = {"secret_env": {"RATCHET_TEST_KEY": secret}} if secret else {}
    spec = make_spec(run_id=run_id, loop=loop, **extra)
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    return spec


def starts(spec: JobRequest) -> int:
    path = spec.output_dir / "starts"
    return len(path.read_text().splitlines()) if path.exists() else 0


def started_once(spec: JobRequest) -> None:
    def check() -> None:
        assert starts(spec) == 1

    assert_eventually(check, timeout=60)


def release(spec: JobRequest) -> None:
    (spec.output_dir / "release").write_text("")


def until(executor: LocalExecutor, handle: Handle, state: str) -> JobStatus:
    def check() -> JobStatus:
        status = executor.status(handle)
        assert status.state == state, status
        return status

    return assert_eventually(check, timeout=60)


def test_jobs_past_the_slots_wait_and_start_when_one_ends(
    make_spec: Callable[..., JobRequest], queue_dir: Path
) -> None:
    executor = slots(queue_dir)
    first = job(make_spec, "a", "a-1")
    second = job(make_spec, "b", "b-1")
    first_handle = executor.submit(first)
    second_handle = executor.submit(second)
    until(executor, first_handle, "running")
    waiting = executor.status(second_handle)
    assert (waiting.state, waiting.reason) == ("pending", "Queued")
    assert waiting.message is not None and "1 of 1 in use" in waiting.message
    assert starts(second) == 0 and second_handle.get("queued")

    release(first)
    until(executor, first_handle, "succeeded")
    running = until(executor, second_handle, "running")  # the handle it had while waiting
    assert running.started_at is not None
    started_once(second)
    release(second)
    until(executor, second_handle, "succeeded")


def test_the_next_slot_goes_to_the_loop_served_longest_ago(
    make_spec: Callable[..., JobRequest], queue_dir: Path
) -> None:
    executor = slots(queue_dir)
    specs = {run: job(make_spec, run[0], run) for run in ("a-1", "a-2", "a-3", "b-1")}
    handles = {run: executor.submit(spec) for run, spec in specs.items()}
    # Loop a's second and third jobs were queued before b's first, but b has had no turn
    # yet: a long queue of one loop never keeps another loop's cycle waiting behind it.
    expected = ["a-1", "b-1", "a-2", "a-3"]
    for index, current in enumerate(expected):
        until(executor, handles[current], "running")
        for later in expected[index + 1 :]:
            assert executor.status(handles[later]).state == "pending", later
            assert starts(specs[later]) == 0
        release(specs[current])
        until(executor, handles[current], "succeeded")
    for spec in specs.values():
        started_once(spec)


def test_a_waiting_job_cancelled_never_starts(
    make_spec: Callable[..., JobRequest], queue_dir: Path
) -> None:
    executor = slots(queue_dir)
    first, second = job(make_spec, "a", "a-1"), job(make_spec, "b", "b-1")
    first_handle, second_handle = executor.submit(first), executor.submit(second)
    until(executor, first_handle, "running")
    executor.cancel(second_handle)
    assert executor.status(second_handle).state == "cancelled"
    release(first)
    until(executor, first_handle, "succeeded")
    assert executor.status(second_handle).state == "cancelled"
    # Submitting the cancelled run again adopts it: it is cancelled, and still never runs.
    assert executor.status(executor.submit(second)).state == "cancelled"
    assert starts(second) == 0
    assert sorted(p.name for p in queue_dir.glob("[!.]*.json")) == []  # no entry left


def test_a_restarted_worker_submits_a_waiting_job_again_and_it_starts_once(
    make_spec: Callable[..., JobRequest], queue_dir: Path
) -> None:
    before = slots(queue_dir)
    first = job(make_spec, "a", "a-1")
    second = job(make_spec, "b", "b-1", secret="s3cr3t")
    first_handle = before.submit(first)
    second_handle = before.submit(second)
    until(before, first_handle, "running")
    # Credentials stay in the submitting process's memory: no file of the queue has them.
    assert all("s3cr3t" not in p.read_text() for p in queue_dir.iterdir() if p.is_file())

    after = slots(queue_dir)  # the worker restarted: this process never saw the request
    release(first)
    until(after, first_handle, "succeeded")
    assert after.status(second_handle).state == "pending"  # nobody here can start it yet
    assert starts(second) == 0
    adopted = after.submit(second)  # the activity's retry submits it again
    assert adopted["run_id"] == "b-1"
    until(after, second_handle, "running")
    started_once(second)
    release(second)
    until(after, second_handle, "succeeded")
    assert starts(second) == 1
