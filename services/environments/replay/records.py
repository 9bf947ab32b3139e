"""Recorded tool calls: canonical keys, what a trace recorded, and the loop's store file.

A replayed tool answers a call with the result production got for the *same* call, so
"the same" must not depend on how an agent happened to write it: the key of a call is the
tool's name, the hash of the tool's JSON schema as the task lists it, and its arguments as
canonical JSON (sorted keys, no whitespace, integral floats written as integers, so
``{"b": 2.0, "a": "x"}`` and ``{"a":"x","b":2}`` are one call). The schema hash keeps a
drifted tool apart: a call recorded against last week's ``search(query)`` is never replayed
to a task whose ``search`` takes ``(query, page)``, because the real tool would not have
answered it the same way.

The loop's store (the ``tool_responses`` table, fed by curation) is shipped to jobs as a
JSONL file beside the dataset's task files (``tool_responses.jsonl``, one
:class:`RecordedCall` per line); jobs read that file, never the database.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STORE_FILE = "tool_responses.jsonl"
STORE_SCHEMA = "ratchet.tool_response/v1"


class StoreFileError(ValueError):
    """A tool-response store file that cannot be read."""


def normalize_json(value: Any) -> Any:
    """``value`` with integral floats as ints and every mapping's keys as strings."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        return value
    if isinstance(value, Mapping):
        return {str(k): normalize_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [normalize_json(v) for v in value]
    return str(value)


def canonical_arguments(arguments: Mapping[str, Any] | str) -> str:
    """A call's arguments as canonical JSON; a string that is not a JSON object stays itself
    (an agent's malformed arguments are still a call that production answered)."""
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
        if not isinstance(decoded, dict):
            return arguments
        arguments = decoded
    return json.dumps(
        normalize_json(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def flat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as ``ratchet.trace/v1`` lists it (``name``, ``description``, ``parameters``),
    from that form or OpenAI's ``{"type": "function", "function": {...}}``."""
    function = tool.get("function")
    inner: Mapping[str, Any] = function if isinstance(function, Mapping) else tool
    out: dict[str, Any] = {"name": inner.get("name")}
    if inner.get("description") is not None:
        out["description"] = inner.get("description")
    out["parameters"] = dict(inner.get("parameters") or {})
    return out


def schema_hash(tool: Mapping[str, Any]) -> str:
    """The version of a tool: sha256 of its parameters' canonical JSON (16 hex digits).

    The description is not part of it: rewording a tool's help changes no result.
    """
    parameters = flat_tool(tool)["parameters"]
    text = json.dumps(normalize_json(parameters), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def arguments_key(arguments: str) -> str:
    """The digest of canonical arguments the store indexes by (64 hex digits)."""
    return hashlib.sha256(arguments.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class RecordedCall:
    """One call production made and the result it got (an error text is a result too)."""

    tool: str
    schema_hash: str
    arguments: str  # canonical JSON (see canonical_arguments)
    result: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.tool, self.schema_hash, self.arguments)

    def to_dict(self) -> dict[str, str]:
        return {
            "schema": STORE_SCHEMA,
            "tool": self.tool,
            "schema_hash": self.schema_hash,
            "arguments": self.arguments,
            "result": self.result,
        }

    @classmethod
    def from_dict(cls, data: Any) -> RecordedCall:
        if not isinstance(data, Mapping) or data.get("schema", STORE_SCHEMA) != STORE_SCHEMA:
            raise StoreFileError(f"a recorded call must be a {STORE_SCHEMA} object")
        values = [data.get(k) for k in ("tool", "schema_hash", "arguments", "result")]
        strings = [v for v in values if isinstance(v, str)]
        if len(strings) != len(values):
            raise StoreFileError("tool, schema_hash, arguments and result must be strings")
        return cls(*strings)


def recorded_calls(trace: Mapping[str, Any]) -> list[RecordedCall]:
    """Every tool call of a ``ratchet.trace/v1`` trace that has its result in the trace.

    A result is the ``tool`` message whose ``tool_call_id`` is the call's id; calls of a tool
    the trace does not list, and calls never answered, are left out (nothing to replay).
    """
    tools = trace.get("tools")
    messages = trace.get("messages")
    if not isinstance(tools, list) or not isinstance(messages, list):
        return []
    hashes = {
        t["name"]: schema_hash(t)
        for t in tools
        if isinstance(t, Mapping) and isinstance(t.get("name"), str)
    }
    results = {
        m.get("tool_call_id"): m.get("content")
        for m in messages
        if isinstance(m, Mapping) and m.get("role") == "tool" and m.get("tool_call_id")
    }
    calls: list[RecordedCall] = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            if not isinstance(call, Mapping):
                continue
            name, result = call.get("name"), results.get(call.get("id"))
            if not isinstance(name, str) or name not in hashes or not isinstance(result, str):
                continue
            arguments = call.get("arguments", {})
            if not isinstance(arguments, Mapping | str):
                continue
            calls.append(RecordedCall(name, hashes[name], canonical_arguments(arguments), result))
    return calls


def write_store_file(path: Path, calls: Iterable[RecordedCall]) -> int:
    """Write a store file (sorted by key, so equal stores are equal bytes); returns the count."""
    ordered = sorted(calls, key=lambda c: c.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for call in ordered:
            fh.write(json.dumps(call.to_dict(), sort_keys=True, ensure_ascii=False) + "\n")
    return len(ordered)


def read_store_file(path: Path) -> dict[tuple[str, str, str], str]:
    """A store file as a lookup table; a bad line is a StoreFileError naming its number."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise StoreFileError(f"cannot read tool-response store {path}: {exc}") from exc
    table: dict[tuple[str, str, str], str] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            call = RecordedCall.from_dict(json.loads(line))
        except (ValueError, StoreFileError) as exc:
            raise StoreFileError(f"{path}: line {number}: {exc}") from exc
        table.setdefault(call.key, call.result)
    return table


def as_table(calls: Sequence[RecordedCall]) -> dict[tuple[str, str, str], str]:
    """Recorded calls as a lookup table; the first result recorded for a key wins."""
    table: dict[tuple[str, str, str], str] = {}
    for call in calls:
        table.setdefault(call.key, call.result)
    return table
