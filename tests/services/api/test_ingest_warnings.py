"""The webhook's answer warns of what the loop's curation will make of a trace: a replay
loop rejects a trace with no tools (``no_tools``, the reason curation then records), and
cannot replay a call of a tool the trace does not list (``unlisted_tool``). Real api,
Postgres and curation pipeline."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient
from ratchet_client import IngestResult

from services.db.session import SessionFactory
from tests.services.api.support import ADMIN, create_loop, curate_once, signed_headers

TOOLS = [
    {
        "name": "get_order",
        "description": "Look up an order by id",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
        },
    }
]


def order_trace(external_id: str, *, tools: list[dict[str, Any]], called: str) -> dict[str, Any]:
    """A failed support episode with a reference answer: a task, if its tools allow (each
    external id asks about its own order, so no two are the same task; the order code is a
    fact the reference's `facts` rule checks)."""
    order = f"A-{1000 + sum(map(ord, external_id))}"
    return {
        "schema": "ratchet.trace/v1",
        "external_id": external_id,
        "tools": tools,
        "messages": [
            {"role": "user", "content": f"Where is my order {order}?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "name": called, "arguments": {"order_id": order}}],
            },
            {
                "role": "tool",
                "tool_call_id": "c1",
                "name": called,
                "content": '{"status": "shipped"}',
            },
            {"role": "assistant", "content": f"Order {order} was cancelled."},
        ],
        "outcome": {"success": False, "error": {"kind": "wrong_answer"}},
        "reference_answer": f"Order {order} has shipped.",
    }


def post(client: TestClient, loop: dict[str, Any], traces: list[dict[str, Any]]) -> Any:
    body = json.dumps({"traces": traces}).encode()
    response = client.post(
        f"/v1/loops/{loop['name']}/traces",
        content=body,
        headers=signed_headers(loop["signing_secret"], body),
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_a_replay_loop_warns_of_what_curation_will_reject_or_cannot_replay(
    client: TestClient, session_factory: SessionFactory
) -> None:
    loop = create_loop(client, "orders", environment="replay")
    answer = post(
        client,
        loop,
        [
            order_trace("fine", tools=TOOLS, called="get_order"),
            order_trace("toolless", tools=[], called="get_order"),
            order_trace("unlisted", tools=TOOLS, called="refund_order"),
        ],
    )
    assert answer["accepted"] == 3
    fine, toolless, unlisted = answer["results"]
    assert fine["warnings"] == []
    assert toolless["warnings"] == [
        {
            "code": "no_tools",
            "path": "tools",
            "message": "curation will reject this trace (no_tools): it lists no tools, and "
            "replay needs the tools the agent was given",
        }
    ]
    assert unlisted["warnings"] == [
        {
            "code": "unlisted_tool",
            "path": "messages.1.tool_calls.0.name",
            "message": "calls 'refund_order', which the trace's tools do not list: a replay "
            "task offers only the listed tools, so this call cannot be replayed (it gets "
            "`error: unknown tool refund_order`); add the tool to the trace's tools",
        }
    ]

    # What curation then made of them is what the warnings said.
    curate_once(session_factory, "orders")
    verdicts = {
        t["external_id"]: (t["curation_outcome"], t["reason"])
        for t in client.get("/v1/loops/orders/traces", headers=ADMIN).json()["traces"]
    }
    assert verdicts["toolless"][0] == "rejected"
    assert verdicts["toolless"][1] is not None and verdicts["toolless"][1].startswith("no_tools")
    assert verdicts["fine"][0] == verdicts["unlisted"][0] == "task"

    # A repost is a duplicate: its body was not stored, so it carries no warning.
    again = post(client, loop, [order_trace("toolless", tools=[], called="get_order")])
    assert again["results"][0]["status"] == "duplicate"
    assert again["results"][0]["warnings"] == []


def test_a_loop_of_another_environment_gets_no_replay_warnings(client: TestClient) -> None:
    loop = create_loop(client, "calc")  # toolcalc
    answer = post(client, loop, [order_trace("toolless", tools=[], called="get_order")])
    assert answer["results"][0]["warnings"] == []


def test_the_light_client_lists_the_warnings_of_a_post() -> None:
    result = IngestResult()
    result.add(
        {
            "accepted": 2,
            "results": [
                {"index": 0, "external_id": "a", "status": "accepted", "warnings": []},
                {
                    "index": 1,
                    "external_id": "b",
                    "status": "accepted",
                    "warnings": [{"code": "no_tools", "path": "tools", "message": "m"}],
                },
            ],
        },
        offset=500,
    )
    assert result.warnings == [
        {"index": 501, "external_id": "b", "code": "no_tools", "path": "tools", "message": "m"}
    ]
