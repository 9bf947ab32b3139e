"""A real MCP server for the tests, written with the official SDK: an airport desk's tools.

``python mcp_tools_server.py --calls FILE [--http PORT]`` serves over stdio (default) or
streamable HTTP on 127.0.0.1:PORT at ``/mcp``. Every tool call appends one JSON line
``{"tool": ..., "arguments": {...}}`` to FILE before it answers, so a test can count what
reached the server (a stdio server gets the SDK's minimal environment, hence the argument).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

READ_ONLY = ToolAnnotations(readOnlyHint=True)
server = MCPServer("airport-desk", log_level="WARNING")
CALLS: Path | None = None


def _count(tool: str, **arguments: Any) -> None:
    assert CALLS is not None
    with CALLS.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"tool": tool, "arguments": arguments}) + "\n")


@server.tool(annotations=READ_ONLY)
def gate_walk_minutes(gate: str) -> str:
    """Walking minutes from security to a gate."""
    _count("gate_walk_minutes", gate=gate)
    return f"{gate}: an 11 minute walk"


@server.tool(annotations=READ_ONLY)
def flight_status(flight: str) -> str:
    """A flight's departure time and gate."""
    _count("flight_status", flight=flight)
    return f"{flight} departs 14:05 from gate D4"


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True))
def rebook(flight: str) -> str:
    """Rebook the passenger (a side effect: never allow-listed)."""
    _count("rebook", flight=flight)
    return f"rebooked on {flight}"


@server.tool(annotations=READ_ONLY)
def slow_lookup(seconds: float) -> str:
    """Answers after ``seconds``."""
    _count("slow_lookup", seconds=seconds)
    time.sleep(seconds)
    return "slow answer"


@server.tool(annotations=READ_ONLY)
def baggage_manifest(size: int) -> str:
    """A manifest of ``size`` characters."""
    _count("baggage_manifest", size=size)
    return "x" * size


@server.tool(annotations=READ_ONLY)
def has_variable(name: str) -> str:
    """Whether this server's environment holds a variable (what the job handed it)."""
    _count("has_variable", name=name)
    return "yes" if name in os.environ else "no"


@server.tool()
def broken(code: str) -> str:
    """Always fails: the tool's own error."""
    _count("broken", code=code)
    raise ValueError(f"no such code {code}")


def main() -> None:
    global CALLS
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=Path, required=True)
    parser.add_argument("--http", type=int)
    args = parser.parse_args()
    CALLS = args.calls
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
