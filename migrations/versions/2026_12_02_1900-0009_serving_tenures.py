"""serving tenures

The serving ledger: one row per version's time serving a loop (from its verified deploy to
the deploy that replaced it), with the prompt, cached-prompt and completion tokens and the
busy compute-seconds it served and what they cost; ``baseline`` holds the server's counters
at the last sample. At most one open tenure per loop.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 19:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "serving_tenures",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("loop_id", sa.BigInteger(), nullable=False),
        sa.Column("checkpoint_id", sa.String(length=64), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("cached_prompt_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("busy_seconds", sa.Float(), server_default="0", nullable=False),
        sa.Column(
            "cost_usd", sa.Numeric(precision=14, scale=6), server_default="0", nullable=False
        ),
        sa.Column("baseline", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column(
            "started_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("sampled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_serving_tenures_checkpoint_id_checkpoints"),
        ),
        sa.ForeignKeyConstraint(
            ["loop_id"],
            ["loops.id"],
            name=op.f("fk_serving_tenures_loop_id_loops"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_serving_tenures")),
    )
    op.create_index(
        "ix_serving_tenures_loop_started",
        "serving_tenures",
        ["loop_id", "started_at"],
        unique=False,
    )
    op.create_index(
        "uq_serving_tenures_one_open_per_loop",
        "serving_tenures",
        ["loop_id"],
        unique=True,
        postgresql_where=sa.text("ended_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("uq_serving_tenures_one_open_per_loop", table_name="serving_tenures")
    op.drop_index("ix_serving_tenures_loop_started", table_name="serving_tenures")
    op.drop_table("serving_tenures")
