"""What grows with traffic, in tables partitioned by the time it arrived (services.db.partitions).

A trace's raw body and an OTLP span's payload are most of the bytes and all of what retention
removes, so they live apart from their small rows: ``trace_bodies`` and
``otlp_span_payloads`` are range-partitioned by ``received_at`` (their primary keys carry it,
as Postgres requires of a key on a partitioned table), and retention drops a whole
partition instead of rewriting rows. The small rows (``traces``, ``otlp_spans``) stay
unpartitioned, so everything that references a trace (task sources, feedback, tool
responses) keeps its plain foreign key, and ``(loop, external id)`` stays unique across all
time.

A body references its trace by ``(id, received_at)``: the database holds the body's copy of
the partition key equal to the trace's (``ON UPDATE CASCADE`` moves the body when a trace's
time is changed) and deletes the body with its trace.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    ForeignKeyConstraint,
    Identity,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from services.db.base import Base
from services.db.columns import JSON, now_column


class TraceBody(Base):
    """The raw ``ratchet.trace/v1`` document of a trace, in the partition of its day or week.

    Missing once retention dropped its partition: the trace is then *purged* (its row, its
    outcome and its lineage stay; its tasks keep their own redacted copies)."""

    __tablename__ = "trace_bodies"
    __table_args__ = (
        ForeignKeyConstraint(
            ["trace_id", "received_at"],
            ["traces.id", "traces.received_at"],
            ondelete="CASCADE",
            onupdate="CASCADE",
        ),
        {"postgresql_partition_by": "RANGE (received_at)"},
    )

    trace_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    received_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)


class OtlpSpanPayload(Base):
    """The payload of an OTLP span or log record while it waits for its episode (deleted when
    the episode is assembled; whatever is left goes with its partition)."""

    __tablename__ = "otlp_span_payloads"
    __table_args__ = (
        ForeignKeyConstraint(
            ["span_row_id", "received_at"],
            ["otlp_spans.id", "otlp_spans.received_at"],
            ondelete="CASCADE",
            onupdate="CASCADE",
        ),
        {"postgresql_partition_by": "RANGE (received_at)"},
    )

    span_row_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    received_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    payload: Mapped[str] = mapped_column(Text)


class PartitionRetirement(Base):
    """A range of a partitioned table that retention dropped: when, and about how many rows.

    It is how a trace whose body is gone says when it went (``body_purged_at`` in the API),
    and the log of what retention did."""

    __tablename__ = "partition_retirements"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    table_name: Mapped[str] = mapped_column(String(63))
    lower: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    upper: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    rows: Mapped[int] = mapped_column(BigInteger)
    retired_at: Mapped[dt.datetime] = now_column()
