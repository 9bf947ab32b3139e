"""Tasks set aside: kept and shown with their reason, never in a snapshot's train split.

Every function takes the session keyword-only and never commits. A task is set aside once
(the first reason stands until an operator restores it); restoring clears the reason.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from services.db.models import Task

# Every episode of the task needed a tool result nobody could give (services.curation.
# tool_outcomes).
UNANSWERABLE_CALLS = "unanswerable_calls"


def set_aside_tasks(
    *,
    session: Session,
    loop_id: int,
    task_ids: Sequence[int],
    reason: str,
    detail: str,
    at: dt.datetime,
) -> list[int]:
    """Set the loop's tasks among ``task_ids`` aside (those not aside already); the ids
    changed."""
    if not task_ids:
        return []
    result = session.execute(
        update(Task)
        .where(
            Task.loop_id == loop_id,
            Task.id.in_(list(task_ids)),
            Task.set_aside_reason.is_(None),
        )
        .values(set_aside_reason=reason, set_aside_detail=detail, set_aside_at=at)
        .returning(Task.id)
    )
    return sorted(result.scalars().all())


def restore_tasks(*, session: Session, loop_id: int, task_ids: Sequence[int]) -> list[int]:
    """Bring set-aside tasks of the loop back (the next snapshot may train on them); the
    ids changed."""
    if not task_ids:
        return []
    result = session.execute(
        update(Task)
        .where(
            Task.loop_id == loop_id,
            Task.id.in_(list(task_ids)),
            Task.set_aside_reason.is_not(None),
        )
        .values(set_aside_reason=None, set_aside_detail=None, set_aside_at=None)
        .returning(Task.id)
    )
    return sorted(result.scalars().all())


def foreign_task_ids(*, session: Session, loop_id: int, task_ids: Sequence[int]) -> list[int]:
    """The ids of ``task_ids`` that are not tasks of the loop."""
    own = set(
        session.scalars(select(Task.id).where(Task.loop_id == loop_id, Task.id.in_(list(task_ids))))
    )
    return sorted(set(task_ids) - own)
