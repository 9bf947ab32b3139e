"""OpenAI chat messages and tools read into ``ratchet.trace/v1`` shapes, and the digests that
tell which call continues which.

The gateway stores what an agent sent as trace messages (roles ``system``, ``user``,
``assistant``, ``tool``; tool calls with their arguments as an object when they parse as
one), so a session's calls become a trace without a second translation.

**Digests.** A call continues a session when its messages extend the conversation of the
session's last call (its messages and its reply). The digest of a conversation is a running
sha256 over each message's *content* in a canonical form: the role, the text, and each tool
call's name and arguments (parsed and re-serialized with sorted keys). Ids are left out on
purpose: agent frameworks re-number tool calls, re-serialize arguments and turn ``null``
content into ``""`` when they echo a reply back, and none of that makes it another
conversation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
ROLES_TOOL = {"tool", "function"}


class ConversationError(ValueError):
    """A message or tool the gateway cannot read; ``param`` names it (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def content_text(content: Any) -> str | None:
    """A message's text: a string, or the text parts of a list of parts joined (images and
    audio have no text to train on and are left out)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        ]
        return "".join(texts)
    return str(content)


def parse_arguments(raw: Any) -> dict[str, Any] | str:
    """Tool call arguments as an object when they are one (or JSON text of one), else the
    raw text the model produced."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return raw
        return parsed if isinstance(parsed, dict) else raw
    return "" if raw is None else json.dumps(raw)


def tool_call(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry as a trace tool call."""
    function = raw.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ConversationError(f"{where}.function.name is missing", f"{where}.function")
    call_id = raw.get("id")
    return {
        "id": str(call_id) if call_id else f"call_{where}",
        "name": function["name"],
        "arguments": parse_arguments(function.get("arguments")),
    }


def chat_message(raw: Any, where: str) -> dict[str, Any]:
    """One OpenAI chat message as a trace message."""
    if not isinstance(raw, Mapping):
        raise ConversationError(f"{where} must be an object", where)
    role = raw.get("role")
    text = content_text(raw.get("content"))
    if role in ROLES_TOOL:
        message: dict[str, Any] = {"role": "tool", "content": text}
        call_id = raw.get("tool_call_id") or raw.get("name")
        if call_id:
            message["tool_call_id"] = str(call_id)
        return message
    if role not in ROLES:
        raise ConversationError(f"{where}.role {role!r} is not a chat role", f"{where}.role")
    message = {"role": ROLES[role], "content": text}
    calls = raw.get("tool_calls")
    if calls and role == "assistant":
        message["tool_calls"] = [
            tool_call(call, f"{where}.tool_calls[{index}]") for index, call in enumerate(calls)
        ]
    return message


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise ConversationError("messages must be a non-empty array", "messages")
    return [chat_message(message, f"messages[{index}]") for index, message in enumerate(raw)]


def tool_spec(raw: Any, where: str) -> dict[str, Any] | None:
    """A function tool (chat's ``{"type": "function", "function": {...}}`` or the Responses
    API's flat form) as a trace tool; None for a tool of another type."""
    if not isinstance(raw, Mapping):
        raise ConversationError(f"{where} must be an object", where)
    if raw.get("type", "function") != "function":
        return None
    function = raw.get("function", raw)
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ConversationError(f"{where}: a function tool needs a name", where)
    spec: dict[str, Any] = {"name": name}
    if isinstance(function.get("description"), str):
        spec["description"] = function["description"]
    parameters = function.get("parameters")
    spec["parameters"] = dict(parameters) if isinstance(parameters, Mapping) else {}
    return spec


def tool_specs(raw: Any) -> list[dict[str, Any]]:
    if not raw:
        return []
    if not isinstance(raw, list):
        raise ConversationError("tools must be an array", "tools")
    specs = (tool_spec(tool, f"tools[{index}]") for index, tool in enumerate(raw))
    return [spec for spec in specs if spec is not None]


# Digests ------------------------------------------------------------------------------------


def _canonical(message: Mapping[str, Any]) -> bytes:
    calls = [
        [call.get("name"), _canonical_arguments(call.get("arguments"))]
        for call in message.get("tool_calls") or ()
    ]
    item = [message.get("role"), message.get("content") or "", calls]
    text = json.dumps(item, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate digests as text_digest's


def _canonical_arguments(arguments: Any) -> Any:
    parsed = parse_arguments(arguments)
    return parsed if isinstance(parsed, dict) else str(parsed).strip()


def conversation_digests(
    messages: Sequence[Mapping[str, Any]], reply: Mapping[str, Any] | None
) -> tuple[list[str], str]:
    """``(prefix digests, digest after the reply)``: the digest of the messages up to and
    including each assistant message (where an earlier call's conversation may have ended),
    and of all messages followed by the reply."""
    running = hashlib.sha256()
    prefixes: list[str] = []
    for message in messages:
        running.update(_canonical(message))
        if message.get("role") == "assistant":
            prefixes.append(running.copy().hexdigest())
    if reply is not None:
        running.update(_canonical(reply))
    return prefixes, running.hexdigest()


def text_digest(text: str) -> str:
    """The digest of a text completion's conversation (its prompt and completion so far)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two trace messages are one message by the digests' rule."""
    return _canonical(a) == _canonical(b)


def first_text(items: Iterable[Any]) -> str | None:
    for item in items:
        if isinstance(item, str) and item:
            return item
    return None
