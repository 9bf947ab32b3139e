"""Calls to the upstream: one request, its errors in OpenAI's shape, its time counted apart.

An upstream that answers an error is answered with the same status and, when it sent
OpenAI's error object, the same body (the agent's client raises what it would have raised
talking to the upstream directly); any other error body is wrapped in OpenAI's shape. Only
an upstream that cannot be reached (refused, reset, no answer to connect) is a 502; one that
stops answering mid-way is a 504. Nothing of the agent's request but its body goes upstream:
not its key (the upstream gets the key Ratchet holds for it), not its other headers.

The time spent waiting on the upstream (for its headers, and for every chunk of its body)
is added to :attr:`Timer.upstream_s`, so the gateway's own time is the rest. The client is
the gateway's own (services.gateway.upstream), for the reason given there.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.chat.text import utf8_json
from services.gateway.errors import GatewayError
from services.gateway.routing import Route
from services.gateway.upstream import (
    ConnectFailed,
    Disconnected,
    Response,
    TimedOut,
    UpstreamClient,
    UpstreamError,
)

MAX_ERROR_BODY = 64 * 1024
_PASSED_ERROR_HEADERS = ("retry-after", "x-request-id")


@dataclass
class Timer:
    """When the request arrived, and how long it waited on the upstream since."""

    started: float = field(default_factory=time.perf_counter)
    wall_started: float = field(default_factory=time.time)
    upstream_s: float = 0.0

    def overhead(self) -> float:
        return max(time.perf_counter() - self.started - self.upstream_s, 0.0)


def build_client(timeout_s: float, max_connections: int = 1024) -> UpstreamClient:
    """The process's one upstream client: kept-alive connections per upstream."""
    return UpstreamClient(timeout_s=timeout_s, max_connections=max_connections)


def _headers(route: Route) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "application/json"}
    if route.api_key:
        headers["authorization"] = f"Bearer {route.api_key}"
    return headers


async def send(
    client: UpstreamClient,
    route: Route,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    timer: Timer,
) -> Response:
    """The upstream's response, its body still to be read; an error status raised as a
    :class:`GatewayError`."""
    content = utf8_json(body) if body is not None else None
    started = time.perf_counter()
    try:
        response = await client.request(
            method, f"{route.base_url}{path}", body=content, headers=_headers(route)
        )
    except TimedOut as exc:
        raise GatewayError(
            504,
            f"the upstream ({route.name}) did not answer in time ({exc})",
            kind="upstream_error",
            code="upstream_timeout",
        ) from None
    except (ConnectFailed, Disconnected) as exc:
        raise unreachable(route, exc) from None
    finally:
        timer.upstream_s += time.perf_counter() - started
    if response.status_code >= 400:
        raise await upstream_error(route, response, timer)
    return response


def unreachable(route: Route, exc: Exception) -> GatewayError:
    return GatewayError(
        502,
        f"the upstream ({route.name}) cannot be reached: {type(exc).__name__}",
        kind="upstream_error",
        code="upstream_unreachable",
    )


async def upstream_error(route: Route, response: Response, timer: Timer) -> GatewayError:
    """The upstream's error answer, in OpenAI's shape, with its status."""
    started = time.perf_counter()
    data = b""
    try:
        data = await response.read(limit=MAX_ERROR_BODY)
    except UpstreamError:
        pass
    finally:
        await response.aclose()
        timer.upstream_s += time.perf_counter() - started
    headers = {k: response.headers[k] for k in _PASSED_ERROR_HEADERS if k in response.headers}
    error = _openai_error(bytes(data[:MAX_ERROR_BODY]))
    if error is not None:
        found = GatewayError(
            response.status_code,
            str(error.get("message") or ""),
            kind=str(error.get("type") or "upstream_error"),
            code=error.get("code") if isinstance(error.get("code"), str) else None,
            param=error.get("param") if isinstance(error.get("param"), str) else None,
            headers=headers,
        )
        return found
    text = bytes(data[:500]).decode("utf-8", "replace").strip()
    return GatewayError(
        response.status_code,
        f"the upstream ({route.name}) answered {response.status_code}: {text or '(no body)'}",
        kind="upstream_error",
        headers=headers,
    )


def _openai_error(data: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return error if isinstance(error, dict) and "message" in error else None


async def read_body(response: Response, timer: Timer, route: Route) -> bytes:
    started = time.perf_counter()
    try:
        return await response.read()
    except TimedOut as exc:
        raise GatewayError(
            504,
            f"the upstream ({route.name}) stopped answering ({exc})",
            kind="upstream_error",
            code="upstream_timeout",
        ) from None
    except UpstreamError as exc:
        raise unreachable(route, exc) from None
    finally:
        await response.aclose()
        timer.upstream_s += time.perf_counter() - started


async def events(response: Response, timer: Timer) -> AsyncIterator[list[bytes]]:
    """The server-sent events of a streamed answer as they arrive: for each piece of the body
    that completes events, their ``data:`` payloads (the bytes after ``data:``), so what
    came together is sent on together; the wait for each piece counts as upstream time."""
    buffer = b""
    chunks = response.chunks()
    try:
        while True:
            started = time.perf_counter()
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            finally:
                timer.upstream_s += time.perf_counter() - started
            payloads, buffer = split_events(buffer + chunk if buffer else chunk)
            if payloads:
                yield payloads
    finally:
        await chunks.aclose()
        await response.aclose()


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The ``data:`` payloads of the whole events at the start of ``buffer``, and the rest."""
    if b"\r" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    *whole, rest = buffer.split(b"\n\n")
    payloads = []
    for event in whole:
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payloads.append(line[5:].strip())
    return payloads, rest
