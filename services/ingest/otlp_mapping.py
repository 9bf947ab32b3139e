"""One OTLP episode (its spans, content from log records applied) as a ``ratchet.trace/v1``.

- messages: ``gen_ai.system_instructions`` as a system message, then the input and output
  messages of the last model call (the input of a call is the whole conversation so far);
  without any, the agent span's messages; without those, the tool calls of ``execute_tool``
  spans;
- tools: ``gen_ai.tool.definitions``, plus any tool seen in an ``execute_tool`` span;
- outcome: the last ``gen_ai.evaluation.result`` event (score value, and success from its
  label), an error status on the episode's span (``error.type`` as the kind);
  ``ratchet.outcome.success`` / ``ratchet.outcome.score`` attributes override;
- external id: the ``ratchet.external_id`` attribute, else the trace id in hex when the
  episode's span is the trace's root, else ``<trace id>:<span id>`` (so two agents in one
  upstream request are two traces, and the same episode always gets the same id);
- model version: ``ratchet.model_version``, else the response (or request) model of the
  first model call; the model calls' ``gen_ai.response.id`` become ``response_ids`` (a
  Ratchet model server signs them for the version that answered).

Content sent as log records is applied to its span first (:func:`apply_logs`): the pre-1.37
message events (``gen_ai.system.message``, ``gen_ai.user.message``,
``gen_ai.assistant.message``, ``gen_ai.tool.message`` as the call's input, ``gen_ai.choice``
as its output) and the attributes of ``gen_ai.client.inference.operation.details``; the
span's own attributes win.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pydantic_core
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from services.ingest.episodes import Node, plan_trace
from services.ingest.errors import IngestError
from services.ingest.otlp import (
    CHAT_OPERATIONS,
    CHOICE_EVENT,
    EVALUATION_EVENT,
    MESSAGE_EVENTS,
    STRUCTURED_KEYS,
    TOOL_OPERATION,
    Limits,
    LogView,
    SpanEvent,
    SpanView,
    parse_structured,
    read_spans,
)
from services.ingest.schema import StoredTrace, validate_trace

STATUS_ERROR = 2
_PASS_LABELS = {"pass", "passed", "success", "succeeded", "true", "correct", "good", "yes"}
_FAIL_LABELS = {"fail", "failed", "failure", "false", "incorrect", "wrong", "bad", "no"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_ROLES |= {"tool": "tool", "model": "assistant"}

# Response attributes an operation-details log record may carry for its span.
RESPONSE_KEYS = ("gen_ai.request.model", "gen_ai.response.model", "gen_ai.response.id")


class MappingError(Exception):
    """A trace whose spans cannot be turned into a Ratchet trace; the message says why."""


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# Content from log records -------------------------------------------------------------------


def _legacy_message(role: str, body: Any) -> dict[str, Any]:
    """A pre-1.37 message event body (``content``, ``tool_calls``, ``id``) as a semconv message."""
    body = body if isinstance(body, dict) else {"content": body}
    content = body.get("content")
    if role == "tool":
        part: dict[str, Any] = {"type": "tool_call_response", "response": content}
        if isinstance(body.get("id"), str):
            part["id"] = body["id"]
        return {"role": "tool", "parts": [part]}
    parts: list[dict[str, Any]] = []
    if content is not None:
        parts.append({"type": "text", "content": content})
    for call in _list(body.get("tool_calls")):
        function = _dict(_dict(call).get("function"))
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            parsed = parse_structured(arguments, "tool_calls.function.arguments")
            arguments = parsed if isinstance(parsed, dict) else arguments
        parts.append(
            {
                "type": "tool_call",
                "id": _dict(call).get("id"),
                "name": function.get("name"),
                "arguments": arguments,
            }
        )
    return {"role": role, "parts": parts}


def apply_logs(spans: list[SpanView], logs: list[LogView]) -> None:
    """Give each span the content its log records carry (the span's own attributes win)."""
    by_span: dict[str, list[LogView]] = defaultdict(list)
    for log in logs:
        by_span[log.span_id].append(log)
    for span in spans:
        records = sorted(by_span.get(span.span_id, ()), key=lambda r: r.time_ns)
        if not records:
            continue
        inputs: list[dict[str, Any]] = []
        outputs: list[dict[str, Any]] = []
        for record in records:
            if record.event_name == EVALUATION_EVENT:
                span.events.append(SpanEvent(record.event_name, record.time_ns, record.attributes))
            elif record.event_name in MESSAGE_EVENTS:
                inputs.append(_legacy_message(MESSAGE_EVENTS[record.event_name], record.body))
            elif record.event_name == CHOICE_EVENT:
                message = _dict(_dict(record.body).get("message"))
                role = message.get("role")
                outputs.append(
                    _legacy_message(role if isinstance(role, str) else "assistant", message)
                )
            for key in (*STRUCTURED_KEYS, *RESPONSE_KEYS):
                if key in record.attributes:
                    span.attributes.setdefault(key, record.attributes[key])
        if inputs:
            span.attributes.setdefault("gen_ai.input.messages", inputs)
        if outputs:
            span.attributes.setdefault("gen_ai.output.messages", outputs)


# Mapping ------------------------------------------------------------------------------------


def _timestamp(ns: int) -> str | None:
    if ns <= 0:
        return None
    try:
        return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).isoformat()
    except (OverflowError, ValueError, OSError):
        return None


def _structured(value: Any, what: str) -> Any:
    """A structured attribute: a JSON string (the usual encoding on spans) or a value."""
    if isinstance(value, str):
        try:
            return pydantic_core.from_json(value, allow_inf_nan=False)
        except ValueError as exc:
            raise MappingError(f"{what} is not valid JSON: {exc}") from None
    return value


def _text_of(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def convert_messages(items: Any, what: str) -> list[dict[str, Any]]:
    """GenAI semconv messages (``role`` + typed ``parts``) as ratchet.trace/v1 messages."""
    messages: list[dict[str, Any]] = []
    if not isinstance(items, list):
        raise MappingError(f"{what} must be a JSON array of messages")
    for position, item in enumerate(items):
        if not isinstance(item, dict):
            raise MappingError(f"{what}[{position}] is not an object")
        raw_role = item.get("role")
        role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise MappingError(f"{what}[{position}] has an unsupported role {raw_role!r}")
        texts, calls, responses = _split_parts(_parts(item))
        if responses:
            messages.extend(_tool_message(response) for response in responses)
            continue
        message: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else None}
        if calls and role == "assistant":
            message["tool_calls"] = calls
        if isinstance(item.get("name"), str) and item["name"]:
            message["name"] = item["name"]
        messages.append(message)
    return messages


def _parts(item: dict[str, Any]) -> list[Any]:
    """A message's typed parts; the older flat ``{"role", "content"}`` form as one text part."""
    parts = item.get("parts")
    if isinstance(parts, list):
        return parts
    content = item.get("content")
    return [{"type": "text", "content": content}] if content is not None else []


def _split_parts(
    parts: list[Any],
) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """A message's texts, tool calls (as ratchet.trace/v1 calls) and tool call responses;
    parts of any other type are dropped."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    responses: list[dict[str, Any]] = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text" and part.get("content") is not None:
            texts.append(_text_of(part["content"]))
        elif kind == "tool_call" and isinstance(part.get("name"), str):
            calls.append(_tool_call(part, position=len(calls)))
        elif kind == "tool_call_response":
            responses.append(part)
    return texts, calls, responses


def _tool_call(part: dict[str, Any], *, position: int) -> dict[str, Any]:
    """A ``tool_call`` part as a call; one without an id is named by its position."""
    arguments = part.get("arguments")
    if not isinstance(arguments, dict | str):
        arguments = {} if arguments is None else _text_of(arguments)
    call_id = part.get("id")
    return {
        "id": call_id if isinstance(call_id, str) and call_id else f"call_{position}",
        "name": part["name"],
        "arguments": arguments,
    }


def _tool_message(response: dict[str, Any]) -> dict[str, Any]:
    """A ``tool_call_response`` part as a ``tool`` message."""
    message: dict[str, Any] = {"role": "tool", "content": _text_of(response.get("response"))}
    if isinstance(response.get("id"), str) and response["id"]:
        message["tool_call_id"] = response["id"]
    return message


def _system_messages(spans: list[SpanView]) -> list[dict[str, Any]]:
    for span in spans:
        value = span.attributes.get("gen_ai.system_instructions")
        if value is None:
            continue
        parts = _structured(value, "gen_ai.system_instructions")
        if isinstance(parts, str):
            return [{"role": "system", "content": parts}]
        texts = [
            _text_of(p.get("content"))
            for p in _list(parts)
            if isinstance(p, dict)
            and p.get("type", "text") == "text"
            and p.get("content") is not None
        ]
        if texts:
            return [{"role": "system", "content": "\n".join(texts)}]
    return []


def _conversation(
    spans: list[SpanView], chats: list[SpanView], agent: SpanView
) -> list[dict[str, Any]]:
    for span in sorted(chats, key=lambda s: s.end_ns, reverse=True):
        if "gen_ai.input.messages" in span.attributes:
            messages = convert_messages(
                _structured(span.attributes["gen_ai.input.messages"], "gen_ai.input.messages"),
                "gen_ai.input.messages",
            )
            output = span.attributes.get("gen_ai.output.messages")
            if output is not None:
                messages += convert_messages(
                    _structured(output, "gen_ai.output.messages"), "gen_ai.output.messages"
                )
            return messages
    if "gen_ai.input.messages" in agent.attributes or "gen_ai.output.messages" in agent.attributes:
        messages = []
        for key in ("gen_ai.input.messages", "gen_ai.output.messages"):
            if key in agent.attributes:
                messages += convert_messages(_structured(agent.attributes[key], key), key)
        return messages
    return _tool_messages(spans)


def _tool_messages(spans: list[SpanView]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for span in sorted(spans, key=lambda s: s.start_ns):
        if span.operation != TOOL_OPERATION:
            continue
        name = span.attributes.get("gen_ai.tool.name")
        if not isinstance(name, str) or not name:
            continue
        call_id = span.attributes.get("gen_ai.tool.call.id")
        call_id = call_id if isinstance(call_id, str) and call_id else f"call_{span.span_id}"
        arguments = span.attributes.get("gen_ai.tool.call.arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = pydantic_core.from_json(arguments, allow_inf_nan=False)
                arguments = parsed if isinstance(parsed, dict) else arguments
            except ValueError:
                pass
        elif not isinstance(arguments, dict):
            arguments = _text_of(arguments)
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "name": name, "arguments": arguments}],
            }
        )
        result = span.attributes.get("gen_ai.tool.call.result")
        messages.append(
            {
                "role": "tool",
                "content": None if result is None else _text_of(result),
                "tool_call_id": call_id,
                "name": name,
            }
        )
    return messages


def _tools(spans: list[SpanView]) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    for span in spans:
        value = span.attributes.get("gen_ai.tool.definitions")
        if value is None:
            continue
        for item in _list(_structured(value, "gen_ai.tool.definitions")):
            if not isinstance(item, dict):
                continue
            nested = item.get("function")
            function: dict[str, Any] = nested if isinstance(nested, dict) else item
            name = function.get("name")
            if isinstance(name, str) and name and name not in seen:
                seen.add(name)
                parameters = function.get("parameters")
                description = function.get("description")
                tools.append(
                    {
                        "name": name,
                        "description": description if isinstance(description, str) else None,
                        "parameters": parameters if isinstance(parameters, dict) else {},
                    }
                )
        break
    for span in sorted(spans, key=lambda s: s.start_ns):
        name = span.attributes.get("gen_ai.tool.name")
        if span.operation == TOOL_OPERATION and isinstance(name, str) and name and name not in seen:
            seen.add(name)
            description = span.attributes.get("gen_ai.tool.description")
            tools.append(
                {
                    "name": name,
                    "description": description if isinstance(description, str) else None,
                    "parameters": {},
                }
            )
    return tools


def _label_success(label: Any) -> bool | None:
    if isinstance(label, bool):
        return label
    if isinstance(label, str):
        lowered = label.strip().lower()
        if lowered in _PASS_LABELS:
            return True
        if lowered in _FAIL_LABELS:
            return False
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _outcome(spans: list[SpanView], anchor: SpanView) -> tuple[dict[str, Any], dict[str, Any]]:
    """The outcome and what metadata says about the evaluation."""
    success: bool | None = None
    score: float | None = None
    evaluation: dict[str, Any] = {}
    events = [e for s in spans for e in s.events if e.name == EVALUATION_EVENT]
    if events:
        last = max(events, key=lambda e: e.time_ns)
        score = _number(last.attributes.get("gen_ai.evaluation.score.value"))
        label = last.attributes.get("gen_ai.evaluation.score.label")
        success = _label_success(label)
        evaluation = {
            key: last.attributes[f"gen_ai.evaluation.{key}"]
            for key in ("name", "score.label", "explanation")
            if f"gen_ai.evaluation.{key}" in last.attributes
        }
    error: dict[str, Any] | None = None
    if anchor.status_code == STATUS_ERROR:
        kind = anchor.attributes.get("error.type")
        error = {
            "kind": str(kind)[:128] if kind else "span_error",
            "message": anchor.status_message or f"span {anchor.name!r} ended with an error",
        }
    if isinstance(anchor.attributes.get("ratchet.outcome.success"), bool):
        success = anchor.attributes["ratchet.outcome.success"]
    value = _number(anchor.attributes.get("ratchet.outcome.score"))
    if value is not None:
        score = value
    if success is None and error is not None:
        success = False
    return {"success": success, "score": score, "error": error}, evaluation


def _attribute(spans: list[SpanView], key: str) -> Any:
    for span in spans:
        if key in span.attributes:
            return span.attributes[key]
    return None


def external_id_of(trace_id: str, key_span_id: str, *, key_is_root: bool) -> str:
    """The external id of an episode without ``ratchet.external_id`` (module docstring)."""
    return trace_id if key_is_root else f"{trace_id}:{key_span_id}"


def _outermost(spans: list[SpanView]) -> SpanView:
    """The earliest span whose parent is not in the episode."""
    ids = {span.span_id for span in spans}
    tops = [span for span in spans if span.parent_span_id not in ids] or spans
    return min(tops, key=lambda s: s.start_ns)


def map_episode(
    trace_id: str, agent: SpanView | None, spans: list[SpanView], *, external_id: str
) -> dict[str, Any]:
    """One episode's spans as a ratchet.trace/v1 document (not yet validated). ``agent`` is its
    ``invoke_agent`` span (among ``spans``), if it has one; ``external_id`` the default id."""
    if not spans:
        raise MappingError(f"trace {trace_id}: the episode has no GenAI spans")
    ordered = sorted(spans, key=lambda s: s.start_ns)
    anchor = agent if agent is not None else _outermost(ordered)
    started = anchor.start_ns if agent is not None else min(s.start_ns for s in ordered)
    ended = anchor.end_ns if agent is not None else max(s.end_ns for s in ordered)
    agent = anchor
    chats = [s for s in ordered if s.operation in CHAT_OPERATIONS]
    preferred = [anchor, *ordered]
    messages = _system_messages([*chats, agent]) + _conversation(ordered, chats, agent)
    if not messages:
        raise MappingError(
            f"trace {trace_id}: no gen_ai messages or tool calls in its spans (is content "
            "capture on? see docs/ingest.md)"
        )
    given_id = _attribute(preferred, "ratchet.external_id")
    model_version = _attribute(preferred, "ratchet.model_version")
    if model_version is None:
        model_version = _attribute(chats, "gen_ai.response.model") or _attribute(
            [*chats, agent], "gen_ai.request.model"
        )
    response_ids = [s.attributes.get("gen_ai.response.id") for s in chats]
    outcome, evaluation = _outcome(ordered, anchor)
    usage = {
        key: sum(
            int(s.attributes[f"gen_ai.usage.{key}"])
            for s in chats
            if isinstance(s.attributes.get(f"gen_ai.usage.{key}"), int)
        )
        for key in ("input_tokens", "output_tokens")
    }
    metadata = {
        "source": "otlp",
        "trace_id": trace_id,
        "span_id": anchor.span_id,
        "root_span": anchor.name,
        "service_name": anchor.service_name,
        "agent_name": _attribute(preferred, "gen_ai.agent.name"),
        "conversation_id": _attribute(preferred, "gen_ai.conversation.id"),
        "provider": _attribute([*chats, agent], "gen_ai.provider.name")
        or _attribute([*chats, agent], "gen_ai.system"),
        "usage": usage if any(usage.values()) else None,
        "evaluation": evaluation or None,
    }
    reference = _attribute(preferred, "ratchet.reference_answer")
    return {
        "schema": "ratchet.trace/v1",
        "external_id": given_id if isinstance(given_id, str) and given_id else external_id,
        "model_version": model_version if isinstance(model_version, str) else None,
        "response_ids": list(dict.fromkeys(i for i in response_ids if isinstance(i, str) and i)),
        "started_at": _timestamp(started),
        "ended_at": _timestamp(ended),
        "tools": _tools([*chats, agent, *ordered]),
        "messages": messages,
        "outcome": outcome,
        "reference_answer": reference if isinstance(reference, str) else None,
        "metadata": {key: value for key, value in metadata.items() if value is not None},
    }


def validate_episode(
    trace_id: str, agent: SpanView | None, spans: list[SpanView], *, external_id: str
) -> StoredTrace:
    """Map and validate one episode; :class:`MappingError` says why it cannot be stored."""
    try:
        return validate_trace(map_episode(trace_id, agent, spans, external_id=external_id))
    except IngestError as exc:
        detail = "; ".join(f"{f['path']}: {f['message']}" for f in exc.fields[:5])
        raise MappingError(f"trace {trace_id}: {exc.message} ({detail})") from None
    except (RecursionError, ValueError, TypeError) as exc:  # defence in depth: never a 500
        raise MappingError(f"trace {trace_id}: its content cannot be mapped: {exc}") from None


@dataclass
class MappedExport:
    """An export taken as complete: its traces (span count, trace) and what was rejected."""

    traces: list[tuple[int, StoredTrace]] = field(default_factory=list)
    rejected_spans: int = 0
    errors: list[str] = field(default_factory=list)
    total_spans: int = 0


DEFAULT_LIMITS = Limits(max_traces=10_000, max_spans=100_000, max_attribute_bytes=16 << 20)


def map_export(request: ExportTraceServiceRequest, limits: Limits = DEFAULT_LIMITS) -> MappedExport:
    """Every episode of an export, as if nothing more would come (the sweeper's view of a
    quiet trace); failures are counted, never raised. For tools and tests: the api assembles
    through services.ingest.span_store."""
    decoded = read_spans(request, limits)
    mapped = MappedExport(
        rejected_spans=decoded.rejected, errors=list(decoded.errors), total_spans=decoded.total
    )
    for trace_id, spans in decoded.spans.items():
        by_id = {span.span_id: span for span in spans}
        nodes = [
            Node(
                n,
                s.span_id,
                s.span_id,
                s.parent_span_id,
                s.kind,
                s.remote_parent,
                s.has_content,
                False,
            )
            for n, s in enumerate(by_id.values())
        ]
        plan = plan_trace(nodes, flush=True)
        for members in plan.unmapped:
            mapped.rejected_spans += len(members)
            mapped.errors.append(f"trace {trace_id}: no gen_ai spans (nothing to learn from)")
        for episode in plan.episodes:
            views = [by_id[n.span_id] for n in episode.spans]
            agent = by_id[episode.agent.span_id] if episode.agent is not None else None
            external_id = external_id_of(
                trace_id, episode.key_span_id, key_is_root=episode.key_is_root
            )
            try:
                stored = validate_episode(trace_id, agent, views, external_id=external_id)
            except MappingError as exc:
                mapped.rejected_spans += len(views)
                mapped.errors.append(str(exc))
            else:
                mapped.traces.append((len(views), stored))
    return mapped
