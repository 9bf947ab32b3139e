"""The gateway's HTTP/1.1 client for its upstreams: kept-alive connections, nothing else.

Why not httpx, which the gateway used first: profiled under the benchmark's load (64
streaming agents, docs/gateway.md), httpx took 60% of the event loop's CPU, 46% of it in
its connection pool choosing a connection: on every request httpcore walks every pooled
connection and polls each one's socket for readability (a system call per connection per
request), so the cost grows with the number of agents in flight. The gateway needs little
of a general client: one request at a time per connection, a body it already holds, an
answer read as it arrives, no redirects, no cookies, no proxies, no compression.

- **Pool.** Idle connections per origin in a stack (the most recently used first); one is
  taken only if the peer has not closed it and it has been idle less than
  :data:`KEEPALIVE_S` (under the 5 s that uvicorn, hence ``ratchet serve`` and vLLM, keeps
  an idle connection). A request that fails on a reused connection before any byte of the
  answer came (the peer closed it meanwhile) is sent once more on a new connection.
- **Framing.** Answers by ``Content-Length``, ``Transfer-Encoding: chunked`` or to the end
  of the connection; ``Accept-Encoding: identity`` is asked, so bodies are never
  compressed. A connection goes back to the pool only once its answer was read to the end
  and the peer did not ask to close it; an answer abandoned mid-way (a hung-up agent)
  closes its connection, which tells the upstream to stop generating.
- **Timeouts.** ``connect_timeout_s`` to connect; ``timeout_s`` for each wait on the
  upstream after that (its headers, each piece of its body, a full send buffer).
- **TLS** for ``https`` upstreams with httpx's default context (certifi's roots), as before.

Errors are :class:`ConnectFailed` (no connection: refused, unresolvable, timed out),
:class:`Disconnected` (the connection broke, or the answer is not HTTP) and
:class:`TimedOut` (connected, then no answer in time).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

KEEPALIVE_S = 4.0
MAX_HEAD_BYTES = 64 * 1024
READ_BYTES = 64 * 1024
_STREAM_LIMIT = 1024 * 1024  # the longest line readuntil accepts (a chunk-size line)


class UpstreamError(Exception):
    """A request to an upstream that did not get a whole answer."""


class ConnectFailed(UpstreamError):
    """No connection to the upstream could be made."""


class Disconnected(UpstreamError):
    """The connection broke, or what came back is not an HTTP/1.1 answer."""


class TimedOut(UpstreamError):
    """Connected, and then the upstream did not answer (or send on) in time."""


@dataclass(frozen=True)
class Target:
    """Where a URL points: the pool key (scheme, host, port) and what the request line and
    the ``Host`` header say."""

    scheme: str
    host: str
    port: int
    host_header: str
    path: str


@lru_cache(maxsize=1024)
def target_of(url: str) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    default = 443 if parts.scheme == "https" else 80
    port = parts.port or default
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, host, port, shown if port == default else f"{shown}:{port}", path)


@dataclass(eq=False)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False
    idle_since: float = 0.0

    def usable(self, now: float) -> bool:
        return (
            not self.writer.is_closing()
            and not self.reader.at_eof()
            and now - self.idle_since < KEEPALIVE_S
        )

    def close(self) -> None:
        self.writer.close()


@dataclass(eq=False)
class Response:
    """An upstream's answer: status and headers (names lower-case), the body still to come.
    Read it with :meth:`read` or :meth:`chunks`, and :meth:`aclose` it in every case."""

    status_code: int
    headers: dict[str, str]
    _client: UpstreamClient
    _target: Target
    _connection: _Connection | None
    _length: int | None  # Content-Length; None when chunked or to the end
    _chunked: bool
    _keep_alive: bool
    _done: bool = False
    _released: bool = field(default=False)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive (chunked framing removed)."""
        connection = self._connection
        if self._done or connection is None:
            return
        if self._chunked:
            pieces = _chunked(connection.reader, self._client.timeout_s)
        elif self._length is not None:
            pieces = _sized(connection.reader, self._client.timeout_s, self._length)
        else:
            pieces = _to_end(connection.reader, self._client.timeout_s)
            self._keep_alive = False
        try:
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    yield piece
        except TimeoutError:
            raise TimedOut("the upstream stopped sending its answer") from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            name = type(exc).__name__
            raise Disconnected(f"the answer's body is cut or malformed ({name})") from None
        except OSError as exc:
            raise Disconnected(f"the connection broke ({type(exc).__name__})") from None
        self._done = True

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body (or, past ``limit`` bytes, what came so far, the rest unread)."""
        data = bytearray()
        async with contextlib.aclosing(self.chunks()) as chunks:
            async for chunk in chunks:
                data += chunk
                if limit is not None and len(data) > limit:
                    break
        return bytes(data)

    async def aclose(self) -> None:
        """Give the connection back (an answer read to the end) or close it."""
        if self._released:
            return
        self._released = True
        connection, self._connection = self._connection, None
        self._client._release(self._target, connection, reusable=self._done and self._keep_alive)


class UpstreamClient:
    """See the module docstring. One per process; :meth:`aclose` closes its connections."""

    def __init__(
        self,
        *,
        timeout_s: float,
        connect_timeout_s: float = 10.0,
        max_connections: int = 1024,
        user_agent: str = "ratchet-gateway",
    ) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self._user_agent = user_agent
        self._idle: dict[tuple[str, str, int], deque[_Connection]] = {}
        self._in_flight: asyncio.Semaphore | None = None
        self._ssl: ssl.SSLContext | None = None

    async def request(
        self, method: str, url: str, *, body: bytes | None, headers: Mapping[str, str]
    ) -> Response:
        """Send the request; the answer once its headers came, its body still to be read."""
        target = target_of(url)
        head = self._head(method, target, body, headers)
        if self._in_flight is None:
            self._in_flight = asyncio.Semaphore(self.max_connections)
        if self._in_flight.locked():
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._in_flight.acquire()
            except TimeoutError:
                raise TimedOut("no connection to the upstream came free in time") from None
        else:
            await self._in_flight.acquire()
        try:
            while True:
                connection = await self._connection(target)
                try:
                    return await self._exchange(connection, target, head, body)
                except _Stale:
                    connection.close()  # closed by the peer while idle: once more, anew
                except BaseException:
                    connection.close()
                    raise
        except BaseException:
            self._in_flight.release()
            raise

    def _head(
        self, method: str, target: Target, body: bytes | None, headers: Mapping[str, str]
    ) -> bytes:
        lines = [
            f"{method} {target.path} HTTP/1.1",
            f"host: {target.host_header}",
            f"user-agent: {self._user_agent}",
            "accept-encoding: identity",
        ]
        if body is not None:
            lines.append(f"content-length: {len(body)}")
        lines += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _connection(self, target: Target) -> _Connection:
        idle = self._idle.get((target.scheme, target.host, target.port))
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable(now):
                connection.reused = True
                return connection
            connection.close()
        ssl_context = self._ssl_context() if target.scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    target.host,
                    target.port,
                    ssl=ssl_context,
                    server_hostname=target.host if ssl_context is not None else None,
                    limit=_STREAM_LIMIT,
                )
        except TimeoutError:
            raise ConnectFailed("connecting timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from None
        return _Connection(reader, writer)

    async def _exchange(
        self, connection: _Connection, target: Target, head: bytes, body: bytes | None
    ) -> Response:
        reader, writer = connection.reader, connection.writer
        try:
            writer.write(head + body if body else head)
            async with asyncio.timeout(self.timeout_s):
                await writer.drain()
                while True:
                    raw = await reader.readuntil(b"\r\n\r\n")
                    status, headers = _parse_head(raw)
                    if status >= 200:
                        break  # a 1xx answer (100 Continue) comes before the answer
            chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            length = None if chunked else _content_length(headers)
        except TimeoutError:
            raise TimedOut("the upstream did not answer in time") from None
        except asyncio.IncompleteReadError as exc:
            if connection.reused and not exc.partial:
                raise _Stale from None
            raise Disconnected("the upstream closed the connection without an answer") from None
        except ConnectionError as exc:
            if connection.reused:  # reset before the answer: the peer had closed it
                raise _Stale from None
            raise Disconnected(f"the connection broke ({type(exc).__name__})") from None
        except (asyncio.LimitOverrunError, ValueError) as exc:
            raise Disconnected(f"the answer is not HTTP/1.1 ({exc})") from None
        except OSError as exc:
            raise Disconnected(f"the connection broke ({type(exc).__name__})") from None
        keep_alive = raw.startswith(b"HTTP/1.1") and "close" not in headers.get("connection", "")
        if status in (204, 304):
            length, chunked = 0, False
        response = Response(status, headers, self, target, connection, length, chunked, keep_alive)
        response._done = length == 0
        return response

    def _release(self, target: Target, connection: _Connection | None, *, reusable: bool) -> None:
        if self._in_flight is not None:
            self._in_flight.release()
        if connection is None:
            return
        if not reusable or connection.writer.is_closing():
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle = self._idle.setdefault((target.scheme, target.host, target.port), deque())
        idle.append(connection)
        while len(idle) > self.max_connections:
            idle.popleft().close()

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            import httpx  # its default context: certifi's roots, as the gateway had before

            self._ssl = httpx.create_ssl_context()
        return self._ssl

    async def aclose(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


async def _chunked(reader: asyncio.StreamReader, wait_s: float) -> AsyncGenerator[bytes, None]:
    while True:
        async with asyncio.timeout(wait_s):
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers
                return
            data = await reader.readexactly(size + 2)
        yield data[:-2]


async def _sized(
    reader: asyncio.StreamReader, wait_s: float, length: int
) -> AsyncGenerator[bytes, None]:
    remaining = length
    while remaining > 0:
        async with asyncio.timeout(wait_s):
            data = await reader.read(min(remaining, READ_BYTES))
        if not data:
            raise asyncio.IncompleteReadError(b"", remaining)
        remaining -= len(data)
        yield data


async def _to_end(reader: asyncio.StreamReader, wait_s: float) -> AsyncGenerator[bytes, None]:
    while True:
        async with asyncio.timeout(wait_s):
            data = await reader.read(READ_BYTES)
        if not data:
            return
        yield data


class _Stale(Exception):
    """A reused connection the peer had closed: nothing of the answer came."""


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    """The status and headers (names lower-case, repeated ones joined) of an answer's head."""
    if len(raw) > MAX_HEAD_BYTES:
        raise ValueError("the answer's head is too long")
    first, _, rest = raw.partition(b"\r\n")
    version, _, remainder = first.partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1 status line: {first[:80]!r}")
    status = int(remainder[:3])
    headers: dict[str, str] = {}
    for line in rest.split(b"\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            raise ValueError(f"a header line without a colon: {line[:80]!r}")
        key = name.strip().lower().decode("latin-1")
        text = value.strip().decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return status, headers


def _content_length(headers: Mapping[str, str]) -> int | None:
    raw = headers.get("content-length")
    if raw is None:
        return None
    values = {value.strip() for value in raw.split(",")}
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise ValueError(f"an invalid Content-Length: {raw!r}")
    return int(values.pop())
