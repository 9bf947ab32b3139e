"""The gateway's upstream client against a scripted HTTP/1.1 server on a real socket: each
framing of an answer, connections kept alive and reused, one closed by the peer while idle
retried on a new one, an abandoned answer closing its connection, and each failure named
(refused, timed out, cut off); and server-sent events split as they arrive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from services.gateway import upstream
from services.gateway.forward import split_events
from services.gateway.upstream import (
    ConnectFailed,
    Disconnected,
    TimedOut,
    UpstreamClient,
    target_of,
)
from tests.services.api.support import free_port

Reply = Callable[[asyncio.StreamWriter, int], Awaitable[None]]  # n: the connection's nth request


@dataclass
class Scripted:
    """A server answering each request with ``reply``; counts connections and requests."""

    reply: Reply
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                await self.reply(writer, served)
                served += 1
                if writer.is_closing():
                    break
        finally:
            writer.close()
            self.closed.set()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Reply], Awaitable[Scripted]]]:
    servers: list[asyncio.Server] = []

    async def start(reply: Reply) -> Scripted:
        scripted = Scripted(reply)
        port = free_port()
        servers.append(await asyncio.start_server(scripted.handle, "127.0.0.1", port))
        scripted.url = f"http://127.0.0.1:{port}/v1/chat"
        return scripted

    yield start
    for server in servers:
        server.close()


def fixed(data: bytes) -> Reply:
    async def reply(writer: asyncio.StreamWriter, _: int) -> None:
        writer.write(data)
        await writer.drain()

    return reply


SIZED = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{"a":1}'
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Ratchet-Model-Version: 7\r\n\r\n"
    b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n"
)


async def test_a_sized_answer_is_read_and_its_connection_reused(serve: Callable[..., Any]) -> None:
    server = await serve(fixed(SIZED))
    client = UpstreamClient(timeout_s=5)
    for _ in range(3):
        response = await client.request(
            "POST", server.url, body=b'{"q":1}', headers={"content-type": "application/json"}
        )
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert await response.read() == b'{"a":1}'
        await response.aclose()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat HTTP/1.1\r\n")
    assert b"host: 127.0.0.1:" in first and b"content-length: 7" in first
    assert first.endswith(b'\r\n\r\n{"q":1}')
    await client.aclose()


async def test_a_chunked_answer_comes_in_its_chunks_with_names_lower_case(
    serve: Callable[..., Any],
) -> None:
    server = await serve(fixed(CHUNKED))
    client = UpstreamClient(timeout_s=5)
    response = await client.request("GET", server.url, body=None, headers={})
    assert response.headers["x-ratchet-model-version"] == "7"
    assert [chunk async for chunk in response.chunks()] == [b"hello", b" world"]
    await response.aclose()
    again = await client.request("GET", server.url, body=None, headers={})
    assert await again.read() == b"hello world"
    await again.aclose()
    assert server.connections == 1  # read to the end: kept alive
    await client.aclose()


async def test_an_answer_to_the_end_of_the_connection_is_not_reused(
    serve: Callable[..., Any],
) -> None:
    async def reply(writer: asyncio.StreamWriter, _: int) -> None:
        writer.write(b"HTTP/1.1 502 Bad Gateway\r\nconnection: close\r\n\r\nno upstream")
        await writer.drain()
        writer.close()

    server = await serve(reply)
    client = UpstreamClient(timeout_s=5)
    for _ in range(2):
        response = await client.request("GET", server.url, body=None, headers={})
        assert response.status_code == 502
        assert await response.read() == b"no upstream"
        await response.aclose()
    assert server.connections == 2
    await client.aclose()


async def test_a_connection_the_peer_closes_as_it_is_reused_is_retried_on_a_new_one(
    serve: Callable[..., Any],
) -> None:
    async def reply(writer: asyncio.StreamWriter, served: int) -> None:
        if served == 0:
            writer.write(SIZED)
            await writer.drain()
        else:  # its keep-alive time ran out as the request came: closed, no answer
            writer.close()

    server = await serve(reply)
    client = UpstreamClient(timeout_s=5)
    for _ in range(2):
        response = await client.request("POST", server.url, body=b"{}", headers={})
        assert await response.read() == b'{"a":1}'
        await response.aclose()
    assert server.connections == 2 and len(server.requests) == 3
    await client.aclose()


async def test_an_abandoned_answer_closes_its_connection(serve: Callable[..., Any]) -> None:
    async def reply(writer: asyncio.StreamWriter, _: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()  # and never the rest: a model still generating

    server = await serve(reply)
    client = UpstreamClient(timeout_s=5)
    response = await client.request("POST", server.url, body=b"{}", headers={})
    chunks = response.chunks()
    assert await anext(chunks) == b"first"
    await chunks.aclose()
    await response.aclose()  # the agent hung up
    await asyncio.wait_for(server.closed.wait(), 5)  # the upstream sees the connection end
    assert client._idle == {} or all(not idle for idle in client._idle.values())
    await client.aclose()


async def test_failures_are_named_refused_timed_out_and_cut_off(
    serve: Callable[..., Any],
) -> None:
    client = UpstreamClient(timeout_s=0.3)
    with pytest.raises(ConnectFailed):
        await client.request("GET", f"http://127.0.0.1:{free_port()}/v1", body=None, headers={})

    async def silent(writer: asyncio.StreamWriter, _: int) -> None:
        await asyncio.sleep(5)

    quiet = await serve(silent)
    with pytest.raises(TimedOut):
        await client.request("GET", quiet.url, body=None, headers={})

    cut = await serve(fixed(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"))
    response = await client.request("GET", cut.url, body=None, headers={})
    with pytest.raises(TimedOut):  # 7 bytes never come
        await response.read()
    await response.aclose()

    async def hang_up(writer: asyncio.StreamWriter, _: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        writer.close()

    broken = await serve(hang_up)
    response = await client.request("GET", broken.url, body=None, headers={})
    with pytest.raises(Disconnected):
        await response.read()
    await response.aclose()

    garbage = await serve(fixed(b"SSH-2.0-OpenSSH\r\n\r\n"))
    with pytest.raises(Disconnected):
        await client.request("GET", garbage.url, body=None, headers={})
    await client.aclose()


def test_urls_become_targets_with_default_ports_and_queries() -> None:
    target = target_of("https://api.example.com/v1/models?x=1")
    assert (target.scheme, target.host, target.port) == ("https", "api.example.com", 443)
    assert (target.host_header, target.path) == ("api.example.com", "/v1/models?x=1")
    assert target_of("http://[::1]:8000/v1").host_header == "[::1]:8000"
    with pytest.raises(ValueError, match="not an http"):
        target_of("ftp://example.com/")


def test_events_are_split_as_they_arrive_whatever_the_line_endings() -> None:
    payloads, rest = split_events(b'data: {"a":1}\n\ndata: [DONE]\n\ndata: {"b"')
    assert (payloads, rest) == ([b'{"a":1}', b"[DONE]"], b'data: {"b"')
    payloads, rest = split_events(b"event: x\r\ndata: 1\r\n\r\n: comment\r\n\r\ndata:2\r")
    assert (payloads, rest) == ([b"1"], b"data:2\r")
    payloads, rest = split_events(rest + b"\n\r\n")
    assert (payloads, rest) == ([b"2"], b"")


def test_idle_connections_expire_before_the_servers_keep_alive() -> None:
    assert upstream.KEEPALIVE_S < 5  # uvicorn's default, which ratchet serve and vLLM keep
