"""OpenAI chat-completions messages and function tools, as immutable values.

The wire format is OpenAI's (``{"role": "assistant", "tool_calls": [{"id", "type":
"function", "function": {"name", "arguments": "<json string>"}}]}``); inside Ratchet a tool
call's arguments are a decoded ``dict`` so verifiers and environments never re-parse JSON.
Parsing is strict and names the offending field (``messages[2].tool_calls[0].function.name``
style paths are built by callers from the ``field`` given here), because these values come
from users' agents and from hostile input alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ToolCall:
    """One function call requested by the assistant."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": json.dumps(self.arguments, ensure_ascii=False),
            },
        }

    @classmethod
    def from_openai(cls, data: Any, *, where: str = "tool_call") -> ToolCall:
        """Parse an OpenAI tool call; ``arguments`` may be a JSON string (wire form) or object."""
        data = _object(data, where)
        call_id = _non_empty_string(data, "id", where)
        kind = data.get("type", "function")
        if kind != "function":
            raise ValueError(f"{where}.type must be 'function', got {kind!r}")
        function = _object(data.get("function"), f"{where}.function")
        name = _non_empty_string(function, "name", f"{where}.function")
        raw = function.get("arguments", "{}")
        if isinstance(raw, str):
            try:
                arguments = json.loads(raw) if raw.strip() else {}
            except (json.JSONDecodeError, RecursionError, ValueError) as exc:
                raise ValueError(f"{where}.function.arguments is not valid JSON") from exc
        else:
            arguments = raw
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}.function.arguments must be a JSON object")
        return cls(id=call_id, name=name, arguments=arguments)


@dataclass(frozen=True)
class ChatMessage:
    """One chat message: system, user, assistant (content and/or tool calls) or tool result."""

    role: str
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI wire form; optional fields are present only when set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_openai(cls, data: Any, *, where: str = "message") -> ChatMessage:
        """Parse one OpenAI chat message; ValueError names the bad field."""
        data = _object(data, where)
        role = data.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}")
        content = _content_text(data.get("content"), where=f"{where}.content")
        raw_calls = data.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise ValueError(f"{where}.tool_calls must be a list")
        if raw_calls and role != "assistant":
            raise ValueError(f"{where}.tool_calls is only allowed on assistant messages")
        calls = tuple(
            ToolCall.from_openai(call, where=f"{where}.tool_calls[{i}]")
            for i, call in enumerate(raw_calls)
        )
        tool_call_id = data.get("tool_call_id")
        if tool_call_id is not None and not isinstance(tool_call_id, str):
            raise ValueError(f"{where}.tool_call_id must be a string")
        if role == "tool" and not tool_call_id:
            raise ValueError(f"{where}.tool_call_id is required on tool messages")
        name = data.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{where}.name must be a string")
        if role in ("system", "user") and content is None:
            raise ValueError(f"{where}.content is required on {role} messages")
        return cls(
            role=role, content=content, tool_calls=calls, tool_call_id=tool_call_id, name=name
        )


def _content_text(value: Any, *, where: str) -> str | None:
    """Content as text: a string, null, or OpenAI content parts of type ``text`` (joined)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError(f"{where}[{i}] must be a text part ({{'type': 'text', ...}})")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}[{i}].text must be a string")
            texts.append(text)
        return "".join(texts)
    raise ValueError(f"{where} must be a string, null or a list of text parts")


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check OpenAI function tools and return them normalised (``type`` and ``parameters`` set).

    Names follow OpenAI's rule (``^[a-zA-Z0-9_-]{1,64}$``) and are unique; ``parameters`` is
    a JSON-schema object. ValueError names the field path, e.g. ``tools[1].function.name``.
    """
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        tool = _object(tool, where)
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        function = _object(tool.get("function"), f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _valid_name(name):
            raise ValueError(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is defined twice")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = _object(
            function.get("parameters", {"type": "object", "properties": {}}),
            f"{where}.function.parameters",
        )
        if parameters.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters.type must be 'object'")
        _object(parameters.get("properties", {}), f"{where}.function.parameters.properties")
        required = parameters.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"{where}.function.parameters.required must be a list of strings")
        normalised: dict[str, Any] = {"name": name}
        if description is not None:
            normalised["description"] = description
        normalised["parameters"] = dict(parameters)
        out.append({"type": "function", "function": normalised})
    return out


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be an object")
    return value


def _non_empty_string(data: Mapping[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}.{key} must be a non-empty string")
    return value


def _valid_name(name: str) -> bool:
    return 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-") for c in name)
