"""Fixtures for the dashboard tests: a seeded database per module, a real uvicorn server of
``create_app`` on 127.0.0.1, and one headless Chromium (Debian's) per module."""

from __future__ import annotations

import datetime as dt
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import uvicorn
from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright
from sqlalchemy import Engine

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.session import SessionFactory, create_db_engine, make_session_factory
from services.settings import Settings
from tests.conftest import with_database
from tests.services.dashboard.seed import Story, seed_story
from tests.support import assert_eventually

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ADMIN_TOKEN = "dashboard-test-admin-token"
TEMPORAL_UI = "http://temporal-ui.test:8233"


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@contextmanager
def cloned_database(server_url: str, template: str) -> Iterator[str]:
    """A fresh database at the migrations' head that outlives one test (for a module)."""
    name = f"ratchet_dash_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq(server_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        yield with_database(server_url, name)
    finally:
        with psycopg.connect(_libpq(server_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def dashboard_settings(database_url: str, state_dir: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "database_url": database_url,
        "state_dir": state_dir,
        "admin_token": ADMIN_TOKEN,
        "temporal_ui_url": TEMPORAL_UI,
        "temporal_namespace": "default",
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@dataclass
class LiveServer:
    """A running api: its base URL and what it was built from."""

    url: str
    settings: Settings
    session_factory: SessionFactory


@contextmanager
def live_server(settings: Settings, engine: Engine) -> Iterator[LiveServer]:
    """``create_app`` served by uvicorn in a thread on a free port of 127.0.0.1."""
    session_factory = make_session_factory(engine)
    state = AppState(
        settings=settings,
        engine=engine,
        session_factory=session_factory,
        temporal=TemporalConnection(settings),
    )
    app = create_app(settings, state=state)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def started() -> None:
        assert server.started, "uvicorn has not started yet"
        assert thread.is_alive(), "uvicorn exited during startup"

    assert_eventually(started, timeout=30)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", settings, session_factory)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


@dataclass
class SeededDatabase:
    """The realistic loop history in its own database."""

    url: str
    engine: Engine
    session_factory: SessionFactory
    story: Story
    state_dir: Path


@pytest.fixture(scope="module")
def seeded_database(
    postgres_server_url: str, template_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SeededDatabase]:
    state_dir = tmp_path_factory.mktemp("dashboard-state")
    with cloned_database(postgres_server_url, template_database) as url:
        engine = create_db_engine(url, pool_size=4, application="ratchet-dashboard-tests")
        try:
            session_factory = make_session_factory(engine)
            with session_factory.begin() as session:
                story = seed_story(
                    session, now=dt.datetime.now(dt.UTC), artifacts_dir=state_dir / "artifacts"
                )
            yield SeededDatabase(url, engine, session_factory, story, state_dir)
        finally:
            engine.dispose()


@dataclass
class Seeded:
    server: LiveServer
    story: Story
    state_dir: Path


@pytest.fixture(scope="module")
def seeded(seeded_database: SeededDatabase) -> Iterator[Seeded]:
    """The realistic loop history, served by a real api."""
    settings = dashboard_settings(seeded_database.url, seeded_database.state_dir)
    with live_server(settings, seeded_database.engine) as server:
        yield Seeded(server, seeded_database.story, seeded_database.state_dir)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium for the whole module (starting one costs seconds)."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the dashboard tests need Debian's chromium "
            "(apt-get install -y chromium)"
        )
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@dataclass
class BrowserPage:
    """A page in a fresh browser context, with every console error and page error it saw."""

    page: Page
    errors: list[str]


@pytest.fixture
def browser_page(browser: Browser) -> Iterator[BrowserPage]:
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(f"console: {message.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    try:
        yield BrowserPage(page, errors)
    finally:
        context.close()


@pytest.fixture
def empty_server(database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    """An api over a database with no loops at all."""
    engine = create_db_engine(database_url, pool_size=2, application="ratchet-dashboard-tests")
    try:
        with live_server(dashboard_settings(database_url, tmp_path), engine) as server:
            yield server
    finally:
        engine.dispose()
