"""signing secrets encrypted at rest; traces remember when their body was purged

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:15:00

Signing secrets stored in clear are encrypted under RATCHET_SECRET_KEY (services.secrets);
the key is read only if there is something to encrypt, so an empty database needs none.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PREFIX = "fernet:"


def _box():  # type: ignore[no-untyped-def]
    from services.secrets import SecretBox
    from services.settings import get_settings

    return SecretBox.from_settings(get_settings())


def upgrade() -> None:
    op.add_column('traces', sa.Column('body_purged_at', sa.DateTime(timezone=True), nullable=True))
    connection = op.get_bind()
    rows = connection.execute(
        sa.text(
            "SELECT id, secret FROM credentials WHERE kind = 'signing_secret' "
            "AND secret IS NOT NULL AND secret NOT LIKE 'fernet:%'"
        )
    ).all()
    if not rows:
        return
    box = _box()
    for row_id, secret in rows:
        connection.execute(
            sa.text("UPDATE credentials SET secret = :secret WHERE id = :id"),
            {"secret": box.encrypt(secret), "id": row_id},
        )


def downgrade() -> None:
    connection = op.get_bind()
    rows = connection.execute(
        sa.text("SELECT id, secret FROM credentials WHERE secret LIKE 'fernet:%'")
    ).all()
    if rows:
        box = _box()
        for row_id, secret in rows:
            connection.execute(
                sa.text("UPDATE credentials SET secret = :secret WHERE id = :id"),
                {"secret": box.decrypt(secret), "id": row_id},
            )
    op.drop_column('traces', 'body_purged_at')
