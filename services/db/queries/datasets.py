"""Dataset rows: immutable snapshots of a loop's tasks, their membership and lineage.

Every function takes the session keyword-only and never commits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from services.db.models import Dataset, DatasetTask, Loop, TaskSource


def clusters_crossing_trained_line(
    *, session: Session, loop_id: int, trained_ids: Sequence[int], judged_ids: Sequence[int]
) -> list[str]:
    """Clusters that hold both a task in ``trained_ids`` (a dataset's train and replay
    tasks) and a task that judges a candidate: any eval or held-out task of the loop, or
    one of ``judged_ids`` (the dataset's regression suite).

    Always empty unless the invariant is broken; the snapshot refuses to write if not.
    """
    if not trained_ids:
        return []
    rows = session.execute(
        text(
            """
            SELECT DISTINCT a.cluster_id
              FROM tasks AS a
              JOIN tasks AS b ON b.loop_id = a.loop_id AND b.cluster_id = a.cluster_id
             WHERE a.loop_id = :loop_id AND a.id = ANY(CAST(:trained AS bigint[]))
               AND (b.split IN ('eval', 'heldout') OR b.id = ANY(CAST(:judged AS bigint[])))
             LIMIT 10
            """
        ),
        {"loop_id": loop_id, "trained": list(trained_ids), "judged": list(judged_ids)},
    ).all()
    return [row[0] for row in rows]


def dataset_by_hash(*, session: Session, loop_id: int, content_hash: str) -> Dataset | None:
    return session.scalars(
        select(Dataset).where(Dataset.loop_id == loop_id, Dataset.content_hash == content_hash)
    ).one_or_none()


def insert_dataset(*, session: Session, values: Mapping[str, Any]) -> int | None:
    """Insert a dataset row; None when one with the same (loop, content hash) exists."""
    result = session.execute(
        text(
            """
            INSERT INTO datasets (loop_id, content_hash, train_count, eval_count,
                                  regression_count, train_uri, eval_uri, regression_uri,
                                  heldout_count, heldout_uri, replay_count, replay_uri,
                                  stats)
            VALUES (:loop_id, :content_hash, :train_count, :eval_count, :regression_count,
                    :train_uri, :eval_uri, :regression_uri,
                    :heldout_count, :heldout_uri, :replay_count, :replay_uri,
                    CAST(:stats AS jsonb))
            ON CONFLICT (loop_id, content_hash) DO NOTHING
            RETURNING id
            """
        ),
        dict(values),
    ).first()
    return int(result[0]) if result is not None else None


def insert_dataset_tasks(
    *, session: Session, dataset_id: int, members: Sequence[tuple[int, str]]
) -> None:
    """Record membership ``(task_id, split)`` of a new dataset."""
    if not members:
        return
    session.execute(
        text(
            """
            INSERT INTO dataset_tasks (dataset_id, task_id, split)
            SELECT :dataset_id, * FROM unnest(CAST(:tasks AS bigint[]), CAST(:splits AS text[]))
            """
        ),
        {
            "dataset_id": dataset_id,
            "tasks": [m[0] for m in members],
            "splits": [m[1] for m in members],
        },
    )


def dataset_lineage(*, session: Session, dataset_id: int) -> list[tuple[int, str, int]]:
    """``(task id, split, trace id)`` for every trace behind every task of a dataset."""
    rows = session.execute(
        select(DatasetTask.task_id, DatasetTask.split, TaskSource.trace_id)
        .join(TaskSource, TaskSource.task_id == DatasetTask.task_id)
        .where(DatasetTask.dataset_id == dataset_id)
        .order_by(DatasetTask.split, DatasetTask.task_id, TaskSource.trace_id)
    ).all()
    return [(row[0], row[1], row[2]) for row in rows]


def dataset_source_trace_count(*, session: Session, dataset_id: int) -> int:
    """How many distinct traces the tasks of a dataset came from."""
    return int(
        session.scalar(
            select(func.count(func.distinct(TaskSource.trace_id)))
            .join(DatasetTask, DatasetTask.task_id == TaskSource.task_id)
            .where(DatasetTask.dataset_id == dataset_id)
        )
        or 0
    )


def list_datasets(
    *, session: Session, loop_id: int, limit: int = 50, before_id: int | None = None
) -> list[Dataset]:
    """A loop's datasets, newest first; ``before_id`` (the last id of the previous page)
    pages on by keyset."""
    query = select(Dataset).where(Dataset.loop_id == loop_id)
    if before_id is not None:
        query = query.where(Dataset.id < before_id)
    return list(session.scalars(query.order_by(Dataset.id.desc()).limit(limit)))


def dataset_with_loop_name(*, session: Session, dataset_id: int) -> tuple[Dataset, str] | None:
    """A dataset and the name of its loop (what a dataset looked up by its row id is shown
    with)."""
    row = session.execute(
        select(Dataset, Loop.name)
        .join(Loop, Loop.id == Dataset.loop_id)
        .where(Dataset.id == dataset_id)
    ).first()
    return None if row is None else (row[0], row[1])
