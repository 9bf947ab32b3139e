"""Backpressure: Postgres down or the queue full means 503 + Retry-After, health stays up."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg
from sqlalchemy.engine import make_url

from services.api.app import create_app
from services.api.state import AppState
from services.db.session import SessionFactory
from services.ingest.service import IngestService
from tests.conftest import with_database
from tests.services.api.support import (
    ADMIN,
    body_of,
    create_loop,
    existing_external_ids,
    make_trace,
    serve,
    signed_headers,
)
from tests.support import assert_eventually


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def post(http: httpx.Client, loop: dict[str, Any], trace: dict[str, Any]) -> httpx.Response:
    body = body_of(trace)
    return http.post(
        f"/v1/loops/{loop['name']}/traces",
        content=body,
        headers=signed_headers(loop["signing_secret"], body),
    )


@contextmanager
def database_refusing_connections(server_url: str, database_url: str) -> Iterator[None]:
    """Make the test database unreachable (new connections refused, open ones killed)."""
    name = make_url(database_url).database
    with psycopg.connect(_libpq(with_database(server_url, "postgres")), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        try:
            yield
        finally:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


def test_postgres_down_is_503_with_retry_after_and_health_stays_up(
    app_state: AppState,
    postgres_server_url: str,
    database_url: str,
    session_factory: SessionFactory,
) -> None:
    app = create_app(app_state.settings, state=app_state)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        loop = create_loop(http)
        assert post(http, loop, make_trace("before")).status_code == 200

        with database_refusing_connections(postgres_server_url, database_url):
            down = post(http, loop, make_trace("during"))
            assert down.status_code == 503, down.text
            assert down.headers["retry-after"] == "1"
            assert down.json()["error"]["code"] == "unavailable"
            assert http.get("/healthz").status_code == 200
            assert post(http, loop, make_trace("during-2")).status_code == 503

        after = assert_eventually(
            lambda: _accepted(post(http, loop, make_trace("after"))), timeout=30
        )
        assert after["results"][0]["status"] == "accepted"
    with session_factory() as session:
        loop_id = _loop_id(session_factory, loop["name"])
        found = existing_external_ids(
            session=session, loop_id=loop_id, external_ids=["before", "during", "during-2", "after"]
        )
    assert found == {"before", "after"}


def _accepted(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _loop_id(session_factory: SessionFactory, name: str) -> int:
    from services.db.queries.loops import require_loop

    with session_factory() as session:
        loop = require_loop(session=session, name=name)
        return loop.id


def test_a_full_queue_is_503_and_nothing_queued_is_lost(
    app_state: AppState, database_url: str, session_factory: SessionFactory
) -> None:
    settings = app_state.settings.model_copy(
        update={"ingest_queue_max": 1, "ingest_commit_max_wait_ms": 0}
    )
    state = AppState(
        settings=settings,
        engine=app_state.engine,
        session_factory=app_state.session_factory,
        temporal=app_state.temporal,
    )
    app = create_app(settings, state=state)
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        loop = create_loop(http)
        blocked: dict[str, httpx.Response] = {}
        # Hold a lock on the table so the writer's INSERT waits: the one queued trace fills
        # the queue (its request waits for the commit), the next request is refused.
        with psycopg.connect(_libpq(database_url)) as locker:
            locker.execute("LOCK TABLE traces IN EXCLUSIVE MODE")
            waiter = threading.Thread(
                target=lambda: blocked.update(first=post(http, loop, make_trace("queued")))
            )
            waiter.start()

            def one_trace_waits() -> None:
                service = state.ingest
                assert isinstance(service, IngestService) and service.writer.depth == 1

            assert_eventually(one_trace_waits, timeout=30)
            refused = post(http, loop, make_trace("refused"))
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert "queue is full" in refused.json()["error"]["message"]
            assert http.get("/healthz").status_code == 200
            assert "first" not in blocked  # not acknowledged while the commit cannot happen
        waiter.join(timeout=30)
        assert blocked["first"].status_code == 200
        assert blocked["first"].json()["accepted"] == 1
        assert http.get("/v1/loops/support-agent", headers=ADMIN).json()["trace_count"] == 1
