"""Demonstration rows: the verified episodes of a loop's tasks, bounded per task.

Every function takes the session keyword-only and never commits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from services.db.models import DatasetTask, Demonstration, Task


@dataclass(frozen=True)
class NewDemonstration:
    """One episode to record, with the row id of the task it belongs to."""

    task_id: int
    task_hash: str
    sample: int
    passed: bool
    reward: float
    text: str
    tokens: int
    sequences: list[Any]  # [[ids, mask], ...]
    checkpoint_id: str | None
    family: str


def record_demonstrations(
    *,
    session: Session,
    loop_id: int,
    run_id: str,
    source: str,
    rows: Sequence[NewDemonstration],
    per_task: int,
) -> int:
    """Insert ``rows`` of run ``run_id`` (a row already recorded for (run, sample) is left
    as it is), then keep only the newest ``per_task`` successes and failures of each task
    touched. Returns how many rows were inserted."""
    if not rows or per_task < 1:
        return 0
    values = [
        {
            "loop_id": loop_id,
            "run_id": run_id,
            "source": source,
            "task_id": row.task_id,
            "task_hash": row.task_hash,
            "sample": row.sample,
            "passed": row.passed,
            "reward": row.reward,
            "text": row.text,
            "tokens": row.tokens,
            "sequences": row.sequences,
            "checkpoint_id": row.checkpoint_id,
            "family": row.family,
        }
        for row in rows
    ]
    statement = (
        insert(Demonstration)
        .values(values)
        .on_conflict_do_nothing(constraint="uq_demonstrations_run_sample")
        .returning(Demonstration.id)
    )
    inserted = len(session.execute(statement).all())
    prune_demonstrations(session=session, task_ids={row.task_id for row in rows}, per_task=per_task)
    return inserted


def prune_demonstrations(*, session: Session, task_ids: Iterable[int], per_task: int) -> int:
    """Delete all but the newest ``per_task`` successes and failures of each task."""
    ids = sorted(set(task_ids))
    if not ids:
        return 0
    rank = (
        func.row_number()
        .over(
            partition_by=(Demonstration.task_id, Demonstration.passed),
            order_by=(Demonstration.created_at.desc(), Demonstration.id.desc()),
        )
        .label("rank")
    )
    ranked = select(Demonstration.id, rank).where(Demonstration.task_id.in_(ids)).subquery("ranked")
    doomed = select(ranked.c.id).where(ranked.c.rank > per_task)
    result = session.execute(delete(Demonstration).where(Demonstration.id.in_(doomed)))
    return int(getattr(result, "rowcount", 0) or 0)


def demonstrations_for_tasks(
    *, session: Session, loop_id: int, task_ids: Sequence[int], family: str | None = None
) -> list[Demonstration]:
    """The stored episodes of the given tasks (of one model family when given), task by
    task, successes first, newest first: what a train job of those tasks reads."""
    if not task_ids:
        return []
    query = select(Demonstration).where(
        Demonstration.loop_id == loop_id, Demonstration.task_id.in_(list(task_ids))
    )
    if family is not None:
        query = query.where(Demonstration.family == family)
    query = query.order_by(
        Demonstration.task_id, Demonstration.passed.desc(), Demonstration.created_at.desc()
    )
    return list(session.scalars(query))


def task_demonstrations(
    *, session: Session, loop_id: int, task_id: int, limit: int = 50
) -> list[Demonstration]:
    """One task's stored episodes for its page: successes first, newest first."""
    query = (
        select(Demonstration)
        .join(Task, Task.id == Demonstration.task_id)
        .where(Task.loop_id == loop_id, Demonstration.task_id == task_id)
        .order_by(Demonstration.passed.desc(), Demonstration.created_at.desc(), Demonstration.id)
        .limit(limit)
    )
    return list(session.scalars(query))


def train_task_ids(*, session: Session, dataset_id: int) -> list[int]:
    """The row ids of a dataset's train tasks (the tasks a train run of it samples)."""
    query = select(DatasetTask.task_id).where(
        DatasetTask.dataset_id == dataset_id, DatasetTask.split == "train"
    )
    return sorted(session.scalars(query))


def train_split_ids(*, session: Session, loop_id: int, task_ids: Iterable[int]) -> set[int]:
    """Which of ``task_ids`` are the loop's train-split tasks (the only ones a demonstration
    may belong to: an eval task's episode must never become training data)."""
    ids = sorted(set(task_ids))
    if not ids:
        return set()
    query = select(Task.id).where(Task.loop_id == loop_id, Task.id.in_(ids), Task.split == "train")
    return set(session.scalars(query))
