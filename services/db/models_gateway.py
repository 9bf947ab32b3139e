"""The capture gateway's tables: calls as the gateway captured them, the sessions they are
assembled into, and the outcomes that arrive for sessions (services.gateway).

Kept apart from services.db.models, which re-exports them, because they are the gateway's
staging area: what crosses into DESIGN §2's domain model is the trace a closed session
becomes (``gateway_sessions.trace_id``) and the feedback its outcomes add.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Mapped, mapped_column

from services.db.base import Base
from services.db.columns import JSON, now_column


class GatewayCall(Base):
    """One call the gateway answered and captured: the request's conversation and tools, the
    reply with the token ids and log-probs that were sampled, and the serving version.

    ``call_id`` is the gateway's id for the call (unique), so a spool drained twice (a
    replica killed between its insert and its cursor write) stores each call once.
    ``prefix_hashes`` are the digests of the request's conversation at each assistant turn
    and ``after_hash`` the digest of the conversation with the reply: a call continues the
    open session whose last call's ``after_hash`` is one of its ``prefix_hashes``
    (services.gateway.conversation). ``session_id`` stays null until the assembler places
    the call.
    """

    __tablename__ = "gateway_calls"
    __table_args__ = (
        Index(
            "ix_gateway_calls_unplaced",
            "loop_id",
            "captured_at",
            postgresql_where=text("session_id IS NULL"),
        ),
        Index("ix_gateway_calls_session", "session_id", "captured_at"),
        Index("ix_gateway_calls_response", "loop_id", "response_id"),
        CheckConstraint("kind IN ('chat', 'completion', 'responses')", name="kind"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    call_id: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    captured_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    session_key: Mapped[str | None] = mapped_column(Text)
    model_version: Mapped[str | None] = mapped_column(Text)
    response_id: Mapped[str | None] = mapped_column(Text)
    prefix_hashes: Mapped[list[str]] = mapped_column(ARRAY(String(64)))
    after_hash: Mapped[str] = mapped_column(String(64))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    session_id: Mapped[int | None] = mapped_column(
        ForeignKey("gateway_sessions.id", ondelete="SET NULL")
    )
    stored_at: Mapped[dt.datetime] = now_column()


class GatewaySession(Base):
    """Calls of one episode: open while calls come, closed (after the idle time, or by the
    api) into one trace.

    ``key`` is the id the agent gave (``X-Ratchet-Session``, ``metadata.session_id`` or
    ``user``), else ``call-<the first call's id>``; at most one open session per key.
    """

    __tablename__ = "gateway_sessions"
    __table_args__ = (
        CheckConstraint("status IN ('open', 'closed')", name="status"),
        Index(
            "uq_gateway_sessions_open_key",
            "loop_id",
            "key",
            unique=True,
            postgresql_where=text("status = 'open'"),
        ),
        Index(
            "ix_gateway_sessions_open_after",
            "loop_id",
            "last_after_hash",
            postgresql_where=text("status = 'open'"),
        ),
        Index("ix_gateway_sessions_loop_key", "loop_id", "key", "opened_at"),
        Index("ix_gateway_sessions_idle", "last_call_at", postgresql_where=text("status = 'open'")),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(Text)
    explicit: Mapped[bool] = mapped_column(Boolean)
    status: Mapped[str] = mapped_column(String(8), server_default="open")
    call_count: Mapped[int] = mapped_column(Integer, server_default="0")
    last_after_hash: Mapped[str | None] = mapped_column(String(64))
    # For text completions: the length of the last call's prompt and completion, so a call
    # whose prompt extends it is found by the digest of its prompt's first that many chars.
    last_after_chars: Mapped[int | None] = mapped_column(Integer)
    opened_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    last_call_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    closed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    close_reason: Mapped[str | None] = mapped_column(String(16))
    trace_id: Mapped[int | None] = mapped_column(ForeignKey("traces.id", ondelete="SET NULL"))


class GatewayOutcome(Base):
    """An outcome posted for a session (``POST /v1/loops/{loop}/sessions/{id}/outcome``),
    before or after the session closed.

    ``session_ref`` is the id the sender used: a session key, or a call or response id of
    the session. ``session_id`` is set once it is joined; ``feedback_id`` once it reached
    the session's trace as feedback (which sends the trace back to curation). The webhook id
    is unique per loop, so a replayed request is refused.
    """

    __tablename__ = "gateway_outcomes"
    __table_args__ = (
        UniqueConstraint("loop_id", "webhook_id"),
        Index(
            "ix_gateway_outcomes_pending", "loop_id", postgresql_where=text("feedback_id IS NULL")
        ),
        Index("ix_gateway_outcomes_session", "session_id"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    webhook_id: Mapped[str] = mapped_column(String(256))
    session_ref: Mapped[str] = mapped_column(Text)
    success: Mapped[bool | None] = mapped_column(Boolean)
    score: Mapped[float | None] = mapped_column(Float)
    reference_answer: Mapped[str | None] = mapped_column(Text)
    label: Mapped[str | None] = mapped_column(Text)
    received_at: Mapped[dt.datetime] = now_column()
    session_id: Mapped[int | None] = mapped_column(
        ForeignKey("gateway_sessions.id", ondelete="SET NULL")
    )
    feedback_id: Mapped[int | None] = mapped_column(
        ForeignKey("trace_feedback.id", ondelete="SET NULL")
    )
