"""The agent protocol Ratchet trains, evaluates and serves: OpenAI chat messages with tools.

Stdlib only, so every process (api, worker, serving, GPU jobs) can import it. ``protocol``
holds the message types and validation, ``toolcalls`` turns a model's raw text into an
assistant message, ``render`` is the fallback rendering of tools for chat templates that
take no ``tools=`` argument.
"""

from services.chat.protocol import ChatMessage, ToolCall, validate_tools
from services.chat.render import tools_system_prompt
from services.chat.toolcalls import parse_assistant_output

__all__ = [
    "ChatMessage",
    "ToolCall",
    "parse_assistant_output",
    "tools_system_prompt",
    "validate_tools",
]
