"""Pure rules: which call continues which (digests), the Responses API read as chat, and a
session of calls made into one trace."""

from __future__ import annotations

import datetime as dt

import pytest

from services.gateway.conversation import chat_messages, conversation_digests
from services.gateway.errors import GatewayError
from services.gateway.responses import to_chat
from services.gateway.sessions import StoredCall, build_trace
from services.ingest.schema import validate_trace

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "price of a pear?"}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get", "arguments": '{"item":"pear"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "12"}


def test_a_reply_echoed_back_with_new_ids_and_spacing_still_continues_its_conversation() -> None:
    first = chat_messages([SYSTEM, USER])
    reply = chat_messages([CALL])[0]
    _, after = conversation_digests(first, reply)
    echoed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "x9",
                "type": "function",
                "function": {"name": "get", "arguments": '{ "item": "pear" }'},
            }
        ],
    }
    prefixes, _ = conversation_digests(chat_messages([SYSTEM, USER, echoed, RESULT]), None)
    assert after in prefixes
    other, _ = conversation_digests(
        chat_messages([SYSTEM, {"role": "user", "content": "no"}, echoed]), None
    )
    assert after not in other


def test_the_responses_api_reads_as_chat_and_refuses_state() -> None:
    chat = to_chat(
        {
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "price?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "12"},
            ],
            "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}],
            "max_output_tokens": 5,
            "store": True,
        }
    )
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert chat["messages"][1]["content"] == "price?"
    assert chat["messages"][2]["tool_calls"][0]["id"] == "c1"
    assert chat["tools"][0]["function"]["name"] == "get" and chat["max_tokens"] == 5
    for refused in ({"previous_response_id": "resp_1"}, {"tools": [{"type": "web_search"}]}):
        with pytest.raises(GatewayError) as raised:
            to_chat({"input": "hi", **refused})
        assert raised.value.status == 400


def _call(index: int, prompt: str, completion: str) -> StoredCall:
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=index)
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "tools": [],
        "prompt": prompt,
        "reply": {
            "role": "assistant",
            "content": completion,
            "token_ids": [1, 2],
            "logprobs": [-0.1, -0.2],
        },
    }
    return StoredCall(f"c{index}", "completion", at, at, "v1", f"cmpl-{index}", body)


def test_a_session_of_text_completions_becomes_alternating_turns() -> None:
    calls = [_call(0, "Q: 2+2?\nA:", " 4"), _call(1, "Q: 2+2?\nA: 4\nQ: 3+3?\nA:", " 6")]
    trace = build_trace(
        session_id=7, key="k", explicit=True, calls=calls, outcome=None, close_reason="idle"
    )
    assert [(m["role"], m["content"]) for m in trace["messages"]] == [
        ("user", "Q: 2+2?\nA:"),
        ("assistant", " 4"),
        ("user", "\nQ: 3+3?\nA:"),
        ("assistant", " 6"),
    ]
    assert trace["messages"][1]["token_ids"] == [1, 2]
    assert trace["response_ids"] == ["cmpl-0", "cmpl-1"]
    validate_trace(trace)  # a valid ratchet.trace/v1 document
