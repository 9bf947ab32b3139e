"""A replay loop's live tools as an operator checks them (``ratchet loop tools NAME``).

The loop names a tool endpoint of the deployment (``curation_policy.tool_endpoint``); what it
may be asked is the deployment's allow-list for that endpoint, nothing else. An MCP server
also lists its tools with annotations: the listing shows each tool's ``readOnlyHint``, the
server's own word, so an operator can see what they allow-listed, but Ratchet never takes a
hint as permission (a server that calls a tool read-only is not thereby allowed to be asked;
only the allow-list is). The process that asks (the api) connects for the listing only,
within the endpoint's timeout (at most :data:`LIST_TIMEOUT_S`), and says why when it cannot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.environments.replay.tool_config import ListedTool, ToolCallError
from services.environments.replay.tool_endpoints import LiveToolEndpoint
from services.loop.job_documents import tool_endpoint_config
from services.settings import ToolEndpoint

LIST_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class LoopTool:
    """One tool: on the allow-list or not, listed by the server or not (None: the endpoint
    cannot list), and the server's read-only hint (None: no hint, or no listing)."""

    name: str
    allowed: bool
    listed: bool | None
    read_only_hint: bool | None
    description: str | None


@dataclass(frozen=True)
class LoopTools:
    endpoint: str | None
    kind: str | None
    tools: list[LoopTool]
    error: str | None = None


def loop_tools(
    curation_policy: Mapping[str, Any], endpoints: Mapping[str, ToolEndpoint]
) -> LoopTools:
    """The loop's endpoint, its allow-list and what its server lists (see the module)."""
    name = curation_policy.get("tool_endpoint")
    if not isinstance(name, str):
        return LoopTools(endpoint=None, kind=None, tools=[], error="the loop names no endpoint")
    endpoint = endpoints.get(name)
    if endpoint is None:
        return LoopTools(
            endpoint=name,
            kind=None,
            tools=[],
            error=f"{name!r} is not an endpoint of this deployment (RATCHET_TOOL_ENDPOINTS)",
        )
    listed, error = _listing(name, endpoint)
    return LoopTools(
        endpoint=name, kind=endpoint.kind, tools=_merge(endpoint.tools, listed), error=error
    )


def _listing(name: str, endpoint: ToolEndpoint) -> tuple[list[ListedTool] | None, str | None]:
    config = tool_endpoint_config(name, endpoint)
    config = dataclasses.replace(config, timeout_s=min(config.timeout_s, LIST_TIMEOUT_S))
    if config.kind != "mcp":
        return None, None
    live = LiveToolEndpoint(config)
    try:
        return live.list_tools(), None
    except ToolCallError as exc:
        return None, f"cannot list the server's tools: {exc}"
    finally:
        live.close()


def _merge(allowed: list[str], listed: list[ListedTool] | None) -> list[LoopTool]:
    by_name = {tool.name: tool for tool in listed or []}
    return [
        LoopTool(
            name=name,
            allowed=name in allowed,
            listed=None if listed is None else name in by_name,
            read_only_hint=by_name[name].read_only_hint if name in by_name else None,
            description=by_name[name].description if name in by_name else None,
        )
        for name in sorted(set(allowed) | set(by_name))
    ]
