"""The gateway's ASGI app driven directly, in front of a scripted upstream on a real socket:
an agent that hangs up mid-stream cancels the upstream request (the upstream sees its
connection close), and a whole stream is answered and captured before its end is sent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from services.gateway.app import GatewayApp, GatewayParts
from services.gateway.capture import CapturedCall
from services.gateway.keys import GatewayLoop, KeyTable
from services.gateway.routing import Route
from services.gateway.upstream import UpstreamClient
from services.ingest.credentials import hash_token
from services.loop.states import LoopLifecycle
from tests.services.api.support import free_port

KEY = "rgk_test"
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(content: str) -> bytes:
    payload = {"id": "c1", "choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class Upstream:
    """Answers a streamed chat completion with one event, then the rest only if ``finish``."""

    def __init__(self, *, finish: bool) -> None:
        self.finish = finish
        self.closed = asyncio.Event()
        self.port = free_port()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        writer.write(HEAD + chunk(event("Hel")))
        if self.finish:
            writer.write(chunk(event("lo") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the gateway closes the connection
        self.closed.set()
        writer.close()


def gateway_parts(port: int, record: Callable[[CapturedCall], None]) -> GatewayParts:
    route = Route("serving", f"http://127.0.0.1:{port}/v1", None, "m", token_ids=False)
    loop = GatewayLoop(1, "l", LoopLifecycle.ACTIVE, route, None)
    return GatewayParts(
        keys=KeyTable(lambda: {hash_token(KEY): loop}, refresh_s=60),
        client=UpstreamClient(timeout_s=5),
        record=record,
        max_body_bytes=1 << 20,
        serve_metrics=False,
    )


async def _call(app: GatewayApp, hang_up: asyncio.Event, sent: list[dict[str, Any]]) -> None:
    body = json.dumps(
        {"model": "x", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body.encode(), "more_body": False}
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", f"Bearer {KEY}".encode())],
    }
    await app(scope, receive, send)  # type: ignore[arg-type]


async def test_an_agent_that_hangs_up_mid_stream_cancels_the_upstream_request() -> None:
    captured: list[CapturedCall] = []
    upstream = Upstream(finish=False)
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", upstream.port)
    gateway = gateway_parts(upstream.port, captured.append)
    await gateway.keys.refresh()
    hang_up, sent = asyncio.Event(), []
    try:
        call = asyncio.ensure_future(_call(GatewayApp(gateway), hang_up, sent))
        while not any(m.get("body") for m in sent):
            await asyncio.sleep(0.01)  # the first event reached the agent
        hang_up.set()
        await asyncio.wait_for(call, 5)  # the request ends, without an error
        await asyncio.wait_for(upstream.closed.wait(), 5)  # and the upstream saw it end
    finally:
        server.close()
        await gateway.client.aclose()
    assert b"Hel" in sent[1]["body"]
    assert not any(m.get("more_body") is False for m in sent[2:])  # no end was sent
    assert captured == []  # the answer never ended: nothing to capture


async def test_a_whole_stream_is_captured_before_its_end_is_sent() -> None:
    captured: list[CapturedCall] = []
    sent: list[dict[str, Any]] = []

    def record(call: CapturedCall) -> None:
        captured.append(call)
        sent.append({"type": "captured"})

    upstream = Upstream(finish=True)
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", upstream.port)
    gateway = gateway_parts(upstream.port, record)
    await gateway.keys.refresh()
    try:
        await asyncio.wait_for(_call(GatewayApp(gateway), asyncio.Event(), sent), 5)
    finally:
        server.close()
        await gateway.client.aclose()
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert body.count(b"data: ") == 3 and body.endswith(b"data: [DONE]\n\n")
    done = next(i for i, m in enumerate(sent) if b"[DONE]" in m.get("body", b""))
    assert sent.index({"type": "captured"}) < done
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert len(captured) == 1 and captured[0].reply["content"] == "Hello"
