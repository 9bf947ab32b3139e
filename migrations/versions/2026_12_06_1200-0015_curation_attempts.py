"""traces.curation_attempts: a trace that fails curation alone is set aside, not retried forever

A curation batch runs in one transaction, oldest traces first. A trace whose batch fails
(a row Postgres refuses, a bug in a step) failed it again on every retry, and the traces
behind it waited for good (issue 43). Now a failed batch is curated again one trace per
transaction; the trace that fails alone has its failure counted here and, at the bound,
is set aside (``rejected``, reason ``curation_failed``, the error in ``curation_detail``),
so the queue behind it moves on. Feedback that sends a trace back to curation resets it.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A constant default: Postgres adds the column without rewriting the table.
    op.add_column(
        "traces",
        sa.Column("curation_attempts", sa.Integer(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("traces", "curation_attempts")
