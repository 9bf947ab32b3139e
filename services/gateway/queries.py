"""The gateway's queries: calls to place, sessions to find, open and close, outcomes to join.

Every function takes the session keyword-only and never commits: the caller owns the
transaction (one per loop and pass of the assembler, one per api request).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import func, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db.models import GatewayCall, GatewayOutcome, GatewaySession
from services.db.queries import trace_inserts

# Namespace of the assembler's advisory locks (the other key is the loop id).
_LOCK_NAMESPACE = 0x524757  # "RGW"
OPEN = "open"
CLOSED = "closed"


def try_lock_loop(*, session: Session, loop_id: int) -> bool:
    """Whether this transaction now holds the loop's assembler lock (released at its end);
    False when another replica (or the api) is assembling the loop."""
    return bool(
        session.execute(
            text("SELECT pg_try_advisory_xact_lock(:namespace, :key)"),
            {"namespace": _LOCK_NAMESPACE, "key": loop_id % 2_147_483_647},
        ).scalar_one()
    )


def lock_loop(*, session: Session, loop_id: int) -> None:
    """Wait for the loop's assembler lock (the api's close and outcome requests)."""
    session.execute(
        text("SELECT pg_advisory_xact_lock(:namespace, :key)"),
        {"namespace": _LOCK_NAMESPACE, "key": loop_id % 2_147_483_647},
    )


def loops_with_work(*, session: Session, idle_before: dt.datetime) -> list[int]:
    """Loops with calls to place, sessions idle long enough to close, or outcomes waiting."""
    unplaced = select(GatewayCall.loop_id).where(GatewayCall.session_id.is_(None))
    idle = select(GatewaySession.loop_id).where(
        GatewaySession.status == OPEN, GatewaySession.last_call_at < idle_before
    )
    waiting = select(GatewayOutcome.loop_id).where(GatewayOutcome.feedback_id.is_(None))
    found = session.scalars(unplaced.union(idle, waiting)).all()
    return sorted({int(loop_id) for loop_id in found})


def unplaced_calls(*, session: Session, loop_id: int, limit: int) -> Sequence[GatewayCall]:
    return session.scalars(
        select(GatewayCall)
        .where(GatewayCall.loop_id == loop_id, GatewayCall.session_id.is_(None))
        .order_by(GatewayCall.captured_at, GatewayCall.id)
        .limit(limit)
    ).all()


def open_session_by_key(*, session: Session, loop_id: int, key: str) -> GatewaySession | None:
    return session.scalars(
        select(GatewaySession).where(
            GatewaySession.loop_id == loop_id,
            GatewaySession.key == key,
            GatewaySession.status == OPEN,
        )
    ).first()


def open_sessions_by_keys(
    *, session: Session, loop_id: int, keys: Collection[str]
) -> Sequence[GatewaySession]:
    """The loop's open sessions of these keys (at most one a key)."""
    if not keys:
        return []
    return session.scalars(
        select(GatewaySession).where(
            GatewaySession.loop_id == loop_id,
            GatewaySession.key.in_(list(keys)),
            GatewaySession.status == OPEN,
        )
    ).all()


def open_sessions_ending_in(
    *, session: Session, loop_id: int, digests: Collection[str]
) -> Sequence[GatewaySession]:
    """Open sessions whose last call's conversation ends at one of ``digests``."""
    if not digests:
        return []
    return session.scalars(
        select(GatewaySession).where(
            GatewaySession.loop_id == loop_id,
            GatewaySession.status == OPEN,
            GatewaySession.last_after_hash.in_(list(digests)),
        )
    ).all()


def open_text_lengths(*, session: Session, loop_id: int) -> list[int]:
    """The conversation lengths (characters) of the loop's open text-completion sessions."""
    found = session.scalars(
        select(GatewaySession.last_after_chars)
        .where(
            GatewaySession.loop_id == loop_id,
            GatewaySession.status == OPEN,
            GatewaySession.last_after_chars.is_not(None),
        )
        .distinct()
    ).all()
    return sorted((int(n) for n in found if n is not None), reverse=True)


def new_session(
    *,
    session: Session,
    loop_id: int,
    key: str,
    explicit: bool,
    at: dt.datetime,
    flush: bool = True,
) -> GatewaySession:
    """An open session; with ``flush``, inserted now (it has its id)."""
    row = GatewaySession(
        loop_id=loop_id,
        key=key,
        explicit=explicit,
        status=OPEN,
        opened_at=at,
        last_call_at=at,
        call_count=0,
    )
    session.add(row)
    if flush:
        session.flush()
    return row


def idle_sessions(
    *, session: Session, loop_id: int, idle_before: dt.datetime, limit: int
) -> Sequence[GatewaySession]:
    return session.scalars(
        select(GatewaySession)
        .where(
            GatewaySession.loop_id == loop_id,
            GatewaySession.status == OPEN,
            GatewaySession.last_call_at < idle_before,
        )
        .order_by(GatewaySession.last_call_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()


def session_calls(*, session: Session, session_id: int) -> Sequence[GatewayCall]:
    return session.scalars(
        select(GatewayCall)
        .where(GatewayCall.session_id == session_id)
        .order_by(GatewayCall.captured_at, GatewayCall.id)
    ).all()


def insert_trace(*, session: Session, loop_id: int, values: dict[str, Any]) -> int:
    """Store a session's trace (``source`` ``gateway``); the row id, the existing one's when
    the session was stored before (a close retried after a lost commit)."""
    return trace_inserts.insert_trace(
        session=session, loop_id=loop_id, source="gateway", values=values
    )


# Sessions by the id an outcome or a close names ----------------------------------------------


def session_for_ref(*, session: Session, loop_id: int, ref: str) -> GatewaySession | None:
    """The session an id names: the newest session with that key (open ones first), else
    the session of the call whose gateway id or upstream response id it is."""
    by_key = session.scalars(
        select(GatewaySession)
        .where(GatewaySession.loop_id == loop_id, GatewaySession.key == ref)
        .order_by((GatewaySession.status == OPEN).desc(), GatewaySession.opened_at.desc())
        .limit(1)
    ).first()
    if by_key is not None:
        return by_key
    call_id = ref.removeprefix("resp_")  # the gateway's Responses ids are resp_<call id>
    session_id = session.scalars(
        select(GatewayCall.session_id).where(
            GatewayCall.loop_id == loop_id,
            or_(GatewayCall.call_id == call_id, GatewayCall.response_id == ref),
            GatewayCall.session_id.is_not(None),
        )
    ).first()
    return session.get(GatewaySession, session_id) if session_id is not None else None


def waiting_outcomes(*, session: Session, loop_id: int) -> Sequence[GatewayOutcome]:
    """Outcomes not yet on a trace, oldest first."""
    return session.scalars(
        select(GatewayOutcome)
        .where(GatewayOutcome.loop_id == loop_id, GatewayOutcome.feedback_id.is_(None))
        .order_by(GatewayOutcome.received_at, GatewayOutcome.id)
    ).all()


def add_outcome(*, session: Session, loop_id: int, values: dict[str, Any]) -> int | None:
    """Store an outcome; None when its webhook id was used before (a replay)."""
    inserted = session.execute(
        pg_insert(GatewayOutcome)
        .values(loop_id=loop_id, **values)
        .on_conflict_do_nothing(index_elements=["loop_id", "webhook_id"])
        .returning(GatewayOutcome.id)
    ).scalar_one_or_none()
    return int(inserted) if inserted is not None else None


def mark_closed(
    *, session: Session, row: GatewaySession, reason: str, trace_id: int | None
) -> None:
    session.execute(
        update(GatewaySession)
        .where(GatewaySession.id == row.id)
        .values(status=CLOSED, closed_at=func.now(), close_reason=reason, trace_id=trace_id)
    )


def session_counts(*, session: Session, loop_id: int) -> dict[str, int]:
    """Open and closed sessions of a loop, and outcomes received (the loop page)."""
    by_status = dict(
        session.execute(
            select(GatewaySession.status, func.count())
            .where(GatewaySession.loop_id == loop_id)
            .group_by(GatewaySession.status)
        ).all()
    )
    outcomes = session.execute(
        select(func.count()).select_from(GatewayOutcome).where(GatewayOutcome.loop_id == loop_id)
    ).scalar_one()
    return {
        "open": int(by_status.get(OPEN, 0)),
        "closed": int(by_status.get(CLOSED, 0)),
        "outcomes": int(outcomes),
    }


def recent_sessions(*, session: Session, loop_id: int, limit: int = 20) -> Sequence[Any]:
    """The loop's newest sessions with their newest outcome (the loop page's table)."""
    latest = (
        select(
            GatewayOutcome.session_id,
            GatewayOutcome.success,
            GatewayOutcome.score,
            GatewayOutcome.label,
            func.row_number()
            .over(
                partition_by=GatewayOutcome.session_id, order_by=GatewayOutcome.received_at.desc()
            )
            .label("rank"),
        )
        .where(GatewayOutcome.loop_id == loop_id, GatewayOutcome.session_id.is_not(None))
        .subquery()
    )
    return session.execute(
        select(
            GatewaySession.id,
            GatewaySession.key,
            GatewaySession.status,
            GatewaySession.call_count,
            GatewaySession.opened_at,
            GatewaySession.last_call_at,
            GatewaySession.closed_at,
            GatewaySession.close_reason,
            GatewaySession.trace_id,
            latest.c.success,
            latest.c.score,
            latest.c.label,
        )
        .outerjoin(latest, (latest.c.session_id == GatewaySession.id) & (latest.c.rank == 1))
        .where(GatewaySession.loop_id == loop_id)
        .order_by(GatewaySession.last_call_at.desc())
        .limit(limit)
    ).all()
