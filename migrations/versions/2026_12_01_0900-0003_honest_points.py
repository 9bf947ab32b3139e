"""honest points: the held-out split in datasets, three numbers per cycle

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('datasets', sa.Column('heldout_count', sa.Integer(), server_default='0', nullable=False))
    op.add_column('datasets', sa.Column('heldout_uri', sa.Text(), nullable=True))
    op.drop_constraint(op.f('ck_dataset_tasks_split'), 'dataset_tasks', type_='check')
    op.create_check_constraint(
        op.f('ck_dataset_tasks_split'),
        'dataset_tasks',
        "split IN ('train', 'eval', 'heldout', 'regression')",
    )
    op.add_column('cycles', sa.Column('gate_points', sa.Float(), nullable=True))
    op.add_column('cycles', sa.Column('live_points', sa.Float(), nullable=True))
    op.add_column(
        'cycles',
        sa.Column(
            'points_detail',
            postgresql.JSONB(none_as_null=True, astext_type=sa.Text()),
            server_default='{}',
            nullable=False,
        ),
    )


def downgrade() -> None:
    op.drop_column('cycles', 'points_detail')
    op.drop_column('cycles', 'live_points')
    op.drop_column('cycles', 'gate_points')
    op.execute("DELETE FROM dataset_tasks WHERE split = 'heldout'")
    op.drop_constraint(op.f('ck_dataset_tasks_split'), 'dataset_tasks', type_='check')
    op.create_check_constraint(
        op.f('ck_dataset_tasks_split'), 'dataset_tasks', "split IN ('train', 'eval', 'regression')"
    )
    op.drop_column('datasets', 'heldout_uri')
    op.drop_column('datasets', 'heldout_count')
