"""The fallback rendering of tools for chat templates that take no ``tools=`` argument.

Templates such as Qwen2.5's and Llama 3.1's render ``tools`` themselves; many others
(SmolLM2-Instruct's among them) ignore the argument, and the model would never see the
tools. For those, Ratchet puts this text in a system message (prepended to the first one
when the conversation already has one). It follows the Hermes convention that Qwen and
SmolLM2 were tuned on: the function signatures as JSON inside ``<tools></tools>``, and calls
answered as ``<tool_call>{...}</tool_call>``, which :mod:`services.chat.toolcalls` parses.
The exact text is part of the contract (documented in docs/models.md): a model trained on
it must see the same bytes at serving time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. "
    "The available functions are listed within <tools></tools>:\n<tools>\n"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n"
    "To call a function, reply with a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
    "The result comes back in a tool message. When you have the answer, reply with it "
    "in plain text and no tool call."
)


def tools_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system-message text listing ``tools`` (OpenAI function tools), one JSON per line."""
    lines = [
        json.dumps(tool.get("function", tool), ensure_ascii=False, sort_keys=True) for tool in tools
    ]
    return TOOLS_PREAMBLE + "\n".join(lines) + TOOLS_INSTRUCTIONS


def tool_call_text(name: str, arguments: Any) -> str:
    """One call as the fallback convention writes it (a ``<tool_call>`` block, compact JSON)."""
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def plain_template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages a template without tool support can render: an assistant's ``tool_calls``
    become ``<tool_call>`` blocks in its content, tool results stay ``tool`` messages."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None) or []
        if message.get("role") == "assistant" and calls:
            blocks = [
                tool_call_text(c["function"]["name"], c["function"].get("arguments", {}))
                for c in calls
            ]
            text = message.get("content") or ""
            message["content"] = "\n".join([text, *blocks] if text else blocks)
        if message.get("content") is None:
            message["content"] = ""
        message.pop("tool_call_id", None)
        message.pop("name", None)
        out.append(message)
    return out


def messages_with_tools_prompt(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """OpenAI messages with the tools rendered into the system message (added if missing),
    in the form :func:`plain_template_messages` gives."""
    out = plain_template_messages(messages)
    if not tools:
        return out
    rendered = tools_system_prompt(tools)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{rendered}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": rendered})
    return out
