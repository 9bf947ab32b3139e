"""A live tool endpoint's configuration as a job gets it, and what its wire may say.

The deployment lists tool endpoints in ``settings.tool_endpoints`` (services.settings.
ToolEndpoint); a job has no settings object, so the worker hands it the endpoints its loop
names as ``RATCHET_TOOL_ENDPOINTS`` (:mod:`.endpoints`), which :class:`ToolEndpointConfig`
parses. The terms it carries are enforced by :mod:`.tool_endpoints`; the wires that speak
to a server (:mod:`.tool_endpoints`' HTTP, :mod:`.mcp_client`'s MCP) share these types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("http", "mcp")
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_REQUESTS_PER_MINUTE = 60.0
DEFAULT_MAX_RESULT_BYTES = 65_536
_FIELDS = {
    "kind",
    "url",
    "command",
    "api_key",
    "tools",
    "timeout_s",
    "requests_per_minute",
    "max_result_bytes",
}


class ToolEndpointError(ValueError):
    """A tool endpoint's configuration that is not the documented shape."""


class ToolCallError(RuntimeError):
    """A live call that got no result (unreachable, timed out, HTTP error, bad reply)."""


@dataclass(frozen=True)
class ToolEndpointConfig:
    """One endpoint as a job gets it (``RATCHET_TOOL_ENDPOINTS``, see :mod:`.endpoints`)."""

    name: str
    kind: str
    tools: frozenset[str]
    url: str | None = None
    command: tuple[str, ...] | None = None
    api_key: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    requests_per_minute: float = DEFAULT_REQUESTS_PER_MINUTE
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES

    @classmethod
    def from_json(cls, name: str, data: Any) -> ToolEndpointConfig:
        """Parse one endpoint; :class:`ToolEndpointError` names the field at fault."""
        where = f"tool endpoint {name!r}"
        if not isinstance(data, Mapping):
            raise ToolEndpointError(f"{where} must be an object")
        unknown = sorted(set(data) - _FIELDS)
        if unknown:
            raise ToolEndpointError(f"{where} has unknown field(s) {unknown}")
        kind = data.get("kind", "http")
        if kind not in KINDS:
            raise ToolEndpointError(f"{where}: kind must be one of {list(KINDS)}")
        url, command = data.get("url"), data.get("command")
        if url is not None and (not isinstance(url, str) or not _is_http_url(url)):
            raise ToolEndpointError(f"{where}: url must be an http:// or https:// URL")
        if command is not None and (
            not isinstance(command, list)
            or not command
            or not all(isinstance(part, str) and part for part in command)
        ):
            raise ToolEndpointError(f"{where}: command must be a non-empty argv list of strings")
        if (kind == "http" and url is None) or (url is None) == (command is None):
            raise ToolEndpointError(
                f"{where}: an http endpoint needs a url; an mcp endpoint a url or a command"
            )
        tools = data.get("tools")
        if not isinstance(tools, list) or not tools or not all(isinstance(t, str) for t in tools):
            raise ToolEndpointError(
                f"{where}: tools must list the tool names the endpoint may be asked"
            )
        key = data.get("api_key")
        if key is not None and not isinstance(key, str):
            raise ToolEndpointError(f"{where}: api_key must be a string")
        return cls(
            name=name,
            kind=kind,
            tools=frozenset(tools),
            url=url.rstrip("/") if url else None,
            command=tuple(command) if command else None,
            api_key=key,
            timeout_s=_positive(data, "timeout_s", DEFAULT_TIMEOUT_S, where),
            requests_per_minute=_positive(
                data, "requests_per_minute", DEFAULT_REQUESTS_PER_MINUTE, where
            ),
            max_result_bytes=int(
                _positive(data, "max_result_bytes", DEFAULT_MAX_RESULT_BYTES, where)
            ),
        )

    def to_json(self) -> dict[str, Any]:
        """The endpoint as the job variable carries it (the key in clear: see endpoints)."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "tools": sorted(self.tools),
            "timeout_s": self.timeout_s,
            "requests_per_minute": self.requests_per_minute,
            "max_result_bytes": self.max_result_bytes,
        }
        if self.url is not None:
            out["url"] = self.url
        if self.command is not None:
            out["command"] = list(self.command)
        if self.api_key is not None:
            out["api_key"] = self.api_key
        return out


@dataclass(frozen=True)
class ListedTool:
    """A tool as its server lists it; ``read_only_hint`` is the server's word, shown to the
    operator and never taken as permission (the allow-list is)."""

    name: str
    description: str | None
    read_only_hint: bool | None


def _is_http_url(url: str) -> bool:
    scheme, sep, rest = url.partition("://")
    return bool(sep) and scheme in {"http", "https"} and bool(rest.strip("/"))


def _positive(data: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = data.get(key, default)
    if isinstance(value, bool):
        raise ToolEndpointError(f"{where}: {key} must be a number > 0")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ToolEndpointError(f"{where}: {key} must be a number > 0") from None
    if not number > 0 or number == float("inf"):
        raise ToolEndpointError(f"{where}: {key} must be a number > 0")
    return number
