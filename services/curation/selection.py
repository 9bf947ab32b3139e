"""Which traces become tasks, and which are refused before an adapter ever sees them.

- A trace is a **failure** when any failure signal is present: ``outcome.success`` is false,
  an error kind is reported (a tool error, a timeout), or the score is below
  ``failure_score_threshold``. A negative ``gen_ai.evaluation.result`` arrives as one of
  these: the OTLP mapping puts it into the outcome.
- A trace with a positive outcome and no failure signal is a **success**; a fixed share
  (``success_sample_rate``) of successes is curated into regression tasks. The sample is a
  hash of the trace's external id, so a retried batch samples the same traces.
- A trace with no outcome at all is skipped.

:func:`screen_trace` refuses bodies no adapter should parse: too large, not a
``ratchet.trace/v1`` object, messages or tool calls in an unknown shape, binary content,
absurd nesting. Each refusal has a stable reason code.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from services.environments.base import TRACE_SCHEMA, Rejection

Verdict = Literal["failure", "success", "unknown"]

MAX_DEPTH = 32
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_BINARY = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffd\ud800-\udfff]")


@dataclass(frozen=True)
class Outcome:
    """What the agent runtime reported about an episode (the trace's outcome columns)."""

    success: bool | None
    score: float | None
    error_kind: str | None


def classify(outcome: Outcome, *, failure_score_threshold: float | None) -> Verdict:
    """failure (any failure signal), success (a positive signal and none bad), or unknown."""
    low_score = (
        outcome.score is not None
        and failure_score_threshold is not None
        and outcome.score < failure_score_threshold
    )
    if outcome.success is False or outcome.error_kind or low_score:
        return "failure"
    if outcome.success is True or outcome.score is not None:
        return "success"
    return "unknown"


def sampled(loop_id: int, external_id: str, rate: float) -> bool:
    """Whether a success is in the regression sample: a stable hash, not a random draw."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    digest = hashlib.blake2b(f"{loop_id}/{external_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < rate


def screen_trace(body: Any, *, size_bytes: int, max_trace_bytes: int) -> Rejection | None:
    """Why ``body`` must not reach an adapter, or None when it may."""
    if size_bytes > max_trace_bytes:
        return Rejection(
            "too_large",
            f"trace is {size_bytes} bytes; curation_policy.max_trace_bytes is {max_trace_bytes}",
        )
    if not isinstance(body, Mapping):
        return Rejection("malformed_trace", "trace body is not a JSON object")
    schema = body.get("schema", TRACE_SCHEMA)
    if schema != TRACE_SCHEMA:
        return Rejection("unsupported_schema", f"schema {str(schema)[:64]!r} is not {TRACE_SCHEMA}")
    shape = _check_messages(body.get("messages")) or _check_tools(body.get("tools"))
    if shape is not None:
        return shape
    return _check_content(body)


def _check_messages(messages: Any) -> Rejection | None:
    if not isinstance(messages, list) or not messages:
        return Rejection("missing_messages", "trace has no messages list")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in _ROLES:
            return Rejection(
                "malformed_trace", f"message {index} is not an object with a known role"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            return Rejection("malformed_trace", f"message {index} content is not text")
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            return Rejection("unknown_tool_format", f"message {index} tool_calls is not a list")
        for call in calls:
            if (
                not isinstance(call, Mapping)
                or not isinstance(call.get("name"), str)
                or not isinstance(call.get("arguments", {}), Mapping | str)
            ):
                return Rejection(
                    "unknown_tool_format",
                    f"message {index} has a tool call without a name and object/string arguments",
                )
    return None


def _check_tools(tools: Any) -> Rejection | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, Mapping) and isinstance(t.get("name"), str) for t in tools
    ):
        return Rejection("unknown_tool_format", "tools must be a list of objects with a name")
    return None


def _check_content(body: Mapping[str, Any]) -> Rejection | None:
    """Binary payloads (control characters, undecodable bytes) and absurd nesting."""
    stack: list[tuple[Any, int]] = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return Rejection("malformed_trace", f"trace is nested deeper than {MAX_DEPTH} levels")
        # Bodies are decoded JSON: exact type checks are much cheaper than ABC checks.
        kind = type(value)
        if kind is str:
            if not value.isprintable() and _looks_binary(value):
                return Rejection("binary_payload", "trace holds binary data in a text field")
        elif kind is dict or (kind is not list and isinstance(value, Mapping)):
            stack.extend((item, depth + 1) for item in value.values())
        elif kind is list:
            stack.extend((item, depth + 1) for item in value)
    return None


def _looks_binary(text: str) -> bool:
    """At least 1% control characters, replacement characters or lone surrogates."""
    bad = len(_BINARY.findall(text))
    return bad > 0 and bad * 100 >= len(text)


def failure_signature(body: Mapping[str, Any], error_kind: str | None) -> str:
    """A short description of how an episode failed: error kind and the tools it called."""
    names: list[str] = []
    for message in body.get("messages") or ():
        for call in (message.get("tool_calls") or ()) if isinstance(message, Mapping) else ():
            name = call.get("name") if isinstance(call, Mapping) else None
            if isinstance(name, str) and name not in names:
                names.append(name)
    kind = error_kind or "failed"
    return f"{kind}|{','.join(names[:8])}"[:256]
