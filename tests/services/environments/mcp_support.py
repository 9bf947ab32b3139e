"""The tests' airport desk: its tools as traces list them, a trace whose agent never called
``gate_walk_minutes``, and the real MCP server of ``mcp_tools_server.py`` over stdio or
streamable HTTP, with the calls that reached it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from services.environments.replay.tool_config import ToolEndpointConfig
from tests.support import free_port

SERVER = Path(__file__).with_name("mcp_tools_server.py")
ENDPOINT = "desk"


def _tool(tool: str, description: str, **properties: str) -> dict[str, Any]:
    return {
        "name": tool,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {key: {"type": kind} for key, kind in properties.items()},
            "required": sorted(properties),
        },
    }


TOOLS = [
    _tool("flight_status", "A flight's departure time and gate.", flight="string"),
    _tool("gate_walk_minutes", "Walking minutes to a gate.", gate="string"),
    _tool("rebook", "Rebook the passenger.", flight="string"),
    _tool("slow_lookup", "Answers after some seconds.", seconds="number"),
    _tool("baggage_manifest", "A manifest of some size.", size="integer"),
    _tool("has_variable", "Whether the server sees a variable.", name="string"),
    _tool("broken", "Always fails.", code="string"),
]
STATUS = "LX318 departs 14:05 from gate D4"


def airport_trace(
    external_id: str = "gate-1", *, endpoint: str | None = ENDPOINT
) -> dict[str, Any]:
    """The agent looked up the flight, never asked how far the gate is, and guessed."""
    trace: dict[str, Any] = {
        "schema": "ratchet.trace/v1",
        "external_id": external_id,
        "model_version": "desk-agent-1",
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": "You are the airport connections desk."},
            {"role": "user", "content": f"How do I make LX318? ({external_id})"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "name": "flight_status", "arguments": {"flight": "LX318"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "flight_status", "content": STATUS},
            {"role": "assistant", "content": "LX318 leaves 14:05 from D4, a short walk."},
        ],
        "outcome": {"success": False, "score": 0.0},
        "reference_answer": r".*\b11\b.*",
        "metadata": {"reference_match": {"rule": "regex"}},
    }
    if endpoint is not None:
        trace["ratchet"] = {"policy": {"tool_endpoint": endpoint}}
    return trace


def stdio_command(calls: Path) -> list[str]:
    return [sys.executable, str(SERVER), "--calls", str(calls)]


def config(
    *,
    command: list[str] | None = None,
    url: str | None = None,
    tools: tuple[str, ...] = ("gate_walk_minutes", "flight_status"),
    **terms: Any,
) -> ToolEndpointConfig:
    return ToolEndpointConfig(
        name=ENDPOINT,
        kind="mcp",
        tools=frozenset(tools),
        command=tuple(command) if command else None,
        url=url,
        **terms,
    )


def calls_made(calls: Path) -> list[dict[str, Any]]:
    """Every call that reached the server, in order."""
    if not calls.exists():
        return []
    return [json.loads(line) for line in calls.read_text().splitlines() if line.strip()]


@contextmanager
def http_server(calls: Path) -> Iterator[str]:
    """The server over streamable HTTP; yields its URL once it accepts connections."""
    port = free_port()
    process = subprocess.Popen(
        [*stdio_command(calls), "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the MCP test server did not start") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=10)
