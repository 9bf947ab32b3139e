"""Every rejection explained: the admin API's view of a loop's traces and their curation.

``GET /v1/loops/{loop}/traces`` lists traces newest first with what curation made of each
(task, duplicate, rejected with its reason, skipped, or still pending), filtered by the
reported outcome, the curation outcome, the reason and the time received, in pages joined by
an opaque cursor. ``GET /v1/loops/{loop}/traces/{external_id}`` shows one trace with the
tasks it became and the feedback it got. (``POST /v1/loops/{loop}/traces`` is the webhook,
in services.api.routes.traces.)
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from typing import Annotated, Any

from fastapi import APIRouter, Query

from services.api.deps import AdminDep, SessionDep
from services.api.errors import ApiError
from services.api.routes.loops import loop_or_404
from services.api.schemas.tasks import FactPublic, RewardCheckPublic
from services.api.schemas.traces import (
    FeedbackPublic,
    ReportedOutcome,
    TraceDetail,
    TraceListFilters,
    TracePage,
    TraceSummaryPublic,
    TraceTaskPublic,
)
from services.db.queries.trace_bodies import trace_body
from services.db.queries.traces import (
    TraceFilter,
    TraceKey,
    TraceSummary,
    list_traces,
    trace_feedback,
    trace_summary,
    trace_tasks,
)
from services.environments.replay.scoring import describe_reward

router = APIRouter(prefix="/v1/loops", tags=["traces"], dependencies=[AdminDep])

_CURSOR_VERSION = 1


def encode_cursor(last: TraceKey) -> str:
    """An opaque cursor: clients pass it back and never build one."""
    raw = json.dumps(
        {"v": _CURSOR_VERSION, "at": last.received_at.isoformat(), "id": last.id},
        separators=(",", ":"),
    )
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _cursor_data(cursor: str) -> dict[str, Any]:
    """A cursor's fields, or a 400 naming the ``cursor`` field."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("v") != _CURSOR_VERSION:
            raise ValueError("another cursor version")
        return data
    except (binascii.Error, ValueError, TypeError):
        raise invalid_cursor() from None


def invalid_cursor() -> ApiError:
    return ApiError(
        400,
        "invalid_cursor",
        "the cursor is not one this API gave out: pass next_cursor from the previous "
        "page unchanged, or leave it out for the first page",
        fields=[{"path": "cursor", "message": "not a cursor from this API"}],
    )


def decode_cursor(cursor: str) -> TraceKey:
    """Where the previous page of traces ended, or a 400 naming the ``cursor`` field."""
    data = _cursor_data(cursor)
    try:
        at = dt.datetime.fromisoformat(data["at"])
        row_id = data["id"]
        if at.tzinfo is None or not isinstance(row_id, int) or isinstance(row_id, bool):
            raise ValueError("not a cursor of this API")
        return TraceKey(at, row_id)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise invalid_cursor() from None


def encode_id_cursor(last_id: int) -> str:
    """The cursor of a listing ordered by row id, newest first (tasks, datasets)."""
    raw = json.dumps({"v": _CURSOR_VERSION, "before": last_id}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_id_cursor(cursor: str | None) -> int | None:
    """The row id the previous page ended at (None for the first page), or a 400."""
    if cursor is None:
        return None
    before = _cursor_data(cursor).get("before")
    if not isinstance(before, int) or isinstance(before, bool) or before < 1:
        raise invalid_cursor()
    return before


def reported_outcome(row: TraceSummary) -> ReportedOutcome:
    """As services.db.queries.traces.REPORTED_OUTCOMES defines it."""
    if row.success is False or row.error_kind:
        return "failure"
    if row.success is True:
        return "success"
    return "unknown"


def reward_check_public(reward: Any) -> RewardCheckPublic | None:
    """What a stored replay reward checks, as the listings show it (None: not replay)."""
    check = describe_reward(reward)
    if check is None:
        return None
    return RewardCheckPublic(
        rule=check.rule,
        facts=[FactPublic(kind=f.kind, value=f.value, text=f.text) for f in check.facts],
        judge=check.judge,
    )


def summary_public(row: TraceSummary) -> TraceSummaryPublic:
    return TraceSummaryPublic(
        external_id=row.external_id,
        model_version=row.model_version,
        outcome=reported_outcome(row),
        success=row.success,
        score=row.score,
        error_kind=row.error_kind,
        received_at=row.received_at,
        curated_at=row.curated_at,
        curation_outcome=row.curation_outcome,
        reason=row.reason,
        curation_detail=row.curation_detail,
        body_purged=row.body_purged,
        check=reward_check_public(row.reward),
    )


def _aware(value: dt.datetime | None, field: str) -> dt.datetime | None:
    if value is not None and value.tzinfo is None:
        raise ApiError(
            422,
            "invalid_request",
            f"{field} needs a time zone, e.g. 2026-12-02T14:00:00Z",
            fields=[{"path": field, "message": "needs a time zone"}],
        )
    return value


@router.get(
    "/{loop}/traces",
    summary="List a loop's traces, newest first, with what curation made of each",
    responses={400: {"description": "A cursor this API did not give out (field: cursor)"}},
)
def list_loop_traces(
    loop: str,
    session: SessionDep,
    filters: Annotated[TraceListFilters, Query()],
    cursor: Annotated[str | None, Query(max_length=200, description="next_cursor")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> TracePage:
    row = loop_or_404(session, loop)
    trace_filter = TraceFilter(
        outcome=filters.outcome,
        curation=filters.curation,
        reason=filters.reason,
        since=_aware(filters.since, "since"),
        until=_aware(filters.until, "until"),
    )
    after = decode_cursor(cursor) if cursor is not None else None
    rows = list_traces(
        session=session, loop_id=row.id, filters=trace_filter, after=after, limit=limit + 1
    )
    page = rows[:limit]
    more = len(rows) > limit
    return TracePage(
        traces=[summary_public(r) for r in page],
        next_cursor=encode_cursor(TraceKey(page[-1].received_at, page[-1].id)) if more else None,
    )


@router.get(
    "/{loop}/traces/{external_id:path}",
    summary="One trace: its curation outcome and reason, the tasks it became, its feedback",
)
def show_trace(loop: str, external_id: str, session: SessionDep) -> TraceDetail:
    row = loop_or_404(session, loop)
    found = trace_summary(session=session, loop_id=row.id, external_id=external_id)
    if found is None:
        raise ApiError(
            404,
            "trace_not_found",
            f"loop {loop!r} has no trace with external_id {external_id[:256]!r}",
        )
    body, purged_at = trace_body(session=session, trace_id=found.id)
    return TraceDetail(
        **summary_public(found).model_dump(),
        tasks=[
            TraceTaskPublic(
                task_id=t.task_id,
                relation=t.relation,
                environment=t.environment,
                split=t.split,
                origin=t.origin,
            )
            for t in trace_tasks(session=session, trace_id=found.id)
        ],
        feedback=[
            FeedbackPublic(
                id=f.id,
                score=f.score,
                label=f.label,
                correction=f.correction,
                comment=f.comment,
                created_at=f.created_at,
            )
            for f in trace_feedback(session=session, trace_id=found.id)
        ],
        body=body,
        body_purged_at=purged_at,
    )
