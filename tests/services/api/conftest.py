"""Fixtures for api tests: the real app over a fresh test database, and a loop in it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.session import SessionFactory
from services.settings import Endpoint, ServingEndpoint, Settings
from tests.services.api.support import ADMIN_TOKEN, SECRET_KEY, create_loop

# The deployment's serving endpoints a loop may name (RATCHET_SERVING_ENDPOINTS).
SERVING_ENDPOINTS = {
    "vllm": ServingEndpoint(kind="openai", url="http://vllm.serving:8000"),
    "prod": ServingEndpoint(kind="kubernetes", url="http://prod:8000", deployment="prod"),
}


@pytest.fixture
def settings(database_url: str) -> Settings:
    return Settings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        secret_key=SECRET_KEY,
        serving_endpoints=SERVING_ENDPOINTS,
        judge_endpoints={"grader": Endpoint(url="http://127.0.0.1:9/v1")},
    )


@pytest.fixture
def app_state(settings: Settings, engine: Engine, session_factory: SessionFactory) -> AppState:
    return AppState(
        settings=settings,
        engine=engine,
        session_factory=session_factory,
        temporal=TemporalConnection(settings),
    )


@pytest.fixture
def client(settings: Settings, app_state: AppState) -> Iterator[TestClient]:
    with TestClient(create_app(settings, state=app_state)) as test_client:
        yield test_client


@pytest.fixture
def loop(client: TestClient) -> dict[str, Any]:
    """A created loop with its signing secret and ingest token."""
    return create_loop(client)
