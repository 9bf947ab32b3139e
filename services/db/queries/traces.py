"""Trace rows: what curation and the drift signal read and stamp (uncurated traces,
failure windows), and what the traces listing, the loop page and feedback read and write.
The ingest writer's insert is in services.db.queries.trace_inserts, bodies are read through
services.db.queries.trace_bodies.

Every function takes the session keyword-only and never commits.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    and_,
    case,
    func,
    not_,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db.models import Task, TaskSource, Trace, TraceFeedback
from services.db.queries.trace_bodies import BODY_TEXT, body_kept


@dataclass(frozen=True)
class TraceRow:
    """An uncurated trace, locked for this transaction."""

    id: int
    external_id: str
    model_version: str | None
    success: bool | None
    score: float | None
    error_kind: str | None
    # The body as Postgres sends it, decoded once where it is curated; None once retention
    # dropped it (curation then records the trace as purged).
    body_json: str | None
    size_bytes: int


class CurationOutcome(enum.StrEnum):
    """What curation made of a trace (``traces.curation_outcome``, which has no check
    constraint): a new ``task``, a ``duplicate`` of one, ``rejected`` by the environment or
    the screen, ``skipped`` (nothing to learn from), or ``purged`` by retention before
    curation saw it. ``pending`` is never stored: it reads a trace curation has not seen."""

    PENDING = "pending"
    TASK = "task"
    DUPLICATE = "duplicate"
    REJECTED = "rejected"
    SKIPPED = "skipped"
    PURGED = "purged"


@dataclass(frozen=True)
class Verdict:
    """What curation decided about one trace (written to the trace row)."""

    trace_id: int
    outcome: CurationOutcome
    detail: str


_TRACE_ROW_COLUMNS = (
    Trace.id,
    Trace.external_id,
    Trace.model_version,
    Trace.success,
    Trace.score,
    Trace.error_kind,
    BODY_TEXT,
    Trace.size_bytes,
)


def lock_uncurated_traces(
    *, session: Session, loop_id: int, limit: int, only: Sequence[int] | None = None
) -> list[TraceRow]:
    """The oldest uncurated traces of a loop (among ``only`` when given), locked; rows
    another transaction holds are skipped."""
    query = select(*_TRACE_ROW_COLUMNS).where(Trace.loop_id == loop_id, Trace.curated_at.is_(None))
    if only is not None:
        query = query.where(Trace.id.in_(list(only)))
    rows = session.execute(
        query.order_by(Trace.id).limit(limit).with_for_update(skip_locked=True, of=Trace)
    ).all()
    return [TraceRow(*row) for row in rows]


def unlink_traces(*, session: Session, trace_ids: Sequence[int]) -> int:
    """Delete the task links of ``trace_ids``; each task a link leaves loses the weight the
    trace gave it. How many links went.

    Curation links a trace when it curates it, so an uncurated trace has no link: one found
    on a trace a batch has just locked was left behind (on versions before issue 43, by
    feedback that arrived while an earlier batch held the trace) and would collide with
    the link the batch makes (``task_sources`` is keyed by task and trace), failing the
    batch, and every retry of it, for good."""
    if not trace_ids:
        return 0
    removed = session.execute(
        text(
            """
            WITH removed AS (
                DELETE FROM task_sources WHERE trace_id = ANY(CAST(:ids AS bigint[]))
                RETURNING task_id
            ), lost AS (
                SELECT task_id, count(*) AS n FROM removed GROUP BY task_id
            ), updated AS (
                UPDATE tasks SET weight = greatest(weight - lost.n, 0)
                  FROM lost WHERE tasks.id = lost.task_id
            )
            SELECT count(*) FROM removed
            """
        ),
        {"ids": list(trace_ids)},
    ).scalar_one()
    return int(removed)


def peek_uncurated_traces(
    *, session: Session, loop_id: int, after_id: int, limit: int
) -> list[TraceRow]:
    """The next uncurated traces after ``after_id``, read without locking them: what the
    loop's next batch will most likely lock (curation prepares them ahead of time and
    checks each row again when the batch really has it)."""
    rows = session.execute(
        select(*_TRACE_ROW_COLUMNS)
        .where(Trace.loop_id == loop_id, Trace.curated_at.is_(None), Trace.id > after_id)
        .order_by(Trace.id)
        .limit(limit)
    ).all()
    return [TraceRow(*row) for row in rows]


def mark_traces_curated(*, session: Session, verdicts: Sequence[Verdict]) -> None:
    """Stamp ``curated_at`` and the verdict on each trace (same transaction as its task)."""
    if not verdicts:
        return
    session.execute(
        text(
            """
            UPDATE traces AS t
               SET curated_at = now(), curation_outcome = v.outcome, curation_detail = v.detail
              FROM unnest(CAST(:ids AS bigint[]), CAST(:outcomes AS text[]),
                          CAST(:details AS text[])) AS v(id, outcome, detail)
             WHERE t.id = v.id
            """
        ),
        {
            "ids": [v.trace_id for v in verdicts],
            "outcomes": [v.outcome for v in verdicts],
            "details": [v.detail for v in verdicts],
        },
    )


def count_uncurated_traces(*, session: Session, loop_id: int) -> int:
    return int(
        session.execute(
            select(func.count()).where(Trace.loop_id == loop_id, Trace.curated_at.is_(None))
        ).scalar_one()
    )


def latest_model_version(*, session: Session, loop_id: int) -> str | None:
    """The model version of the loop's most recently received trace (the one serving)."""
    row = session.execute(
        select(Trace.model_version)
        .where(Trace.loop_id == loop_id, Trace.model_version.is_not(None))
        .order_by(Trace.received_at.desc(), Trace.id.desc())
        .limit(1)
    ).first()
    return row[0] if row is not None else None


def failure_window(
    *,
    session: Session,
    loop_id: int,
    model_version: str,
    window: int,
    failure_score_threshold: float | None,
) -> tuple[int, int]:
    """``(traces with an outcome, failures)`` among the last ``window`` traces of a version.

    The failure test is :func:`services.curation.selection.classify` in SQL.
    """
    row = session.execute(
        text(
            """
            SELECT count(*),
                   count(*) FILTER (WHERE success IS FALSE
                                       OR coalesce(error_kind, '') <> ''
                                       OR (CAST(:threshold AS double precision) IS NOT NULL
                                           AND score < CAST(:threshold AS double precision)))
              FROM (SELECT success, score, error_kind FROM traces
                     WHERE loop_id = :loop_id AND model_version = :model_version
                       AND (success IS NOT NULL OR score IS NOT NULL
                            OR coalesce(error_kind, '') <> '')
                     ORDER BY received_at DESC, id DESC
                     LIMIT :window) AS recent
            """
        ),
        {
            "loop_id": loop_id,
            "model_version": model_version,
            "window": window,
            "threshold": failure_score_threshold,
        },
    ).one()
    return int(row[0]), int(row[1])


# Reading traces back (the listing, one trace, the counts by curation outcome) -------------

CURATION_OUTCOMES = (
    CurationOutcome.PENDING,
    CurationOutcome.TASK,
    CurationOutcome.DUPLICATE,
    CurationOutcome.REJECTED,
    CurationOutcome.SKIPPED,
)
"""What curation made of a trace; ``pending`` is a trace it has not looked at yet."""

REPORTED_OUTCOMES = ("success", "failure", "unknown")
"""What the agent reported: a failure is ``success: false`` or an error kind (as curation's
classify reads it, less the loop's score threshold), a success is ``success: true`` without
an error, and unknown is neither."""

# The reason of a verdict: a rejection's detail is "<reason>: <message>" (the reason code of
# the environment or the screen), a skip's detail is its reason; a task or duplicate has none.
_reason = case(
    (
        Trace.curation_outcome == CurationOutcome.REJECTED,
        func.split_part(Trace.curation_detail, ":", 1),
    ),
    (Trace.curation_outcome == CurationOutcome.SKIPPED, Trace.curation_detail),
    else_=None,
)
_curation = func.coalesce(Trace.curation_outcome, CurationOutcome.PENDING)
_failed = or_(Trace.success.is_(False), func.coalesce(Trace.error_kind, "") != "")
_succeeded = and_(Trace.success.is_(True), func.coalesce(Trace.error_kind, "") == "")


@dataclass(frozen=True)
class TraceFilter:
    """The listing's filters; None means any."""

    outcome: str | None = None  # one of REPORTED_OUTCOMES
    curation: str | None = None  # one of CURATION_OUTCOMES
    reason: str | None = None
    since: dt.datetime | None = None  # received at or after
    until: dt.datetime | None = None  # received before


@dataclass(frozen=True)
class TraceKey:
    """Where a page of the listing ends: the last row's ``(received_at, id)``."""

    received_at: dt.datetime
    id: int


@dataclass(frozen=True)
class TraceSummary:
    """One trace as the listing shows it."""

    id: int
    external_id: str
    model_version: str | None
    success: bool | None
    score: float | None
    error_kind: str | None
    received_at: dt.datetime
    curated_at: dt.datetime | None
    curation_outcome: str
    reason: str | None
    curation_detail: str | None
    # The stored reward (``verifier.params.reward``) of the task the trace became or was
    # counted into, so the listing can show what will be checked; None for no task.
    reward: Any = None
    # Whether retention dropped the body (feedback on the trace is refused then).
    body_purged: bool = False


@dataclass(frozen=True)
class TraceTask:
    """A task a trace became (or was folded into), and how: origin, duplicate, near_duplicate."""

    task_id: int
    relation: str
    environment: str
    split: str
    origin: str


@dataclass(frozen=True)
class FeedbackRow:
    id: int
    score: float | None
    label: str | None
    correction: str | None
    comment: str | None
    created_at: dt.datetime


@dataclass(frozen=True)
class CurationCount:
    """How many traces of a loop had one curation outcome and reason, with an example."""

    outcome: str
    reason: str | None
    count: int
    example_external_id: str


# The reward of the trace's task, its origin task first: one small JSON value per row,
# read through the trace_id index of task_sources (never the task's whole spec).
_TASK_REWARD = (
    select(Task.spec["verifier"]["params"]["reward"])
    .join(TaskSource, TaskSource.task_id == Task.id)
    .where(TaskSource.trace_id == Trace.id)
    .order_by(TaskSource.relation != "origin", TaskSource.task_id)
    .limit(1)
    .correlate(Trace)
    .scalar_subquery()
)

_SUMMARY_COLUMNS = (
    Trace.id,
    Trace.external_id,
    Trace.model_version,
    Trace.success,
    Trace.score,
    Trace.error_kind,
    Trace.received_at,
    Trace.curated_at,
    _curation,
    _reason,
    Trace.curation_detail,
    _TASK_REWARD,
)


def _outcome_condition(outcome: str) -> ColumnElement[bool]:
    if outcome == "failure":
        return _failed
    if outcome == "success":
        return _succeeded
    return and_(not_(_failed), not_(_succeeded))


def listing_query(
    *, loop_id: int, filters: TraceFilter, after: TraceKey | None, limit: int
) -> Select[Any]:
    """The statement of :func:`list_traces` (what EXPLAIN is asked about in the tests)."""
    purged = ~body_kept(filters.since, filters.until)
    query = select(*_SUMMARY_COLUMNS, purged).where(Trace.loop_id == loop_id)
    if filters.outcome is not None:
        query = query.where(_outcome_condition(filters.outcome))
    if filters.curation is not None:
        query = query.where(_curation == filters.curation)
    if filters.reason is not None:
        query = query.where(_reason == filters.reason)
    if filters.since is not None:
        query = query.where(Trace.received_at >= filters.since)
    if filters.until is not None:
        query = query.where(Trace.received_at < filters.until)
    if after is not None:
        query = query.where(tuple_(Trace.received_at, Trace.id) < (after.received_at, after.id))
    return query.order_by(Trace.received_at.desc(), Trace.id.desc()).limit(limit)


def list_traces(
    *,
    session: Session,
    loop_id: int,
    filters: TraceFilter,
    after: TraceKey | None,
    limit: int,
) -> list[TraceSummary]:
    """A page of a loop's traces, newest first: by ``(received_at, id)``, the order of the
    ``ix_traces_loop_received`` index, so a page reads only its rows even in a loop of
    millions. ``after`` is the last row of the previous page (keyset pagination: no page
    skips or repeats a row while traces keep arriving). Whether each body is kept is read
    from the ``trace_bodies`` partitions of the filter's time range only."""
    query = listing_query(loop_id=loop_id, filters=filters, after=after, limit=limit)
    return [TraceSummary(*row) for row in session.execute(query).all()]


def trace_summary(*, session: Session, loop_id: int, external_id: str) -> TraceSummary | None:
    row = session.execute(
        select(*_SUMMARY_COLUMNS, ~body_kept()).where(
            Trace.loop_id == loop_id, Trace.external_id == external_id
        )
    ).first()
    return TraceSummary(*row) if row is not None else None


def trace_tasks(*, session: Session, trace_id: int) -> list[TraceTask]:
    """The tasks a trace became or was counted into (its lineage one step on)."""
    rows = session.execute(
        select(TaskSource.task_id, TaskSource.relation, Task.environment, Task.split, Task.origin)
        .join(Task, Task.id == TaskSource.task_id)
        .where(TaskSource.trace_id == trace_id)
        .order_by(TaskSource.task_id)
    ).all()
    return [TraceTask(*row) for row in rows]


def trace_feedback(*, session: Session, trace_id: int) -> list[FeedbackRow]:
    rows = session.execute(
        select(
            TraceFeedback.id,
            TraceFeedback.score,
            TraceFeedback.label,
            TraceFeedback.correction,
            TraceFeedback.comment,
            TraceFeedback.created_at,
        )
        .where(TraceFeedback.trace_id == trace_id)
        .order_by(TraceFeedback.id)
    ).all()
    return [FeedbackRow(*row) for row in rows]


def curation_counts(*, session: Session, loop_id: int) -> list[CurationCount]:
    """Traces by curation outcome and reason, each with its newest trace as the example:
    the answer to "why did my traces not become tasks?" in one query."""
    reason = _reason.label("reason")
    outcome = _curation.label("outcome")
    rows = session.execute(
        select(outcome, reason, func.count(), func.max(Trace.id))
        .where(Trace.loop_id == loop_id)
        .group_by(outcome, reason)
    ).all()
    if not rows:
        return []
    examples = dict(
        session.execute(
            select(Trace.id, Trace.external_id).where(Trace.id.in_([row[3] for row in rows]))
        ).all()
    )
    counts = [CurationCount(row[0], row[1], int(row[2]), examples[row[3]]) for row in rows]
    order: dict[str, int] = {name: i for i, name in enumerate(CURATION_OUTCOMES)}
    return sorted(counts, key=lambda c: (order.get(c.outcome, len(order)), -c.count))


def add_feedback(
    *,
    session: Session,
    loop_id: int,
    trace_id: int,
    score: float | None,
    label: str | None,
    correction: str | None,
    comment: str | None,
    content_hash: str,
) -> tuple[int, bool]:
    """Store feedback on a trace: ``(row id, True)`` when new, ``(the earlier row's id,
    False)`` when the same feedback was stored before (a no-op). New feedback sends the trace
    back to curation (:func:`_send_back_to_curation`), since it may change the reward the
    trace can be given or the reason it was refused."""
    inserted = session.execute(
        pg_insert(TraceFeedback)
        .values(
            loop_id=loop_id,
            trace_id=trace_id,
            score=score,
            label=label,
            correction=correction,
            comment=comment,
            content_hash=content_hash,
        )
        .on_conflict_do_nothing(index_elements=["trace_id", "content_hash"])
        .returning(TraceFeedback.id)
    ).scalar_one_or_none()
    if inserted is None:
        existing = session.execute(
            select(TraceFeedback.id).where(
                TraceFeedback.trace_id == trace_id, TraceFeedback.content_hash == content_hash
            )
        ).scalar_one()
        return int(existing), False
    _send_back_to_curation(session=session, trace_id=trace_id)
    return int(inserted), True


def _send_back_to_curation(*, session: Session, trace_id: int) -> None:
    """Clear a trace's verdict and its links to tasks, so the next curation pass reads it
    as new. The links go too: curation links the trace again (to the same task as a
    duplicate, or as the origin of a new one when the feedback changed its reward), and a
    link left behind would collide with that one (:func:`unlink_traces`).

    The trace's row is locked first. A curation batch that holds the trace (it locks its
    traces) may have written a link this transaction cannot see yet; the delete must come
    after that batch commits, so that it sees the link. The feedback row's foreign-key
    check already waits for the batch (its ``FOR KEY SHARE`` conflicts with the batch's
    ``FOR UPDATE``), and a batch that comes second skips the trace; the explicit lock says
    so here instead of leaving it to how Postgres checks a foreign key
    (tests/services/curation/test_feedback_race.py)."""
    session.execute(select(Trace.id).where(Trace.id == trace_id).with_for_update())
    unlink_traces(session=session, trace_ids=[trace_id])
    session.execute(
        update(Trace)
        .where(Trace.id == trace_id)
        .values(curated_at=None, curation_outcome=None, curation_detail=None, curation_attempts=0)
    )
