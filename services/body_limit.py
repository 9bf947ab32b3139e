"""A request body cap for ASGI apps: the api's doors and the model server's share it.

``Content-Length`` is checked by the caller before anything runs; this is the other half,
for bodies that stream in (chunked) or lie about their length. The app runs with a
``receive`` that counts the bytes: past the limit the refusal goes out from here at once,
and the app is told the client left, its own answer dropped, so no handler's error path can
turn a 413 into another status and an unauthenticated client cannot make the process buffer
more than the limit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


async def run_within_limit(
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    limit: int,
    refuse: Callable[[Send], Awaitable[None]],
) -> None:
    """Run ``app``; when the body passes ``limit`` bytes, ``refuse(send)`` answers (unless
    the app had started answering) and the app sees a disconnect."""
    received = 0
    refused = False
    started = False

    async def receive_within_limit() -> Message:
        nonlocal received, refused
        if refused:
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                refused = True
                if not started:
                    await refuse(send)
                return {"type": "http.disconnect"}
        return message

    async def send_unless_refused(message: Message) -> None:
        nonlocal started
        if refused:
            return
        started = True
        await send(message)

    await app(scope, receive_within_limit, send_unless_refused)
