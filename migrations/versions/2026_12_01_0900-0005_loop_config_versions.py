"""loop config versions

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 09:00:00

Every loop gets its current configuration as version 1 (changed by "migration"), so the
history of a loop created before this revision starts where it stands.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('loop_config_versions',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('loop_id', sa.BigInteger(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('config', postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), nullable=False),
    sa.Column('changes', postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), server_default='[]', nullable=False),
    sa.Column('changed_by', sa.String(length=200), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['loop_id'], ['loops.id'], name=op.f('fk_loop_config_versions_loop_id_loops'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_loop_config_versions')),
    sa.UniqueConstraint('loop_id', 'version', name=op.f('uq_loop_config_versions_loop_id_version'))
    )
    op.execute(
        """
        INSERT INTO loop_config_versions (loop_id, version, config, changed_by, reason, created_at)
        SELECT id, 1, jsonb_build_object(
                   'environment', environment,
                   'executor', executor,
                   'training_profile', training_profile,
                   'serving_target', serving_target,
                   'gate_policy', gate_policy,
                   'trigger_policy', trigger_policy,
                   'curation_policy', curation_policy,
                   'budget_usd', budget_usd),
               'migration', 'configuration when versions were introduced', updated_at
        FROM loops
        """
    )


def downgrade() -> None:
    op.drop_table('loop_config_versions')
