"""A closed session's calls made into one ``ratchet.trace/v1`` trace: pure rules.

**Messages.** A session of chat calls (``/v1/chat/completions``, ``/v1/responses``) is one
conversation growing call by call: each call sends everything so far (the earlier replies,
the tool results the agent got for their calls, new user turns) and gets one reply. The
trace's messages are the last call's messages and its reply; each assistant message there
that an earlier call sampled gets that call's token ids and log-probs (found at the
position where that call's reply sits, when it is the same message by the digests' rule).
A call of an explicitly named session that does not lie on the last call's conversation (an
agent that trimmed its history, or ran a side conversation under the same id) is counted
in ``metadata.gateway.calls_off_transcript``; its text is not in the trace.

A session of text completions (``/v1/completions``) becomes alternating messages: the text
each prompt adds to the conversation so far as a ``user`` message, each completion as an
``assistant`` message with its tokens.

**The rest.** Tools: every function tool the calls offered (by name, the last call's
definition). ``model_version``: the serving version of the last call (each call's in
metadata). ``response_ids``: the upstream's ids of the calls (signed by a Ratchet model
server, they let the canary count the trace by the server's word). The outcome and the
reference answer come from the newest outcome posted before the session closed.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.capture import COMPLETION
from services.gateway.conversation import same_message

MAX_ID = 256
MAX_RESPONSE_IDS = 1024


@dataclass(frozen=True)
class StoredCall:
    """A placed call as the assembler reads it back."""

    call_id: str
    kind: str
    started_at: dt.datetime
    captured_at: dt.datetime
    model_version: str | None
    response_id: str | None
    body: Mapping[str, Any]


@dataclass(frozen=True)
class OutcomeFields:
    success: bool | None = None
    score: float | None = None
    reference_answer: str | None = None
    label: str | None = None


def external_id(session_id: int) -> str:
    return f"gateway-session-{session_id}"


def _clean_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A trace message within the schema's bounds (ids cut to 256 characters, empty ones
    dropped)."""
    out: dict[str, Any] = {"role": message.get("role"), "content": message.get("content")}
    calls = []
    for index, call in enumerate(message.get("tool_calls") or ()):
        calls.append(
            {
                "id": str(call.get("id") or f"call_{index}")[:MAX_ID],
                "name": str(call.get("name") or "unknown")[:MAX_ID],
                "arguments": call.get("arguments", {}),
            }
        )
    if calls:
        out["tool_calls"] = calls
    if message.get("tool_call_id"):
        out["tool_call_id"] = str(message["tool_call_id"])[:MAX_ID]
    for key in ("token_ids", "logprobs"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _with_tokens(message: dict[str, Any], reply: Mapping[str, Any]) -> dict[str, Any]:
    for key in ("token_ids", "logprobs"):
        if reply.get(key) is not None:
            message[key] = reply[key]
    return message


def chat_transcript(calls: Sequence[StoredCall]) -> tuple[list[dict[str, Any]], int]:
    """The trace messages of a session of chat calls, and how many calls lie off them."""
    last = calls[-1].body
    messages = [_clean_message(m) for m in last.get("messages") or ()]
    messages.append(_clean_message(last.get("reply") or {"role": "assistant"}))
    off = 0
    for call in calls[:-1]:
        position = len(call.body.get("messages") or ())
        reply = call.body.get("reply") or {}
        if position < len(messages) and same_message(messages[position], reply):
            _with_tokens(messages[position], reply)
        else:
            off += 1
    return messages, off


def text_transcript(calls: Sequence[StoredCall]) -> tuple[list[dict[str, Any]], int]:
    """The trace messages of a session of text completions, and how many calls did not
    extend the text before them."""
    messages: list[dict[str, Any]] = []
    text = ""
    off = 0
    for call in calls:
        prompt = call.body.get("prompt")
        reply = call.body.get("reply") or {}
        if isinstance(prompt, str):
            if prompt.startswith(text):
                added = prompt[len(text) :]
            else:
                off += 1
                added = prompt
            if added:
                messages.append({"role": "user", "content": added})
            text = prompt + str(reply.get("content") or "")
        else:
            first = (call.body.get("messages") or [{"role": "user", "content": None}])[0]
            messages.append(_clean_message(first))
        messages.append(_clean_message(reply))
    return messages, off


def _tools(calls: Sequence[StoredCall]) -> list[dict[str, Any]]:
    """The last call's tools in its order, then those only earlier calls offered."""
    tools: dict[str, dict[str, Any]] = {}
    for call in reversed(calls):
        for tool in call.body.get("tools") or ():
            name = str(tool.get("name") or "")[:MAX_ID] if isinstance(tool, Mapping) else ""
            if name and name not in tools:
                tools[name] = {**tool, "name": name}
    return list(tools.values())


def build_trace(
    *,
    session_id: int,
    key: str,
    explicit: bool,
    calls: Sequence[StoredCall],
    outcome: OutcomeFields | None,
    close_reason: str,
) -> dict[str, Any]:
    """The ``ratchet.trace/v1`` document of a closed session (see the module docstring)."""
    if calls[-1].kind == COMPLETION:
        messages, off = text_transcript(calls)
    else:
        messages, off = chat_transcript(calls)
    last = calls[-1]
    trace: dict[str, Any] = {
        "schema": "ratchet.trace/v1",
        "external_id": external_id(session_id),
        "model_version": (last.model_version or None) and last.model_version[:MAX_ID],
        "response_ids": [c.response_id[:MAX_ID] for c in calls if c.response_id][:MAX_RESPONSE_IDS],
        "started_at": calls[0].started_at.isoformat(),
        "ended_at": max(c.captured_at for c in calls).isoformat(),
        "tools": _tools(calls),
        "messages": messages,
        "metadata": {
            "gateway": {
                "session": key,
                "session_id": session_id,
                "explicit": explicit,
                "calls": len(calls),
                "calls_off_transcript": off,
                "close_reason": close_reason,
                "upstream": last.body.get("upstream"),
                "model": last.body.get("model"),
                "versions": sorted({c.model_version for c in calls if c.model_version}),
            }
        },
    }
    if outcome is not None:
        trace["outcome"] = {"success": outcome.success, "score": outcome.score}
        if outcome.reference_answer is not None:
            trace["reference_answer"] = outcome.reference_answer
        if outcome.label is not None:
            trace["metadata"]["gateway"]["label"] = outcome.label
    return trace
