"""What every executor shares: the job request, the handle, the status, the errors.

An executor runs one job of the job contract (DESIGN §5) somewhere — a subprocess here, a
``batch/v1`` Job in a cluster — and answers four questions about it: ``submit`` (start it,
or adopt the one already started for this run id), ``status``, ``logs`` and ``cancel``.
``wait`` blocks until the status may have changed, so a caller can poll without spinning
(the Kubernetes executor watches instead of polling).

Handles are plain JSON objects: they are stored in the ``runs.handle`` column and in
Temporal heartbeat details, and a fresh process (a restarted worker) can pick a job up from
its handle alone.

Errors are split by what a retry can do about them: :class:`ExecutorUnavailable` (the API
server hiccupped, try again) versus :class:`JobRequestError` and :class:`JobRejected` (the
request, the template or the cluster's answer will not change on retry).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from services.loop.states import RunStatus

# The job contract's schema and environment variables are the job's (services.training.jobspec
# reads and writes the spec); an executor only passes them on.
from services.training.jobspec import (
    ENV_BASE_CHECKPOINT,
    ENV_DATASET,
    ENV_OUTPUT_DIR,
    ENV_SPEC,
    JOB_SCHEMA,
)

# A job's states are its run's statuses (``runs.status`` records what the executor said).
JobState = RunStatus
TERMINAL_STATES: frozenset[RunStatus] = frozenset(state for state in RunStatus if state.terminal)

# Run kinds (the runs table) and the job subcommand each one runs.
# (a ``calibrate`` run is a train job shortened to time it: services.training.calibration)
RUN_KINDS: frozenset[str] = frozenset({"train", "eval", "probe", "calibrate"})
JOB_KINDS: frozenset[str] = frozenset({"train", "eval"})

# Exit codes that mean "the spec or configuration is wrong": retrying cannot help, so the
# Kubernetes pod failure policy fails the Job at once and the activity does not retry.
# 2 is argparse's usage error; 64-78 are the sysexits.h codes for bad input and config.
CONFIG_EXIT_CODES: tuple[int, ...] = (2, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78)

# The job contract's environment variables (the job reads them, nothing else).
ENV_RUN_ID = "RATCHET_RUN_ID"
CONTRACT_ENV: frozenset[str] = frozenset(
    {ENV_SPEC, ENV_DATASET, ENV_BASE_CHECKPOINT, ENV_OUTPUT_DIR, ENV_RUN_ID}
)

SPEC_FILE = "spec.json"
METRICS_FILE = "metrics.json"
CHECKPOINT_SUBDIR = "checkpoint"

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ExecutorError(Exception):
    """Something went wrong running a job; ``retryable`` says whether trying again may help."""

    retryable: bool = True


class ExecutorUnavailable(ExecutorError):
    """The executor's backend did not answer properly (API server down, throttled, timeout)."""

    retryable = True


class JobRequestError(ExecutorError, ValueError):
    """The job request or the executor's configuration is invalid; a retry cannot fix it."""

    retryable = False


class JobRejected(ExecutorError):
    """The backend refused the job for good (invalid object, forbidden, foreign name clash)."""

    retryable = False


@dataclass(frozen=True)
class JobRequest:
    """One job to run, as the worker asks an executor for it: who it is for, what it runs,
    where its files go.

    ``document`` is the job's job spec, the ``ratchet.job/v1`` document it reads (the job
    side parses it as ``services.training.jobspec.JobSpec``); ``run_dir`` holds the spec
    file and the executor's own state, ``output_dir`` the job's checkpoint and metrics,
    ``logs_dir`` its logs. ``accelerators`` is per node; ``nodes`` > 1 asks for a
    multi-node (torchrun) job where the executor supports it. ``image`` and ``command``
    replace the executor's (a loop's ``training_profile.train_job``/``eval_job``); the job
    kind and ``--spec <path>`` are appended to ``command`` as to the default one.

    ``env`` is the job's plain environment; ``secret_env`` holds the credentials it needs
    (the rollout server's key, judge and tool endpoints): an executor hands them over
    without writing them anywhere others can read (the Kubernetes one through a Secret of
    the run's own, referenced by ``secretKeyRef`` and deleted with the run; the local one
    through the subprocess's environment). A name is in one of the two, never both.
    """

    run_id: str
    loop: str
    kind: str
    document: Mapping[str, Any]
    run_dir: Path
    output_dir: Path
    logs_dir: Path
    cycle: int | None = None
    dataset: str | None = None
    base_checkpoint: str | None = None
    accelerators: int = 0
    nodes: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    # The loop's own job image and command (bring your own trainer); None: the executor's.
    image: str | None = None
    command: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self._check_identity()
        self._check_document()
        self._check_resources()
        self._check_environment()

    def _check_identity(self) -> None:
        if not _RUN_ID.match(self.run_id):
            raise JobRequestError(
                f"run id {self.run_id!r} must be 1-128 characters of letters, digits, '.', '_' "
                "or '-', starting with a letter or digit"
            )
        if self.kind not in RUN_KINDS:
            raise JobRequestError(f"run kind must be one of {sorted(RUN_KINDS)}, got {self.kind!r}")
        if not self.loop:
            raise JobRequestError("a job needs the name of its loop")

    def _check_document(self) -> None:
        if not isinstance(self.document, Mapping):
            raise JobRequestError("the job document must be a JSON object")
        if self.document.get("schema") != JOB_SCHEMA:
            raise JobRequestError(
                f"the job document's schema must be {JOB_SCHEMA!r}, "
                f"got {self.document.get('schema')!r}"
            )
        if self.document.get("kind") not in JOB_KINDS:
            raise JobRequestError(
                f"the job document's kind must be one of {sorted(JOB_KINDS)}, "
                f"got {self.document.get('kind')!r}"
            )
        if self.document.get("run_id") != self.run_id:
            raise JobRequestError(
                f"the job document's run_id {self.document.get('run_id')!r} "
                f"is not the run id {self.run_id!r}"
            )

    def _check_resources(self) -> None:
        if self.accelerators < 0:
            raise JobRequestError(f"accelerators must be >= 0, got {self.accelerators}")
        if self.nodes < 1:
            raise JobRequestError(f"nodes must be >= 1, got {self.nodes}")
        for path_name in ("run_dir", "output_dir", "logs_dir"):
            if not Path(getattr(self, path_name)).is_absolute():
                raise JobRequestError(f"{path_name} must be an absolute path")

    def _check_environment(self) -> None:
        if self.command is not None and (
            not self.command or not all(isinstance(part, str) and part for part in self.command)
        ):
            raise JobRequestError("a job command must be a non-empty list of non-empty strings")
        if self.image is not None and not self.image.strip():
            raise JobRequestError("a job image must not be empty")
        for name in [*self.env, *self.secret_env]:
            if not _ENV_NAME.match(name):
                raise JobRequestError(f"environment variable name {name!r} is not valid")
            if name in CONTRACT_ENV:
                raise JobRequestError(f"{name} is set by the executor and cannot be overridden")
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise JobRequestError(f"{both[0]} is given both as plain and as secret environment")

    @property
    def job_kind(self) -> str:
        """The job subcommand (``train`` or ``eval``); a probe run is an eval job."""
        return str(self.document["kind"])

    @property
    def spec_path(self) -> Path:
        return self.run_dir / SPEC_FILE

    def contract_env(self) -> dict[str, str]:
        """The job contract's environment variables for this job."""
        env = {
            ENV_SPEC: str(self.spec_path),
            ENV_OUTPUT_DIR: str(self.output_dir),
            ENV_RUN_ID: self.run_id,
        }
        if self.dataset:
            env[ENV_DATASET] = self.dataset
        if self.base_checkpoint:
            env[ENV_BASE_CHECKPOINT] = self.base_checkpoint
        return env


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands, with what accounting needs (wall time, CPU seconds)."""

    state: JobState
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    accelerators: int = 0

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def config_error(self) -> bool:
        """The job failed because its spec or config is wrong (a retry cannot help)."""
        return self.state == RunStatus.FAILED and (
            self.exit_code in CONFIG_EXIT_CODES or self.reason == "ConfigError"
        )

    def describe(self) -> str:
        parts: list[str] = [self.state]
        if self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}")
        if self.reason:
            parts.append(self.reason)
        text = ", ".join(parts)
        return f"{text}: {self.message}" if self.message else text


Handle = dict[str, Any]


@runtime_checkable
class Executor(Protocol):
    """Runs jobs of the job contract. Every method is idempotent for a given run id."""

    name: str

    def submit(self, spec: JobRequest) -> Handle:
        """Start the job, or return the handle of the job already started for this run id."""
        ...

    def status(self, handle: Handle) -> JobStatus:
        """The job's status now."""
        ...

    def wait(self, handle: Handle, timeout_s: float) -> JobStatus:
        """Block until the status may have changed or ``timeout_s`` passed; return it."""
        ...

    def logs(self, handle: Handle, *, tail_lines: int | None = None) -> str:
        """The job's output (stdout and stderr together), optionally only the last lines."""
        ...

    def cancel(self, handle: Handle) -> None:
        """Stop the job; a job that already ended is left alone."""
        ...


def write_spec_file(spec: JobRequest) -> Path:
    """Write the job document to ``run_dir/spec.json`` atomically (same bytes every time)."""
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    data = json.dumps(dict(spec.document), sort_keys=True, indent=2) + "\n"
    path = spec.spec_path
    if path.is_file() and path.read_text() == data:
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_new_file(tmp, data.encode())
    tmp.replace(path)
    return path


def write_new_file(path: Path, data: bytes) -> None:
    """Write ``path`` afresh, never through a link: a run directory is a job's to write, and
    a job (an earlier pod of the run, say) may have planted ``path`` as a link elsewhere."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # removes a link itself, never its target
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def last_line(text: str) -> str | None:
    """The last non-empty line of ``text`` (a failed job's reason, by the job contract)."""
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()[:2000]
    return None


def tail(text: str, lines: int | None) -> str:
    if lines is None:
        return text
    if lines <= 0:
        return ""
    kept = text.splitlines(keepends=True)[-lines:]
    return "".join(kept)
