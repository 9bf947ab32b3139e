"""The OTLP staging tables: spans and log records waiting for their episode, and the
sweeper's queue of traces with waiting spans (services.ingest.episodes). Kept apart from
services.db.models, which re-exports both, because they are the ingest path's scratch space,
not part of DESIGN §2's domain model."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from services.db.base import Base
from services.db.columns import now_column


class OtlpSpan(Base):
    """An OTLP span or GenAI log record waiting for its episode, or one already assembled.

    Spans of an unfinished episode wait here (acknowledged to the exporter only once stored)
    until the episode's span arrives or the trace has been quiet for
    ``RATCHET_OTLP_EPISODE_QUIET_S``. Once assembled, a row keeps its ids but loses its
    payload for a retention period, so a re-exported or late span is recognised instead of
    becoming a second, partial trace. The payload lives in ``otlp_span_payloads``,
    partitioned by ``received_at`` (services.db.models_partitioned). See
    services.ingest.episodes.
    """

    __tablename__ = "otlp_spans"
    __table_args__ = (
        UniqueConstraint("loop_id", "trace_id", "record_id"),
        # What a payload's foreign key references (services.db.models_partitioned).
        UniqueConstraint("id", "received_at"),
        CheckConstraint("kind IN ('agent', 'genai', 'other', 'log')", name="kind"),
        Index(
            "ix_otlp_spans_assembled",
            "assembled_at",
            postgresql_where=text("assembled_at IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    trace_id: Mapped[str] = mapped_column(String(32))
    # The span id, or (for a log record) its span id and a digest of the record.
    record_id: Mapped[str] = mapped_column(String(64))
    span_id: Mapped[str] = mapped_column(String(16))
    parent_span_id: Mapped[str] = mapped_column(String(16), server_default="")
    kind: Mapped[str] = mapped_column(String(8))
    # Whether the parent lives in another process (OTLP span flags); null when not said.
    remote_parent: Mapped[bool | None] = mapped_column(Boolean)
    has_content: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    received_at: Mapped[dt.datetime] = now_column()
    assembled_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class OtlpPendingTrace(Base):
    """A trace with spans waiting in ``otlp_spans``: the sweeper's work queue.

    One row per (loop, trace): requests upsert it (its row lock orders concurrent exports of
    one trace), and the quiet-period sweeper claims rows with ``FOR UPDATE SKIP LOCKED`` and a
    lease, so several api replicas never assemble the same trace at the same time. A trace
    that never goes quiet is flushed anyway ``RATCHET_OTLP_EPISODE_MAX_WAIT_S`` after its
    first row.
    """

    __tablename__ = "otlp_pending_traces"
    __table_args__ = (
        Index("ix_otlp_pending_traces_last", "last_received_at"),
        Index("ix_otlp_pending_traces_first", "first_received_at"),
    )

    loop_id: Mapped[int] = mapped_column(
        ForeignKey("loops.id", ondelete="CASCADE"), primary_key=True
    )
    trace_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    first_received_at: Mapped[dt.datetime] = now_column()
    last_received_at: Mapped[dt.datetime] = now_column()
    claimed_until: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
