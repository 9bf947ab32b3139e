"""The curated tasks of a loop, for operators (``ratchet tasks``): which tasks a loop has,
where one came from, and pinning tasks into the loop's regression suite.

``GET /v1/loops/{loop}/tasks`` lists them newest first in pages joined by an opaque cursor;
``GET /v1/tasks/{task_id}`` shows one by its row id (the id every listing prints, which needs
no loop) and ``GET /v1/tasks/{task_id}/demonstrations`` its stored episodes (what the
dashboard's task page shows to a tab holding the admin token; the page itself, open to
anyone who reaches the dashboard, shows neither prompt nor episodes);
``POST /v1/loops/{loop}/tasks/pin`` pins tasks, all of them or, when one cannot be pinned,
none; ``POST /v1/loops/{loop}/tasks/restore`` brings set-aside tasks back (a task the worker
set aside is shown with its reason, and never trained on while it stays aside).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from services.api.deps import AdminDep, SessionDep
from services.api.errors import ApiError
from services.api.routes.loops import loop_or_404
from services.api.routes.trace_listing import (
    decode_id_cursor,
    encode_id_cursor,
    reward_check_public,
)
from services.api.schemas.tasks import (
    DemonstrationPublic,
    PinIn,
    PinResult,
    RestoreIn,
    RestoreResult,
    Split,
    TaskDetail,
    TaskPage,
    TaskPublic,
    TaskSourcePublic,
)
from services.db.models import Task
from services.db.queries import task_set_aside
from services.db.queries import tasks as q
from services.db.queries.demonstrations import task_demonstrations
from services.environments.replay.scoring import task_reward

router = APIRouter(prefix="/v1", tags=["tasks"], dependencies=[AdminDep])


def task_public(task: Task) -> TaskPublic:
    return TaskPublic(
        id=task.id,
        environment=task.environment,
        split=task.split,
        origin=task.origin,
        weight=task.weight,
        pinned=task.pinned,
        cluster_id=task.cluster_id,
        content_hash=task.content_hash,
        probe_pass_rate=task.probe_pass_rate,
        redactions=task.redactions,
        prompt=str(task.spec.get("prompt", "")),
        created_at=task.created_at,
        set_aside_reason=task.set_aside_reason,
        set_aside_detail=task.set_aside_detail,
        set_aside_at=task.set_aside_at,
    )


@router.get(
    "/loops/{loop}/tasks",
    summary="List a loop's curated tasks, newest first",
    responses={
        400: {"description": "A cursor this API did not give out (field: cursor)"},
        404: {"description": "No such loop"},
    },
)
def list_loop_tasks(
    loop: str,
    session: SessionDep,
    split: Annotated[Split | None, Query(description="Only tasks of this split")] = None,
    set_aside: Annotated[
        bool | None, Query(description="Only tasks set aside (true) or not (false)")
    ] = None,
    cursor: Annotated[str | None, Query(max_length=200, description="next_cursor")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> TaskPage:
    row = loop_or_404(session, loop)
    rows = q.list_tasks(
        session=session,
        loop_id=row.id,
        split=split,
        set_aside=set_aside,
        limit=limit + 1,
        before_id=decode_id_cursor(cursor),
    )
    page = rows[:limit]
    more = len(rows) > limit
    return TaskPage(
        tasks=[task_public(task) for task in page],
        next_cursor=encode_id_cursor(page[-1].id) if more else None,
    )


@router.get(
    "/tasks/{task_id}",
    summary="One task: spec, cluster, split, redactions and the traces it came from",
    responses={404: {"description": "No task with this id"}},
)
def show_task(task_id: Annotated[int, Path(ge=1, le=2**63 - 1)], session: SessionDep) -> TaskDetail:
    found = q.task_with_loop_name(session=session, task_id=task_id)
    if found is None:
        raise ApiError(404, "task_not_found", f"there is no task {task_id}")
    task, loop = found
    return TaskDetail(
        **task_public(task).model_dump(),
        loop=loop,
        failure_signature=task.failure_signature,
        spec=task.spec,
        sources=[
            TaskSourcePublic(trace_id=trace_id, external_id=external_id, relation=relation)
            for trace_id, external_id, relation in q.task_sources(session=session, task_id=task.id)
        ],
        check=reward_check_public(task_reward(task.spec)),
    )


@router.get(
    "/tasks/{task_id}/demonstrations",
    summary="One task's stored successes and failures, successes first, newest first",
    responses={404: {"description": "No task with this id"}},
)
def show_task_demonstrations(
    task_id: Annotated[int, Path(ge=1, le=2**63 - 1)], session: SessionDep
) -> list[DemonstrationPublic]:
    found = q.task_with_loop_name(session=session, task_id=task_id)
    if found is None:
        raise ApiError(404, "task_not_found", f"there is no task {task_id}")
    task, _ = found
    rows = task_demonstrations(session=session, loop_id=task.loop_id, task_id=task.id)
    return [
        DemonstrationPublic(
            id=row.id,
            passed=row.passed,
            reward=row.reward,
            source=row.source,
            run_id=row.run_id,
            checkpoint_id=row.checkpoint_id,
            text=row.text,
            created_at=row.created_at,
        )
        for row in rows
    ]


@router.post(
    "/loops/{loop}/tasks/pin",
    summary="Put tasks into the loop's pinned regression suite (never trained on)",
    responses={
        404: {"description": "No such loop"},
        422: {"description": "Some tasks cannot be pinned (fields: task_ids.N); none was"},
    },
)
def pin_loop_tasks(loop: str, body: PinIn, session: SessionDep) -> PinResult:
    row = loop_or_404(session, loop)
    refused = q.unpinnable_task_ids(session=session, loop_id=row.id, task_ids=body.task_ids)
    if refused:
        raise ApiError(
            422,
            "tasks_not_pinnable",
            f"tasks {', '.join(map(str, refused))} are not tasks of loop {row.name!r} or are "
            "held out (the held-out set is frozen); nothing was pinned",
            fields=[
                {"path": f"task_ids.{body.task_ids.index(task_id)}", "message": "not pinnable"}
                for task_id in refused
            ],
        )
    pinned = q.pin_tasks(session=session, loop_id=row.id, task_ids=body.task_ids)
    return PinResult(loop=row.name, pinned=pinned)


@router.post(
    "/loops/{loop}/tasks/restore",
    summary="Bring set-aside tasks back: the next snapshot may train on them again",
    responses={
        404: {"description": "No such loop"},
        422: {
            "description": "Some ids are not tasks of the loop (fields: task_ids.N); none "
            "was restored"
        },
    },
)
def restore_loop_tasks(loop: str, body: RestoreIn, session: SessionDep) -> RestoreResult:
    row = loop_or_404(session, loop)
    foreign = task_set_aside.foreign_task_ids(
        session=session, loop_id=row.id, task_ids=body.task_ids
    )
    if foreign:
        raise ApiError(
            422,
            "tasks_not_found",
            f"tasks {', '.join(map(str, foreign))} are not tasks of loop {row.name!r}; "
            "nothing was restored",
            fields=[
                {
                    "path": f"task_ids.{body.task_ids.index(task_id)}",
                    "message": "not a task of the loop",
                }
                for task_id in foreign
            ],
        )
    restored = task_set_aside.restore_tasks(session=session, loop_id=row.id, task_ids=body.task_ids)
    return RestoreResult(loop=row.name, restored=restored)
