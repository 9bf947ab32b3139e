"""tool responses

The per-loop tool-response store of the replay environment: the result production got for
each (tool, schema hash, canonical arguments), fed by curation, shipped to jobs as a file
with each dataset. ``(loop_id, tool, schema_hash, arguments_key)`` is unique: the first
result recorded for a call is kept.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 14:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tool_responses",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("loop_id", sa.BigInteger(), nullable=False),
        sa.Column("tool", sa.String(length=64), nullable=False),
        sa.Column("schema_hash", sa.String(length=16), nullable=False),
        sa.Column("arguments_key", sa.String(length=64), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("result", sa.Text(), nullable=False),
        sa.Column("trace_id", sa.BigInteger(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["loop_id"],
            ["loops.id"],
            name=op.f("fk_tool_responses_loop_id_loops"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["trace_id"],
            ["traces.id"],
            name=op.f("fk_tool_responses_trace_id_traces"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tool_responses")),
        sa.UniqueConstraint(
            "loop_id",
            "tool",
            "schema_hash",
            "arguments_key",
            name=op.f("uq_tool_responses_loop_id_tool_schema_hash_arguments_key"),
        ),
    )


def downgrade() -> None:
    op.drop_table("tool_responses")
