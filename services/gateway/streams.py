"""What was sampled, read from an upstream's chat or text completion (whole or streamed), and
the fields the gateway asked for on its own taken back out of the agent's answer.

The gateway asks the upstream for ``return_token_ids`` (vLLM's extension, which ``ratchet
serve`` speaks) and ``logprobs`` when the agent did not, so every captured reply carries the
exact token ids and log-probs sampled. What the agent did not ask for is removed from each
answer (and each streamed chunk) before it is sent on: the agent sees what it would have
seen without the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.chat.text import utf8_json
from services.gateway.conversation import tool_call


@dataclass(frozen=True)
class Added:
    """What the gateway added to the request (and so removes from the answer)."""

    token_ids: bool = False
    logprobs: bool = False

    @property
    def any(self) -> bool:
        return self.token_ids or self.logprobs


def strip_choice(choice: dict[str, Any], added: Added) -> None:
    if added.token_ids:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    if added.logprobs and "logprobs" in choice:
        choice["logprobs"] = None


def strip(payload: dict[str, Any], added: Added) -> dict[str, Any]:
    """``payload`` (a completion or a chunk) without what ``added`` says the agent did not ask
    for; changed in place and returned."""
    if added.token_ids:
        payload.pop("prompt_token_ids", None)
    for choice in payload.get("choices") or ():
        if isinstance(choice, dict):
            strip_choice(choice, added)
    return payload


def _logprob_values(logprobs: Any, *, text: bool) -> list[float] | None:
    """The sampled tokens' log-probs from chat's (``content``) or the legacy completions'
    (``token_logprobs``) shape."""
    if not isinstance(logprobs, dict):
        return None
    if text:
        values = logprobs.get("token_logprobs")
        return [float(v) for v in values] if isinstance(values, list) else None
    entries = logprobs.get("content")
    if not isinstance(entries, list):
        return None
    return [float(e["logprob"]) for e in entries if isinstance(e, dict) and "logprob" in e]


@dataclass
class Sampled:
    """One choice as it was sampled: text, tool calls, token ids, log-probs, finish reason."""

    content: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None

    def add_tokens(self, ids: Any, logprobs: list[float] | None) -> None:
        if isinstance(ids, list):
            self.token_ids = (self.token_ids or []) + [int(i) for i in ids]
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs

    def message(self) -> dict[str, Any]:
        """The reply as a trace message (assistant), with what was sampled."""
        text = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if self.calls:
            message["tool_calls"] = [
                tool_call(self.calls[index], f"reply.tool_calls[{index}]")
                for index in sorted(self.calls)
            ]
        if self.token_ids is not None:
            message["token_ids"] = self.token_ids
            if self.logprobs is not None and len(self.logprobs) == len(self.token_ids):
                message["logprobs"] = self.logprobs
        return message


@dataclass
class Reading:
    """A completion read so far: the envelope (id, model, version) and choice 0."""

    text: bool = False  # a legacy text completion, not a chat completion
    id: str | None = None
    model: str | None = None
    fingerprint: str | None = None
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    choice: Sampled = field(default_factory=Sampled)

    def envelope(self, payload: dict[str, Any]) -> None:
        self.id = self.id or payload.get("id")
        self.model = self.model or payload.get("model")
        self.fingerprint = self.fingerprint or payload.get("system_fingerprint")
        if isinstance(payload.get("usage"), dict):
            self.usage = payload["usage"]
        if isinstance(payload.get("prompt_token_ids"), list):
            self.prompt_token_ids = payload["prompt_token_ids"]

    def whole(self, payload: dict[str, Any]) -> None:
        """Read a whole (not streamed) completion."""
        self.envelope(payload)
        choice = _first_choice(payload)
        if choice is None:
            return
        sampled = self.choice
        sampled.finish_reason = choice.get("finish_reason")
        if self.text:
            sampled.content.append(str(choice.get("text") or ""))
        else:
            message = choice.get("message") or {}
            sampled.content.append(str(message.get("content") or ""))
            for index, call in enumerate(message.get("tool_calls") or ()):
                sampled.calls[index] = call
        self._tokens(choice)

    def chunk(self, payload: dict[str, Any]) -> None:
        """Read one streamed chunk."""
        self.envelope(payload)
        choice = _first_choice(payload)
        if choice is None:
            return
        sampled = self.choice
        if choice.get("finish_reason"):
            sampled.finish_reason = choice["finish_reason"]
        if self.text:
            sampled.content.append(str(choice.get("text") or ""))
        else:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                sampled.content.append(str(delta["content"]))
            for call in delta.get("tool_calls") or ():
                _merge_call(sampled.calls, call)
        self._tokens(choice)

    def _tokens(self, choice: dict[str, Any]) -> None:
        if isinstance(choice.get("prompt_token_ids"), list):
            self.prompt_token_ids = choice["prompt_token_ids"]
        self.choice.add_tokens(
            choice.get("token_ids"), _logprob_values(choice.get("logprobs"), text=self.text)
        )

    @property
    def version(self) -> str | None:
        """The serving version, from ``system_fingerprint`` (``ratchet-<checkpoint id>``)."""
        fingerprint = self.fingerprint or ""
        return fingerprint.removeprefix("ratchet-") if fingerprint.startswith("ratchet-") else None


def _first_choice(payload: dict[str, Any]) -> dict[str, Any] | None:
    for choice in payload.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def _merge_call(calls: dict[int, dict[str, Any]], delta: Any) -> None:
    """Add one streamed ``tool_calls`` delta to the call it continues (by ``index``)."""
    if not isinstance(delta, dict):
        return
    index = int(delta.get("index", len(calls)))
    call = calls.setdefault(index, {"id": None, "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    function = delta.get("function") or {}
    if function.get("name"):
        call["function"]["name"] += function["name"]
    if function.get("arguments"):
        call["function"]["arguments"] += function["arguments"]


def sse_data(line: bytes) -> bytes | None:
    """The payload of one server-sent event line (``data: ...``), None for other lines."""
    if line.startswith(b"data:"):
        return line[5:].strip()
    return None


def encode_sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + utf8_json(payload) + b"\n\n"
