"""Schema migrations as a deploy step (`ratchet db upgrade`, the Helm hook Job), never at import."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations

FILE_TEMPLATE = "%%(year)d_%%(month).2d_%%(day).2d_%%(hour).2d%%(minute).2d-%%(rev)s_%%(slug)s"


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at the packaged migrations and the given database."""
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.set_main_option("file_template", FILE_TEMPLATE)
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def current_heads(database_url: str) -> list[str]:
    """Revisions the database is at (empty before the first upgrade)."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    from services.settings import to_sqlalchemy_url

    engine = create_engine(to_sqlalchemy_url(database_url))
    try:
        with engine.connect() as connection:
            return list(MigrationContext.configure(connection).get_current_heads())
    finally:
        engine.dispose()
