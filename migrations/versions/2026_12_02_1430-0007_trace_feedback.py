"""trace feedback

Feedback posted after the fact (``POST /v1/loops/{loop}/traces/{external_id}/feedback``):
a score, a label, a correction, a comment. ``(trace_id, content_hash)`` is unique, so the
same feedback posted twice is one row.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 14:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "trace_feedback",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("loop_id", sa.BigInteger(), nullable=False),
        sa.Column("trace_id", sa.BigInteger(), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("label", sa.Text(), nullable=True),
        sa.Column("correction", sa.Text(), nullable=True),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["loop_id"],
            ["loops.id"],
            name=op.f("fk_trace_feedback_loop_id_loops"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["trace_id"],
            ["traces.id"],
            name=op.f("fk_trace_feedback_trace_id_traces"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trace_feedback")),
        sa.UniqueConstraint(
            "trace_id", "content_hash", name=op.f("uq_trace_feedback_trace_id_content_hash")
        ),
    )


def downgrade() -> None:
    op.drop_table("trace_feedback")
