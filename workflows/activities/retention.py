"""The retention activities: partitions made ahead, old ones retired (services.db.partitions)."""

from __future__ import annotations

import datetime as dt
import logging
import time

from temporalio import activity
from temporalio.exceptions import ApplicationError

from services.db.partitions import (
    OTLP_SPAN_PAYLOADS,
    PERIODS,
    TRACE_BODIES,
    PartitionedTable,
    Period,
    Retired,
)
from services.db.queries.retention import (
    drop_retired,
    make_partitions_ahead,
    retire_span_payloads,
    retire_trace_bodies,
)
from services.db.session import SessionFactory
from services.metrics import (
    PARTITION_RETIREMENT_DURATION,
    PARTITIONS_CREATED,
    PARTITIONS_RETIRED,
    TRACE_BODIES_PURGED,
)
from workflows.payloads.retention import (
    MaintainPartitionsInput,
    MaintainPartitionsResult,
    PurgeTraceBodiesInput,
    PurgeTraceBodiesResult,
)

logger = logging.getLogger(__name__)


def _period(value: str) -> Period:
    for period in PERIODS:
        if value == period:
            return period
    raise ApplicationError(
        f"partition period {value!r} is not one of {', '.join(PERIODS)}", non_retryable=True
    )


def _count_retired(table: str, retired: list[Retired], started: float) -> None:
    PARTITION_RETIREMENT_DURATION.labels(table).observe(time.monotonic() - started)
    PARTITIONS_RETIRED.labels(table).inc(sum(1 for r in retired if not r.name.endswith("_default")))


class RetentionActivities:
    def __init__(self, session_factory: SessionFactory) -> None:
        self._sessions = session_factory

    @activity.defn(name="maintain_partitions")
    def maintain_partitions(self, input: MaintainPartitionsInput) -> MaintainPartitionsResult:
        """Make the partitions of the current period and ``ahead`` more, and drop the span
        payload partitions past the span retention; one transaction each.

        Idempotent: what exists is not made again, what is gone is not dropped again, and a
        run that finds another holding a table's maintenance lock leaves the table to it.
        """
        now = dt.datetime.fromisoformat(input.now)
        period = _period(input.period)
        with self._sessions.begin() as session:
            made = make_partitions_ahead(session=session, now=now, period=period, ahead=input.ahead)
        for name in made or ():
            PARTITIONS_CREATED.labels(name.rsplit("_p", 1)[0]).inc()
        if made:
            logger.info("partitions: made %s", ", ".join(made))
        started = time.monotonic()
        cutoff = now - dt.timedelta(seconds=input.span_retention_s)
        with self._sessions.begin() as session:
            retired = retire_span_payloads(session=session, received_before=cutoff, now=now)
        self._drop_retired(OTLP_SPAN_PAYLOADS)
        _count_retired(OTLP_SPAN_PAYLOADS.name, retired or [], started)
        return MaintainPartitionsResult(made=made or [], retired=[r.name for r in retired or ()])

    @activity.defn(name="purge_trace_bodies")
    def purge_trace_bodies(self, input: PurgeTraceBodiesInput) -> PurgeTraceBodiesResult:
        """Drop the partitions of trace bodies past the retention period (and older bodies
        in the default partition): a short transaction detaches them, whatever the rows, and
        a second drops them, locking nothing ingest or listings use; nothing when
        ``retention_days`` is 0 (kept for ever).

        Idempotent: the cutoff is fixed by the input's ``now``, and a dropped partition is
        not there to drop again; a run that finds another worker at it leaves it the work.
        """
        if input.retention_days <= 0:
            return PurgeTraceBodiesResult()
        now = dt.datetime.fromisoformat(input.now)
        cutoff = now - dt.timedelta(days=input.retention_days)
        started = time.monotonic()
        with self._sessions.begin() as session:
            retired = retire_trace_bodies(session=session, received_before=cutoff, now=now)
        self._drop_retired(TRACE_BODIES)
        if retired is None:
            logger.info("retention: another worker is retiring trace bodies; left to it")
            return PurgeTraceBodiesResult(cutoff=cutoff.isoformat())
        _count_retired(TRACE_BODIES.name, retired, started)
        purged = sum(r.rows for r in retired)
        TRACE_BODIES_PURGED.inc(purged)
        if retired:
            logger.info(
                "retention: dropped %s (about %d trace bodies received before %s)",
                ", ".join(r.name for r in retired),
                purged,
                cutoff,
            )
        return PurgeTraceBodiesResult(
            purged=purged, cutoff=cutoff.isoformat(), retired=[r.name for r in retired]
        )

    def _drop_retired(self, table: PartitionedTable) -> None:
        """Drop what retention detached from ``table``, after the detach committed."""
        with self._sessions.begin() as session:
            dropped = drop_retired(session=session, table=table)
        if dropped:
            logger.info("retention: dropped the detached %s", ", ".join(dropped))
