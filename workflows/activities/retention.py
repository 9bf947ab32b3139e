"""The retention activity: purge raw trace bodies older than the retention period."""

from __future__ import annotations

import datetime as dt
import logging

from temporalio import activity

from services.db.queries.retention import purge_trace_bodies
from services.db.session import SessionFactory
from services.metrics import TRACE_BODIES_PURGED
from workflows.payloads.retention import PurgeTraceBodiesInput, PurgeTraceBodiesResult

logger = logging.getLogger(__name__)


class RetentionActivities:
    def __init__(self, session_factory: SessionFactory) -> None:
        self._sessions = session_factory

    @activity.defn(name="purge_trace_bodies")
    def purge_trace_bodies(self, input: PurgeTraceBodiesInput) -> PurgeTraceBodiesResult:
        """Purge in batches, one transaction each, heartbeating between them.

        Idempotent: the cutoff is fixed by the input's ``now``, and purged rows are skipped,
        so a retry after a crash continues where the last committed batch ended.
        """
        now = dt.datetime.fromisoformat(input.now)
        cutoff = now - dt.timedelta(days=input.retention_days)
        purged = 0
        while True:
            with self._sessions.begin() as session:
                batch = purge_trace_bodies(
                    session=session, received_before=cutoff, now=now, limit=input.batch_size
                )
            purged += batch
            TRACE_BODIES_PURGED.inc(batch)
            activity.heartbeat(purged)
            if batch < input.batch_size:
                break
        if purged:
            logger.info("retention: purged %d trace bodies received before %s", purged, cutoff)
        return PurgeTraceBodiesResult(purged=purged, cutoff=cutoff.isoformat())
