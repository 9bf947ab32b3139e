"""The gateway's ASGI app: who is asking, how much, which route; then a handler.

Plain ASGI, not a framework router: this is the path every agent call takes, and the
gateway's own time per request is the figure it is judged by (benchmarks/gateway.py). In
order, for each request:

1. **The key.** ``Authorization: Bearer <gateway key>`` names the loop (services.gateway.
   keys); a missing, unknown, revoked or expired key is a 401 in OpenAI's shape.
2. **The body.** Refused (413) from ``Content-Length`` before a byte is read, and while it
   streams in past ``RATCHET_GATEWAY_MAX_BODY_BYTES``; then parsed as JSON (400).
3. **The handler** (services.gateway.handlers) forwards, captures and answers. It runs as a
   task beside a watch on the connection: a client that hangs up cancels the task, which
   closes the upstream request (the upstream stops generating), captured or not.

``/health`` answers while the process runs; ``/readyz`` once the key table has been read;
``/metrics`` serves the registry unless ``RATCHET_GATEWAY_METRICS_PORT`` gives it a port of
its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from services.gateway.capture import SESSION_HEADER, CapturedCall, new_call_id, session_key
from services.gateway.errors import GatewayError, send_bytes, send_error, too_large, unauthorized
from services.gateway.forward import Timer
from services.gateway.handlers import HANDLERS, Call
from services.gateway.keys import GatewayLoop, KeysUnavailable, KeyTable
from services.gateway.routing import NoRoute
from services.gateway.upstream import UpstreamClient
from services.loop.states import LoopLifecycle
from services.metrics import GATEWAY_OVERHEAD, GATEWAY_REQUESTS, render_latest

log = logging.getLogger(__name__)

Record = Callable[[CapturedCall], None]
Lifespan = Callable[[], Awaitable[None]]


@dataclass
class GatewayParts:
    """What the app needs: the key table, the upstream client, the capture sink, limits."""

    keys: KeyTable
    client: UpstreamClient
    record: Record
    max_body_bytes: int
    serve_metrics: bool = True


class GatewayApp:
    """See the module docstring. ``startup``/``shutdown`` run on the ASGI lifespan."""

    def __init__(
        self,
        parts: GatewayParts,
        *,
        startup: Lifespan | None = None,
        shutdown: Lifespan | None = None,
    ) -> None:
        self.parts = parts
        self._startup = startup
        self._shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and path in ("/health", "/healthz", "/readyz"):
            ready = path != "/readyz" or self.parts.keys.loaded
            await send_bytes(
                send,
                200 if ready else 503,
                b'{"ok":%s}' % (b"true" if ready else b"false"),
                b"application/json",
            )
            return
        if method == "GET" and path == "/metrics" and self.parts.serve_metrics:
            data, content_type = render_latest()
            await send_bytes(send, 200, data, content_type.encode())
            return
        found = HANDLERS.get((method, path.rstrip("/")))
        if found is None:
            await send_error(send, _not_found(method, path))
            return
        await self._handle(scope, receive, send, found)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, found: Any) -> None:
        route_name, handler = found
        timer = Timer()
        status = [0]  # 0 until the answer starts
        loop_name = "-"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            headers = Headers(scope=scope)
            loop = await self._loop(headers)
            loop_name = loop.name
            body = await self._body(headers, receive) if scope["method"] == "POST" else {}
            call = self._call(loop, body, headers, timer)
            await _until_hung_up(handler(call, counted), receive)
        except _HungUp:
            status[0] = status[0] or 499
        except GatewayError as exc:
            await _send_error_if_unsent(counted, exc, status)
        except Exception:
            log.exception("gateway: %s failed", route_name)
            error = GatewayError(500, "the gateway failed on this request", kind="server_error")
            await _send_error_if_unsent(counted, error, status)
        finally:
            _requests(loop_name, route_name, (status[0] or 499) // 100).inc()
            _overhead(route_name).observe(timer.overhead())

    async def _loop(self, headers: Headers) -> GatewayLoop:
        scheme, _, key = (headers.get("authorization") or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise unauthorized(
                "missing API key: set the OpenAI client's api_key to the loop's gateway key"
            )
        try:
            loop = await self.parts.keys.lookup(key)
        except KeysUnavailable as exc:
            raise GatewayError(
                503,
                str(exc),
                kind="server_error",
                code="keys_unavailable",
                headers={"retry-after": "1"},
            ) from None
        if loop is None:
            raise unauthorized("the gateway key is unknown, revoked or expired")
        if loop.status == LoopLifecycle.ARCHIVED:
            raise GatewayError(
                403,
                f"loop {loop.name!r} is archived",
                kind="permission_error",
                code="loop_archived",
            )
        return loop

    async def _body(self, headers: Headers, receive: Receive) -> dict[str, Any]:
        limit = self.parts.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise too_large(limit)
        data = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _HungUp
            data += message.get("body", b"")
            if len(data) > limit:
                raise too_large(limit)
            if not message.get("more_body"):
                break
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise GatewayError(
                400, f"the body is not valid JSON: {exc}", code="invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object", code="invalid_json")
        return body

    def _call(
        self, loop: GatewayLoop, body: dict[str, Any], headers: Headers, timer: Timer
    ) -> Call:
        route = loop.route
        if isinstance(route, NoRoute):
            raise GatewayError(503, route.reason, kind="server_error", code="no_route")
        return Call(
            loop=loop,
            route=route,
            body=body,
            session_key=session_key(headers.get(SESSION_HEADER), body),
            client=self.parts.client,
            record=self.parts.record,
            timer=timer,
            call_id=new_call_id(),
        )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    if self._startup is not None:
                        await self._startup()
                except Exception as exc:
                    log.exception("gateway: startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._shutdown is not None:
                    await self._shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


@functools.lru_cache(maxsize=4096)
def _requests(loop: str, route: str, status_class: int) -> Counter:
    """The labelled counter (looked up once: ``labels`` takes a lock on every call)."""
    return GATEWAY_REQUESTS.labels(loop, route, f"{status_class}xx")


@functools.lru_cache(maxsize=64)
def _overhead(route: str) -> Histogram:
    return GATEWAY_OVERHEAD.labels(route)


def _not_found(method: str, path: str) -> GatewayError:
    return GatewayError(
        404,
        f"{method} {path} is not a route of the gateway (it serves /v1/chat/completions, "
        "/v1/completions, /v1/responses and /v1/models)",
        code="unknown_url",
    )


class _HungUp(Exception):
    """The client hung up while its body was being read."""


async def _send_error_if_unsent(send: Send, error: GatewayError, status: list[int]) -> None:
    """Answer ``error`` unless an answer has started (a stream that broke mid-way just ends)."""
    if status[0] == 0:
        with contextlib.suppress(Exception):
            await send_error(send, error)


async def _until_hung_up(work: Awaitable[None], receive: Receive) -> None:
    """Run ``work`` in this task; if the client hangs up first, cancel it (closing the
    upstream request). One watch task beside it, not a second task for the work and a wait
    on both: this runs for every request."""
    current = asyncio.current_task()
    assert current is not None
    hung_up = False

    def on_done(watch: asyncio.Future[None]) -> None:
        nonlocal hung_up
        if not watch.cancelled() and watch.exception() is None:
            hung_up = True
            current.cancel()

    watch = asyncio.ensure_future(_disconnected(receive))
    watch.add_done_callback(on_done)
    try:
        await work
    except asyncio.CancelledError:
        if not hung_up:
            raise
        current.uncancel()
    finally:
        watch.remove_done_callback(on_done)
        watch.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
