"""The CLI's commands against a real api (uvicorn) on a per-test database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.session import SessionFactory
from services.settings import Settings, get_settings
from tests.services.api.support import ADMIN_TOKEN, serve


@pytest.fixture
def api_url(
    database_url: str,
    engine: Engine,
    session_factory: SessionFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[str]:
    """The api's URL, with the CLI's settings (public URL, admin token) pointing at it."""
    settings = Settings(database_url=database_url, admin_token=ADMIN_TOKEN)
    state = AppState(settings, engine, session_factory, TemporalConnection(settings))
    with serve(create_app(settings, state=state)) as url:
        monkeypatch.setenv("RATCHET_PUBLIC_URL", url)
        monkeypatch.setenv("RATCHET_ADMIN_TOKEN", ADMIN_TOKEN)
        get_settings.cache_clear()
        yield url
    get_settings.cache_clear()
