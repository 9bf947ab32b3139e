"""The bookshop's stdio MCP server, started as a loop would start it and called through the
official ``mcp`` client: it lists the four tools with honest hints, and answers every call a
trace recorded with the recorded result, and the calls no trace made as the shop would."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest

from tests.examples.support import EXAMPLE, example_module

mcp = pytest.importorskip("mcp")
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

traffic_module = example_module("traffic")
bookshop = example_module("bookshop")

USAGE = "error: track_parcel is missing required argument(s) carrier"


async def _session_calls(seed: int, calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    params = StdioServerParameters(
        command=sys.executable, args=[str(EXAMPLE / "mcp_server.py"), "--seed", str(seed)]
    )
    async with (
        stdio_client(params) as (read, write),
        mcp.ClientSession(read, write) as session,
    ):
        await session.initialize()
        listed = await session.list_tools()
        answers = []
        for name, arguments in calls:
            result = await session.call_tool(name, arguments)
            answers.append(result.content[0].text)
    return {"tools": listed.tools, "answers": answers}


def test_the_server_answers_as_the_recorded_traces_and_beyond_them() -> None:
    traffic = traffic_module.generate(seed=5, count=200)
    recorded: list[tuple[str, dict[str, Any], str]] = []
    for trace in traffic.traces[::3]:
        results = {
            m["tool_call_id"]: m["content"] for m in trace["messages"] if m["role"] == "tool"
        }
        for message in trace["messages"]:
            for call in message.get("tool_calls") or ():
                if results[call["id"]] == USAGE:
                    continue  # the sandbox refuses this call by the task's schema first
                recorded.append((call["name"], call["arguments"], results[call["id"]]))
    shop = bookshop.Shop(5)
    order = shop.orders[shop.order_ids[0]]
    parcel = order.parcel
    wrong = next(c for c in bookshop.CARRIERS if c != parcel.carrier)
    unrecorded = [
        ("track_parcel", {"tracking_id": parcel.tracking_id, "carrier": parcel.carrier}),
        ("track_parcel", {"tracking_id": parcel.tracking_id, "carrier": wrong}),
        ("track_parcel", {"tracking_id": parcel.tracking_id}),
    ]
    calls = [(name, arguments) for name, arguments, _ in recorded] + unrecorded
    served = asyncio.run(_session_calls(5, calls))

    tools = {tool.name: tool for tool in served["tools"]}
    assert set(tools) == {"find_order", "track_parcel", "refund_order", "check_stock"}
    assert tools["find_order"].annotations.read_only_hint is True
    assert tools["refund_order"].annotations.read_only_hint is False
    assert tools["track_parcel"].input_schema["required"] == ["tracking_id"]
    answers = served["answers"]
    assert len(recorded) > 50
    assert answers[: len(recorded)] == [result for _, _, result in recorded]
    with_carrier, wrong_carrier, without = answers[len(recorded) :]
    assert json.loads(with_carrier) == parcel.to_result()
    assert json.loads(wrong_carrier) == {
        "error": f"parcel {parcel.tracking_id} is not with {wrong}"
    }
    assert json.loads(without) == parcel.to_result()  # API v1's shape is served too
