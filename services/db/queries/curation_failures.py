"""A curation batch that failed: the traces it held, and the count of each one's failures.

A batch curates its traces in one transaction, oldest first, so a trace that fails it
(a row Postgres refuses, a bug in a step) would fail every retry and hold back the traces
behind it for good (issue 43). The curation activity then curates the batch's traces one
per transaction (:func:`oldest_uncurated_ids` says which); a trace that fails alone has
the failure counted (:func:`record_curation_failure`) and, at the bound, is set aside.

Every function takes the session keyword-only and never commits.
"""

from __future__ import annotations

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

from services.db.models import Trace
from services.db.queries.traces import CurationOutcome

CURATION_FAILED = "curation_failed"  # the reason a set-aside trace is listed with


def oldest_uncurated_ids(*, session: Session, loop_id: int, limit: int) -> list[int]:
    """The ids of the oldest ``limit`` uncurated traces of a loop (what its next batch
    takes), read without locking them."""
    query = (
        select(Trace.id)
        .where(Trace.loop_id == loop_id, Trace.curated_at.is_(None))
        .order_by(Trace.id)
        .limit(limit)
    )
    return list(session.scalars(query))


def record_curation_failure(
    *, session: Session, trace_id: int, error: str, max_attempts: int
) -> bool:
    """Count a failed attempt to curate ``trace_id`` alone; at ``max_attempts`` the trace
    is set aside: stamped curated, ``rejected``, reason ``curation_failed``, so the traces
    behind it are curated and the listing shows it with the error. True when set aside.
    Below the bound the error is kept in ``curation_detail`` while the trace waits."""
    attempts = Trace.curation_attempts + 1
    give_up = attempts >= max_attempts
    detail = case(
        (give_up, func.concat(f"{CURATION_FAILED}: set aside after ", attempts, " attempts: ")),
        else_=func.concat(f"{CURATION_FAILED}: attempt ", attempts, f" of {max_attempts}: "),
    )
    set_aside = session.execute(
        update(Trace)
        .where(Trace.id == trace_id, Trace.curated_at.is_(None))
        .values(
            curation_attempts=attempts,
            curated_at=case((give_up, func.now()), else_=None),
            curation_outcome=case((give_up, CurationOutcome.REJECTED.value), else_=None),
            curation_detail=func.concat(detail, error[:800]),
        )
        .returning(Trace.curated_at.is_not(None))
    ).scalar_one_or_none()
    return bool(set_aside)
