"""A bookshop's support agent that reports every episode to Ratchet.

The agent answers customers of a small bookshop with four tools (``find_order``,
``track_parcel``, ``refund_order``, ``check_stock``; ``bookshop.py``) over any
OpenAI-compatible chat endpoint (``ratchet serve``, vLLM, a hosted API): the usual tool loop,
nothing Ratchet-specific. What Ratchet needs is added at the end of each episode: the
conversation as the model saw it (OpenAI messages with tool calls and their results), the
tools, the outcome, and the shop's right answer, posted as ``ratchet.trace/v1`` with the
light client (``clients/python``). Later verdicts (a customer's rating, a support lead's
correction) go in as feedback on the trace.

    python agent.py --loop bookshop --secret-file bookshop.json \\
        --model-url http://127.0.0.1:8001/v1 --model my-model

Ratchet's api is ``--api``, else ``$RATCHET_PUBLIC_URL``, else
``http://$RATCHET_API_HOST:$RATCHET_API_PORT`` (``127.0.0.1:8000``), as the ``ratchet``
commands find it. The loop's signing secret is ``--secret``, or the file ``ratchet loop
create --secret-file`` wrote (it names the loop too). Without ``--model-url`` the agent runs a
scripted stand-in for the model (deterministic, and wrong on some tickets, as a model in
production is), so the example runs anywhere. ``--tools-version v2`` gives it the tools after
the shop's carrier change (``track_parcel`` requires ``carrier``), which the stand-in, like an
agent nobody updated, still calls the old way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bookshop import SYSTEM_PROMPT, TOOLS, Shop, eur
from ratchet_client import RatchetError, RatchetUnreachable, TraceClient
from tickets import Ticket, TicketMaker

Model = Callable[[list[dict[str, Any]]], dict[str, Any]]


class AgentError(Exception):
    """Why the agent cannot run, as the one line it prints."""


def openai_model(base_url: str, model: str, api_key: str | None, tools_version: str) -> Model:
    """One chat completion with the tools, from any OpenAI-compatible server."""
    http = httpx.Client(base_url=base_url.rstrip("/"), timeout=120)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tools = [{"type": "function", "function": tool} for tool in TOOLS[tools_version]]

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


def _call(name: str, **arguments: str) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function", "function": function}
        ],
    }


def scripted_model(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A stand-in for the model: reads the ticket's order id or quoted title, looks them up
    and answers in the shop's words. It never refunds (it tells the customer to wait), and
    calls ``track_parcel`` without a carrier (answering from memory when that fails), as a
    weak model does."""
    question = next(str(m["content"]) for m in messages if m["role"] == "user")
    results = [_result(m["content"]) for m in messages if m["role"] == "tool"]
    order = re.search(r"PT-\d{5}", question)
    if order is not None:
        return _order_reply(question.lower(), order.group(0), results)
    title = re.search(r"(?:^|\s)'([^']+)'", question)
    if title is None:
        return {"role": "assistant", "content": "Which order or book is this about?"}
    if not results:
        return _call("check_stock", title=title.group(1))
    return {"role": "assistant", "content": _stock_answer(results[0])}


def _order_reply(question: str, order_id: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    if not results:
        return _call("find_order", order_id=order_id)
    found = results[0]
    if "error" in found:
        text = f"Sorry, I could not find order {order_id}."
    elif any(word in question for word in ("pay", "total", "cost", "charged", "come to")):
        text = f"Order {order_id} came to {eur(found['total_eur'])}."
    elif len(results) == 1:
        return _call("track_parcel", tracking_id=found["tracking_id"])
    elif "refund" in question or "money back" in question:
        text = f"Order {order_id} is on its way; please wait a few more days."
    elif "status" not in results[1]:
        text = f"Order {order_id} is on its way and should arrive in a few days."
    elif results[1]["status"] == "delivered":
        text = f"Order {order_id} was delivered on {results[1]['delivered_on']}."
    else:
        parcel = results[1]
        text = f"Order {order_id} is in transit with {parcel['carrier']}, expected on "
        text += f"{parcel.get('expected')}."
    return {"role": "assistant", "content": text}


def _result(content: str) -> dict[str, Any]:
    """A tool's result as an object (a usage error's text under ``error``)."""
    try:
        parsed = json.loads(content)
    except ValueError:
        return {"error": content}
    return parsed if isinstance(parsed, dict) else {"result": parsed}


def _stock_answer(book: Mapping[str, Any]) -> str:
    if "error" in book:
        return "Sorry, we don't seem to carry that book."
    if book["in_stock"]:
        return (
            f"Yes: {book['in_stock']} copies of '{book['title']}' are in stock at "
            f"{eur(book['price_eur'])}."
        )
    return f"'{book['title']}' is out of stock until {book['restock_on']}."


def run_episode(
    model: Model, shop: Shop, tools_version: str, ticket: Ticket, *, max_turns: int = 6
) -> list[dict[str, Any]]:
    """The tool loop: the model's messages, the tools' results, until it answers."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": ticket.question},
    ]
    for _ in range(max_turns):
        reply = model(messages)
        messages.append(reply)
        if not reply.get("tool_calls"):
            break
        for call in reply["tool_calls"]:
            function = call["function"]
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": function["name"],
                    "content": shop.call(tools_version, function["name"], function["arguments"]),
                }
            )
    return messages


def to_trace(
    ticket: Ticket, messages: list[dict[str, Any]], model_version: str, tools_version: str
) -> dict[str, Any]:
    """The episode as ``ratchet.trace/v1``: OpenAI messages, with each tool call's JSON
    arguments as an object, the tools, the outcome and the shop's right answer. The shop
    counts an answer right when it states every fact of the reference."""
    converted = []
    for message in messages:
        item: dict[str, Any] = {"role": message["role"], "content": message.get("content")}
        if message.get("tool_calls"):
            item["tool_calls"] = [
                {
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": _arguments(call["function"]["arguments"]),
                }
                for call in message["tool_calls"]
            ]
        if message["role"] == "tool":
            item["tool_call_id"] = message["tool_call_id"]
            item["name"] = message["name"]
        converted.append(item)
    answer = converted[-1].get("content") or ""
    solved = all(fact in answer for fact in ticket.stated_facts)
    outcome: dict[str, Any] = {"success": solved}
    if not solved:
        outcome["error"] = {"kind": "wrong_answer", "message": "the customer's issue is open"}
    return {
        "schema": "ratchet.trace/v1",
        "external_id": f"{ticket.kind}-{uuid.uuid4().hex[:8]}",
        "model_version": model_version,
        "tools": TOOLS[tools_version],
        "messages": converted,
        "outcome": outcome,
        "reference_answer": ticket.reference,
        "metadata": {"shop": "pageturner", "ticket": ticket.kind, "tool_api": tools_version},
    }


def _arguments(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw or "{}")
    except ValueError:
        return raw  # the model's malformed arguments, as it wrote them


def api_url(given: str | None, environ: Mapping[str, str]) -> str:
    """Ratchet's api, found as the ``ratchet`` commands find it."""
    if given:
        return given.rstrip("/")
    if environ.get("RATCHET_PUBLIC_URL"):
        return environ["RATCHET_PUBLIC_URL"].rstrip("/")
    host = environ.get("RATCHET_API_HOST") or "127.0.0.1"
    return f"http://{host}:{environ.get('RATCHET_API_PORT') or 8000}"


def credentials(args: argparse.Namespace) -> tuple[str, str]:
    """The loop and its signing secret, from the options or the secret file."""
    loop, secret = args.loop, args.secret
    if args.secret_file is not None:
        try:
            document = json.loads(Path(args.secret_file).read_text())
        except (OSError, ValueError) as exc:
            raise AgentError(f"cannot read the secret file {args.secret_file}: {exc}") from None
        if not isinstance(document, dict) or not document.get("signing_secret"):
            raise AgentError(f"{args.secret_file} holds no signing_secret")
        secret = secret or str(document["signing_secret"])
        loop = loop or document.get("loop")
    if not secret:
        raise AgentError("no signing secret: pass --secret whsec_... or --secret-file PATH")
    return str(loop or "bookshop"), str(secret)


def check_api(url: str) -> None:
    """Fail at once, in one line, when nothing answers at ``url``."""
    try:
        httpx.get(f"{url}/healthz", timeout=5).raise_for_status()
    except httpx.HTTPError as exc:
        raise AgentError(
            f"cannot reach Ratchet's api at {url} ({exc.__class__.__name__}: {exc}); start it "
            "with `ratchet up`, or point RATCHET_PUBLIC_URL (or --api) at it"
        ) from None


def post_episodes(args: argparse.Namespace, url: str, loop: str, secret: str) -> None:
    shop = Shop(args.seed)
    maker = TicketMaker(shop, random.Random(f"agent/{args.seed}"))
    if args.model_url:
        model = openai_model(args.model_url, args.model, args.api_key, args.tools_version)
        version = args.model
    else:
        model, version = scripted_model, "scripted"
    with TraceClient(url, loop, secret, max_retries=2, backoff_s=0.5) as client:
        for _ in range(args.tickets):
            ticket = maker.next()
            messages = run_episode(model, shop, args.tools_version, ticket)
            trace = to_trace(ticket, messages, version, args.tools_version)
            result = client.post([trace])
            success = trace["outcome"]["success"]
            print(f"{trace['external_id']}: success={success} stored={result.accepted}")
            # The customer rates the answer later; a wrong one gets the lead's correction.
            if success:
                client.feedback(trace["external_id"], score=1.0, label="resolved")
            else:
                client.feedback(
                    trace["external_id"], score=0.0, label="unresolved", correction=ticket.reference
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", default=None, help="Ratchet's api (default: see above)")
    parser.add_argument("--loop", default=None, help="the loop's name (default: bookshop)")
    parser.add_argument("--secret", default=None, help="the loop's signing secret (whsec_...)")
    parser.add_argument(
        "--secret-file", default=None, help="the file `ratchet loop create --secret-file` wrote"
    )
    parser.add_argument("--model-url", default=None, help="an OpenAI-compatible /v1 base URL")
    parser.add_argument("--model", default="champion", help="the served model's name")
    parser.add_argument("--api-key", default=None, help="the model server's key, if any")
    parser.add_argument("--tickets", type=int, default=6, help="customer tickets to answer")
    parser.add_argument("--seed", type=int, default=0, help="the shop's and the tickets' seed")
    parser.add_argument("--tools-version", choices=tuple(TOOLS), default="v1")
    args = parser.parse_args(argv)
    try:
        url = api_url(args.api, os.environ)
        loop, secret = credentials(args)
        check_api(url)
        post_episodes(args, url, loop, secret)
    except AgentError as exc:
        print(f"agent.py: {exc}", file=sys.stderr)
        return 2
    except (RatchetError, RatchetUnreachable, ValueError) as exc:
        print(f"agent.py: Ratchet refused or did not answer: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
