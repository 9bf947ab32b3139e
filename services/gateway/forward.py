"""Calls to the upstream: one request, its errors in OpenAI's shape, its time counted apart.

An upstream that answers an error is answered with the same status and, when it sent
OpenAI's error object, the same body (the agent's client raises what it would have raised
talking to the upstream directly); any other error body is wrapped in OpenAI's shape. Only
an upstream that cannot be reached (refused, reset, no answer to connect) is a 502; one that
stops answering mid-way is a 504. Nothing of the agent's request but its body goes upstream:
not its key (the upstream gets the key Ratchet holds for it), not its other headers.

The time spent waiting on the upstream (for its headers, and for every chunk of its body)
is added to :attr:`Timer.upstream_s`, so the gateway's own time is the rest.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.chat.text import utf8_json
from services.gateway.errors import GatewayError
from services.gateway.routing import Route

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


def build_client(timeout_s: float, max_connections: int = 1024) -> httpx.AsyncClient:
    """The process's one upstream client: a pool of kept-alive connections per upstream."""
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=30.0,
    )
    timeout = httpx.Timeout(timeout_s, connect=10.0, pool=timeout_s)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def _headers(route: Route) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "application/json"}
    if route.api_key:
        headers["authorization"] = f"Bearer {route.api_key}"
    return headers


async def send(
    client: httpx.AsyncClient,
    route: Route,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    timer: Timer,
) -> httpx.Response:
    """The upstream's response, its body still to be read; an error status raised as a
    :class:`GatewayError`."""
    content = utf8_json(body) if body is not None else None
    request = client.build_request(
        method, f"{route.base_url}{path}", content=content, headers=_headers(route)
    )
    started = time.perf_counter()
    try:
        response = await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
        raise unreachable(route, exc) from None
    except httpx.TimeoutException as exc:
        raise GatewayError(
            504,
            f"the upstream ({route.name}) did not answer in time ({type(exc).__name__})",
            kind="upstream_error",
            code="upstream_timeout",
        ) from None
    except httpx.HTTPError as exc:
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


async def upstream_error(route: Route, response: httpx.Response, timer: Timer) -> GatewayError:
    """The upstream's error answer, in OpenAI's shape, with its status."""
    started = time.perf_counter()
    data = bytearray()
    try:
        async for chunk in response.aiter_raw():
            data += chunk
            if len(data) > MAX_ERROR_BODY:
                break
    except httpx.HTTPError:
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


async def read_body(response: httpx.Response, timer: Timer, route: Route) -> bytes:
    started = time.perf_counter()
    try:
        return await response.aread()
    except httpx.HTTPError as exc:
        raise unreachable(route, exc) from None
    finally:
        await response.aclose()
        timer.upstream_s += time.perf_counter() - started


async def events(response: httpx.Response, timer: Timer) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed answer, one ``data:`` payload each (the bytes
    after ``data:``), as they arrive; the wait for each counts as upstream time."""
    buffer = b""
    chunks = response.aiter_raw()
    try:
        while True:
            started = time.perf_counter()
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            finally:
                timer.upstream_s += time.perf_counter() - started
            buffer += chunk
            while True:
                end = _event_end(buffer)
                if end < 0:
                    break
                event, buffer = buffer[:end], buffer[end:].lstrip(b"\r\n")
                for line in event.splitlines():
                    if line.startswith(b"data:"):
                        yield line[5:].strip()
    finally:
        await response.aclose()


def _event_end(buffer: bytes) -> int:
    found = [i for i in (buffer.find(b"\n\n"), buffer.find(b"\r\n\r\n")) if i >= 0]
    return min(found) if found else -1
