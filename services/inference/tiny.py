"""The tiny GPT family on the engine: its chat template and its tool-call syntax.

The byte-level GPT was trained on transcripts, one line per turn (see
:mod:`services.environments.base`)::

    tools: #add(a,b) &mul(a,b) @get(item)      <- the system message
    user: $pear*37                              <- the user message
    > @get(pear)                                <- an assistant tool call
    = 12                                        <- the tool message
    > ans 444                                   <- an assistant answer (content "444")

so that is its chat template: system messages verbatim, ``user: `` before user content,
``> `` before an assistant turn, ``= `` before a tool result, and the prompt ends with
``> ``. Without a system message the tools are listed as ``tools: name(p1,p2) ...``. An
assistant tool call is written back the way the listing shows it (its sigil and argument
separator are read from the listing), so a conversation the model produced renders to the
bytes it was trained on.

The model's reply (one line: it stops at the newline byte) becomes ``ans X`` → content
``X``, ``name(args)`` naming one of the request's tools with the right number of
arguments → a tool call whose arguments are the tool's parameters in order (integers
where the schema says so), anything else → content as written.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from services.chat.protocol import ChatMessage, ToolCall
from services.inference.engine import EngineError
from services.inference.forward import BatchForward, ForwardCall, KVLayout, write_columns
from services.inference.prefix_cache import DEFAULT_BUDGET_BYTES, PrefixCache
from services.training.checkpoint import CheckpointError
from services.training.device import autocast
from services.training.tiny.model import KVCache, TinyModel

FAMILY = "tiny"

_ANSWER = re.compile(r"^ans\s+(.*)$", re.DOTALL)
_CALL = re.compile(r"^([#&@])?([A-Za-z_][A-Za-z0-9_-]*)\((.*)\)$", re.DOTALL)


class TinyEngine:
    """A loaded tiny GPT checkpoint."""

    family = FAMILY

    def __init__(
        self,
        tiny_model: TinyModel,
        path: Path | str,
        *,
        prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        self.tiny_model = tiny_model
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._weights = 0  # bumped when the weights change in place
        self.version = tiny_model.checkpoint_id or ""
        self.path = str(path)
        self.device = tiny_model.device
        self.eos_ids = frozenset({tiny_model.tokenizer.stop_id})
        self.max_chars_per_token = 1  # one byte a token: never more characters than tokens

    @classmethod
    def load(cls, path: Path, *, device: str = "auto") -> TinyEngine:
        """Load and verify (sha256 of every file against the manifest); CheckpointError if not."""
        try:
            tiny_model = TinyModel.load(path, device=device)
        except CheckpointError:
            raise
        except (ValueError, RuntimeError, OSError) as exc:
            raise CheckpointError(f"cannot load {path}: {exc}") from exc
        return cls(tiny_model, path)

    def context_length(self) -> int:
        return self.tiny_model.model.config.max_seq_len

    def vocab_size(self) -> int:
        return int(self.tiny_model.model.config.vocab_size)

    def adapters(self) -> frozenset[str]:
        return frozenset()

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]]) -> list[int]:
        return self.tiny_model.tokenizer.encode(render_transcript(messages, tools))

    def encode_text(self, text: str) -> list[int]:
        return self.tiny_model.tokenizer.encode(text)

    def decode_text(self, ids: Sequence[int]) -> str:
        # Bytes that are not UTF-8 cannot travel in JSON: they become U+FFFD on the wire.
        return bytes(ids).decode("utf-8", "replace")

    def parse_reply(self, text: str, tools: Sequence[dict[str, Any]]) -> ChatMessage:
        return parse_turn(text, tools)

    def kv_layout(self) -> KVLayout:
        config = self.tiny_model.model.config
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        return KVLayout(config.n_layer, config.n_head, config.d_model // config.n_head, dtype)

    def prefix_key(self, adapter: str | None) -> Hashable:
        return (FAMILY, self.version, self._weights)

    def weights_changed(self) -> None:
        """The model's weights were updated in place (a training step): forget its prefixes."""
        self._weights += 1
        self.prefix_cache.clear()

    def forward(self, adapters: Sequence[str | None]) -> BatchForward:
        if any(adapter is not None for adapter in adapters):
            raise EngineError("the tiny family has no adapters")
        model, device = self.tiny_model.model, self.device

        def call(forward: ForwardCall) -> torch.Tensor:
            if any(adapter is not None for adapter in forward.adapters):
                raise EngineError("the tiny family has no adapters")
            with autocast(device):
                logits = model(forward.ids, forward.positions, forward.mask, _Columns(forward))
            return logits[:, -1]  # (B, V)

        return BatchForward(prefill=call, step=call)


class _Columns(KVCache):
    """The tiny GPT's cache interface over the engine's buffers (see ``ForwardCall``)."""

    def __init__(self, forward: ForwardCall) -> None:  # the buffers exist: nothing to allocate
        self.call = forward
        self.length = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: (B, H, T, Dh) for the new positions; returns columns [0, width) (B, H, W, Dh)
        return write_columns(self.call, layer, k, v)

    def advance(self, n: int) -> None:
        return None


def render_transcript(messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]]) -> str:
    """The transcript the tiny GPT continues for a conversation (see the module docstring)."""
    listing = "\n".join(m.content or "" for m in messages if m.role == "system")
    lines: list[str] = []
    if listing:
        lines.append(listing)
    elif tools:
        lines.append("tools: " + " ".join(_signature(tool) for tool in tools))
    for message in messages:
        if message.role == "user":
            lines.append(f"user: {_one_line(message.content)}")
        elif message.role == "assistant":
            for call in message.tool_calls:
                lines.append(f"> {format_call(call, tools, listing)}")
            if not message.tool_calls or message.content:
                content = _one_line(message.content)
                lines.append(f"> {content}" if _ANSWER.match(content) else f"> ans {content}")
        elif message.role == "tool":
            lines.append(f"= {_one_line(message.content)}")
    return "".join(f"{line}\n" for line in lines) + "> "


def format_call(call: ToolCall, tools: Sequence[dict[str, Any]], listing: str) -> str:
    """``@get(pear)``: a tool call as the listing writes it (sigil and separator from it)."""
    shown = re.search(rf"([#&@]?){re.escape(call.name)}\(([^)]*)\)", listing)
    sigil = shown.group(1) if shown else ""
    separator = ";" if shown and ";" in shown.group(2) else ","
    params = _params(_tool(tools, call.name)) or list(call.arguments)
    values = [_scalar(call.arguments[p]) for p in params if p in call.arguments]
    return f"{sigil}{call.name}({separator.join(values)})"


def parse_turn(text: str, tools: Sequence[dict[str, Any]]) -> ChatMessage:
    """The assistant message in one generated line (see the module docstring)."""
    line = text.strip()
    answer = _ANSWER.match(line)
    if answer is not None:
        return ChatMessage(role="assistant", content=answer.group(1).strip())
    call = _CALL.match(line)
    tool = _tool(tools, call.group(2)) if call is not None else None
    if call is None or tool is None:
        return ChatMessage(role="assistant", content=line or None)
    raw = call.group(3)
    values = [v.strip() for v in raw.split(";" if ";" in raw else ",")] if raw.strip() else []
    params = _params(tool)
    if len(values) != len(params):
        return ChatMessage(role="assistant", content=line)
    properties = (tool.get("parameters") or {}).get("properties") or {}
    arguments = {
        param: _typed(value, properties.get(param) or {})
        for param, value in zip(params, values, strict=True)
    }
    return ChatMessage(
        role="assistant",
        tool_calls=(ToolCall(id="call_0", name=call.group(2), arguments=arguments),),
    )


def _tool(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            return dict(function)
    return None


def _params(function: dict[str, Any] | None) -> list[str]:
    if function is None:
        return []
    parameters = function.get("parameters") or {}
    properties = list((parameters.get("properties") or {}).keys())
    required = [p for p in parameters.get("required") or [] if isinstance(p, str)]
    return required + [p for p in properties if p not in required]


def _signature(tool: dict[str, Any]) -> str:
    function = tool.get("function", tool)
    return f"{function.get('name')}({','.join(_params(function))})"


def _typed(value: str, schema: dict[str, Any]) -> Any:
    if schema.get("type") == "integer" and re.fullmatch(r"-?\d{1,18}", value):
        return int(value)
    if schema.get("type") == "number":
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return _one_line(str(value))


def _one_line(text: str | None) -> str:
    return (text or "").replace("\n", " ")
