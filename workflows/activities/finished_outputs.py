"""What the worker reads of a finished job's output directory.

A job's output is untrusted (any trainer image can honour the job contract) and is read
once, when its run is finished (:func:`read_outputs`): refused whole when a symbolic link
leads to the directory or lies anywhere in it
(:func:`~services.executors.runfiles.refuse_links`); else its ``metrics.json``, read as every
job output is (a regular file, finite numbers, text made storable: services.chat.text). A
job that exited 0 without metrics the run can hold has failed, and its run says why: a
``NaN`` left the run ``running`` while the activity retried, before issue 43.

The rows a succeeded run leaves beside its outcome (its demonstrations, its tool outcomes)
are services.curation.job_outputs', each recorded so that it can never fail the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.executors.accounting import read_job_metrics
from services.executors.base import METRICS_FILE
from services.executors.runfiles import UnsafeRunFile, refuse_links
from services.loop.states import RunStatus


@dataclass(frozen=True)
class JobOutputs:
    """A finished job's status as its outputs leave it, and its metrics."""

    state: RunStatus
    error: str | None
    metrics: dict[str, Any]


def read_outputs(
    root: Path, output_dir: Path, *, state: RunStatus, error: str | None
) -> JobOutputs:
    """The job's outputs under the artifact ``root`` (see the module): a job that exited
    with ``state`` and ``error`` may end failed here, saying why."""
    refused = refused_output(root, output_dir)
    if refused is not None:  # nothing of it is read: the run fails, saying why
        return JobOutputs(RunStatus.FAILED, refused, {})
    if state != RunStatus.SUCCEEDED and not (output_dir / METRICS_FILE).exists():
        return JobOutputs(state, error, {})
    try:
        return JobOutputs(state, error, read_job_metrics(output_dir / METRICS_FILE))
    except ValueError as exc:
        if state == RunStatus.SUCCEEDED:
            return JobOutputs(RunStatus.FAILED, str(exc), {})
        return JobOutputs(state, error, {})


def refused_output(root: Path, output_dir: Path) -> str | None:
    """Why the job's output directory is not read (a symbolic link on the way to it or
    anywhere inside it), or None."""
    try:
        refuse_links(root, output_dir)
    except FileNotFoundError:
        return None  # no output at all: the run's status says what happened
    except UnsafeRunFile as exc:
        return f"job output refused: {exc}"
    return None


def refuse_links_in_job_output(root: Path, directory: Path) -> None:
    """UnsafeRunFile when ``directory``, if under the artifact ``root`` (a job's output, such
    as the checkpoint a train run wrote), is reached through a link or holds one. A
    directory elsewhere is the operator's (a first champion registered from a path)."""
    directory, root = directory.absolute(), root.absolute()
    if directory.is_relative_to(root) or directory.is_relative_to(root.resolve()):
        refuse_links(root, directory)
