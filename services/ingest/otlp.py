"""OTLP/HTTP traces → ``ratchet.trace/v1``: OpenTelemetry GenAI spans assembled per trace.

An agent instrumented with the OpenTelemetry GenAI semantic conventions emits, per episode,
an ``invoke_agent`` span, ``chat`` spans (one per model call, with ``gen_ai.input.messages``
and ``gen_ai.output.messages``), ``execute_tool`` spans, and ``gen_ai.evaluation.result``
events when something scored the answer. Spans are grouped by trace id; each trace becomes
one Ratchet trace:

- messages: ``gen_ai.system_instructions`` as a system message, then the input and output
  messages of the last model call (the input of a call is the whole conversation so far);
  without any, the agent span's messages; without those, the tool calls of ``execute_tool``
  spans;
- tools: ``gen_ai.tool.definitions``, plus any tool seen in an ``execute_tool`` span;
- outcome: the last ``gen_ai.evaluation.result`` event (score value, and success from its
  label), an error status on the root or agent span (``error.type`` as the kind);
  ``ratchet.outcome.success`` / ``ratchet.outcome.score`` attributes override;
- external id: the ``ratchet.external_id`` attribute, else the trace id in hex;
- model version: ``ratchet.model_version``, else the response (or request) model of the
  first model call.

A trace is assembled only when its root span (no parent) is in the request: exporters send a
trace's spans together unless it outlives the batch delay, and a partial trace stored now
would turn the rest into a duplicate later. Spans of traces without their root are reported
back as rejected (OTLP partial success), never silently dropped.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from services.ingest.errors import IngestError
from services.ingest.schema import StoredTrace, decode_json, validate_trace

CHAT_OPERATIONS = {"chat", "text_completion", "generate_content"}
STATUS_ERROR = 2
EVALUATION_EVENT = "gen_ai.evaluation.result"
_PASS_LABELS = {"pass", "passed", "success", "succeeded", "true", "correct", "good", "yes"}
_FAIL_LABELS = {"fail", "failed", "failure", "false", "incorrect", "wrong", "bad", "no"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_ROLES |= {"tool": "tool", "model": "assistant"}


class MappingError(Exception):
    """A trace whose spans cannot be turned into a Ratchet trace; the message says why."""


# Decoding -----------------------------------------------------------------------------------


def decode_protobuf(body: bytes) -> ExportTraceServiceRequest:
    try:
        return ExportTraceServiceRequest.FromString(body)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise IngestError(
            400, "invalid_protobuf", f"the body is not an OTLP ExportTraceServiceRequest: {exc}"
        ) from None


def _hex_to_b64(value: Any, where: str) -> Any:
    if not isinstance(value, str) or not value:
        return value
    try:
        return base64.b64encode(bytes.fromhex(value)).decode("ascii")
    except ValueError:
        raise IngestError(400, "invalid_otlp", f"{where} is not a hex id: {value[:64]!r}") from None


def _ids_to_base64(data: dict[str, Any]) -> None:
    """OTLP/JSON writes trace and span ids in hex; protobuf's JSON mapping expects base64."""
    for r, resource_spans in enumerate(_list(data.get("resourceSpans"))):
        for s, scope_spans in enumerate(_list(_dict(resource_spans).get("scopeSpans"))):
            for n, span in enumerate(_list(_dict(scope_spans).get("spans"))):
                if not isinstance(span, dict):
                    continue
                where = f"resourceSpans.{r}.scopeSpans.{s}.spans.{n}"
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = _hex_to_b64(span[key], f"{where}.{key}")
                for k, link in enumerate(_list(span.get("links"))):
                    if isinstance(link, dict):
                        for key in ("traceId", "spanId"):
                            if key in link:
                                link[key] = _hex_to_b64(link[key], f"{where}.links.{k}.{key}")


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def decode_json_request(body: bytes) -> ExportTraceServiceRequest:
    data = decode_json(body)
    if not isinstance(data, dict):
        raise IngestError(400, "invalid_otlp", "an OTLP/JSON body must be a JSON object")
    _ids_to_base64(data)
    try:
        return json_format.ParseDict(data, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except (json_format.ParseError, RecursionError, ValueError, TypeError) as exc:
        raise IngestError(
            400, "invalid_otlp", f"the body is not an OTLP/JSON ExportTraceServiceRequest: {exc}"
        ) from None


def encode_response(rejected_spans: int, message: str, *, as_json: bool) -> bytes:
    """An ExportTraceServiceResponse, with partial success when spans were rejected."""
    response = ExportTraceServiceResponse()
    if rejected_spans:
        response.partial_success.rejected_spans = rejected_spans
        response.partial_success.error_message = message
    if as_json:
        return json_format.MessageToJson(response, indent=None).encode("utf-8")
    return response.SerializeToString()


# Spans --------------------------------------------------------------------------------------


def any_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as plain JSON-able Python."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "array_value":
        return [any_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return None


def attributes(items: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    item: KeyValue
    for item in items:
        result[item.key] = any_value(item.value)
    return result


@dataclass
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass
class SpanView:
    """The parts of a span the mapping reads."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[SpanEvent]
    status_code: int
    status_message: str
    resource: dict[str, Any]

    @property
    def operation(self) -> str | None:
        value = self.attributes.get("gen_ai.operation.name")
        if isinstance(value, str):
            return value
        # Some instrumentations only name the span "<operation> <target>".
        head = self.name.split(" ", 1)[0]
        return head if head in CHAT_OPERATIONS | {"invoke_agent", "execute_tool"} else None


def group_spans(request: ExportTraceServiceRequest) -> tuple[dict[str, list[SpanView]], int]:
    """Spans by trace id (hex), and the number of spans in the request."""
    traces: dict[str, list[SpanView]] = defaultdict(list)
    total = 0
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                total += 1
                view = SpanView(
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(),
                    name=span.name,
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    attributes=attributes(span.attributes),
                    events=[
                        SpanEvent(e.name, e.time_unix_nano, attributes(e.attributes))
                        for e in span.events
                    ],
                    status_code=span.status.code,
                    status_message=span.status.message,
                    resource=resource,
                )
                traces[view.trace_id].append(view)
    return dict(traces), total


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
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise MappingError(f"{what} is not valid JSON: {exc.msg}") from None
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
        parts = item.get("parts")
        if not isinstance(parts, list):
            content = item.get("content")  # the older flat {"role", "content"} form
            parts = [{"type": "text", "content": content}] if content is not None else []
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
                arguments = part.get("arguments")
                if not isinstance(arguments, dict | str):
                    arguments = {} if arguments is None else _text_of(arguments)
                call_id = part.get("id")
                calls.append(
                    {
                        "id": call_id
                        if isinstance(call_id, str) and call_id
                        else f"call_{len(calls)}",
                        "name": part["name"],
                        "arguments": arguments,
                    }
                )
            elif kind == "tool_call_response":
                responses.append(part)
        if responses:
            for response in responses:
                message: dict[str, Any] = {
                    "role": "tool",
                    "content": _text_of(response.get("response")),
                }
                if isinstance(response.get("id"), str) and response["id"]:
                    message["tool_call_id"] = response["id"]
                messages.append(message)
            continue
        message = {"role": role, "content": "\n".join(texts) if texts else None}
        if calls and role == "assistant":
            message["tool_calls"] = calls
        if isinstance(item.get("name"), str) and item["name"]:
            message["name"] = item["name"]
        messages.append(message)
    return messages


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
        if span.operation != "execute_tool":
            continue
        name = span.attributes.get("gen_ai.tool.name")
        if not isinstance(name, str) or not name:
            continue
        call_id = span.attributes.get("gen_ai.tool.call.id")
        call_id = call_id if isinstance(call_id, str) and call_id else f"call_{span.span_id}"
        arguments = span.attributes.get("gen_ai.tool.call.arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
                arguments = parsed if isinstance(parsed, dict) else arguments
            except json.JSONDecodeError:
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
        if span.operation == "execute_tool" and isinstance(name, str) and name and name not in seen:
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


def _outcome(
    spans: list[SpanView], root: SpanView, agent: SpanView
) -> tuple[dict[str, Any], dict[str, Any]]:
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
    for span in (root, agent):
        if span.status_code == STATUS_ERROR:
            kind = span.attributes.get("error.type")
            error = {
                "kind": str(kind)[:128] if kind else "span_error",
                "message": span.status_message or f"span {span.name!r} ended with an error",
            }
            break
    for span in (agent, root):
        if isinstance(span.attributes.get("ratchet.outcome.success"), bool):
            success = span.attributes["ratchet.outcome.success"]
            break
    for span in (agent, root):
        value = _number(span.attributes.get("ratchet.outcome.score"))
        if value is not None:
            score = value
            break
    if success is None and error is not None:
        success = False
    return {"success": success, "score": score, "error": error}, evaluation


def _attribute(spans: list[SpanView], key: str) -> Any:
    for span in spans:
        if key in span.attributes:
            return span.attributes[key]
    return None


def map_trace(trace_id: str, spans: list[SpanView]) -> dict[str, Any]:
    """One trace's spans as a ratchet.trace/v1 document (not yet validated)."""
    roots = sorted((s for s in spans if not s.parent_span_id), key=lambda s: s.start_ns)
    if not roots:
        raise MappingError(f"trace {trace_id}: its root span was not in this export")
    root = roots[0]
    ordered = sorted(spans, key=lambda s: s.start_ns)
    agents = [s for s in ordered if s.operation == "invoke_agent"]
    agent = agents[0] if agents else root
    chats = [s for s in ordered if s.operation in CHAT_OPERATIONS]
    preferred = [agent, root, *ordered]
    messages = _system_messages([*chats, agent]) + _conversation(ordered, chats, agent)
    if not messages:
        raise MappingError(f"trace {trace_id}: no gen_ai messages or tool calls in its spans")
    external_id = _attribute(preferred, "ratchet.external_id")
    model_version = _attribute(preferred, "ratchet.model_version")
    if model_version is None:
        model_version = _attribute(chats, "gen_ai.response.model") or _attribute(
            [*chats, agent], "gen_ai.request.model"
        )
    outcome, evaluation = _outcome(ordered, root, agent)
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
        "root_span": root.name,
        "service_name": root.resource.get("service.name"),
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
        "external_id": external_id if isinstance(external_id, str) and external_id else trace_id,
        "model_version": model_version if isinstance(model_version, str) else None,
        "started_at": _timestamp(root.start_ns),
        "ended_at": _timestamp(root.end_ns),
        "tools": _tools([*chats, agent, *ordered]),
        "messages": messages,
        "outcome": outcome,
        "reference_answer": reference if isinstance(reference, str) else None,
        "metadata": {key: value for key, value in metadata.items() if value is not None},
    }


@dataclass
class MappedExport:
    """The traces of one export request, and what was rejected (spans, with reasons)."""

    traces: list[tuple[int, StoredTrace]] = field(default_factory=list)  # (span count, trace)
    rejected_spans: int = 0
    errors: list[str] = field(default_factory=list)
    total_spans: int = 0


def map_export(request: ExportTraceServiceRequest) -> MappedExport:
    """Assemble and validate every trace of an export; failures are counted, never raised."""
    grouped, total = group_spans(request)
    mapped = MappedExport(total_spans=total)
    for trace_id, spans in grouped.items():
        try:
            document = map_trace(trace_id, spans)
            stored = validate_trace(document)
        except MappingError as exc:
            mapped.rejected_spans += len(spans)
            mapped.errors.append(str(exc))
        except IngestError as exc:
            mapped.rejected_spans += len(spans)
            detail = "; ".join(f"{f['path']}: {f['message']}" for f in exc.fields[:5])
            mapped.errors.append(f"trace {trace_id}: {exc.message} ({detail})")
        else:
            mapped.traces.append((len(spans), stored))
    return mapped
