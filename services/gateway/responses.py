"""The Responses API (``POST /v1/responses``) for stateless calls, over any chat-completions
upstream: the OpenAI Agents SDK's default model speaks it.

A request is read into a chat completion (``instructions`` as the system message; input
items ``message``, ``function_call`` and ``function_call_output`` as chat messages; function
tools as chat tools) and the upstream's answer is written back as output items (a
``message`` with ``output_text``, ``function_call`` items), whole or as the Responses
streaming events (``response.created`` ... ``response.completed``).

Stateless only: ``previous_response_id`` and ``conversation`` name state the gateway does not
keep (a replica holds nothing), so they are refused with an error that says to send the
whole conversation in ``input``, which the Agents SDK does by default. Built-in tools (web
search, file search, computer use) have no chat-completions equivalent and are refused.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.chat.text import utf8_json
from services.gateway.conversation import content_text
from services.gateway.errors import GatewayError
from services.gateway.streams import Reading

_REFUSED_STATE = ("previous_response_id", "conversation", "prompt")
_PASSED = ("temperature", "top_p", "parallel_tool_calls", "metadata", "user", "seed")


def _refuse(param: str, message: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="unsupported_parameter")


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions request a Responses request asks for (the ``model`` is the
    route's, set by the caller)."""
    for name in _REFUSED_STATE:
        if body.get(name) is not None:
            raise _refuse(
                name,
                f"{name} is not supported: the gateway is stateless; send the whole "
                "conversation in `input` (the Agents SDK does so by default)",
            )
    if body.get("background"):
        raise _refuse("background", "background responses are not supported by the gateway")
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    messages += input_messages(body.get("input"))
    chat: dict[str, Any] = {"messages": messages}
    tools = [_chat_tool(tool, index) for index, tool in enumerate(body.get("tools") or [])]
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in _PASSED:
        if body.get(name) is not None:
            chat[name] = body[name]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """Input items as chat messages; a run of ``function_call`` items joins the assistant
    message before it (a reply with text and calls is one chat message)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise GatewayError(400, "input must be a string or a non-empty array", param="input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(raw):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise GatewayError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output)
            messages.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id")), "content": text or ""}
            )
        elif kind != "reasoning":  # reasoning items carry nothing a chat model reads
            raise GatewayError(
                400, f"{where}.type {kind!r} is not supported by the gateway", param=f"{where}.type"
            )
    return messages


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise GatewayError(400, f"{where}.role {role!r} is not supported", param=f"{where}.role")
    return {
        "role": "system" if role == "developer" else role,
        "content": content_text(item.get("content")),
    }


def _add_call(messages: list[dict[str, Any]], item: Mapping[str, Any], where: str) -> None:
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise GatewayError(400, f"{where}.name is missing", param=f"{where}.name")
    call = {
        "id": str(item.get("call_id") or item.get("id") or f"call_{len(messages)}"),
        "type": "function",
        "function": {"name": name, "arguments": str(item.get("arguments") or "")},
    }
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise GatewayError(
            400,
            f"{where}.type {kind!r}: only function tools are supported by the gateway",
            param=f"{where}.type",
        )
    function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, str):
        return choice
    raise GatewayError(
        400, "tool_choice must be auto, none, required or a function", param="tool_choice"
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if not isinstance(fmt, Mapping) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": str(fmt.get("type"))}


# The answer ---------------------------------------------------------------------------------


def _usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(details.get("cached_tokens") or 0)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


@dataclass
class ResponseWriter:
    """Builds the Responses answer of one call: the response object and its stream events."""

    call_id: str
    body: Mapping[str, Any]
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0
    text_open: bool = False
    text: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"resp_{self.call_id}"

    def response(self, status: str, reading: Reading | None = None) -> dict[str, Any]:
        body = self.body
        output = self.output(reading) if reading is not None else []
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "output_text": "".join(self.text) if reading is not None else "",
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": list(body.get("tools") or []),
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "error": None,
            "incomplete_details": None,
            "usage": _usage(reading.usage) if reading is not None else None,
        }

    def output(self, reading: Reading) -> list[dict[str, Any]]:
        sampled = reading.choice
        self.text = list(sampled.content)
        items: list[dict[str, Any]] = []
        text = "".join(sampled.content)
        if text:
            items.append(self._message_item(text, "completed"))
        for index in sorted(sampled.calls):
            items.append(self._call_item(index, sampled.calls[index]))
        return items

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": f"msg_{self.call_id}",
            "status": status,
            "role": "assistant",
            "content": content if status == "completed" or text else [],
        }

    def _call_item(self, index: int, call: Mapping[str, Any]) -> dict[str, Any]:
        function = call.get("function") or {}
        return {
            "type": "function_call",
            "id": f"fc_{self.call_id}_{index}",
            "call_id": str(call.get("id") or f"call_{self.call_id}_{index}"),
            "name": function.get("name"),
            "arguments": function.get("arguments") or "",
            "status": "completed",
        }

    # Streaming --------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + utf8_json(payload) + b"\n\n"

    def opening(self) -> list[bytes]:
        created = self.response("in_progress")
        return [
            self.event("response.created", response=created),
            self.event("response.in_progress", response=created),
        ]

    def text_delta(self, delta: str) -> list[bytes]:
        events = []
        if not self.text_open:
            self.text_open = True
            item = self._message_item("", "in_progress")
            events.append(self.event("response.output_item.added", output_index=0, item=item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._part("response.content_part.added", part))
        self.text.append(delta)
        events.append(self._part("response.output_text.delta", None, delta=delta, logprobs=[]))
        return events

    def _part(self, kind: str, part: dict[str, Any] | None, **fields: Any) -> bytes:
        where = {"item_id": f"msg_{self.call_id}", "output_index": 0, "content_index": 0}
        if part is not None:
            where["part"] = part
        return self.event(kind, **where, **fields)

    def closing(self, reading: Reading) -> list[bytes]:
        """The events after the upstream's last chunk: the text closed, each function call,
        and ``response.completed``."""
        final = self.response("completed", reading)
        events = []
        index = 0
        if self.text_open:
            text = "".join(self.text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events.append(self._part("response.output_text.done", None, text=text, logprobs=[]))
            events.append(self._part("response.content_part.done", part))
            item = self._message_item(text, "completed")
            events.append(self.event("response.output_item.done", output_index=0, item=item))
            index = 1
        for item in final["output"]:
            if item["type"] != "function_call":
                continue
            added = {**item, "arguments": "", "status": "in_progress"}
            events.append(self.event("response.output_item.added", output_index=index, item=added))
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
            )
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(self.event("response.output_item.done", output_index=index, item=item))
            index += 1
        events.append(self.event("response.completed", response=final))
        return events
