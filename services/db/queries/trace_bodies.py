"""Trace bodies (``trace_bodies``, partitioned by ``received_at``): what queries over traces
read of them, and whether and when retention purged one. Never commits.

A body is found by its trace's id and ``received_at`` together, the partition key, so Postgres
reads one partition's index per trace; a query with a time range repeats its bounds on the
body's ``received_at``, so the partitions outside it are left out of the plan.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import ColumnElement, Select, Text, cast, func, literal, select
from sqlalchemy.orm import Session

from services.db.models import PartitionRetirement, Trace, TraceBody
from services.db.partitions import TRACE_BODIES


def _body_of_trace() -> Select[Any]:
    """The body row of the trace of the enclosing query: its id and its ``received_at``, the
    partition key, so Postgres reads one partition's index (pruned at run time, per row)."""
    return select(TraceBody).where(
        TraceBody.trace_id == Trace.id, TraceBody.received_at == Trace.received_at
    )


BODY_TEXT = (
    _body_of_trace()
    .with_only_columns(cast(TraceBody.body, Text))
    .correlate(Trace)
    .scalar_subquery()
)
"""The trace's body as JSON text, None once purged (a column of a query over ``traces``)."""


def body_kept(
    since: dt.datetime | None = None, until: dt.datetime | None = None
) -> ColumnElement[bool]:
    """Whether the trace still has its body (a column of a query over ``traces``). The
    bounds of a query's time range, repeated on the partition key, let Postgres leave the
    partitions outside it out of the plan.

    A scalar subquery, not ``EXISTS``: Postgres may run an ``EXISTS`` as a hashed subplan,
    which reads every body's key to answer for a page of 50 (O(rows), 40 ms at 100k); a
    scalar subquery is one index probe per row of the page."""
    found = _body_of_trace().with_only_columns(literal(True)).limit(1)
    if since is not None:
        found = found.where(TraceBody.received_at >= since)
    if until is not None:
        found = found.where(TraceBody.received_at < until)
    return found.correlate(Trace).scalar_subquery().is_not(None)


def _purged_at(received_at: dt.datetime) -> Select[Any]:
    """When retention dropped the range holding ``received_at`` (the first that covers it)."""
    return select(func.min(PartitionRetirement.retired_at)).where(
        PartitionRetirement.table_name == TRACE_BODIES.name,
        PartitionRetirement.lower <= received_at,
        PartitionRetirement.upper > received_at,
    )


def trace_purge_state(
    *, session: Session, loop_id: int, external_id: str
) -> tuple[int, dt.datetime | None] | None:
    """A trace's row id and when retention purged its body (None: not purged); None when
    the loop has no such trace."""
    row = session.execute(
        select(Trace.id, Trace.received_at, body_kept()).where(
            Trace.loop_id == loop_id, Trace.external_id == external_id
        )
    ).first()
    if row is None:
        return None
    trace_id, received_at, kept = row
    return int(trace_id), None if kept else _purged_time(session, received_at)


def _purged_time(session: Session, received_at: dt.datetime) -> dt.datetime:
    """When a body that is gone went; a range retired before retention kept a record (none
    should be) reads as purged when received."""
    found = session.execute(_purged_at(received_at)).scalar_one()
    return found if found is not None else received_at


def trace_body(
    *, session: Session, trace_id: int
) -> tuple[dict[str, Any] | None, dt.datetime | None]:
    """The stored body and when retention purged it: ``(body, None)`` while it is the
    agent's own, ``(None, when)`` once purged."""
    received_at, body = session.execute(
        select(
            Trace.received_at,
            _body_of_trace().with_only_columns(TraceBody.body).correlate(Trace).scalar_subquery(),
        ).where(Trace.id == trace_id)
    ).one()
    if body is not None:
        return body, None
    return None, _purged_time(session, received_at)
