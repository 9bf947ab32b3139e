"""Retention and upkeep of the tables partitioned by time (services.db.partitions). The caller
owns the transaction.

A trace's body holds what the agent saw and said, unredacted. After the retention period
(``RATCHET_TRACE_RETENTION_DAYS``) it goes with its partition of ``trace_bodies``: a
partition is dropped once it is wholly older than the cutoff, so a body is kept at most one
period (a day or a week) longer than the setting says. The trace's row stays (loop, external
id, outcome, timings), so counts, the drift signal and the lineage from tasks back to their
source traces keep working, and tasks keep their own redacted copies. A trace whose body went
before curation saw it is recorded by curation as ``purged``
(services.curation.workers), and ``partition_retirements`` says when it went.

OTLP span payloads normally leave when their episode is assembled; what is left (spans of
an episode that never completed) goes with its partition once it is older than the span
retention, unless a span still waiting holds a payload in it.

Each function takes the table's maintenance lock first and returns None when another
transaction holds it (another worker is at it: this run has nothing to do). Retiring detaches;
the caller commits and then drops what was detached (:func:`drop_retired`) in a second
transaction, so ingest and listings wait for the catalog change only, never for the files.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import text
from sqlalchemy.orm import Session

from services.db.partitions import (
    OTLP_SPAN_PAYLOADS,
    PARTITIONED_TABLES,
    TRACE_BODIES,
    Partition,
    PartitionedTable,
    Period,
    Retired,
    drop_detached_partitions,
    ensure_partitions,
    lock_table_maintenance,
    retire_partitions,
)


def make_partitions_ahead(
    *, session: Session, now: dt.datetime, period: Period, ahead: int
) -> list[str] | None:
    """Make the partitions of the current period and ``ahead`` more, of every partitioned
    table (idempotent); the names of those made, None when another run holds a lock."""
    made: list[str] = []
    for table in PARTITIONED_TABLES:
        if not lock_table_maintenance(session=session, table=table):
            return None
        made += ensure_partitions(session=session, table=table, now=now, period=period, ahead=ahead)
    return made


def retire_trace_bodies(
    *, session: Session, received_before: dt.datetime, now: dt.datetime
) -> list[Retired] | None:
    """Drop the partitions of trace bodies wholly received before ``received_before`` and
    delete older bodies from the default partition; what went, None when locked out."""
    if not lock_table_maintenance(session=session, table=TRACE_BODIES):
        return None
    return retire_partitions(session=session, table=TRACE_BODIES, before=received_before, now=now)


def _no_waiting_span(session: Session, part: Partition) -> bool:
    """Whether no span still waiting for its episode has its payload in ``part``."""
    waiting = session.execute(
        text(
            f"SELECT EXISTS (SELECT 1 FROM {part.name} AS p JOIN otlp_spans AS s "
            "ON s.id = p.span_row_id AND s.received_at = p.received_at "
            "WHERE s.assembled_at IS NULL)"
        )
    ).scalar_one()
    return not waiting


def retire_span_payloads(
    *, session: Session, received_before: dt.datetime, now: dt.datetime
) -> list[Retired] | None:
    """Drop the partitions of span payloads wholly received before ``received_before`` that
    no waiting span needs; what went, None when locked out."""
    if not lock_table_maintenance(session=session, table=OTLP_SPAN_PAYLOADS):
        return None
    return retire_partitions(
        session=session,
        table=OTLP_SPAN_PAYLOADS,
        before=received_before,
        now=now,
        may_retire=_no_waiting_span,
    )


def drop_retired(*, session: Session, table: PartitionedTable) -> list[str] | None:
    """Drop the partitions retention detached from ``table`` (in a transaction after the one
    that detached them); the names dropped, None when locked out."""
    if not lock_table_maintenance(session=session, table=table):
        return None
    return drop_detached_partitions(session=session, table=table)
