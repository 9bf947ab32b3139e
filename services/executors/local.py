"""The local executor: each job is a subprocess on this machine, in a session of its own.

A job runs under a small supervisor (:mod:`services.executors.supervise`) started with
``setsid``: the supervisor and the job form one process group, so ``cancel`` stops both
with one signal (SIGTERM, then SIGKILL after a grace period), and the supervisor writes the
job's exit status and CPU seconds to a file any later worker can read.

State lives in files under the run directory, never only in memory, so a worker that
restarts picks its jobs up again:

- ``<run_dir>/executor/handle.json`` — the handle; a second ``submit`` of the run id adopts
  it instead of starting another process (a file lock serialises racing submits);
- ``supervisor.json`` / ``exit.json`` — written by the supervisor;
- ``cancel.json`` — written before a cancel signals the group, so a job killed by it reads
  as ``cancelled`` and not ``failed``.

Re-attaching checks the supervisor's pid *and* its start time, so a recycled pid is never
mistaken for the job; a supervisor that is gone without an ``exit.json`` marks the job
``lost``. Accounting: wall time x the declared accelerators, and the CPU seconds of the
job process tree (from ``wait4`` once it ended, from the live tree while it runs).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from services.cores import ThreadBudget, job_threads, thread_budget, thread_env
from services.executors.base import (
    Handle,
    JobRequest,
    JobRequestError,
    JobStatus,
    last_line,
    tail,
    write_spec_file,
)
from services.executors.runfiles import UnsafeRunFile, read_text
from services.executors.supervise import EXIT_FILE, SUPERVISOR_FILE, write_json_atomic
from services.loop.states import RunStatus

logger = logging.getLogger(__name__)

STATE_SUBDIR = "executor"
HANDLE_FILE = "handle.json"
CANCEL_FILE = "cancel.json"
LOG_FILE = "job.log"
JOB_MODULES = {"train": "services.training.job", "eval": "services.evaluation.job"}

# Two start times of one process differ by float noise only; a recycled pid starts later.
_START_TIME_TOLERANCE_S = 1.0


class LocalExecutor:
    """Runs jobs as local subprocesses. Safe to share between threads."""

    name = "local"

    def __init__(
        self,
        *,
        python: str | None = None,
        command: Sequence[str] | None = None,
        loop_commands_enabled: bool = False,
        cancel_grace_s: float = 10.0,
        poll_interval_s: float = 0.2,
    ) -> None:
        """``python`` runs ``-m services.<training|evaluation>.job`` (default: this one).

        ``command`` replaces that: the job kind and ``--spec <path>`` are appended to it, as
        the Kubernetes job template does, so any trainer honouring the job contract fits.
        ``command`` is the deployment's; a *loop's* own command (``JobRequest.command``) runs
        only with ``loop_commands_enabled`` (``RATCHET_LOCAL_JOB_COMMANDS_ENABLED``).
        """
        if command is not None and not command:
            raise JobRequestError("the local job command must not be empty")
        self._python = python or sys.executable
        self._command = list(command) if command is not None else None
        self._loop_commands_enabled = loop_commands_enabled
        self._cancel_grace_s = cancel_grace_s
        self._poll_interval_s = poll_interval_s
        # Supervisors this process started: polled so they never linger as zombies.
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    # Submit ------------------------------------------------------------------------------

    def job_command(self, spec: JobRequest) -> list[str]:
        """The loop's own command (where the deployment enables it), else this executor's,
        else Ratchet's job module.

        The executor is the last line: a loop saved before the deployment turned loop
        commands off, or written to the database directly, is refused here too.
        """
        if spec.command:
            if not self._loop_commands_enabled:
                raise JobRequestError(f"run {spec.run_id}: {LOOP_COMMAND_REFUSED}")
            return [*spec.command, spec.job_kind, "--spec", str(spec.spec_path)]
        if self._command is not None:
            return [*self._command, spec.job_kind, "--spec", str(spec.spec_path)]
        module = JOB_MODULES[spec.job_kind]
        return [self._python, "-m", module, "--spec", str(spec.spec_path)]

    def submit(self, spec: JobRequest) -> Handle:
        """Start the job under a supervisor, or adopt the one this run id already has."""
        state_dir = spec.run_dir / STATE_SUBDIR
        state_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(state_dir / "submit.lock"):
            existing = _read_json(state_dir / HANDLE_FILE)
            if existing is not None:
                logger.info("adopting local job of run %s (pid %s)", spec.run_id, existing["pid"])
                return existing
            if (state_dir / SUPERVISOR_FILE).exists():
                # A submit died between starting the supervisor and writing the handle.
                return self._handle_from_supervisor(spec, state_dir)
            return self._start(spec, state_dir)

    def _start(self, spec: JobRequest, state_dir: Path) -> Handle:
        command = self.job_command(spec)
        write_spec_file(spec)
        spec.output_dir.mkdir(parents=True, exist_ok=True)
        spec.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = spec.logs_dir / LOG_FILE
        if spec.image:
            # A job image means nothing here (no container): say so where the job's owner
            # looks, its log, before the job's own output.
            warning = image_ignored(spec.image)
            logger.warning("run %s: %s", spec.run_id, warning)
            _append_line(log_path, f"ratchet: warning: {warning}")
        supervisor = [
            sys.executable,
            "-m",
            "services.executors.supervise",
            "--state-dir",
            str(state_dir),
            "--log",
            str(log_path),
            "--cwd",
            str(spec.run_dir),
            "--",
            *command,
        ]
        # The job's credentials go through the subprocess's environment only: never a file.
        env = {
            **job_environment(os.environ),
            **job_thread_env(spec),
            **spec.secret_env,
            **spec.contract_env(),
        }
        with (state_dir / "supervisor.log").open("ab") as supervisor_log:
            process = subprocess.Popen(
                supervisor,
                stdin=subprocess.DEVNULL,
                stdout=supervisor_log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=spec.run_dir,
            )
        with self._lock:
            self._children[process.pid] = process
        handle = self._make_handle(spec, state_dir, process.pid, _create_time(process.pid))
        write_json_atomic(state_dir / HANDLE_FILE, handle)
        logger.info("started local job of run %s (pid %s)", spec.run_id, process.pid)
        return handle

    def _handle_from_supervisor(self, spec: JobRequest, state_dir: Path) -> Handle:
        record = _read_json(state_dir / SUPERVISOR_FILE) or {}
        pid = int(record.get("pid", 0))
        handle = self._make_handle(spec, state_dir, pid, _create_time(pid))
        write_json_atomic(state_dir / HANDLE_FILE, handle)
        return handle

    def _make_handle(
        self, spec: JobRequest, state_dir: Path, pid: int, create_time: float | None
    ) -> Handle:
        return {
            "executor": self.name,
            "run_id": spec.run_id,
            "pid": pid,
            "create_time": create_time,
            "state_dir": str(state_dir),
            "log_path": str(spec.logs_dir / LOG_FILE),
            "output_dir": str(spec.output_dir),
            "accelerators": spec.accelerators * spec.nodes,
            "submitted_at": time.time(),
        }

    # Status ------------------------------------------------------------------------------

    def status(self, handle: Handle) -> JobStatus:
        state_dir = Path(handle["state_dir"])
        self._reap(int(handle["pid"]))
        ended = _read_json(state_dir / EXIT_FILE)
        if ended is None and not self._supervisor_alive(handle):
            ended = _read_json(state_dir / EXIT_FILE)  # it may have finished just now
            if ended is None:
                return self._gone(handle, state_dir)
        if ended is None:
            return self._running(handle)
        return self._ended(handle, state_dir, ended)

    def _running(self, handle: Handle) -> JobStatus:
        supervisor = _read_json(Path(handle["state_dir"]) / SUPERVISOR_FILE) or {}
        started = float(supervisor.get("started_at") or handle.get("submitted_at") or time.time())
        return JobStatus(
            state=RunStatus.RUNNING,
            started_at=started,
            wall_seconds=max(0.0, time.time() - started),
            cpu_seconds=self._live_cpu_seconds(handle),
            accelerators=int(handle.get("accelerators", 0)),
        )

    def _ended(self, handle: Handle, state_dir: Path, ended: dict[str, Any]) -> JobStatus:
        returncode = int(ended["returncode"])
        started = float(ended.get("started_at") or handle.get("submitted_at") or 0.0)
        finished = float(ended.get("ended_at") or started)
        common: dict[str, Any] = {
            "started_at": started,
            "ended_at": finished,
            "exit_code": returncode,
            "wall_seconds": max(0.0, finished - started),
            "cpu_seconds": float(ended.get("cpu_seconds") or 0.0),
            "accelerators": int(handle.get("accelerators", 0)),
        }
        if returncode == 0:
            return JobStatus(state=RunStatus.SUCCEEDED, **common)
        if (state_dir / CANCEL_FILE).exists():
            return JobStatus(state=RunStatus.CANCELLED, reason="Cancelled", **common)
        message = ended.get("error") or last_line(self._read_log(handle, tail_lines=50))
        reason = f"Signal{ended['signal']}" if ended.get("signal") else "Error"
        return JobStatus(state=RunStatus.FAILED, reason=reason, message=message, **common)

    def _gone(self, handle: Handle, state_dir: Path) -> JobStatus:
        """The supervisor is gone and wrote no exit status: cancelled (SIGKILL) or lost."""
        started = float(handle.get("submitted_at") or 0.0)
        cancel = _read_json(state_dir / CANCEL_FILE)
        accelerators = int(handle.get("accelerators", 0))
        if cancel is not None:
            ended = float(cancel.get("killed_at") or cancel.get("requested_at") or started)
            return JobStatus(
                state=RunStatus.CANCELLED,
                reason="Cancelled",
                started_at=started,
                ended_at=ended,
                wall_seconds=max(0.0, ended - started),
                accelerators=accelerators,
            )
        return JobStatus(
            state=RunStatus.LOST,
            reason="SupervisorGone",
            message=(
                f"the job's supervisor (pid {handle['pid']}) is gone and left no exit status "
                "(the machine restarted or the process was killed)"
            ),
            started_at=started,
            accelerators=accelerators,
        )

    def wait(self, handle: Handle, timeout_s: float) -> JobStatus:
        """Poll the files until the state changes or ``timeout_s`` passes."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        first = self.status(handle)
        current = first
        while not current.terminal and current.state == first.state:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(self._poll_interval_s, remaining))
            current = self.status(handle)
        return current

    # Logs and cancel ---------------------------------------------------------------------

    def logs(self, handle: Handle, *, tail_lines: int | None = None) -> str:
        return self._read_log(handle, tail_lines=tail_lines)

    def cancel(self, handle: Handle) -> None:
        """SIGTERM the job's process group, SIGKILL it after the grace period."""
        state_dir = Path(handle["state_dir"])
        if self.status(handle).terminal:
            return
        if not (state_dir / CANCEL_FILE).exists():
            write_json_atomic(state_dir / CANCEL_FILE, {"requested_at": time.time()})
        pgid = int(handle["pid"])
        logger.info("cancelling local job of run %s (process group %s)", handle["run_id"], pgid)
        self._signal_group(handle, signal.SIGTERM)
        deadline = time.monotonic() + self._cancel_grace_s
        while time.monotonic() < deadline:
            if self.status(handle).terminal:
                return
            time.sleep(self._poll_interval_s)
        logger.warning("job of run %s ignored SIGTERM; sending SIGKILL", handle["run_id"])
        self._signal_group(handle, signal.SIGKILL)
        write_json_atomic(
            state_dir / CANCEL_FILE,
            {**(_read_json(state_dir / CANCEL_FILE) or {}), "killed_at": time.time()},
        )
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not self.status(handle).terminal:
            time.sleep(self._poll_interval_s)

    # Helpers -----------------------------------------------------------------------------

    def _signal_group(self, handle: Handle, signum: signal.Signals) -> None:
        if not self._supervisor_alive(handle):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(handle["pid"]), signum)

    def _supervisor_alive(self, handle: Handle) -> bool:
        """True when the pid runs and is the process this handle started (same start time)."""
        pid = int(handle.get("pid") or 0)
        if pid <= 0:
            return False
        try:
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return False
            created = process.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False
        expected = handle.get("create_time")
        return expected is None or abs(created - float(expected)) < _START_TIME_TOLERANCE_S

    def _live_cpu_seconds(self, handle: Handle) -> float:
        """CPU seconds of the job tree so far (the supervisor's descendants)."""
        total = 0.0
        try:
            for child in psutil.Process(int(handle["pid"])).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    times = child.cpu_times()
                    total += times.user + times.system
        except psutil.Error:
            return 0.0
        return total

    def _reap(self, pid: int) -> None:
        with self._lock:
            process = self._children.get(pid)
            if process is not None and process.poll() is not None:
                del self._children[pid]

    def _read_log(self, handle: Handle, *, tail_lines: int | None) -> str:
        """The job's log, never through a link the job planted (its reason would be the
        first line of whatever file the link names)."""
        path = Path(handle["log_path"])
        run_dir = Path(handle["state_dir"]).parent
        root = run_dir if path.is_relative_to(run_dir) else path.parent
        try:
            text = read_text(root, path)
        except FileNotFoundError:
            return ""
        except UnsafeRunFile as exc:
            logger.warning("run %s: not reading its log: %s", handle.get("run_id"), exc)
            return ""
        return tail(text, tail_lines)


# What a local job keeps of the worker's environment: how to find programs, libraries and
# accelerators, the locale, thread counts and model caches. An allow-list, not a deny-list:
# the worker's environment holds Ratchet's settings (RATCHET_DATABASE_URL, _ADMIN_TOKEN,
# _SECRET_KEY, _SERVE_API_KEY, ...), and may hold a cloud's or a model hub's credentials,
# none of which a job needs: it talks to nothing but its files (the job contract).
JOB_ENV_NAMES: frozenset[str] = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TERM",
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "LD_LIBRARY_PATH",
        "CUDA_HOME",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "PYTORCH_CUDA_ALLOC_CONF",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        "XDG_CACHE_HOME",
        "TORCH_HOME",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    }
)
JOB_ENV_PREFIXES: tuple[str, ...] = ("LC_",)

LOOP_COMMAND_REFUSED = (
    "the local executor runs a loop's own job command only where the deployment enables "
    "it: set RATCHET_LOCAL_JOB_COMMANDS_ENABLED=true (settings field "
    "local_job_commands_enabled), trusting every author of a loop's configuration, as the "
    "command runs as the worker's user on the worker's machine (docs/deploy.md, Security); "
    "or use the kubernetes executor"
)


def job_environment(worker_env: Mapping[str, str]) -> dict[str, str]:
    """The part of the worker's environment a local job gets (see :data:`JOB_ENV_NAMES`);
    the executor adds the job contract's variables."""
    return {
        key: value
        for key, value in worker_env.items()
        if key in JOB_ENV_NAMES or key.startswith(JOB_ENV_PREFIXES)
    }


def job_thread_env(spec: JobRequest, budget: ThreadBudget | None = None) -> dict[str, str]:
    """The loop's ``env`` for the job, with the thread variables set to the job's threads:
    its ``hyperparameters.threads`` where set (over the loop's env too: the job sets torch
    to it), else the loop's env where it names them, else the job's share of the machine
    (``ThreadBudget.job``: the model server beside it keeps the other half)."""
    budget = budget or thread_budget()
    hyperparameters = spec.document.get("hyperparameters")
    own = job_threads(hyperparameters) if isinstance(hyperparameters, Mapping) else None
    env = {**thread_env(budget.job), **spec.env}
    if own is not None:
        env.update(thread_env(own))
    return env


def image_ignored(image: str) -> str:
    return (
        f"the local executor ignores the job image {image!r}: the command runs on the "
        "worker's machine, not in a container"
    )


def check_loop_jobs(
    executor: str, training_profile: Mapping[str, Any], *, commands_enabled: bool
) -> tuple[list[tuple[str, str]], list[str]]:
    """What the local executor makes of a loop's ``train_job``/``eval_job``: the refusals
    (path, message) and the warnings, so a loop is refused when it is saved, not at its
    first job. Other executors run both the image and the command: nothing to say."""
    errors: list[tuple[str, str]] = []
    warnings: list[str] = []
    if executor != "local":
        return errors, warnings
    for key in ("train_job", "eval_job"):
        override = training_profile.get(key)
        if not isinstance(override, Mapping):
            continue
        path = f"training_profile.{key}"
        if override.get("command") and not commands_enabled:
            errors.append((f"{path}.command", LOOP_COMMAND_REFUSED))
        if override.get("image"):
            warnings.append(f"{path}.image: {image_ignored(str(override['image']))}")
    return errors, warnings


def _append_line(path: Path, line: str) -> None:
    """One line at the end of a run file, never through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def _create_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        logger.warning("ignoring unreadable executor state file %s", path)
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def kill_local_jobs(artifacts_dir: Path) -> int:
    """End every local job still running under ``artifacts_dir``; returns how many.

    Jobs run in sessions of their own so they outlive a worker restart; a demo or a test
    that tears its whole stack down uses this so nothing keeps running after it. A pid is
    killed only if its start time matches the handle (never a recycled pid).
    """
    killed = 0
    for handle_path in artifacts_dir.glob(f"loops/*/runs/*/{STATE_SUBDIR}/{HANDLE_FILE}"):
        with contextlib.suppress(OSError, ValueError, KeyError, psutil.Error):
            handle = json.loads(handle_path.read_text())
            pid = int(handle["pid"])
            expected = handle.get("create_time")
            process = psutil.Process(pid)
            if expected is None or abs(process.create_time() - float(expected)) < 1.0:
                os.killpg(pid, signal.SIGKILL)
                killed += 1
    return killed
