"""The models and the migrations agree, and the migrations go both ways on a real Postgres."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from services.db.migrate import current_heads, downgrade, upgrade
from services.db.models import Base
from services.db.partitions import include_name
from services.settings import to_sqlalchemy_url


def test_autogenerate_finds_no_difference(database_url: str) -> None:
    engine = create_engine(to_sqlalchemy_url(database_url))
    with engine.connect() as connection:
        # The partitions the schedule makes are not in the models: only their parents are.
        context = MigrationContext.configure(connection, opts={"include_name": include_name})
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


def test_the_revision_chain_is_linear_from_0001_to_one_head() -> None:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    root = Path(__file__).resolve().parents[3]
    config = Config()
    config.set_main_option("script_location", str(root / "migrations"))
    script = ScriptDirectory.from_config(config)
    (head,) = script.get_heads()
    chain = [rev.revision for rev in script.walk_revisions("base", "heads")]
    assert chain[0] == head and chain[-1] == "0001"
    assert chain[-11:] == [f"{n:04d}" for n in range(11, 0, -1)]
    # every revision builds on the one before it: no branch, no gap
    downs = [script.get_revision(rev).down_revision for rev in chain]
    assert downs == [*chain[1:], None]
