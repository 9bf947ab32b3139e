"""Nothing an agent was answered for is lost: the spool survives a ``kill -9`` of the gateway
process, and Postgres down for 30 s costs agents nothing and the spool nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import openai
import psycopg
import pytest
from sqlalchemy import Engine, select

from services.db.models import GatewayCall
from services.db.queries.loops import LoopFields
from services.db.session import SessionFactory
from services.ingest.provisioning import provision_loop
from services.modelserver.registry import ModelRegistry
from services.secrets import SecretBox
from tests.services.api.support import REPO, SECRET_KEY, free_port
from tests.services.gateway.conftest import MODEL, Uvicorn, gateway_settings
from tests.services.modelserver.conftest import ServerThread, path_of, write_checkpoint
from tests.support import assert_eventually

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def model_server(tmp_path: Path) -> Iterator[ServerThread]:
    registry = ModelRegistry(device="cpu")
    registry.load(MODEL, path_of(write_checkpoint(tmp_path / "tiny", 0)))
    with ServerThread(registry) as server:
        yield server


@pytest.fixture
def gateway_key(session_factory: SessionFactory) -> str:
    with session_factory.begin() as session:
        created = provision_loop(
            session,
            fields=LoopFields(
                name="durable",
                environment="toolcalc",
                serving_target={"kind": "local", "model": MODEL},
            ),
            box=SecretBox.from_keys(SECRET_KEY),
        )
        return created.gateway_key


def stored_ids(session_factory: SessionFactory) -> list[str]:
    with session_factory() as session:
        return list(session.scalars(select(GatewayCall.call_id)).all())


def answered_calls(base_url: str, key: str, count: int) -> list[str]:
    """``count`` calls answered by the gateway; their ids (X-Ratchet-Call-Id)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
    ids = []
    for _ in range(count):
        raw = client.chat.completions.with_raw_response.create(
            model="m",
            messages=HELLO,  # type: ignore[arg-type]
            max_tokens=3,
        )
        raw.parse()
        ids.append(raw.headers["x-ratchet-call-id"])
    return ids


class GatewayProcess:
    """``python -m services gateway`` as a user runs it."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = int(env["RATCHET_GATEWAY_PORT"])
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services", "gateway"],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

        def ready() -> None:
            assert self.process.poll() is None, log.read_text()[-2000:]
            try:
                assert httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            except httpx.TransportError as exc:
                raise AssertionError(str(exc)) from exc

        assert_eventually(ready, timeout=60, interval=0.2)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        self._log.close()


def test_the_spool_survives_a_kill_9_of_the_gateway(
    database_url: str,
    session_factory: SessionFactory,
    gateway_key: str,
    model_server: ServerThread,
    tmp_path: Path,
) -> None:
    env = {
        "RATCHET_DATABASE_URL": database_url,
        "RATCHET_STATE_DIR": str(tmp_path / "state"),
        "RATCHET_GATEWAY_PORT": str(free_port()),
        "RATCHET_GATEWAY_SPOOL_DIR": str(tmp_path / "spool"),
        "RATCHET_SERVE_HOST": "127.0.0.1",
        "RATCHET_SERVE_PORT": str(model_server.port),
        "RATCHET_LOG_LEVEL": "WARNING",
    }
    gateway = GatewayProcess(env, tmp_path / "gateway.log")
    libpq = database_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        # Hold the table, so the writer cannot drain: every answered call is in the spool only.
        with psycopg.connect(libpq) as blocker:
            blocker.execute("LOCK TABLE gateway_calls IN ACCESS EXCLUSIVE MODE")
            answered = answered_calls(gateway.url, gateway_key, 12)
            gateway.kill()
            blocker.rollback()
        assert stored_ids(session_factory) == []
        gateway = GatewayProcess(env, tmp_path / "gateway.log")

        def drained() -> None:
            assert sorted(stored_ids(session_factory)) == sorted(answered)

        assert_eventually(drained, timeout=60, interval=0.2)
    finally:
        gateway.stop()


class PostgresProxy:
    """A TCP port in front of Postgres's socket that can be cut (every connection closed,
    new ones refused) and restored: Postgres down, as the gateway sees it."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            listener.close()
        with self._lock:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
                connection.close()
            self._connections.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.socket_path)
            with self._lock:  # cut() holds it while it closes what is open
                if self._listener is not listener:  # cut meanwhile: Postgres is down
                    client.close()
                    upstream.close()
                    return
                self._connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                with contextlib.suppress(OSError):
                    end.close()


def _proxied(database_url: str, proxy: PostgresProxy) -> str:
    parsed = urlparse(database_url)
    user = parsed.username or "postgres"
    return f"postgresql://{user}@127.0.0.1:{proxy.port}{parsed.path}"


def _socket_path(database_url: str) -> str | None:
    host = parse_qs(urlparse(database_url).query).get("host", [None])[0]
    return f"{host}/.s.PGSQL.{urlparse(database_url).port or 5432}" if host else None


def test_postgres_down_for_30_s_loses_nothing(
    database_url: str,
    engine: Engine,
    session_factory: SessionFactory,
    gateway_key: str,
    model_server: ServerThread,
    tmp_path: Path,
) -> None:
    path = _socket_path(database_url)
    if path is None:
        pytest.skip("the test Postgres is not on a local socket this test can cut")
    proxy = PostgresProxy(path)
    settings = gateway_settings(_proxied(database_url, proxy), tmp_path, model_server.port)
    from services.gateway.server import build_gateway

    gateway = Uvicorn(build_gateway(settings)).start()
    try:
        answered = answered_calls(gateway.url, gateway_key, 2)
        assert_eventually(lambda: _all_stored(session_factory, answered), timeout=30)
        proxy.cut()
        down_until = time.monotonic() + 30
        while time.monotonic() < down_until:
            answered += answered_calls(gateway.url, gateway_key, 1)  # answered while down
            time.sleep(0.5)
        assert not set(answered) <= set(stored_ids(session_factory))
        proxy.restore()
        assert_eventually(lambda: _all_stored(session_factory, answered), timeout=60, interval=0.2)
        assert len(stored_ids(session_factory)) == len(answered)
    finally:
        gateway.stop()
        proxy.cut()


def _all_stored(session_factory: SessionFactory, ids: list[str]) -> Any:
    stored = set(stored_ids(session_factory))
    missing = [i for i in ids if i not in stored]
    assert not missing, f"{len(missing)} answered calls are not in Postgres yet"
