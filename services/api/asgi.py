"""Plain ASGI routes for the api's hot paths (the ingest webhook).

FastAPI's per-request machinery (route matching through included routers, dependency solving,
the request wrapper and its exit stacks) cost about as much CPU as the webhook's own work:
measured in-process on the dev machine, ~370 µs per single-trace request through an
``APIRoute`` against ~180 µs through a :class:`PlainRoute` placed first in the routing table.
So a route module may expose ``plain_routes``: Starlette routes with a plain ASGI endpoint,
which ``create_app`` puts ahead of every router. They still run inside the app's middleware
(HTTP metrics, error handlers: an ``ApiError`` raised before the answer starts is rendered
as usual), and each mirrors an ``APIRoute`` of its module, which documents it in the OpenAPI
and shares its code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send


class PlainRoute(Route):
    """A Starlette route whose endpoint is an ASGI app; it names itself as the scope's route
    (FastAPI's router does not), so the HTTP metrics label it by its path template."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child_scope = super().matches(scope)
        if match is not Match.NONE:
            child_scope["route"] = self
        return match, child_scope


async def body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The request body as it arrives (as ``Request.stream()``, without the Request)."""
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk: bytes = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()


async def send_bytes(send: Send, body: bytes, *, media_type: str, status: int = 200) -> None:
    """A complete response with a known length (as Starlette's ``Response`` sends it)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-length", str(len(body)).encode("latin-1")),
                (b"content-type", media_type.encode("latin-1")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
