"""The local executor: real subprocesses in their own process group, state in files.

Jobs here are tiny Python programs that honour the job contract (the trainer job has its
own test in test_local_trainer.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from services.executors.base import Handle, JobRequest, JobRequestError
from services.executors.local import LocalExecutor
from tests.support import assert_eventually

SUCCEED = """
import json, os, pathlib, sys
out = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"])
spec = json.loads(pathlib.Path(sys.argv[sys.argv.index("--spec") + 1]).read_text())
print("training", spec["run_id"], "kind", sys.argv[1], flush=True)
(out / "metrics.json").write_text(json.dumps({"loss": 0.5}))
"""
FAIL = """
import sys
print("step 1", flush=True)
print("dataset is empty", file=sys.stderr)
sys.exit(1)
"""
CONFIG_ERROR = """
import sys
print("unknown hyperparameter 'lrr'", file=sys.stderr)
sys.exit(78)
"""
SLEEP = """
import os, pathlib, time
marker = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"]) / "starts"
with marker.open("a") as fh:
    fh.write("started\\n")
time.sleep(600)
"""
IGNORE_TERM = """
import os, pathlib, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
(pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"]) / "starts").write_text("started\\n")
time.sleep(600)
"""


def executor_for(script: str, *, cancel_grace_s: float = 10.0) -> LocalExecutor:
    return LocalExecutor(
        command=[sys.executable, "-c", textwrap.dedent(script)],
        poll_interval_s=0.05,
        cancel_grace_s=cancel_grace_s,
    )


Start = Callable[..., tuple[LocalExecutor, Handle]]


@pytest.fixture
def start() -> Iterator[Start]:
    """Submit ``spec`` to an ``executor_for(script, ...)``; the jobs still running when the
    test ends are killed with their process group."""
    started: list[tuple[LocalExecutor, Handle]] = []

    def submit(script: str, spec: JobRequest, **options: float) -> tuple[LocalExecutor, Handle]:
        executor = executor_for(script, **options)
        started.append((executor, executor.submit(spec)))
        return started[-1]

    yield submit
    for executor, handle in started:
        if not executor.status(handle).terminal:
            os.killpg(int(str(handle["pid"])), signal.SIGKILL)


def wait_done(executor: LocalExecutor, handle: dict[str, object]) -> None:
    assert_eventually(lambda: _assert_terminal(executor, handle), timeout=30)


def _assert_terminal(executor: LocalExecutor, handle: dict[str, object]) -> None:
    assert executor.status(handle).terminal


def test_a_job_runs_to_success_with_logs_and_accounting(
    make_spec: Callable[..., JobRequest],
) -> None:
    spec = make_spec(accelerators=2)
    executor = executor_for(SUCCEED)
    handle = executor.submit(spec)
    status = executor.wait(handle, 30)
    while not status.terminal:
        status = executor.wait(handle, 30)

    assert status.state == "succeeded"
    assert status.exit_code == 0
    assert status.accelerators == 2
    assert status.wall_seconds > 0
    assert status.cpu_seconds > 0
    assert status.ended_at is not None and status.started_at is not None
    assert "training demo-c1-train kind train" in executor.logs(handle)
    assert json.loads((spec.output_dir / "metrics.json").read_text()) == {"loss": 0.5}
    assert json.loads(spec.spec_path.read_text())["run_id"] == "demo-c1-train"


def test_a_failed_job_reports_its_last_stderr_line(make_spec: Callable[..., JobRequest]) -> None:
    executor = executor_for(FAIL)
    handle = executor.submit(make_spec())
    wait_done(executor, handle)

    status = executor.status(handle)
    assert (status.state, status.exit_code) == ("failed", 1)
    assert status.message == "dataset is empty"
    assert not status.config_error
    assert executor.logs(handle, tail_lines=1) == "dataset is empty\n"


def test_a_config_exit_code_is_a_config_error(make_spec: Callable[..., JobRequest]) -> None:
    executor = executor_for(CONFIG_ERROR)
    handle = executor.submit(make_spec())
    wait_done(executor, handle)
    status = executor.status(handle)
    assert (status.state, status.exit_code, status.config_error) == ("failed", 78, True)
    assert status.message == "unknown hyperparameter 'lrr'"


def test_a_missing_job_program_fails_with_the_reason(make_spec: Callable[..., JobRequest]) -> None:
    executor = LocalExecutor(command=["/nonexistent/trainer"], poll_interval_s=0.05)
    handle = executor.submit(make_spec())
    wait_done(executor, handle)
    status = executor.status(handle)
    assert (status.state, status.exit_code) == ("failed", 127)
    assert "cannot start job command '/nonexistent/trainer'" in (status.message or "")


def test_submitting_a_run_twice_starts_one_job(
    make_spec: Callable[..., JobRequest], start: Start
) -> None:
    spec = make_spec()
    executor, first = start(SLEEP, spec)
    # Another executor (another worker, or this one after a restart) adopts it.
    second = executor_for(SLEEP).submit(spec)

    assert second == first
    starts = spec.output_dir / "starts"
    assert_eventually(lambda: _assert_lines(starts, 1))
    executor.cancel(first)


def _assert_lines(path: Path, count: int) -> None:
    assert path.exists() and path.read_text().count("started") == count


def test_cancel_kills_the_whole_process_group(
    make_spec: Callable[..., JobRequest], start: Start
) -> None:
    spec = make_spec()
    executor, handle = start(SLEEP, spec)
    assert_eventually(lambda: _assert_lines(spec.output_dir / "starts", 1))
    job_pid = json.loads((spec.run_dir / "executor" / "child.json").read_text())["pid"]
    assert executor.status(handle).state == "running"

    executor.cancel(handle)

    status = executor.status(handle)
    assert status.state == "cancelled"
    assert not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == "zombie"
    executor.cancel(handle)  # cancelling an ended job changes nothing
    assert executor.status(handle).state == "cancelled"


def test_a_job_ignoring_sigterm_is_killed_after_the_grace_period(
    make_spec: Callable[..., JobRequest], start: Start
) -> None:
    spec = make_spec()
    executor, handle = start(IGNORE_TERM, spec, cancel_grace_s=0.5)
    assert_eventually(lambda: _assert_lines(spec.output_dir / "starts", 1))

    executor.cancel(handle)

    assert executor.status(handle).state == "cancelled"


def test_a_restarted_worker_reattaches_and_sees_the_end(
    make_spec: Callable[..., JobRequest], tmp_path: Path
) -> None:
    release = tmp_path / "release"
    script = f"""
import os, pathlib, time
while not pathlib.Path({str(release)!r}).exists():
    time.sleep(0.02)
(pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"]) / "metrics.json").write_text("{{}}")
"""
    spec = make_spec()
    handle = executor_for(script).submit(spec)
    restarted = executor_for(script)  # knows the job only by its handle
    assert restarted.status(handle).state == "running"

    release.touch()
    wait_done(restarted, handle)
    assert restarted.status(handle).state == "succeeded"


def test_a_job_whose_supervisor_vanished_is_lost(make_spec: Callable[..., JobRequest]) -> None:
    spec = make_spec()
    executor = executor_for(SLEEP)
    handle = executor.submit(spec)
    assert_eventually(lambda: _assert_lines(spec.output_dir / "starts", 1))
    os.killpg(int(handle["pid"]), signal.SIGKILL)  # the machine "restarted"

    assert_eventually(lambda: _assert_state(executor, handle, "lost"))
    assert "left no exit status" in (executor.status(handle).message or "")


def _assert_state(executor: LocalExecutor, handle: dict[str, object], state: str) -> None:
    assert executor.status(handle).state == state


def test_a_recycled_pid_is_not_mistaken_for_the_job(make_spec: Callable[..., JobRequest]) -> None:
    executor = executor_for(SUCCEED)
    handle = executor.submit(make_spec())
    wait_done(executor, handle)
    # Same pid as a running process (this one), but another start time: not our job.
    stranger = {**handle, "pid": os.getpid(), "create_time": 1.0, "state_dir": "/nonexistent"}
    assert executor.status(stranger).state == "lost"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"run_id": "bad run id"}, "run id"),
        ({"kind": "deploy"}, "run kind"),
        ({"document": {"schema": "other/v9"}}, "schema"),
        ({"document": {"run_id": "other"}}, "is not the run id"),
        ({"nodes": 0}, "nodes"),
        ({"env": {"RATCHET_OUTPUT_DIR": "/tmp"}}, "cannot be overridden"),
    ],
)
def test_invalid_specs_fail_before_anything_runs(
    make_spec: Callable[..., JobRequest], overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(JobRequestError, match=message):
        make_spec(**overrides)
