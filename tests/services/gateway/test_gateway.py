"""The capture gateway in front of a real model server: a tool-calling agent's calls become
one trace with what the server sampled; sessions by header and by prefix; outcomes."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from services.gateway.sessions import external_id
from tests.services.api.support import body_of, signed_headers
from tests.services.gateway.conftest import MODEL, Stack
from tests.services.modelserver.conftest import LISTING, TOOLCALC_TOOLS, ServerThread

pytestmark = pytest.mark.slow


def run_agent(stack: Stack, **extra: Any) -> list[Any]:
    """A two-turn tool-calling agent written with the openai client: it asks, runs the tool
    the model calls, and gets the answer. Returns the two completions."""
    client = stack.openai()
    messages: list[Any] = [
        {"role": "system", "content": LISTING},
        {"role": "user", "content": "$pear"},
    ]
    first = client.chat.completions.create(
        model="gpt-4o", messages=messages, tools=TOOLCALC_TOOLS, temperature=0, **extra
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get", {"item": "pear"})
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12"},
    ]
    second = client.chat.completions.create(
        model="gpt-4o", messages=messages, tools=TOOLCALC_TOOLS, temperature=0, **extra
    )
    assert second.choices[0].message.content == "12"
    return [first, second]


def sampled_directly(server: ServerThread, messages: list[Any]) -> list[int]:
    """What the model server samples for ``messages`` asked directly (greedy)."""
    answer = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "tools": TOOLCALC_TOOLS,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=30,
    ).json()
    ids: list[int] = answer["choices"][0]["token_ids"]
    return ids


def close(stack: Stack, session: str) -> dict[str, Any]:
    response = httpx.post(
        f"{stack.api}/v1/loops/gw-agent/sessions/{session}/close",
        headers={"Authorization": f"Bearer {stack.key}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    closed: dict[str, Any] = response.json()
    return closed


def test_a_tool_calling_agent_becomes_one_trace_of_what_the_server_sampled(
    stack: Stack, model_server: ServerThread
) -> None:
    first, second = run_agent(stack)

    # The agent got what it would have got without the gateway: no token ids or log-probs.
    assert "token_ids" not in (first.choices[0].model_extra or {})
    assert first.choices[0].logprobs is None
    stack.wait_stored(2)
    closed = close(stack, second.id)

    assert closed["status"] == "closed" and closed["calls"] == 2
    traces = stack.traces()
    assert len(traces) == 1
    body = traces[0].body
    assert traces[0].external_id == external_id(closed["session_id"])
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    call = body["messages"][2]["tool_calls"][0]
    assert (call["name"], call["arguments"]) == ("get", {"item": "pear"})
    assert body["messages"][3] == {"role": "tool", "content": "12", "tool_call_id": call["id"]}
    assert body["messages"][4]["content"] == "12"
    assert [t["name"] for t in body["tools"]] == ["add", "get"]
    assert body["tools"][1]["parameters"] == TOOLCALC_TOOLS[1]["function"]["parameters"]  # type: ignore[index]
    # Token ids (and one log-prob each) of both replies, as the server samples them.
    asked = [{"role": "system", "content": LISTING}, {"role": "user", "content": "$pear"}]
    assert body["messages"][2]["token_ids"] == sampled_directly(model_server, asked)
    later = [
        *asked,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call["id"], "content": "12"},
    ]
    assert body["messages"][4]["token_ids"] == sampled_directly(model_server, later)
    for reply in (body["messages"][2], body["messages"][4]):
        assert len(reply["logprobs"]) == len(reply["token_ids"])
    # The serving version and the server's response ids.
    assert traces[0].model_version == body["model_version"] and body["model_version"]
    assert body["response_ids"] == [first.id, second.id]
    assert body["metadata"]["gateway"]["calls"] == 2


def test_streaming_calls_are_captured_and_answered_as_without_the_gateway(
    stack: Stack,
) -> None:
    client = stack.openai()
    chunks = list(
        client.chat.completions.create(
            model="x",
            messages=[{"role": "system", "content": LISTING}, {"role": "user", "content": "$pear"}],
            tools=TOOLCALC_TOOLS,
            temperature=0,
            stream=True,
        )
    )

    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls if c.function] == ["get"]
    assert all("token_ids" not in (chunk.choices[0].model_extra or {}) for chunk in chunks)
    [stored] = stack.wait_stored(1)
    reply = stored.body["reply"]
    assert reply["tool_calls"][0]["name"] == "get" and reply["token_ids"]
    assert len(reply["logprobs"]) == len(reply["token_ids"])


def test_calls_group_by_header_and_by_conversation_prefix(stack: Stack) -> None:
    # Two agents run under one header each; two more are grouped by their conversations.
    run_agent(stack, extra_headers={"X-Ratchet-Session": "run-a"})
    run_agent(stack, user="run-b")
    run_agent(stack)
    run_agent(stack)
    stack.wait_stored(8)
    for session in ("run-a", "run-b"):
        assert close(stack, session)["calls"] == 2
    open_sessions = [s for s in stack.sessions() if s.status == "open"]
    # The two prefix-grouped runs have the same conversation: the second run's first call
    # does not extend the first run's last one, so each run is a session of two calls.
    assert sorted(s.call_count for s in open_sessions) == [2, 2]
    for session in open_sessions:
        close(stack, session.key)
    assert len(stack.traces()) == 4
    assert {t.body["metadata"]["gateway"]["calls"] for t in stack.traces()} == {2}
    keys = {t.body["metadata"]["gateway"]["session"] for t in stack.traces()}
    assert {"run-a", "run-b"} <= keys


def post_outcome(
    stack: Stack, session: str, outcome: dict[str, Any], *, msg_id: str | None = None
) -> httpx.Response:
    body = body_of(outcome)
    headers = signed_headers(stack.loop["signing_secret"], body, msg_id=msg_id)
    return httpx.post(
        f"{stack.api}/v1/loops/gw-agent/sessions/{session}/outcome",
        content=body,
        headers=headers,
        timeout=30,
    )


def test_an_outcome_joins_its_session_before_and_after_close(stack: Stack) -> None:
    run_agent(stack, user="before")
    run_agent(stack, user="after")
    stack.wait_stored(4)

    early = post_outcome(stack, "before", {"success": True, "reference_answer": "12"})
    assert early.status_code == 201 and early.json()["status"] == "waiting"
    close(stack, "before")
    close(stack, "after")
    late = post_outcome(stack, "after", {"success": False, "label": "wrong"})
    assert late.status_code == 201, late.text
    assert late.json()["status"] == "applied"

    traces = {t.body["metadata"]["gateway"]["session"]: t for t in stack.traces()}
    before = traces["before"]
    assert before.body["outcome"]["success"] is True and before.success is True
    assert before.body["reference_answer"] == "12"
    from sqlalchemy import select

    from services.db.models import TraceFeedback

    with stack.session_factory() as session:
        feedback = {f.trace_id: f for f in session.scalars(select(TraceFeedback)).all()}
    assert feedback[before.id].correction == "12" and feedback[before.id].score == 1.0
    after = traces["after"]
    assert feedback[after.id].label == "wrong" and feedback[after.id].score == 0.0
    assert after.curated_at is None  # back to curation

    # The loop page shows the sessions and their outcomes.
    page = httpx.get(f"{stack.api}/loops/gw-agent", timeout=30).text
    assert "0 open, 2 closed, 2 outcomes" in page
    assert 'data-session="before" data-status="closed"' in page
    assert "failure" in page and "wrong" in page


def test_a_replayed_outcome_is_refused(stack: Stack) -> None:
    msg_id = f"msg_{uuid.uuid4().hex}"
    first = post_outcome(stack, "s1", {"score": 0.5}, msg_id=msg_id)
    assert first.status_code == 201
    again = post_outcome(stack, "s1", {"score": 0.5}, msg_id=msg_id)
    assert again.status_code == 409 and again.json()["error"]["code"] == "replayed"
    unsigned = httpx.post(
        f"{stack.api}/v1/loops/gw-agent/sessions/s1/outcome", json={"score": 1}, timeout=30
    )
    assert unsigned.status_code == 401
    empty = post_outcome(stack, "s1", {})
    assert empty.status_code == 422
