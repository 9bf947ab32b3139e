"""/metrics on its own port: not next to the webhook when RATCHET_API_METRICS_PORT is set."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.api.metrics_server import MetricsServer
from services.api.state import AppState


def test_the_api_port_does_not_serve_metrics_when_they_have_their_own(
    app_state: AppState,
) -> None:
    settings = app_state.settings.model_copy(update={"api_metrics_port": 9102})
    app_state.settings = settings
    with TestClient(create_app(settings, state=app_state)) as client:
        response = client.get("/metrics")
        assert response.status_code == 404
        assert "RATCHET_API_METRICS_PORT" in response.json()["error"]["message"]
        assert client.get("/healthz").status_code == 200


def test_the_metrics_server_serves_the_registry_and_nothing_else() -> None:
    server = MetricsServer("127.0.0.1", 0).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        response = httpx.get(f"{base}/metrics", timeout=5)
        assert response.status_code == 200
        assert "ratchet_http_requests_total" in response.text
        assert response.headers["content-type"].startswith("text/plain")
        assert httpx.get(f"{base}/v1/loops", timeout=5).status_code == 404
    finally:
        server.stop()
