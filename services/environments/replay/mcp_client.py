"""An MCP server as a replay tool endpoint, through the official ``mcp`` Python SDK.

The sandbox is synchronous (the rollout loop asks a tool and waits); the SDK is async. One
:class:`McpTransport` per endpoint and process keeps an event loop on a daemon thread and
one session on it, opened on the first call (a stdio server is started then, a streamable
HTTP session connected) and kept for the job's life, so a GRPO run pays the handshake once,
not per call. Calls from any thread are handed to that loop and waited for with the
endpoint's timeout. A session that breaks (the server exited, the connection dropped) is
closed and opened again by the next call.

The SDK's own rules hold beneath: its streamable HTTP client follows a redirect only within
the endpoint's origin, so the ``Authorization`` header (the endpoint's ``api_key``) never
reaches another host; a stdio server gets the SDK's minimal environment (``PATH``, ``HOME``,
…), never the job's variables and the keys among them.

A result is its text blocks joined by newlines (another block is named by its type; a
result with only structured content is that content as JSON); ``isError`` marks the tool's
own error, which the agent sees as ``error: ...``.

This is the only module that imports the SDK (``pip install 'ratchet[mcp]'``); it is
imported when a job's loop names an MCP endpoint, or when an operator lists one's tools.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import sys
import threading
import time
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from typing import Any, TypeVar

from services.environments.replay.tool_config import (
    ListedTool,
    ToolCallError,
    ToolEndpointConfig,
)

_T = TypeVar("_T")
_CLOSE_WAIT_S = 5.0
_LIST_PAGES = 20
# Opening a session may start a server (an interpreter and its imports, for stdio): it gets
# at least this long, whatever the calls' own timeout.
CONNECT_TIMEOUT_S = 30.0
RETRY_AFTER_S = 30.0  # after a failed connect


class McpTransport:
    """One MCP server's session, shared by every thread of the process (see the module)."""

    def __init__(self, config: ToolEndpointConfig) -> None:
        try:
            import mcp  # noqa: F401  (fail here, with the fix, not deep in a rollout)
        except ImportError:
            raise ToolCallError(
                "the mcp package is not installed (pip install 'ratchet[mcp]')"
            ) from None
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"mcp-{config.name}", daemon=True
        )
        self._thread.start()
        self._lock = threading.Lock()
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._holder: asyncio.Future[None] | None = None
        self._closed = False
        self._down_until = 0.0
        self._down_reason = ""
        atexit.register(self.close)

    @property
    def _connect_timeout_s(self) -> float:
        return max(self.config.timeout_s, CONNECT_TIMEOUT_S)

    def call(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> tuple[str, bool]:
        """The tool's result text and its ``isError``; :class:`ToolCallError` when none."""
        from mcp.shared.exceptions import MCPError

        client = self._session(timeout_s)
        try:
            result = self._run(client.call_tool(tool, arguments, timeout_s), timeout_s)
        except ToolCallError:
            raise
        except MCPError as exc:  # the server answered the request with an error
            raise ToolCallError(_describe(exc)) from None
        except Exception as exc:
            self._drop()  # the session may be broken: the next call opens a new one
            raise ToolCallError(_describe(exc)) from None
        return result_text(result), bool(getattr(result, "is_error", False))

    def list_tools(self, timeout_s: float) -> list[ListedTool]:
        """Every tool the server lists, with its ``readOnlyHint`` (shown, never trusted)."""
        client = self._session(timeout_s)

        async def pages() -> list[Any]:
            tools: list[Any] = []
            cursor = None
            for _ in range(_LIST_PAGES):
                page = await client.list_tools(cursor=cursor)
                tools.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
            return tools

        try:
            listed = self._run(pages(), timeout_s)
        except ToolCallError:
            raise
        except Exception as exc:
            self._drop()
            raise ToolCallError(_describe(exc)) from None
        return [
            ListedTool(
                name=str(tool.name),
                description=tool.description,
                read_only_hint=getattr(tool.annotations, "read_only_hint", None),
            )
            for tool in listed
        ]

    def close(self) -> None:
        """End the session (a stdio server exits with it) and the loop's thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=_CLOSE_WAIT_S)
        atexit.unregister(self.close)

    # -- the session ------------------------------------------------------------------

    def _session(self, timeout_s: float) -> Any:
        """The open session; opened now if there is none. A server that could not be
        reached is not tried again for :data:`RETRY_AFTER_S`: the calls meanwhile fail at
        once with the same reason, rather than each waiting out a connect."""
        with self._lock:
            if self._closed:
                raise ToolCallError("the endpoint is closed")
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until:
                raise ToolCallError(self._down_reason)
            ready = asyncio.run_coroutine_threadsafe(self._open(), self._loop)
            try:
                self._client = ready.result(timeout=self._connect_timeout_s + 1.0)
            except Exception as exc:
                ready.cancel()
                self._down_reason = f"cannot connect: {_describe(exc)}"
                self._down_until = time.monotonic() + RETRY_AFTER_S
                raise ToolCallError(self._down_reason) from None
            return self._client

    async def _open(self) -> Any:
        """Start the task that holds the session open; the connected client once it is.
        The SDK's context managers are entered and left by that one task, as anyio asks."""
        ready: asyncio.Future[Any] = self._loop.create_future()
        self._stop = asyncio.Event()
        self._holder = asyncio.ensure_future(self._hold(ready, self._stop))
        try:
            return await asyncio.wait_for(asyncio.shield(ready), self._connect_timeout_s)
        except BaseException:
            self._stop.set()
            raise

    async def _hold(self, ready: asyncio.Future[Any], stop: asyncio.Event) -> None:
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(await self._client_context(stack))
                if not ready.done():
                    ready.set_result(client)
                await stop.wait()
        except BaseException as exc:  # handed to the caller waiting on it
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(exc))

    async def _client_context(self, stack: AsyncExitStack) -> Any:
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        config = self.config
        if config.command is not None:
            server = StdioServerParameters(
                command=config.command[0],
                args=list(config.command[1:]),
                encoding_error_handler="replace",
            )
            # The server's stderr joins the process's own (the job's log); the real stream,
            # since a replaced sys.stderr (a test's capture) may have no file to hand on.
            errlog = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
            return Client(
                stdio_client(server, errlog=errlog), read_timeout_seconds=config.timeout_s
            )
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        http = await stack.enter_async_context(
            httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(config.timeout_s))
        )
        assert config.url is not None
        transport = streamable_http_client(config.url, http_client=http)
        return Client(transport, read_timeout_seconds=config.timeout_s)

    def _drop(self) -> None:
        """Forget the session and let its holder leave the SDK's contexts."""
        with self._lock:
            self._client = None
            stop, holder = self._stop, self._holder
            self._stop = self._holder = None
        if stop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(stop.set)
        if holder is not None and self._loop.is_running():

            async def finished() -> None:
                await asyncio.wait([holder], timeout=_CLOSE_WAIT_S)

            # A server that will not exit is left to the OS.
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(finished(), self._loop).result(
                    timeout=_CLOSE_WAIT_S + 1.0
                )

    def _run(self, coroutine: Coroutine[Any, Any, _T], timeout_s: float) -> _T:
        """Run ``coroutine`` on the session's loop; :class:`ToolCallError` past the timeout
        (the call is cancelled, the session kept)."""

        async def bounded() -> _T:
            return await asyncio.wait_for(coroutine, timeout_s)

        future = asyncio.run_coroutine_threadsafe(bounded(), self._loop)
        try:
            return future.result(timeout=timeout_s + 1.0)
        except TimeoutError:
            future.cancel()
            raise ToolCallError(f"timed out after {timeout_s:g} s") from None


def result_text(result: Any) -> str:
    """A ``CallToolResult`` as the text the agent reads (see the module)."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')}]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        return json.dumps(structured, ensure_ascii=False, sort_keys=True)
    return "\n".join(parts)


def _describe(exc: BaseException) -> str:
    """One line for an SDK failure (an exception group names its first member)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
