"""The api process: webhook, admin REST API, loop dashboard, metrics and health.

``create_app(settings)`` takes its settings (and, in tests, a ready state) as arguments;
nothing is built at import time.

Every module under ``services/api/routes`` exposes a ``router`` (an ``APIRouter``) and may
expose ``async def startup(app)`` / ``async def shutdown(app)`` for resources it owns (the
ingest writer, say), and ``plain_routes`` for hot paths served as plain ASGI ahead of every
router (see services.api.asgi). Adding a resource means adding a module there, nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import ModuleType

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import services.api.routes as routes_package
from services.api.errors import error_body, install_error_handlers
from services.api.state import AppState, TemporalConnection
from services.body_limit import run_within_limit
from services.db.session import engine_from_settings, make_session_factory
from services.metrics import HTTP_REQUEST_DURATION, HTTP_REQUESTS, forget_this_process
from services.serving.kinds import check_serving_endpoints
from services.settings import Settings


def route_modules() -> list[ModuleType]:
    """The route modules, in name order (health first)."""
    names = sorted(module.name for module in pkgutil.iter_modules(routes_package.__path__))
    names.sort(key=lambda name: name != "health")
    return [importlib.import_module(f"{routes_package.__name__}.{name}") for name in names]


class HttpMetricsMiddleware:
    """Counts and times every request by route template, as plain ASGI (no per-request task)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record_status)
        finally:
            route = scope.get("route")
            template = str(
                getattr(route, "path_format", None) or getattr(route, "path", "unmatched")
            )
            method = scope.get("method", "GET")
            elapsed = time.perf_counter() - started
            HTTP_REQUEST_DURATION.labels(str(template), method).observe(elapsed)
            HTTP_REQUESTS.labels(str(template), method, str(status)).inc()


# The doors that take traces read their bodies under RATCHET_INGEST_MAX_BODY_BYTES instead.
INGEST_PATHS = re.compile(r"^(/v1/loops/[^/]+/traces|(/v1)?/otlp/v1/[a-z]+)$")


class BodyLimitMiddleware:
    """Refuse request bodies over ``limit`` bytes outside the ingest doors, before any route,
    authentication or parsing sees them: from ``Content-Length`` at once, and while the body
    streams in for chunked requests (an unauthenticated client cannot make the api buffer
    more than the limit)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or INGEST_PATHS.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and not declared.isdigit():
            await _refuse(send, 400, "invalid_header", "Content-Length is not a number")
            return
        if declared is not None and int(declared) > self.limit:
            await _refuse(send, 413, "body_too_large", self._too_large())
            return

        async def refuse(send: Send) -> None:
            await _refuse(send, 413, "body_too_large", self._too_large())

        await run_within_limit(self.app, scope, receive, send, limit=self.limit, refuse=refuse)

    def _too_large(self) -> str:
        return f"the request body is over the limit of {self.limit} bytes"


class NulInUrlMiddleware:
    """Refuse a URL whose path or query holds a NUL character (``%00``) with a 400, before
    any route reads it. Postgres ``text`` cannot hold NUL: a loop name, a trace's external
    id or a listing filter carrying one reached a query and failed it as a 500 (found by
    the hostile pass of issue 43). No name, id or filter Ratchet stores can hold one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (
            "\x00" in scope.get("path", "") or b"%00" in scope.get("query_string", b"")
        ):
            message = "the URL holds a NUL character (%00), which no name, id or filter can"
            await _refuse(send, 400, "invalid_url", message)
            return
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, code: str, message: str) -> None:
    response = JSONResponse(error_body(code, message), status_code=status)
    await response({"type": "http"}, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def create_app(settings: Settings, *, state: AppState | None = None) -> FastAPI:
    """Build the api. Tests pass a ready ``state``; production builds it in the lifespan.

    A serving endpoint its kind refuses stops the api here (SettingsError, one line), before
    any loop that names it is saved."""
    check_serving_endpoints(settings.serving_endpoints)
    modules = route_modules()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned_engine = None
        if state is None:
            owned_engine = engine_from_settings(settings, application="ratchet-api")
            app.state.ratchet = AppState(
                settings=settings,
                engine=owned_engine,
                session_factory=make_session_factory(owned_engine),
                temporal=TemporalConnection(settings),
            )
        else:
            app.state.ratchet = state
        started: list[ModuleType] = []
        try:
            for module in modules:
                startup = getattr(module, "startup", None)
                if startup is not None:
                    await startup(app)
                started.append(module)
            yield
        finally:
            for module in reversed(started):
                shutdown = getattr(module, "shutdown", None)
                if shutdown is not None:
                    await shutdown(app)
            if owned_engine is not None:
                owned_engine.dispose()
            forget_this_process()

    app = FastAPI(
        title="Ratchet",
        version="0.1.0",
        summary="Continuous post-training for AI agents.",
        lifespan=lifespan,
        # /docs is services.api.routes.docs (Swagger UI from the package, offline too).
        docs_url=None,
        redoc_url=None,
        # Ratchet's metrics are Prometheus (services.metrics). FastAPI's native OpenTelemetry
        # layer, on by default, looks for a configured provider on every request: three
        # failed environment lookups, ~4.6 us of every request's CPU on the dev machine.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limit=settings.api_max_body_bytes)
    app.add_middleware(NulInUrlMiddleware)
    app.add_middleware(HttpMetricsMiddleware)
    plain_routes = [route for module in modules for route in getattr(module, "plain_routes", ())]
    app.router.routes[:0] = plain_routes  # ahead of FastAPI's own routes and every router
    for module in modules:
        app.include_router(module.router)
    return app
