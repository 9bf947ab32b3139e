"""Fixtures for the capture gateway's tests: a real model server (the tiny family taught to
call tools), the api, and the gateway under uvicorn on real sockets, over a fresh database."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from sqlalchemy import Engine, select

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.models import GatewayCall, GatewaySession, Trace
from services.db.session import SessionFactory
from services.gateway.app import GatewayApp
from services.gateway.server import build_gateway
from services.modelserver.registry import ModelRegistry
from services.serving.base import CheckpointRef
from services.settings import Endpoint, Settings
from tests.services.api.support import ADMIN_TOKEN, SECRET_KEY, create_loop, free_port
from tests.services.modelserver.conftest import (  # noqa: F401 (fixtures)
    ServerThread,
    path_of,
    tool_calling_tiny,
)
from tests.support import assert_eventually

MODEL = "agent"


class Uvicorn:
    """An ASGI app under uvicorn in a thread, on a port of its own, until ``stop``."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> Uvicorn:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def model_server(tool_calling_tiny: CheckpointRef) -> Iterator[ServerThread]:  # noqa: F811
    """`ratchet serve`'s app on a real socket, serving the tool-calling tiny GPT as ``agent``."""
    registry = ModelRegistry(device="cpu")
    registry.load(MODEL, path_of(tool_calling_tiny))
    with ServerThread(registry) as server:
        yield server


@dataclass
class Stack:
    """The api and the gateway over one database, and a loop served by ``model_server``."""

    settings: Settings
    api: str
    gateway: Uvicorn
    gateway_app: GatewayApp
    loop: dict[str, Any]
    session_factory: SessionFactory

    @property
    def key(self) -> str:
        return str(self.loop["gateway_key"])

    def openai(self, key: str | None = None, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.gateway.url}/v1", api_key=key or self.key, max_retries=0, **options
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.api, timeout=30)

    def calls(self) -> list[GatewayCall]:
        with self.session_factory() as session:
            return list(session.scalars(select(GatewayCall).order_by(GatewayCall.id)).all())

    def sessions(self) -> list[GatewaySession]:
        with self.session_factory() as session:
            return list(session.scalars(select(GatewaySession).order_by(GatewaySession.id)).all())

    def traces(self) -> list[Trace]:
        with self.session_factory() as session:
            rows = session.scalars(
                select(Trace).where(Trace.source == "gateway").order_by(Trace.id)
            ).all()
            return list(rows)

    def wait_stored(self, count: int) -> list[GatewayCall]:
        def stored() -> None:
            assert len(self.calls()) >= count

        assert_eventually(stored, timeout=30, interval=0.05)
        return self.calls()

    def wait_placed(self, count: int) -> list[GatewaySession]:
        """Wait until ``count`` calls are stored and placed into sessions (the assembler runs
        every second in the gateway)."""

        def placed() -> None:
            calls = self.calls()
            assert len(calls) >= count and all(c.session_id is not None for c in calls)

        assert_eventually(placed, timeout=30, interval=0.1)
        return self.sessions()


def gateway_settings(
    database_url: str, tmp_path: Path, serve_port: int, **overrides: Any
) -> Settings:
    fields: dict[str, Any] = {
        "database_url": database_url,
        "admin_token": ADMIN_TOKEN,
        "secret_key": SECRET_KEY,
        "state_dir": tmp_path / "state",
        "serve_host": "127.0.0.1",
        "serve_port": serve_port,
        "gateway_spool_dir": tmp_path / "spool",
        "gateway_session_idle_s": 3600.0,
        "gateway_key_refresh_s": 0.5,
        "gateway_upstreams": {"hosted": Endpoint(url="http://127.0.0.1:9/v1", api_key="sk-held")},
        **overrides,
    }
    return Settings(**fields)


@pytest.fixture
def stack(
    database_url: str,
    engine: Engine,
    session_factory: SessionFactory,
    model_server: ServerThread,
    tmp_path: Path,
) -> Iterator[Stack]:
    settings = gateway_settings(database_url, tmp_path, model_server.port)
    state = AppState(
        settings=settings,
        engine=engine,
        session_factory=session_factory,
        temporal=TemporalConnection(settings),
    )
    api = Uvicorn(create_app(settings, state=state)).start()
    with httpx.Client(base_url=api.url) as http:
        loop = create_loop(http, "gw-agent", serving_target={"kind": "local", "model": MODEL})
    app = build_gateway(settings)
    gateway = Uvicorn(app).start()
    try:
        yield Stack(settings, api.url, gateway, app, loop, session_factory)
    finally:
        gateway.stop()
        api.stop()
