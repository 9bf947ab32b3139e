"""cycle estimate and phase costs

What a cycle was expected to cost before it trained (``estimate_usd``, with the planned
work, the per-phase rates and what was left of the budget in ``estimate``) and where its
money went (``cost_by_phase``: seconds, compute-seconds and dollars per phase of its runs),
so the ledger shows the estimate beside the actual.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 19:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("cycles", sa.Column("estimate_usd", sa.Numeric(14, 6), nullable=True))
    for name in ("estimate", "cost_by_phase"):
        op.add_column(
            "cycles",
            sa.Column(
                name,
                postgresql.JSONB(none_as_null=True, astext_type=sa.Text()),
                server_default="{}",
                nullable=False,
            ),
        )


def downgrade() -> None:
    op.drop_column("cycles", "cost_by_phase")
    op.drop_column("cycles", "estimate")
    op.drop_column("cycles", "estimate_usd")
