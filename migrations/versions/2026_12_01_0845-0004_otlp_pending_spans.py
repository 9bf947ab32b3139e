"""otlp pending spans: durable storage of unfinished OTLP episodes

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 08:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'otlp_spans',
        sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column('loop_id', sa.BigInteger(), nullable=False),
        sa.Column('trace_id', sa.String(length=32), nullable=False),
        sa.Column('record_id', sa.String(length=64), nullable=False),
        sa.Column('span_id', sa.String(length=16), nullable=False),
        sa.Column('parent_span_id', sa.String(length=16), server_default='', nullable=False),
        sa.Column('kind', sa.String(length=8), nullable=False),
        sa.Column('remote_parent', sa.Boolean(), nullable=True),
        sa.Column('has_content', sa.Boolean(), server_default=sa.text('false'), nullable=False),
        sa.Column('payload', sa.Text(), nullable=True),
        sa.Column('received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('assembled_at', sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("kind IN ('agent', 'genai', 'other', 'log')", name=op.f('ck_otlp_spans_kind')),
        sa.ForeignKeyConstraint(['loop_id'], ['loops.id'], name=op.f('fk_otlp_spans_loop_id_loops'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_otlp_spans')),
        sa.UniqueConstraint('loop_id', 'trace_id', 'record_id', name=op.f('uq_otlp_spans_loop_id_trace_id_record_id')),
    )
    op.create_index('ix_otlp_spans_assembled', 'otlp_spans', ['assembled_at'], unique=False, postgresql_where=sa.text('assembled_at IS NOT NULL'))
    op.create_table(
        'otlp_pending_traces',
        sa.Column('loop_id', sa.BigInteger(), nullable=False),
        sa.Column('trace_id', sa.String(length=32), nullable=False),
        sa.Column('first_received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('last_received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('claimed_until', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['loop_id'], ['loops.id'], name=op.f('fk_otlp_pending_traces_loop_id_loops'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('loop_id', 'trace_id', name=op.f('pk_otlp_pending_traces')),
    )
    op.create_index('ix_otlp_pending_traces_last', 'otlp_pending_traces', ['last_received_at'], unique=False)
    op.create_index('ix_otlp_pending_traces_first', 'otlp_pending_traces', ['first_received_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_otlp_pending_traces_first', table_name='otlp_pending_traces')
    op.drop_index('ix_otlp_pending_traces_last', table_name='otlp_pending_traces')
    op.drop_table('otlp_pending_traces')
    op.drop_index('ix_otlp_spans_assembled', table_name='otlp_spans', postgresql_where=sa.text('assembled_at IS NOT NULL'))
    op.drop_table('otlp_spans')
