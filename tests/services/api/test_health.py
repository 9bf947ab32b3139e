"""Readiness is "this process can serve"; dependency health is reported on its own."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.settings import Settings
from tests.services.api.support import body_of, make_trace, signed_headers


def test_the_api_stays_ready_while_temporal_is_down_and_says_so_elsewhere(
    client: TestClient, loop: dict[str, Any]
) -> None:
    # The test settings point at a Temporal address nothing listens on.
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    deps = client.get("/health/dependencies")
    assert deps.status_code == 503
    assert deps.json()["checks"]["postgres"] == "ok"
    assert deps.json()["checks"]["temporal"].startswith("unreachable")


def test_the_webhook_answers_503_with_retry_after_while_postgres_is_down(
    app_state: AppState, settings: Settings, loop: dict[str, Any]
) -> None:
    """With Postgres unreachable the pod stays ready, so senders get the retryable 503."""
    from sqlalchemy import create_engine

    from services.db.session import make_session_factory

    broken = Settings(database_url="postgresql://nobody@127.0.0.1:1/none", admin_token="t")
    engine = create_engine(broken.sqlalchemy_url(), connect_args={"connect_timeout": 1})
    state = AppState(
        settings=broken,
        engine=engine,
        session_factory=make_session_factory(engine),
        temporal=TemporalConnection(broken),
    )
    with TestClient(create_app(broken, state=state)) as client:
        assert client.get("/readyz").status_code == 200
        assert (
            client.get("/health/dependencies")
            .json()["checks"]["postgres"]
            .startswith("unreachable")
        )
        body = body_of(make_trace())
        response = client.post(
            f"/v1/loops/{loop['name']}/traces",
            content=body,
            headers=signed_headers(loop["signing_secret"], body),
        )
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"]
    engine.dispose()
