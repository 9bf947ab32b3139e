"""Rows bootstrap reads to choose its demonstrations (services.curation.bootstrap): the
loop's newest traces and their outcomes, the tasks curation folded them into, and the splits
every cluster holds.

Every function takes the session keyword-only and never commits; none writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, BindParameter, String, any_, bindparam, func, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from services.db.models import Task, TaskSource, Trace
from services.db.queries.trace_bodies import BODY_TEXT, body_kept
from services.db.queries.traces import TraceRow


@dataclass(frozen=True)
class TraceOutcome:
    """One trace as bootstrap first sees it: its outcome and what curation made of it, no
    body."""

    id: int
    external_id: str
    success: bool | None
    score: float | None
    error_kind: str | None
    curated: bool
    purged: bool


@dataclass(frozen=True)
class TaskLink:
    """The task a trace became or was folded into, with the task's split and cluster."""

    task_id: int
    split: str
    cluster_id: str


def newest_traces(*, session: Session, loop_id: int, limit: int) -> list[TraceOutcome]:
    """The loop's newest ``limit`` traces (by arrival), newest first."""
    rows = session.execute(
        select(
            Trace.id,
            Trace.external_id,
            Trace.success,
            Trace.score,
            Trace.error_kind,
            Trace.curated_at.is_not(None),
            ~body_kept(),
        )
        .where(Trace.loop_id == loop_id)
        .order_by(Trace.received_at.desc(), Trace.id.desc())
        .limit(limit)
    ).all()
    return [TraceOutcome(*row) for row in rows]


def curated_trace_count(*, session: Session, loop_id: int) -> int:
    """How many of the loop's traces curation has seen (an automatic bootstrap looks again
    only when this moved)."""
    return int(
        session.execute(
            select(func.count()).where(Trace.loop_id == loop_id, Trace.curated_at.is_not(None))
        ).scalar_one()
    )


def trace_bodies(*, session: Session, trace_ids: Sequence[int]) -> dict[int, TraceRow]:
    """The traces as curation's per-trace work reads them (the body as JSON text)."""
    if not trace_ids:
        return {}
    rows = session.execute(
        select(
            Trace.id,
            Trace.external_id,
            Trace.model_version,
            Trace.success,
            Trace.score,
            Trace.error_kind,
            BODY_TEXT,
            Trace.size_bytes,
        ).where(Trace.id == any_(_ids(trace_ids)))
    ).all()
    return {row[0]: TraceRow(*row) for row in rows}


def task_links(*, session: Session, trace_ids: Sequence[int]) -> dict[int, TaskLink]:
    """The task each of ``trace_ids`` is a source of (origin or duplicate), where one is."""
    if not trace_ids:
        return {}
    rows = session.execute(
        select(TaskSource.trace_id, Task.id, Task.split, Task.cluster_id)
        .join(Task, Task.id == TaskSource.task_id)
        .where(TaskSource.trace_id == any_(_ids(trace_ids)))
        .order_by(TaskSource.trace_id, Task.id)
    ).all()
    links: dict[int, TaskLink] = {}
    for trace_id, task_id, split, cluster_id in rows:
        links.setdefault(trace_id, TaskLink(task_id, split, cluster_id))
    return links


def tasks_by_id(*, session: Session, task_ids: Sequence[int]) -> dict[int, TaskLink]:
    """Split and cluster of each stored task among ``task_ids``."""
    if not task_ids:
        return {}
    rows = session.execute(
        select(Task.id, Task.split, Task.cluster_id).where(Task.id == any_(_ids(task_ids)))
    ).all()
    return {row[0]: TaskLink(row[0], row[1], row[2]) for row in rows}


def cluster_split_sets(
    *, session: Session, loop_id: int, cluster_ids: Sequence[str]
) -> dict[str, frozenset[str]]:
    """Every split the stored tasks of each cluster hold (clusters with no task absent)."""
    if not cluster_ids:
        return {}
    array: ARRAY[Any] = ARRAY(String)
    rows = session.execute(
        select(Task.cluster_id, func.array_agg(func.distinct(Task.split)))
        .where(
            Task.loop_id == loop_id,
            Task.cluster_id == any_(bindparam(None, sorted(set(cluster_ids)), type_=array)),
        )
        .group_by(Task.cluster_id)
    ).all()
    return {cluster_id: frozenset(splits) for cluster_id, splits in rows}


def _ids(values: Sequence[int]) -> BindParameter[Any]:
    array: ARRAY[Any] = ARRAY(BigInteger)
    return bindparam(None, list(values), type_=array)
