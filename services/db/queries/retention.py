"""Retention of raw trace bodies. The caller owns the transaction.

A trace's body holds what the agent saw and said, unredacted. After the retention period it
is replaced by ``{}`` and ``body_purged_at`` is set; the row stays (loop, external id,
outcome, timings), so counts, the drift signal and the lineage from tasks back to their
source trace ids keep working, and tasks keep their own redacted copies. A trace purged
before curation saw it is marked curated with the outcome ``purged``, so curation never
reads an empty body.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import text
from sqlalchemy.orm import Session

from services.db.queries.traces import CurationOutcome

PURGED_OUTCOME = CurationOutcome.PURGED

_PURGE_SQL = text(
    """
    UPDATE traces
       SET body = '{}'::json,
           body_purged_at = :now,
           curated_at = COALESCE(curated_at, :now),
           curation_outcome = COALESCE(curation_outcome, :outcome)
     WHERE id IN (
        SELECT id FROM traces
         WHERE received_at < :before AND body_purged_at IS NULL
         ORDER BY id
         LIMIT :limit
         FOR UPDATE SKIP LOCKED
     )
    """
)


def purge_trace_bodies(
    *, session: Session, received_before: dt.datetime, now: dt.datetime, limit: int
) -> int:
    """Purge up to ``limit`` bodies of traces received before ``received_before``; how many.

    Idempotent: purged rows are skipped, so a retried or concurrent run purges nothing twice
    (rows another transaction holds are skipped, not waited for).
    """
    result = session.execute(
        _PURGE_SQL,
        {"before": received_before, "now": now, "limit": limit, "outcome": PURGED_OUTCOME},
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
