"""Limits outside the ingest doors: bodies are capped before any route or auth sees them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi.testclient import TestClient

from services.cli.stack import uvicorn_options
from services.settings import Settings
from tests.services.api.support import ADMIN, body_of, make_trace, signed_headers

MIB = 1024 * 1024


def chunked(data: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_an_admin_body_over_the_cap_is_413_with_or_without_a_token(client: TestClient) -> None:
    big = b'{"name": "' + b"x" * (2 * MIB) + b'"}'
    for headers in (ADMIN, {}):
        response = client.post("/v1/loops", content=big, headers=headers)
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "body_too_large"
        # Without Content-Length (chunked): refused while it streams in.
        response = client.post("/v1/loops", content=chunked(big), headers=headers)
        assert response.status_code == 413, response.text
    response = client.post("/v1/loops", content=b"{}", headers={**ADMIN, "content-length": "x"})
    assert response.status_code == 400


def test_the_ingest_doors_keep_their_own_larger_limit(
    client: TestClient, loop: dict[str, Any], settings: Settings
) -> None:
    assert settings.ingest_max_body_bytes > settings.api_max_body_bytes
    trace = make_trace(metadata={"padding": "x" * (settings.api_max_body_bytes + 1000)})
    body = body_of(trace)
    response = client.post(
        f"/v1/loops/{loop['name']}/traces",
        content=body,
        headers=signed_headers(loop["signing_secret"], body),
    )
    assert response.status_code != 413, response.text


def test_uvicorn_bounds_connections_and_idle_time() -> None:
    options = uvicorn_options(Settings(api_limit_concurrency=50, api_timeout_keep_alive_s=3))
    assert options["limit_concurrency"] == 50 and options["timeout_keep_alive"] == 3


def test_a_webhook_body_of_many_gzip_members_is_refused_without_inflating_them(
    client: TestClient, loop: dict[str, Any]
) -> None:
    """200k empty gzip members with a made-up signature: refused at the 65th member (400),
    where the api used to inflate all of them (36 s of event loop) before answering 401."""
    import gzip

    body = gzip.compress(b"") * 200_000
    headers = signed_headers("whsec_" + "C" * 43, b"made up")
    headers["content-encoding"] = "gzip"
    response = client.post(f"/v1/loops/{loop['name']}/traces", content=body, headers=headers)
    assert response.status_code == 400, response.text
    assert "more than 64 members" in response.json()["error"]["message"]
