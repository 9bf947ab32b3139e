"""The models and the migrations agree, and the migrations go both ways on a real Postgres."""

from __future__ import annotations

from collections.abc import Callable

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from services.db.migrate import current_heads, downgrade, upgrade
from services.db.models import Base
from services.settings import to_sqlalchemy_url


def test_autogenerate_finds_no_difference(database_url: str) -> None:
    engine = create_engine(to_sqlalchemy_url(database_url))
    with engine.connect() as connection:
        context = MigrationContext.configure(connection)
        diff = compare_metadata(context, Base.metadata)
    engine.dispose()
    assert diff == []


def test_upgrade_downgrade_upgrade(make_database: Callable[[], str]) -> None:
    url = make_database()
    assert current_heads(url) != []
    downgrade(url, "base")
    engine = create_engine(to_sqlalchemy_url(url))
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(url)
    tables = set(inspect(engine).get_table_names())
    engine.dispose()
    assert {"loops", "traces", "tasks", "datasets", "cycles", "runs", "checkpoints"} <= tables
    assert {"evaluations", "evaluation_results", "promotions", "credentials"} <= tables
