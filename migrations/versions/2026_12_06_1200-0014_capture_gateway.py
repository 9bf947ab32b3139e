"""capture gateway: gateway keys, captured calls, sessions and their outcomes

``ratchet gateway`` (services.gateway) captures every call an agent makes through it. The
calls land in ``gateway_calls`` (drained from each replica's spool; ``call_id`` is unique,
so a spool drained twice stores each once), are placed into ``gateway_sessions`` by the
assembler, and a closed session becomes a trace. Outcomes posted for a session wait in
``gateway_outcomes`` until it has a trace, then reach it as feedback; the webhook id is
unique per loop, so a replayed outcome is refused. A loop's gateway keys are credentials of
a third kind, ``gateway_key``, stored as sha256 like ingest tokens.

Revision ID: 0014
Revises: 0012
Create Date: 2026-12-06 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_KINDS = "kind IN ('signing_secret', 'ingest_token')"
_NEW_KINDS = "kind IN ('signing_secret', 'ingest_token', 'gateway_key')"


def _timestamp(name: str, *, nullable: bool = False, now: bool = False) -> sa.Column:
    return sa.Column(
        name,
        sa.DateTime(timezone=True),
        server_default=sa.text("now()") if now else None,
        nullable=nullable,
    )


def upgrade() -> None:
    op.drop_constraint(op.f("ck_credentials_kind"), "credentials", type_="check")
    op.create_check_constraint(op.f("ck_credentials_kind"), "credentials", _NEW_KINDS)
    op.create_table(
        "gateway_sessions",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("loop_id", sa.BigInteger(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("explicit", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=8), server_default="open", nullable=False),
        sa.Column("call_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_after_hash", sa.String(length=64), nullable=True),
        sa.Column("last_after_chars", sa.Integer(), nullable=True),
        _timestamp("opened_at"),
        _timestamp("last_call_at"),
        _timestamp("closed_at", nullable=True),
        sa.Column("close_reason", sa.String(length=16), nullable=True),
        sa.Column("trace_id", sa.BigInteger(), nullable=True),
        sa.CheckConstraint("status IN ('open', 'closed')", name=op.f("ck_gateway_sessions_status")),
        sa.ForeignKeyConstraint(
            ["loop_id"],
            ["loops.id"],
            name=op.f("fk_gateway_sessions_loop_id_loops"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["trace_id"],
            ["traces.id"],
            name=op.f("fk_gateway_sessions_trace_id_traces"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gateway_sessions")),
    )
    op.create_index(
        "uq_gateway_sessions_open_key",
        "gateway_sessions",
        ["loop_id", "key"],
        unique=True,
        postgresql_where=sa.text("status = 'open'"),
    )
    op.create_index(
        "ix_gateway_sessions_open_after",
        "gateway_sessions",
        ["loop_id", "last_after_hash"],
        postgresql_where=sa.text("status = 'open'"),
    )
    op.create_index(
        "ix_gateway_sessions_loop_key", "gateway_sessions", ["loop_id", "key", "opened_at"]
    )
    op.create_index(
        "ix_gateway_sessions_idle",
        "gateway_sessions",
        ["last_call_at"],
        postgresql_where=sa.text("status = 'open'"),
    )
    op.create_table(
        "gateway_calls",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("loop_id", sa.BigInteger(), nullable=False),
        sa.Column("call_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        _timestamp("started_at"),
        _timestamp("captured_at"),
        sa.Column("session_key", sa.Text(), nullable=True),
        sa.Column("model_version", sa.Text(), nullable=True),
        sa.Column("response_id", sa.Text(), nullable=True),
        sa.Column("prefix_hashes", postgresql.ARRAY(sa.String(length=64)), nullable=False),
        sa.Column("after_hash", sa.String(length=64), nullable=False),
        sa.Column("body", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("session_id", sa.BigInteger(), nullable=True),
        _timestamp("stored_at", now=True),
        sa.CheckConstraint(
            "kind IN ('chat', 'completion', 'responses')", name=op.f("ck_gateway_calls_kind")
        ),
        sa.ForeignKeyConstraint(
            ["loop_id"],
            ["loops.id"],
            name=op.f("fk_gateway_calls_loop_id_loops"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["gateway_sessions.id"],
            name=op.f("fk_gateway_calls_session_id_gateway_sessions"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gateway_calls")),
        sa.UniqueConstraint("call_id", name=op.f("uq_gateway_calls_call_id")),
    )
    op.create_index(
        "ix_gateway_calls_unplaced",
        "gateway_calls",
        ["loop_id", "captured_at"],
        postgresql_where=sa.text("session_id IS NULL"),
    )
    op.create_index("ix_gateway_calls_session", "gateway_calls", ["session_id", "captured_at"])
    op.create_index("ix_gateway_calls_response", "gateway_calls", ["loop_id", "response_id"])
    op.create_table(
        "gateway_outcomes",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("loop_id", sa.BigInteger(), nullable=False),
        sa.Column("webhook_id", sa.String(length=256), nullable=False),
        sa.Column("session_ref", sa.Text(), nullable=False),
        sa.Column("success", sa.Boolean(), nullable=True),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("reference_answer", sa.Text(), nullable=True),
        sa.Column("label", sa.Text(), nullable=True),
        _timestamp("received_at", now=True),
        sa.Column("session_id", sa.BigInteger(), nullable=True),
        sa.Column("feedback_id", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["loop_id"],
            ["loops.id"],
            name=op.f("fk_gateway_outcomes_loop_id_loops"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["gateway_sessions.id"],
            name=op.f("fk_gateway_outcomes_session_id_gateway_sessions"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["feedback_id"],
            ["trace_feedback.id"],
            name=op.f("fk_gateway_outcomes_feedback_id_trace_feedback"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gateway_outcomes")),
        sa.UniqueConstraint(
            "loop_id", "webhook_id", name=op.f("uq_gateway_outcomes_loop_id_webhook_id")
        ),
    )
    op.create_index(
        "ix_gateway_outcomes_pending",
        "gateway_outcomes",
        ["loop_id"],
        postgresql_where=sa.text("feedback_id IS NULL"),
    )
    op.create_index("ix_gateway_outcomes_session", "gateway_outcomes", ["session_id"])


def downgrade() -> None:
    op.drop_index("ix_gateway_outcomes_session", table_name="gateway_outcomes")
    op.drop_index("ix_gateway_outcomes_pending", table_name="gateway_outcomes")
    op.drop_table("gateway_outcomes")
    op.drop_index("ix_gateway_calls_response", table_name="gateway_calls")
    op.drop_index("ix_gateway_calls_session", table_name="gateway_calls")
    op.drop_index("ix_gateway_calls_unplaced", table_name="gateway_calls")
    op.drop_table("gateway_calls")
    op.drop_index("ix_gateway_sessions_idle", table_name="gateway_sessions")
    op.drop_index("ix_gateway_sessions_loop_key", table_name="gateway_sessions")
    op.drop_index("ix_gateway_sessions_open_after", table_name="gateway_sessions")
    op.drop_index("uq_gateway_sessions_open_key", table_name="gateway_sessions")
    op.drop_table("gateway_sessions")
    op.execute("DELETE FROM credentials WHERE kind = 'gateway_key'")
    op.drop_constraint(op.f("ck_credentials_kind"), "credentials", type_="check")
    op.create_check_constraint(op.f("ck_credentials_kind"), "credentials", _OLD_KINDS)
