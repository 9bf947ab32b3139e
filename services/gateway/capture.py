"""One captured call: what goes into the spool, and what the writer makes of it for Postgres.

A record is a JSON object: the loop, the call's id and times, the session id the agent gave
(if any), the request's conversation and tools as trace messages, the reply with its token
ids and log-probs, the serving version and the upstream's response id. Digests are computed
by the writer when it drains the spool, off the path of the answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from services.chat.text import utf8_json
from services.gateway.conversation import conversation_digests, text_digest

CHAT = "chat"
COMPLETION = "completion"
RESPONSES = "responses"
SESSION_HEADER = "x-ratchet-session"
MAX_SESSION_KEY = 256


def new_call_id() -> str:
    return uuid.uuid4().hex


def session_key(header: str | None, body: Mapping[str, Any]) -> str | None:
    """The session id the agent gave: the ``X-Ratchet-Session`` header, else the request's
    ``metadata.session_id`` (or ``metadata.ratchet_session``), else its ``user``; None asks
    for grouping by conversation prefix."""
    metadata = body.get("metadata")
    candidates: list[Any] = [header]
    if isinstance(metadata, Mapping):
        candidates += [metadata.get("session_id"), metadata.get("ratchet_session")]
    candidates.append(body.get("user"))
    for value in candidates:
        if isinstance(value, str) and value.strip():
            return value.strip()[:MAX_SESSION_KEY]
    return None


@dataclass
class CapturedCall:
    """See the module docstring. ``prompt`` is set for text completions only."""

    loop_id: int
    loop: str
    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    reply: dict[str, Any]
    started_at: float
    captured_at: float = field(default_factory=time.time)
    call_id: str = field(default_factory=new_call_id)
    session_key: str | None = None
    model: str | None = None
    upstream: str | None = None
    model_version: str | None = None
    response_id: str | None = None
    prompt: str | None = None
    usage: dict[str, Any] | None = None

    def encode(self) -> bytes:
        # Not dataclasses.asdict: it deep-copies every message and tool first, on the path
        # of the answer.
        fields = {name: getattr(self, name) for name in _FIELDS}
        return utf8_json(fields, compact=True)

    @classmethod
    def decode(cls, data: bytes) -> CapturedCall:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("a captured call must be a JSON object")
        return cls(**raw)

    def digests(self) -> tuple[list[str], str]:
        """The prefix digests and the digest after the reply (services.gateway.conversation);
        for a text completion, the digest of its prompt and completion."""
        if self.kind == COMPLETION:
            text = (self.prompt or "") + str(self.reply.get("content") or "")
            return [], text_digest(text)
        return conversation_digests(self.messages, self.reply)

    def body(self) -> dict[str, Any]:
        """The ``gateway_calls.body`` column: what a trace is built from."""
        body: dict[str, Any] = {
            "messages": self.messages,
            "tools": self.tools,
            "reply": self.reply,
            "model": self.model,
            "upstream": self.upstream,
        }
        if self.prompt is not None:
            body["prompt"] = self.prompt
        if self.usage is not None:
            body["usage"] = self.usage
        return body


_FIELDS = tuple(f.name for f in fields(CapturedCall))
