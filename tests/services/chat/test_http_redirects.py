"""A key sent to an endpoint never follows a redirect to another origin (issue 43, item 8).

Two real HTTP servers on loopback: the endpoint the client is configured with, which
redirects, and another origin (another port) that records every header it receives. On
main, ``urllib`` followed the endpoint's 302 and handed the other origin the judge's and the
rollout server's ``Authorization``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.environments.replay.judge import Judge, JudgeEndpoint, JudgeError
from services.inference.remote import RemoteBackend, RemoteClient, RemoteError

KEY = "sk-endpoint-secret"
ANSWER = {"choices": [{"message": {"content": "PASS"}}], "usage": {}}


@dataclass
class Origin:
    """A server that redirects POSTs to ``redirect_to`` (when set) or answers ANSWER, and
    keeps the Authorization header of every request."""

    server: ThreadingHTTPServer
    redirect_to: str | None = None
    seen: list[str | None] = field(default_factory=list)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"


def serve(origin_box: list[Origin]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            origin = origin_box[0]
            origin.seen.append(self.headers.get("Authorization"))
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            if origin.redirect_to is not None and not self.path.startswith("/moved"):
                self.send_response(302)
                self.send_header("Location", origin.redirect_to + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = json.dumps(ANSWER).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self._answer()

        def log_message(self, format: str, *args: object) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def origins() -> Iterator[tuple[Origin, Origin]]:
    made: list[Origin] = []
    for _ in range(2):
        box: list[Origin] = []
        origin = Origin(serve(box))
        box.append(origin)
        threading.Thread(target=origin.server.serve_forever, daemon=True).start()
        made.append(origin)
    try:
        yield made[0], made[1]
    finally:
        for origin in made:
            origin.server.shutdown()
            origin.server.server_close()


def judge(url: str) -> Judge:
    return Judge(JudgeEndpoint(url=url, api_key=KEY, timeout_s=5), requests_per_minute=6000)


def ask(client: Judge) -> None:
    client.verdict(task_id="t", conversation="c", answer="a", rubric="r", model="m")


def test_the_judge_refuses_a_redirect_to_another_origin(origins: tuple[Origin, Origin]) -> None:
    endpoint, elsewhere = origins
    endpoint.redirect_to = elsewhere.url
    with pytest.raises(JudgeError, match="another origin"):
        ask(judge(endpoint.url))
    assert endpoint.seen == [f"Bearer {KEY}"]
    assert elsewhere.seen == []  # the key never reached the other origin


def test_the_rollout_client_refuses_a_redirect_to_another_origin(
    origins: tuple[Origin, Origin],
) -> None:
    endpoint, elsewhere = origins
    endpoint.redirect_to = elsewhere.url
    client = RemoteClient(RemoteBackend(url=endpoint.url, model="m", api_key=KEY, timeout_s=5))
    with pytest.raises(RemoteError, match="another origin"):
        client.post("/v1/chat/completions", {"model": "m"})
    assert elsewhere.seen == []


def test_a_redirect_within_the_origin_is_followed_with_the_key(
    origins: tuple[Origin, Origin],
) -> None:
    endpoint, _ = origins
    endpoint.redirect_to = endpoint.url + "/moved"
    ask(judge(endpoint.url))
    assert endpoint.seen == [f"Bearer {KEY}", f"Bearer {KEY}"]
