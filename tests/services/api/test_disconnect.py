"""A client that hangs up mid-body is not a server error."""

from __future__ import annotations

import socket
from typing import Any

from services.api.app import create_app
from services.api.state import AppState
from services.metrics import REGISTRY
from tests.services.api.support import serve, signed_headers
from tests.support import assert_eventually

ROUTE = "/v1/loops/{loop}/traces"


def count(status: str) -> float:
    labels = {"route": ROUTE, "method": "POST", "status": status}
    return REGISTRY.get_sample_value("ratchet_http_requests_total", labels) or 0.0


def test_a_client_that_hangs_up_mid_body_is_a_499_not_a_500(
    app_state: AppState, loop: dict[str, Any]
) -> None:
    app = create_app(app_state.settings, state=app_state)
    before_500, before_499 = count("500"), count("499")
    with serve(app) as url:
        host, port = url.removeprefix("http://").split(":")
        headers = signed_headers(loop["signing_secret"], b"{}" * 10)
        head = f"POST /v1/loops/{loop['name']}/traces HTTP/1.1\r\nhost: {host}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        head += "content-length: 100000\r\n\r\n"
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + b'{"schema": ')

        def answered_499() -> None:
            assert count("499") == before_499 + 1

        assert_eventually(answered_499, timeout=10)
    assert count("500") == before_500
