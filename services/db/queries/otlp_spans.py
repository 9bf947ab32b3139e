"""Waiting OTLP spans and log records (``otlp_spans``) and the sweeper's queue of traces.

See services.ingest.span_store for how they are used and why the locking is what it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import and_, delete, exists, func, select, text, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from services.db.models import Loop, OtlpPendingTrace, OtlpSpan, OtlpSpanPayload

STRUCTURE_COLUMNS = (
    OtlpSpan.trace_id,
    OtlpSpan.id,
    OtlpSpan.record_id,
    OtlpSpan.span_id,
    OtlpSpan.parent_span_id,
    OtlpSpan.kind,
    OtlpSpan.remote_parent,
    OtlpSpan.has_content,
    OtlpSpan.assembled_at.is_not(None),
)


_TOUCH = insert(OtlpPendingTrace)
_TOUCH = _TOUCH.on_conflict_do_update(
    index_elements=[OtlpPendingTrace.loop_id, OtlpPendingTrace.trace_id],
    set_={"last_received_at": func.now()},
)
# Core statements executed with many parameter sets: compiled once (a multi-row VALUES
# built per call costs SQLAlchemy ~2 ms per 100 rows to compile, more than Postgres's work).
_INSERT = (
    insert(OtlpSpan)
    .on_conflict_do_nothing(
        index_elements=[OtlpSpan.loop_id, OtlpSpan.trace_id, OtlpSpan.record_id]
    )
    .returning(OtlpSpan.trace_id, OtlpSpan.record_id, OtlpSpan.id, OtlpSpan.received_at)
)
_INSERT_PAYLOAD = insert(OtlpSpanPayload)


def touch_pending_traces(*, session: Session, loop_id: int, trace_ids: Iterable[str]) -> None:
    """Mark traces as having new rows (now), creating their queue entries.

    Taken in trace id order, the row locks serialize concurrent exports of one trace (another
    api replica's rows are committed before this export reads the trace), without deadlocks.
    """
    ordered = sorted(set(trace_ids))
    if ordered:
        session.connection().execute(
            _TOUCH, [{"loop_id": loop_id, "trace_id": trace_id} for trace_id in ordered]
        )


def insert_rows(*, session: Session, rows: Sequence[dict[str, Any]]) -> set[tuple[str, str]]:
    """Insert span/log rows (a row already there is left as it is); the (trace id, record id)
    of those that were new. A row's ``payload`` (None for none) goes to
    ``otlp_span_payloads``, in the partition of the row's ``received_at``."""
    if not rows:
        return set()
    result = session.connection().execute(
        _INSERT, [{k: v for k, v in row.items() if k != "payload"} for row in rows]
    )
    new = {(trace_id, record_id): (row_id, at) for trace_id, record_id, row_id, at in result}
    payloads = [
        {"span_row_id": new[key][0], "received_at": new[key][1], "payload": row["payload"]}
        for row in rows
        if row.get("payload") is not None and (key := (row["trace_id"], row["record_id"])) in new
    ]
    if payloads:
        session.connection().execute(_INSERT_PAYLOAD, payloads)
    return set(new)


def lock_pending_traces(*, session: Session, loop_id: int, trace_ids: Iterable[str]) -> None:
    """Lock the traces' queue rows, in trace id order (the order every writer takes them)."""
    ids = sorted(set(trace_ids))
    if ids:
        session.execute(
            select(OtlpPendingTrace.trace_id)
            .where(OtlpPendingTrace.loop_id == loop_id, OtlpPendingTrace.trace_id.in_(ids))
            .order_by(OtlpPendingTrace.trace_id)
            .with_for_update()
        ).all()


def trace_structure(
    *, session: Session, loop_id: int, trace_ids: Iterable[str]
) -> list[tuple[Any, ...]]:
    """Every row of the traces, without payloads: STRUCTURE_COLUMNS per row."""
    ids = sorted(set(trace_ids))
    if not ids:
        return []
    return [
        tuple(row)
        for row in session.execute(
            select(*STRUCTURE_COLUMNS)
            .where(OtlpSpan.loop_id == loop_id, OtlpSpan.trace_id.in_(ids))
            .order_by(OtlpSpan.id)
        )
    ]


def payloads(*, session: Session, row_ids: Iterable[int]) -> dict[int, str | None]:
    ids = sorted(set(row_ids))
    if not ids:
        return {}
    found = session.execute(
        select(OtlpSpan.id, OtlpSpanPayload.payload)
        .outerjoin(
            OtlpSpanPayload,
            and_(
                OtlpSpanPayload.span_row_id == OtlpSpan.id,
                OtlpSpanPayload.received_at == OtlpSpan.received_at,
            ),
        )
        .where(OtlpSpan.id.in_(ids))
    )
    return {int(row_id): payload for row_id, payload in found}


def mark_assembled(*, session: Session, row_ids: Iterable[int]) -> None:
    """Rows whose episode is done: keep the ids (late spans are recognised), drop the payload."""
    ids = sorted(set(row_ids))
    if ids:
        marked = session.execute(
            update(OtlpSpan)
            .where(OtlpSpan.id.in_(ids), OtlpSpan.assembled_at.is_(None))
            .values(assembled_at=func.now())
            .returning(OtlpSpan.id, OtlpSpan.received_at)
        ).all()
        if marked:
            session.execute(
                delete(OtlpSpanPayload).where(
                    tuple_(OtlpSpanPayload.span_row_id, OtlpSpanPayload.received_at).in_(
                        [tuple(row) for row in marked]
                    )
                )
            )


def delete_rows(*, session: Session, row_ids: Iterable[int]) -> None:
    """Forget rows outright (trees without GenAI spans: nothing to recognise them by later)."""
    ids = sorted(set(row_ids))
    if ids:
        session.execute(delete(OtlpSpan).where(OtlpSpan.id.in_(ids)))


def release_traces(
    *, session: Session, loop_id: int, trace_ids: Iterable[str], unclaim: bool = True
) -> None:
    """Drop the queue entries of traces with nothing left waiting; unclaim the others (unless
    they should stay leased: the writer refused them, retry when the lease ends)."""
    ids = sorted(set(trace_ids))
    if not ids:
        return
    waiting = exists().where(
        OtlpSpan.loop_id == OtlpPendingTrace.loop_id,
        OtlpSpan.trace_id == OtlpPendingTrace.trace_id,
        OtlpSpan.assembled_at.is_(None),
    )
    selected = and_(OtlpPendingTrace.loop_id == loop_id, OtlpPendingTrace.trace_id.in_(ids))
    session.execute(delete(OtlpPendingTrace).where(selected, ~waiting))
    if unclaim:
        session.execute(update(OtlpPendingTrace).where(selected).values(claimed_until=None))


_CLAIM_SQL = text(
    "UPDATE otlp_pending_traces AS p SET claimed_until = now() + make_interval(secs => :lease_s) "
    "FROM (SELECT loop_id, trace_id FROM otlp_pending_traces "
    "      WHERE (last_received_at < now() - make_interval(secs => :quiet_s) "
    "             OR first_received_at < now() - make_interval(secs => :max_wait_s)) "
    "        AND (claimed_until IS NULL OR claimed_until < now()) "
    "      ORDER BY last_received_at LIMIT :limit FOR UPDATE SKIP LOCKED) AS c "
    "WHERE p.loop_id = c.loop_id AND p.trace_id = c.trace_id "
    "RETURNING p.loop_id, p.trace_id"
)


def claim_quiet_traces(
    *, session: Session, quiet_s: float, max_wait_s: float, lease_s: float, limit: int
) -> list[tuple[int, str, str]]:
    """Claim up to ``limit`` traces that received nothing for ``quiet_s`` (or have waited
    ``max_wait_s`` since their first row, quiet or not) and that no one else
    holds (``FOR UPDATE SKIP LOCKED``, then a lease of ``lease_s``, so a claimer that dies
    leaves them to the next): (loop id, loop name, trace id), times from Postgres's clock."""
    claimed = [
        (int(loop_id), str(trace_id))
        for loop_id, trace_id in session.execute(
            _CLAIM_SQL,
            {"quiet_s": quiet_s, "max_wait_s": max_wait_s, "lease_s": lease_s, "limit": limit},
        )
    ]
    if not claimed:
        return []
    loops = select(Loop.id, Loop.name).where(Loop.id.in_({loop_id for loop_id, _ in claimed}))
    names = {int(loop_id): str(name) for loop_id, name in session.execute(loops)}
    return [(loop_id, names.get(loop_id, "-"), trace_id) for loop_id, trace_id in claimed]


def purge_assembled(*, session: Session, retention_s: float, limit: int) -> int:
    """Forget assembled rows older than the retention period (at most ``limit`` per call)."""
    oldest = (
        select(OtlpSpan.id)
        .where(
            OtlpSpan.assembled_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, retention_s)
        )
        .limit(limit)
        .scalar_subquery()
    )
    result = session.execute(delete(OtlpSpan).where(OtlpSpan.id.in_(oldest)))
    return int(getattr(result, "rowcount", 0) or 0)
