"""A bookshop's support agent that reports every episode to Ratchet.

The agent answers customers of a small bookshop with three tools (``find_order``,
``track_parcel``, ``refund_order``) over any OpenAI-compatible chat endpoint (``ratchet
serve``, vLLM, a hosted API): the usual tool loop, nothing Ratchet-specific. What Ratchet
needs is added at the end of each episode: the conversation as the model saw it (OpenAI
messages with tool calls and their results), the tools, the outcome, and, when the shop
knows it, the right answer, posted as ``ratchet.trace/v1`` with the light client
(``clients/python``). Later verdicts (a customer's rating, a support lead's correction) go in
as feedback on the trace.

    python agent.py --api http://127.0.0.1:8000 --loop bookshop --secret whsec_... \\
        --model-url http://127.0.0.1:8001/v1 --model my-model

Without ``--model-url`` the agent runs a scripted stand-in for the model (deterministic, and
wrong on some tickets, as a model in production is), so the example runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from ratchet_client import TraceClient

TOOLS = [
    {
        "name": "find_order",
        "description": "Look up a customer's order: its books, total and parcel tracking id.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "description": "e.g. PT-1001"}},
            "required": ["order_id"],
        },
    },
    {
        "name": "track_parcel",
        "description": "Where a parcel is: status and expected delivery date.",
        "parameters": {
            "type": "object",
            "properties": {"tracking_id": {"type": "string"}},
            "required": ["tracking_id"],
        },
    },
    {
        "name": "refund_order",
        "description": "Refund an order in full. Only for damaged or lost parcels.",
        "parameters": {
            "type": "object",
            "properties": {
                "order_id": {"type": "string"},
                "reason": {"type": "string", "enum": ["damaged", "lost"]},
            },
            "required": ["order_id", "reason"],
        },
    },
]

SYSTEM = (
    "You are the support assistant of Pageturner Books. Use the tools to look orders and "
    "parcels up; never guess. Answer in one or two sentences."
)

ORDERS = {
    "PT-1001": {"books": ["Middlemarch"], "total_eur": 14.5, "tracking_id": "TR-88"},
    "PT-1002": {"books": ["Dune", "Emma"], "total_eur": 27.0, "tracking_id": "TR-91"},
    "PT-1003": {"books": ["Ulysses"], "total_eur": 19.9, "tracking_id": "TR-95"},
}
PARCELS = {
    "TR-88": {"status": "delivered", "delivered_on": "2026-11-28"},
    "TR-91": {"status": "in transit", "expected": "2026-12-04"},
    "TR-95": {"status": "lost", "since": "2026-11-20"},
}


def call_tool(name: str, arguments: Mapping[str, Any]) -> str:
    """The shop's tools (a dictionary here; a database and a carrier's API in a real shop)."""
    if name == "find_order":
        order = ORDERS.get(str(arguments.get("order_id")))
        return json.dumps(order if order else {"error": "no such order"})
    if name == "track_parcel":
        parcel = PARCELS.get(str(arguments.get("tracking_id")))
        return json.dumps(parcel if parcel else {"error": "no such parcel"})
    if name == "refund_order":
        order = ORDERS.get(str(arguments.get("order_id")))
        if order is None:
            return json.dumps({"error": "no such order"})
        return json.dumps({"refunded_eur": order["total_eur"], "reason": arguments.get("reason")})
    return json.dumps({"error": f"unknown tool {name}"})


@dataclass(frozen=True)
class Ticket:
    """A customer's question and what the shop knows the right answer to be."""

    id: str
    question: str
    answer: str


TICKETS = [
    Ticket(
        "t-1", "Where is my order PT-1002?", "Order PT-1002 is in transit, expected 2026-12-04."
    ),
    Ticket("t-2", "Has order PT-1001 arrived?", "Order PT-1001 was delivered on 2026-11-28."),
    Ticket(
        "t-3",
        "My parcel for PT-1003 never came. Can I get my money back?",
        "Order PT-1003 was lost; it has been refunded in full (19.9 EUR).",
    ),
]

Model = Callable[[list[dict[str, Any]]], dict[str, Any]]


def openai_model(base_url: str, model: str, api_key: str | None) -> Model:
    """One chat completion with the tools, from any OpenAI-compatible server."""
    http = httpx.Client(base_url=base_url.rstrip("/"), timeout=120)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tools = [{"type": "function", "function": tool} for tool in TOOLS]

    def complete(messages: list[dict[str, Any]]) -> dict[str, Any]:
        response = http.post(
            "/chat/completions",
            json={"model": model, "messages": messages, "tools": tools, "temperature": 0},
            headers=headers,
        )
        response.raise_for_status()
        message: dict[str, Any] = response.json()["choices"][0]["message"]
        return message

    return complete


def scripted_model(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A stand-in for the model: looks the order up, then the parcel, then answers, and
    gets the refund ticket wrong (it never calls refund_order), as a weak model does."""

    def call(name: str, **arguments: str) -> dict[str, Any]:
        function = {"name": name, "arguments": json.dumps(arguments)}
        call_id = f"call_{uuid.uuid4().hex[:8]}"
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }

    question = next(m["content"] for m in messages if m["role"] == "user")
    order_id = next(word.strip("?.,") for word in question.split() if word.startswith("PT-"))
    results = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
    if not results:
        return call("find_order", order_id=order_id)
    if len(results) == 1:
        return call("track_parcel", tracking_id=results[0]["tracking_id"])
    parcel = results[1]
    if parcel["status"] == "delivered":
        text = f"Order {order_id} was delivered on {parcel['delivered_on']}."
    elif parcel["status"] == "in transit":
        text = f"Order {order_id} is in transit, expected {parcel['expected']}."
    else:
        text = f"Order {order_id} is on its way; please wait a few more days."
    return {"role": "assistant", "content": text}


def run_episode(model: Model, ticket: Ticket, *, max_turns: int = 6) -> list[dict[str, Any]]:
    """The tool loop: the model's messages, the tools' results, until it answers."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ticket.question},
    ]
    for _ in range(max_turns):
        reply = model(messages)
        messages.append(reply)
        if not reply.get("tool_calls"):
            break
        for call in reply["tool_calls"]:
            function = call["function"]
            arguments = json.loads(function["arguments"] or "{}")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": function["name"],
                    "content": call_tool(function["name"], arguments),
                }
            )
    return messages


def to_trace(ticket: Ticket, messages: list[dict[str, Any]], model_version: str) -> dict[str, Any]:
    """The episode as ``ratchet.trace/v1``: OpenAI messages, with each tool call's JSON
    arguments as an object, the tools, the outcome and the shop's right answer."""
    converted = []
    for message in messages:
        item: dict[str, Any] = {"role": message["role"], "content": message.get("content")}
        if message.get("tool_calls"):
            item["tool_calls"] = [
                {
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": json.loads(call["function"]["arguments"] or "{}"),
                }
                for call in message["tool_calls"]
            ]
        if message["role"] == "tool":
            item["tool_call_id"] = message["tool_call_id"]
            item["name"] = message["name"]
        converted.append(item)
    answer = converted[-1].get("content") or ""
    solved = answer.strip() == ticket.answer
    outcome: dict[str, Any] = {"success": solved}
    if not solved:
        outcome["error"] = {"kind": "wrong_answer", "message": "the customer's issue is open"}
    return {
        "schema": "ratchet.trace/v1",
        "external_id": f"{ticket.id}-{uuid.uuid4().hex[:8]}",
        "model_version": model_version,
        "tools": TOOLS,
        "messages": converted,
        "outcome": outcome,
        "reference_answer": ticket.answer,
        "metadata": {"shop": "pageturner", "ticket": ticket.id},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", default="http://127.0.0.1:8000", help="Ratchet's api")
    parser.add_argument("--loop", default="bookshop", help="the loop's name")
    parser.add_argument("--secret", required=True, help="the loop's signing secret (whsec_...)")
    parser.add_argument("--model-url", default=None, help="an OpenAI-compatible /v1 base URL")
    parser.add_argument("--model", default="champion", help="the served model's name")
    parser.add_argument("--api-key", default=None, help="the model server's key, if any")
    args = parser.parse_args(argv)
    model = (
        openai_model(args.model_url, args.model, args.api_key) if args.model_url else scripted_model
    )
    version = args.model if args.model_url else "scripted"
    with TraceClient(args.api, args.loop, args.secret) as client:
        for ticket in TICKETS:
            trace = to_trace(ticket, run_episode(model, ticket), version)
            result = client.post([trace])
            print(
                f"{trace['external_id']}: success={trace['outcome']['success']} "
                f"stored={result.accepted}"
            )
            # The customer rates the answer later; a wrong one gets the lead's correction.
            if trace["outcome"]["success"]:
                client.feedback(trace["external_id"], score=1.0, label="resolved")
            else:
                client.feedback(
                    trace["external_id"], score=0.0, label="unresolved", correction=ticket.answer
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
