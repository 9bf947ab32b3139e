"""Ratchet as a user runs it, for end-to-end tests: real servers, real processes, real jobs.

:class:`LiveStack` starts the embedded stack of ``ratchet up`` (pgserver Postgres, the Temporal
dev server, the api and the worker) in a fresh state directory on free ports, with every
process logging to a file under ``<state>/logs`` so a failing test can show what happened.
The worker can be killed with SIGKILL and started again, as a crashed pod would be.

The evidence a chaos test needs lives here too: how often each run's job was launched (the
local executor's files and the worker's "started local job" lines), on which attempt each
``run_job`` activity finished (the Temporal history), and tails of every log.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
from pydantic import SecretStr
from sqlalchemy import Engine, select
from temporalio.api.enums.v1 import TimeoutType

from services.artifacts import ArtifactStore
from services.client import RatchetClient
from services.db.models import Cycle, Loop
from services.db.session import SessionFactory, create_db_engine, make_session_factory
from services.environments import get_environment, write_task_file
from services.environments.base import build_trace
from services.executors.local import HANDLE_FILE, LOG_FILE, STATE_SUBDIR, kill_local_jobs
from services.executors.supervise import EXIT_FILE, SUPERVISOR_FILE
from services.local.stack import Stack
from services.loop.policies import TrainingProfile
from services.settings import Settings
from services.temporal import connect_temporal
from services.training.jobspec import train_job_document
from tests.support import assert_eventually, free_port

T = TypeVar("T")

# A policy small enough that every job of a cycle takes seconds on a busy 2-core machine.
TINY_MODEL = {"n_layer": 1, "n_head": 2, "d_model": 32}


def _environment_without_ratchet_settings() -> dict[str, str]:
    """This process's environment minus RATCHET_* (a developer's settings must not leak in)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("RATCHET_")}


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class JobLaunches:
    """What the local executor and the worker recorded about one run's job process."""

    run_id: str
    started_lines: int  # "started local job of run <id>" in all worker logs
    handle_pid: int | None  # handle.json: the supervisor the executor started
    supervisor_pid: int | None  # supervisor.json: the supervisor that actually ran
    exit: dict[str, Any] | None  # exit.json: how the job ended
    job_log: str


@dataclass(frozen=True)
class ActivityAttempt:
    """The attempt on which an activity completed, and why the one before it failed."""

    attempt: int
    previous_failure_was_heartbeat_timeout: bool


@dataclass
class LiveStack:
    """The embedded stack plus api and worker processes, each logging to its own file."""

    settings: Settings
    token: str
    stack: Stack
    workers_started: int = 0
    apis_started: int = 1
    _engine: Engine | None = None

    @classmethod
    def in_dir(cls, state_dir: Path) -> LiveStack:
        """A stack whose data, logs and artifacts all live under ``state_dir``, on free ports."""
        token = secrets.token_urlsafe(24)
        settings = Settings(
            state_dir=state_dir,
            artifact_root=None,
            database_url=None,
            temporal_address=None,
            api_port=free_port(),
            worker_port=free_port(),
            gateway_port=free_port(),
            temporal_port=free_port(),
            temporal_ui_port=free_port(),
            serve_port=free_port(),
            admin_token=SecretStr(token),
            serve_api_key=SecretStr(secrets.token_urlsafe(24)),
            serve_admin_key=SecretStr(secrets.token_urlsafe(24)),
            executor="local",
        )
        extra_env = {
            "RATCHET_ADMIN_TOKEN": token,
            "RATCHET_LOG_FORMAT": "text",
            "RATCHET_EXECUTOR": "local",
        }
        return cls(settings=settings, token=token, stack=Stack(settings, extra_env=extra_env))

    # Lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.settings.logs_dir.mkdir(parents=True, exist_ok=True)
        self.stack.preflight()
        self.stack.start_servers()
        self.stack.migrate()
        self.stack.children["api"] = self._spawn("api", self.settings.logs_dir / "api.log")
        self.start_worker()
        self.stack.wait_api_ready(timeout=120)

    def start_worker(self) -> None:
        """Start a worker process (``python -m services worker``), as after a crash."""
        self.workers_started += 1
        log = self.settings.logs_dir / f"worker-{self.workers_started}.log"
        self.stack.children["worker"] = self._spawn("worker", log)

    def kill_worker(self) -> None:
        """SIGKILL the worker: no shutdown hook, no graceful end of its activities."""
        worker = self.stack.children.pop("worker")
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)

    def kill_api(self) -> None:
        """SIGKILL the api, every process of it at once (``ratchet api`` serves from one
        process per core under a supervisor), as a node failure or an OOM kill of its pod:
        requests in flight are cut, its ingest writer loses what it had not committed."""
        api = self.stack.children.pop("api")
        processes = [psutil.Process(api.pid)]
        processes += processes[0].children(recursive=True)
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(processes, timeout=30)
        api.wait(30)

    def start_api(self, timeout: float = 120) -> None:
        """Start an api process again (a new log file) and wait until it answers."""
        self.apis_started += 1
        log = self.settings.logs_dir / f"api-{self.apis_started}.log"
        self.stack.children["api"] = self._spawn("api", log)
        self.stack.wait_api_ready(timeout=timeout)

    def restart_postgres(self, down_s: float) -> None:
        """Stop the embedded Postgres (every connection of api and worker is cut), leave it
        down ``down_s`` seconds, and start it again on the same data and socket."""
        postgres = self.stack.postgres
        assert postgres is not None, "the stack's Postgres is not embedded"
        if self._engine is not None:  # the test's own connections go too
            self._engine.dispose()
            self._engine = None
        postgres.stop()
        time.sleep(down_s)
        assert postgres.start() == self.stack.database_url, "Postgres came back elsewhere"

    def restart_temporal(self, down_s: float) -> None:
        """Stop the Temporal dev server, leave it down ``down_s`` seconds, and start it again
        on the same file database (its workflows, timers and tasks persist)."""
        temporal = self.stack.temporal
        assert temporal is not None, "the stack's Temporal is not embedded"
        temporal.stop()
        time.sleep(down_s)
        temporal.start()
        temporal.wait_ready()

    def stop(self) -> None:
        """Stop api, worker, Temporal and Postgres, then any job a killed worker left behind."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        try:
            self.stack.stop()
        finally:
            self._kill_leftover_jobs()

    def _spawn(self, command: str, log_path: Path) -> subprocess.Popen[bytes]:
        with log_path.open("ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "services", command],
                env=self.stack.child_environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def _kill_leftover_jobs(self) -> None:
        """Jobs run in sessions of their own and outlive the worker: end any still running."""
        kill_local_jobs(self.settings.artifacts_dir)

    # Access ------------------------------------------------------------------------------

    @property
    def api_url(self) -> str:
        return self.settings.api_base_url

    def client(self) -> RatchetClient:
        return RatchetClient(self.api_url, self.token)

    def sessions(self) -> SessionFactory:
        """A session factory on the stack's Postgres (one small engine, disposed by stop)."""
        if self._engine is None:
            assert self.stack.database_url is not None, "the stack is not started"
            self._engine = create_db_engine(
                self.stack.database_url, pool_size=2, application="ratchet-e2e"
            )
        return make_session_factory(self._engine)

    def run_dir(self, loop: str, run_id: str) -> Path:
        return ArtifactStore(self.settings.artifacts_dir).run_dir(loop, run_id)

    # Evidence ----------------------------------------------------------------------------

    def worker_logs(self) -> str:
        return "\n".join(
            path.read_text(errors="replace")
            for path in sorted(self.settings.logs_dir.glob("worker-*.log"))
        )

    def job_has_ended(self, loop: str, run_id: str) -> bool:
        """The supervisor wrote the job's exit status (the job process is gone)."""
        return (self.run_dir(loop, run_id) / STATE_SUBDIR / EXIT_FILE).exists()

    def job_launches(self, loop: str, run_id: str) -> JobLaunches:
        state = self.run_dir(loop, run_id) / STATE_SUBDIR
        pattern = re.compile(rf"started local job of run {re.escape(run_id)} \(pid \d+\)")
        handle = _read_json(state / HANDLE_FILE)
        supervisor = _read_json(state / SUPERVISOR_FILE)
        job_log = self.run_dir(loop, run_id) / "logs" / LOG_FILE
        return JobLaunches(
            run_id=run_id,
            started_lines=len(pattern.findall(self.worker_logs())),
            handle_pid=int(handle["pid"]) if handle else None,
            supervisor_pid=int(supervisor["pid"]) if supervisor else None,
            exit=_read_json(state / EXIT_FILE),
            job_log=job_log.read_text(errors="replace") if job_log.exists() else "",
        )

    def run_job_attempts(self, workflow_id: str) -> dict[str, ActivityAttempt]:
        """For each run id of a stage workflow: the attempt its ``run_job`` activity ended on."""
        return asyncio.run(self._run_job_attempts(workflow_id))

    async def _run_job_attempts(self, workflow_id: str) -> dict[str, ActivityAttempt]:
        client = await connect_temporal(self.settings)
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        scheduled: dict[int, str] = {}
        attempts: dict[str, ActivityAttempt] = {}
        for event in history.events:
            if event.HasField("activity_task_scheduled_event_attributes"):
                attrs = event.activity_task_scheduled_event_attributes
                if attrs.activity_type.name == "run_job":
                    scheduled[event.event_id] = json.loads(attrs.input.payloads[0].data)["run_id"]
            elif event.HasField("activity_task_started_event_attributes"):
                started = event.activity_task_started_event_attributes
                run_id = scheduled.get(started.scheduled_event_id)
                if run_id is not None:
                    failure = started.last_failure
                    attempts[run_id] = ActivityAttempt(
                        attempt=started.attempt,
                        previous_failure_was_heartbeat_timeout=(
                            failure.HasField("timeout_failure_info")
                            and failure.timeout_failure_info.timeout_type
                            == TimeoutType.TIMEOUT_TYPE_HEARTBEAT
                        ),
                    )
        return attempts

    def log_tails(self, lines: int = 40) -> str:
        """The end of every process log and job log, for a failing test's report."""
        paths = sorted(self.settings.logs_dir.glob("*.log"))
        paths += sorted(self.settings.artifacts_dir.glob(f"loops/*/runs/*/logs/{LOG_FILE}"))
        return "\n".join(f"===== {path} =====\n{_tail(path, lines)}" for path in paths)

    @contextlib.contextmanager
    def diagnostics(self) -> Iterator[None]:
        """On any failure inside the block, print the log tails (pytest shows them)."""
        try:
            yield
        except BaseException:
            print(self.log_tails(), file=sys.stderr)
            raise


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


# Inputs ---------------------------------------------------------------------------------


def make_tiny_champion(work_dir: Path) -> Path:
    """The first champion: a tiny policy, SFT for a few steps through the real train job."""
    tasks = get_environment("toolcalc").generate_tasks(64, seed=1, api_version="v1")
    dataset = work_dir / "sft.jsonl"
    write_task_file(dataset, tasks)
    spec = train_job_document(
        run_id="e2e-champion",
        environment="toolcalc",
        dataset=str(dataset),
        profile=TrainingProfile.model_construct(
            algorithm="sft",
            device="cpu",
            hyperparameters={
                "steps": 5,
                "batch_size": 8,
                "warmup": 1,
                "threads": 1,
                "model": TINY_MODEL,
            },
        ).model_dump(mode="json"),
    )
    spec_path = work_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    output = work_dir / "output"
    log_path = work_dir / "job.log"
    with log_path.open("wb") as log:
        result = subprocess.run(
            [sys.executable, "-m", "services", "job", "train", "--spec", str(spec_path)],
            env={**_environment_without_ratchet_settings(), "RATCHET_OUTPUT_DIR": str(output)},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=300,
            check=False,
        )
    assert result.returncode == 0, f"champion job failed:\n{_tail(log_path, 40)}"
    return output / "checkpoint"


def _answering(answer: int) -> Callable[[str], str]:
    """An agent that answers at once, without calling a tool."""

    def act(_transcript: str) -> str:
        return f"ans {answer}"

    return act


def toolcalc_traces(
    count: int, *, seed: int, passing: bool, id_prefix: str, api_version: str = "v2"
) -> list[dict[str, Any]]:
    """``ratchet.trace/v1`` documents of toolcalc episodes answered right or wrong.

    The same ``seed`` gives the same requests, so a second call with another ``id_prefix``
    makes new traces of the same tasks (duplicates for curation).
    """
    env = get_environment("toolcalc")
    traces = []
    for index, task in enumerate(env.generate_tasks(count, seed=seed, api_version=api_version)):
        assert task.reference_answer is not None
        right = int(task.reference_answer)
        answer = right if passing else right + 1
        started_at = dt.datetime.now(dt.UTC).isoformat()
        episode = env.run_episode(task, _answering(answer), max_turns=3)
        reward = env.verify(task, episode)
        assert reward.passed is passing, (task.prompt, answer, reward)
        traces.append(
            build_trace(
                task,
                episode,
                reward,
                external_id=f"{id_prefix}-{index}",
                model_version="e2e-champion",
                started_at=started_at,
                ended_at=dt.datetime.now(dt.UTC).isoformat(),
            )
        )
    return traces


def new_tasks_trigger(min_new_tasks: int) -> dict[str, Any]:
    """The e2e trigger policy: a cycle once ``min_new_tasks`` are curated, checked every
    second; drift detection off, so only the traffic a test posts starts a cycle."""
    return {"min_new_tasks": min_new_tasks, "check_interval_s": 1, "drift_enabled": False}


def wait_for(check: Callable[[], T], *, timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll ``check`` (which asserts) until it passes; the last assertion says what is missing."""
    try:
        return assert_eventually(check, timeout=timeout, interval=interval)
    except AssertionError as exc:
        raise AssertionError(f"waiting for {what}: {exc}") from exc


def loop_cycle(live: LiveStack, loop: str, number: int = 1) -> Cycle:
    """Cycle ``number`` of ``loop`` as Postgres has it now; asserts it has started."""
    with live.sessions()() as session:
        cycle = session.scalars(
            select(Cycle).join(Loop).where(Loop.name == loop, Cycle.number == number)
        ).one_or_none()
    assert cycle is not None, f"cycle {number} has not started"
    return cycle


def cycle_closed(live: LiveStack, loop: str) -> Callable[[], Cycle]:
    """A ``wait_for`` check: cycle 1 of ``loop`` has ended."""

    def check() -> Cycle:
        cycle = loop_cycle(live, loop)
        assert cycle.ended_at is not None, f"stage is {cycle.stage}"
        return cycle

    return check
