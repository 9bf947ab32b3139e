"""Live tool endpoints: where the sandbox sends a call nobody recorded, and on what terms.

A replay task's tools answer from recorded results; a call nobody recorded (the tool the
failing trace never called, an argument nobody tried) can go to the team's own tools, when
the loop names an endpoint the deployment lists (``settings.tool_endpoints``). Two kinds:

- ``http``: Ratchet's own shape, ``POST <url>`` with ``{"name": tool, "arguments": {...}}``;
  the reply (``{"content": "..."}``, or the body as text) is the result;
- ``mcp``: an MCP server through the official SDK (:mod:`.mcp_client`), streamable HTTP at
  ``url`` or a stdio ``command`` the job starts; the SDK is imported on the first call.

Tool names come from traces and the policy chooses the calls, so an endpoint would be a
confused deputy without terms, which :class:`LiveToolEndpoint` enforces for both kinds:

- an **allow-list**: only the tool names the deployment lists for the endpoint are called;
  any other call gets the sandbox's "no recorded result" answer and never leaves the job;
- a **rate limit** per endpoint and process (calls are spaced ``60 / requests_per_minute``
  seconds apart; a call that would wait longer than its timeout is refused);
- a **timeout** per call (connect, send and read together; opening an MCP session, which
  may start a server, gets at least :data:`.mcp_client.CONNECT_TIMEOUT_S`);
- a **result size cap**: a result over ``max_result_bytes`` becomes an error text;
- no ``Authorization`` header across a redirect to another origin.

Every outcome is a :class:`ToolAnswer` that says whether the tool answered (a result the
agent may learn from, recorded for the next rollout when it is not an error) or nobody
could (counted as unanswerable, :mod:`.sandbox`).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from services.environments.replay.tool_config import (
    ListedTool,
    ToolCallError,
    ToolEndpointConfig,
)


def no_record(tool: str) -> str:
    """The sandbox's answer to a call nobody recorded and no endpoint may answer."""
    return f"error: no recorded result for tool {tool} with these arguments"


@dataclass(frozen=True)
class ToolAnswer:
    """What the sandbox tells the agent, and what it means.

    ``answered``: the tool (or the record of it) gave this result, an error text of the
    tool's own included; False when nobody could (no record, not allow-listed, the endpoint
    failed). ``recordable``: a live result worth keeping for the next rollout (answered by
    the endpoint and not an error, which may be transient).
    """

    text: str
    answered: bool
    recordable: bool = False


class ToolTransport(Protocol):
    """One kind of endpoint's wire: a call's result text and whether the tool said it is
    an error; :class:`ToolCallError` when there is no result."""

    def call(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> tuple[str, bool]: ...

    def close(self) -> None: ...


@dataclass
class EndpointUsage:
    """What one endpoint did in this process (the job reports it in ``metrics.json``)."""

    calls: int = 0  # requests sent
    answered: int = 0  # results the tool gave (its error texts included)
    refused: int = 0  # tools not on the allow-list: never sent
    failed: int = 0  # no result: unreachable, timed out, over the size cap, rate-limited

    def to_dict(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "answered": self.answered,
            "refused": self.refused,
            "failed": self.failed,
        }


class Pacer:
    """Spaces calls ``60 / requests_per_minute`` seconds apart across the threads of one
    process; a call that would wait longer than ``max_wait_s`` is refused instead."""

    def __init__(
        self,
        requests_per_minute: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if requests_per_minute <= 0:
            raise ValueError("requests_per_minute must be > 0")
        self.interval_s = 60.0 / requests_per_minute
        self._next_at = float("-inf")
        self._lock = threading.Lock()
        self._clock, self._sleep = clock, sleep

    def acquire(self, max_wait_s: float) -> bool:
        """Wait for this call's turn; False (and no turn taken) when it is too far off."""
        with self._lock:
            now = self._clock()
            start = max(now, self._next_at)
            if start - now > max_wait_s:
                return False
            self._next_at = start + self.interval_s
        if start > now:
            self._sleep(start - now)
        return True


class LiveToolEndpoint:
    """One configured endpoint under its terms (see the module): allow-list, pace,
    timeout and size cap, over an HTTP or MCP transport made on the first call."""

    def __init__(
        self,
        config: ToolEndpointConfig,
        *,
        transport: Callable[[ToolEndpointConfig], ToolTransport] | None = None,
    ) -> None:
        self.config = config
        self.usage = EndpointUsage()
        self._pacer = Pacer(config.requests_per_minute)
        self._make_transport = transport or make_transport
        self._transport: ToolTransport | None = None
        self._lock = threading.Lock()

    def allows(self, tool: str) -> bool:
        return tool in self.config.tools

    def answer(self, tool: str, arguments: dict[str, Any]) -> ToolAnswer:
        """The endpoint's answer to one call (see :class:`ToolAnswer`)."""
        if not self.allows(tool):
            with self._lock:
                self.usage.refused += 1
            return ToolAnswer(no_record(tool), answered=False)
        if not self._pacer.acquire(self.config.timeout_s):
            return self._failed(
                f"error: tool {tool} is rate-limited ({self.config.requests_per_minute:g} "
                "calls per minute); no result"
            )
        with self._lock:
            self.usage.calls += 1
        try:
            text, is_error = self._wire().call(tool, arguments, self.config.timeout_s)
        except ToolCallError as exc:
            return self._failed(f"error: tool {tool} gave no result: {exc}")
        if len(text.encode("utf-8")) > self.config.max_result_bytes:
            return self._failed(
                f"error: tool {tool} answered more than this endpoint's cap of "
                f"{self.config.max_result_bytes} bytes; no result"
            )
        with self._lock:
            self.usage.answered += 1
        if is_error:
            return ToolAnswer(text if text.startswith("error") else f"error: {text}", True)
        return ToolAnswer(text, answered=True, recordable=True)

    def list_tools(self) -> list[ListedTool] | None:
        """The tools the server lists (MCP), or None for an endpoint that cannot list."""
        lister = getattr(self._wire(), "list_tools", None)
        return lister(self.config.timeout_s) if callable(lister) else None

    def close(self) -> None:
        with self._lock:
            transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()

    def _wire(self) -> ToolTransport:
        with self._lock:
            if self._transport is None:
                self._transport = self._make_transport(self.config)
            return self._transport

    def _failed(self, text: str) -> ToolAnswer:
        with self._lock:
            self.usage.failed += 1
        return ToolAnswer(text, answered=False)


def make_transport(config: ToolEndpointConfig) -> ToolTransport:
    """The endpoint's wire: HTTP here, MCP from :mod:`.mcp_client` (which imports the SDK,
    so only a job whose loop names an MCP server ever loads it)."""
    if config.kind == "mcp":
        from services.environments.replay.mcp_client import McpTransport

        return McpTransport(config)
    return HttpTransport(config)


class HttpTransport:
    """Ratchet's own tool shape over HTTP (see the module)."""

    def __init__(self, config: ToolEndpointConfig) -> None:
        assert config.url is not None
        self.config = config
        self._opener = urllib.request.build_opener(SameOriginAuthRedirect())

    def call(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> tuple[str, bool]:
        body = json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False)
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        assert self.config.url is not None
        request = urllib.request.Request(self.config.url, body.encode(), headers, method="POST")
        deadline = time.monotonic() + timeout_s
        try:
            with self._opener.open(request, timeout=timeout_s) as response:
                data = _read_within(response, self.config.max_result_bytes, deadline)
        except urllib.error.HTTPError as exc:
            raise ToolCallError(f"HTTP {exc.code}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise ToolCallError(f"unreachable: {getattr(exc, 'reason', exc)}") from None
        text = data.decode("utf-8", errors="replace")
        try:
            reply = json.loads(text)
        except ValueError:
            return text, False
        if isinstance(reply, Mapping) and isinstance(reply.get("content"), str):
            return str(reply["content"]), False
        return text, False

    def close(self) -> None:
        return None


class SameOriginAuthRedirect(urllib.request.HTTPRedirectHandler):
    """Follows redirects as urllib does, but never carries ``Authorization`` to another
    origin (scheme, host, port): a tool server that redirects elsewhere does not get to
    hand the deployment's key to that host."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _read_within(response: Any, cap: int, deadline: float) -> bytes:
    """At most ``cap + 1`` bytes of a reply (one more says it was too big), before
    ``deadline``: a server that drips its body slowly still times out."""
    chunks: list[bytes] = []
    size = 0
    while size <= cap:
        if time.monotonic() > deadline:
            raise TimeoutError("timed out reading the result")
        chunk = response.read(min(65_536, cap + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return (parts.scheme, (parts.hostname or "").lower(), parts.port or default)
