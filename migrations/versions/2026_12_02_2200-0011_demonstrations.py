"""demonstrations: every verified episode of a curated task, with its exact tokens

A table, not files of the dataset snapshot: a demonstration is found by the task it solves
(its content hash) across runs and cycles (a success found by one cycle's probe trains the
next cycle), bounded per task, and shown on the task's page; a snapshot is immutable and
per cycle, so files in it could neither be bounded across cycles nor found by task without
reading every snapshot. Lineage stays one join away: ``run_id`` names the run (probe or
train) that sampled the episode, ``checkpoint_id`` the weights it sampled from.

The rows are recorded from a job's ``episodes.jsonl`` only as far as its ``metrics.json``
listing vouches for it (size, sha256, count, declared kinds); see
services/curation/demonstrations.py.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 22:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "demonstrations",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("loop_id", sa.BigInteger(), nullable=False),
        sa.Column("task_id", sa.BigInteger(), nullable=False),
        sa.Column("task_hash", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("sample", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("checkpoint_id", sa.String(length=128), nullable=True),
        sa.Column("family", sa.String(length=32), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("sequences", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "source IN ('train', 'eval', 'probe')", name=op.f("ck_demonstrations_source")
        ),
        sa.ForeignKeyConstraint(
            ["loop_id"],
            ["loops.id"],
            name=op.f("fk_demonstrations_loop_id_loops"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["task_id"],
            ["tasks.id"],
            name=op.f("fk_demonstrations_task_id_tasks"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_demonstrations_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_demonstrations")),
        sa.UniqueConstraint("run_id", "sample", name="uq_demonstrations_run_sample"),
    )
    op.create_index(
        "ix_demonstrations_task_passed",
        "demonstrations",
        ["task_id", "passed", "created_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_demonstrations_task_passed", table_name="demonstrations")
    op.drop_table("demonstrations")
