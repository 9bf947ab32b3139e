"""tasks set aside: a task the loop keeps but never trains on, with the reason why

A replay task whose every episode needed a tool result nobody could give (no recorded
result, no live endpoint or a tool off its allow-list, or the endpoint failed) teaches only
noise: the worker, reading a job's ``metrics.json`` (``unanswerable_calls``), sets it aside
(services/curation/tool_outcomes.py) instead of deleting it. The snapshot leaves set-aside
tasks out of the train split; ``ratchet tasks list/show`` and the task API show the reason;
``ratchet tasks restore`` brings a task back (e.g. once its tool is allow-listed).

Three nullable columns on ``tasks``; no index (the train split is read by loop and split,
and a set-aside task is rare).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("set_aside_reason", sa.String(length=32), nullable=True))
    op.add_column("tasks", sa.Column("set_aside_detail", sa.Text(), nullable=True))
    op.add_column("tasks", sa.Column("set_aside_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "set_aside_at")
    op.drop_column("tasks", "set_aside_detail")
    op.drop_column("tasks", "set_aside_reason")
