"""Runs (jobs on executors) and checkpoints (their artifacts): upserts and reads.

Every write is idempotent, because the activities calling them may run twice: a run id
inserts one row however often it is submitted, a checkpoint id one row however often it
is registered. Functions take the session keyword-only and never commit.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from services.db.models import Checkpoint, Cycle, Loop, Run
from services.db.queries.errors import existing
from services.db.queries.loops import config_at
from services.loop.states import RunStatus

TERMINAL_RUN_STATUSES = frozenset(status for status in RunStatus if status.terminal)


def cycle_id_for(*, session: Session, loop_id: int, number: int | None) -> int | None:
    """The id of a loop's cycle ``number`` (None when not given or not recorded)."""
    if number is None:
        return None
    return session.scalar(select(Cycle.id).where(Cycle.loop_id == loop_id, Cycle.number == number))


@dataclass(frozen=True)
class RunArtifacts:
    """Where a run's output directory and its log file are (``file://`` or object-store
    URIs); None where not known yet. Both the submission and the outcome carry them."""

    output_uri: str | None = None
    logs_uri: str | None = None


@dataclass(frozen=True)
class NewRun:
    """A run as its job is submitted: what it is, where it runs, and what it belongs to."""

    run_id: str
    loop_id: int
    kind: str
    executor: str
    spec: dict[str, Any]
    cycle_id: int | None = None
    dataset_id: int | None = None
    base_checkpoint_id: str | None = None
    accelerators: int = 0
    artifacts: RunArtifacts = RunArtifacts()


def upsert_run(*, session: Session, run: NewRun) -> Run:
    """Insert the run as ``pending`` unless it exists; return the row as stored.

    An existing row is returned untouched: its executor, spec and status win over a retry's.
    """
    statement = (
        insert(Run)
        .values(
            id=run.run_id,
            loop_id=run.loop_id,
            cycle_id=run.cycle_id,
            dataset_id=run.dataset_id,
            base_checkpoint_id=run.base_checkpoint_id,
            kind=run.kind,
            executor=run.executor,
            spec=run.spec,
            accelerators=run.accelerators,
            output_uri=run.artifacts.output_uri,
            logs_uri=run.artifacts.logs_uri,
        )
        .on_conflict_do_nothing(index_elements=[Run.id])
    )
    session.execute(statement)
    stored = get_run(session=session, run_id=run.run_id, for_update=True)
    assert stored is not None  # just inserted or already there
    return stored


def get_run(*, session: Session, run_id: str, for_update: bool = False) -> Run | None:
    statement = select(Run).where(Run.id == run_id).execution_options(populate_existing=True)
    if for_update:
        statement = statement.with_for_update()
    return session.scalars(statement).one_or_none()


def record_submission(
    *, session: Session, run_id: str, handle: dict[str, Any], running: bool = False
) -> None:
    """Store the executor's handle (and mark running) unless the run already ended."""
    values: dict[str, Any] = {"handle": handle}
    if running:
        values["status"] = RunStatus.RUNNING
    session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status.not_in(TERMINAL_RUN_STATUSES))
        .values(**values)
    )


def mark_running(*, session: Session, run_id: str, started_at: dt.datetime) -> None:
    """Move a pending run to running (once: a later call keeps the first start time)."""
    session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status.in_((RunStatus.PENDING, RunStatus.RUNNING)))
        .values(status=RunStatus.RUNNING, started_at=func.coalesce(Run.started_at, started_at))
    )


def mark_cancel_requested(*, session: Session, run_id: str, ended_at: dt.datetime) -> bool:
    """Record that the run was cancelled; False when it had already ended."""
    result = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status.not_in(TERMINAL_RUN_STATUSES))
        .values(status=RunStatus.CANCELLED, ended_at=ended_at, error="cancelled on request")
    )
    return bool(getattr(result, "rowcount", 0))


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended and what it cost: its status and error, the metrics its job wrote,
    its accounting, its times, and where its output and logs ended up (an unset URI keeps
    the one the submission recorded)."""

    status: RunStatus
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    compute_seconds: float = 0.0
    cpu_seconds: float = 0.0
    cost_usd: Decimal = Decimal(0)
    accelerators: int = 0
    started_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None
    artifacts: RunArtifacts = RunArtifacts()


def finish_run(*, session: Session, run_id: str, outcome: RunOutcome) -> Run:
    """Write a run's outcome and accounting. A run cancelled on request stays ``cancelled``."""
    run = get_run(session=session, run_id=run_id, for_update=True)
    if run is None:
        raise LookupError(f"run {run_id!r} does not exist")
    if run.status != RunStatus.CANCELLED:
        run.status = outcome.status
        run.error = outcome.error
    run.metrics = outcome.metrics
    run.compute_seconds = outcome.compute_seconds
    run.cpu_seconds = outcome.cpu_seconds
    run.cost_usd = outcome.cost_usd
    run.accelerators = outcome.accelerators
    run.started_at = run.started_at or outcome.started_at
    run.ended_at = outcome.ended_at or run.ended_at
    if outcome.artifacts.output_uri is not None:
        run.output_uri = outcome.artifacts.output_uri
    if outcome.artifacts.logs_uri is not None:
        run.logs_uri = outcome.artifacts.logs_uri
    session.flush()
    return run


def get_checkpoint(*, session: Session, checkpoint_id: str) -> Checkpoint | None:
    """The checkpoint ``checkpoint_id``, or None if it is not registered."""
    return session.get(Checkpoint, checkpoint_id)


def require_checkpoint(*, session: Session, checkpoint_id: str) -> Checkpoint:
    """The checkpoint ``checkpoint_id``; :class:`NotFound` if it is not registered."""
    return existing(session.get(Checkpoint, checkpoint_id), f"checkpoint {checkpoint_id!r}")


@dataclass(frozen=True)
class NewCheckpoint:
    """A checkpoint as installed in the store: its content id, where it is, its format,
    size, hash and manifest, and its lineage (the checkpoint it was trained from, the run
    that produced it)."""

    checkpoint_id: str
    loop_id: int
    uri: str
    fmt: str
    size_bytes: int
    sha256: str
    manifest: dict[str, Any]
    parent_id: str | None = None
    run_id: str | None = None


def upsert_checkpoint(*, session: Session, checkpoint: NewCheckpoint) -> Checkpoint:
    """Insert the checkpoint unless its id (a content hash) exists; return the stored row.

    Equal content is one checkpoint: registering it again keeps the first row, including
    the run that produced it first.
    """
    statement = (
        insert(Checkpoint)
        .values(
            id=checkpoint.checkpoint_id,
            loop_id=checkpoint.loop_id,
            uri=checkpoint.uri,
            parent_id=checkpoint.parent_id,
            run_id=checkpoint.run_id,
            format=checkpoint.fmt,
            size_bytes=checkpoint.size_bytes,
            sha256=checkpoint.sha256,
            manifest=checkpoint.manifest,
        )
        .on_conflict_do_nothing(index_elements=[Checkpoint.id])
    )
    session.execute(statement)
    return session.scalars(
        select(Checkpoint)
        .where(Checkpoint.id == checkpoint.checkpoint_id)
        .execution_options(populate_existing=True)
    ).one()


def cycle_executor(*, session: Session, loop: Loop, cycle_id: int | None) -> str:
    """The executor of the loop's configuration when the cycle started, so a change made
    while a cycle runs moves only later cycles (``PATCH /v1/loops``); the loop's current
    executor for a job outside a cycle, or a cycle older than the loop's history."""
    cycle = session.get(Cycle, cycle_id) if cycle_id is not None else None
    if cycle is None:
        return str(loop.executor)
    config = config_at(session=session, loop_id=loop.id, at=cycle.started_at)
    if config is None or not config.get("executor"):
        return str(loop.executor)
    return str(config["executor"])
