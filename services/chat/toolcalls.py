"""Turn a model's raw completion into an assistant message: tool calls plus leftover text.

Open-weight chat models write tool calls in a few conventions; this reads the two that
cover the families Ratchet targets (Qwen, SmolLM2, Hermes-style and Llama-style JSON):

- tagged blocks ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the content
  may also be a JSON list of such objects): a tagged block is a call whatever its name, so
  an unknown tool reaches the environment, which answers with an error the agent can read;
- bare JSON objects ``{"name": ..., "arguments": ...}`` anywhere in the text (also inside
  a markdown code fence, and ``"parameters"`` in place of ``"arguments"``, Llama's key).
  When ``tool_names`` is given, a bare object is a call only if it names one of them, so
  a final answer that happens to be JSON is not mistaken for a call.

``arguments`` may be an object or a JSON string holding one (OpenAI's wire form, which
models imitate). Ids are ``call_0``, ``call_1``, … in order of appearance, so the same
text always gives the same message (evaluations and replays are reproducible). Whatever
is not a call is the message's content (whitespace-trimmed, ``None`` when empty). Model
output is untrusted and often broken; this never raises on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from services.chat.protocol import ChatMessage, ToolCall

_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"```[a-zA-Z]*\s*```")
_MAX_DECODE_ATTEMPTS = 256  # bounds the work on pathological text like "{"a":{"a":{"a":…
_DECODER = json.JSONDecoder()


def parse_assistant_output(text: str, tool_names: Collection[str] | None = None) -> ChatMessage:
    """The assistant message a completion stands for (see the module docstring)."""
    calls: list[ToolCall] = []
    leftover: list[str] = []
    position = 0
    for match in _TAGGED.finditer(text):
        leftover.append(text[position : match.start()])
        position = match.end()
        for obj in _decode_all(match.group(1)):
            call = _as_call(obj, len(calls), tool_names=None)
            if call is not None:
                calls.append(call)
    leftover.append(text[position:])
    remaining = "".join(leftover)
    remaining, bare = _extract_bare_calls(remaining, len(calls), tool_names)
    calls.extend(bare)
    content = _FENCE.sub("", remaining).strip() or None
    return ChatMessage(role="assistant", content=content, tool_calls=tuple(calls))


def _decode_all(fragment: str) -> list[Any]:
    """Every JSON value in a tagged block: one object, a list of objects, or several objects."""
    values: list[Any] = []
    index = 0
    attempts = 0
    while index < len(fragment) and attempts < _MAX_DECODE_ATTEMPTS:
        start = _next_json_start(fragment, index)
        if start < 0:
            break
        attempts += 1
        decoded = _try_decode(fragment, start)
        if decoded is None:
            index = start + 1
            continue
        value, end = decoded
        values.extend(value if isinstance(value, list) else [value])
        index = end
    return values


def _extract_bare_calls(
    text: str, first_index: int, tool_names: Collection[str] | None
) -> tuple[str, list[ToolCall]]:
    calls: list[ToolCall] = []
    kept: list[str] = []
    index = 0
    attempts = 0
    while attempts < _MAX_DECODE_ATTEMPTS:
        start = text.find("{", index)
        if start < 0:
            break
        attempts += 1
        decoded = _try_decode(text, start)
        if decoded is None:
            kept.append(text[index : start + 1])
            index = start + 1
            continue
        value, end = decoded
        call = _as_call(value, first_index + len(calls), tool_names=tool_names)
        if call is None:
            kept.append(text[index:end])
        else:
            kept.append(text[index:start])
            calls.append(call)
        index = end
    kept.append(text[index:])
    return "".join(kept), calls


def _next_json_start(text: str, index: int) -> int:
    starts = [i for i in (text.find("{", index), text.find("[", index)) if i >= 0]
    return min(starts) if starts else -1


def _try_decode(text: str, start: int) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; so are huge ints
        return None


def _as_call(obj: Any, index: int, *, tool_names: Collection[str] | None) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if tool_names is not None and name not in tool_names:
        return None
    raw = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(raw, str):
        decoded = _try_decode(raw.strip() or "{}", 0)
        raw = decoded[0] if decoded is not None else None
    if not isinstance(raw, dict):
        return None
    return ToolCall(id=f"call_{index}", name=name, arguments=raw)
