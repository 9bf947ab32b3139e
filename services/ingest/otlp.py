"""OTLP/HTTP decoding within limits: trace and log exports to plain span and log record views.

An agent instrumented with the OpenTelemetry GenAI semantic conventions emits, per episode,
an ``invoke_agent`` span, ``chat`` spans (one per model call, with ``gen_ai.input.messages``
and ``gen_ai.output.messages``), ``execute_tool`` spans, and ``gen_ai.evaluation.result``
events when something scored the answer. Several instrumentations send the message content
as OTLP log records instead (``gen_ai.user.message``, ``gen_ai.choice``, …, or
``gen_ai.client.inference.operation.details``), joined to their span by trace and span id.
This module turns exports into :class:`SpanView` and :class:`LogView` objects (what is kept
of them while an episode waits); services.ingest.episodes says which spans form an episode
and when it is complete, services.ingest.otlp_mapping turns one into a Ratchet trace.

Decoding is bounded, because it runs on bodies from the internet before anything is stored:
the structured attributes (message JSON) are parsed once, here, by the same bounded parser as
the webhook's bodies, so nesting past its recursion limit or a number past Python's
4300-digit limit is a 400 naming the span and attribute, never a 500; an export with more
traces than ``RATCHET_INGEST_MAX_BATCH`` or more spans than ``RATCHET_OTLP_MAX_SPANS_PER_EXPORT``
is a 413; a trace holding an attribute value over ``RATCHET_OTLP_MAX_ATTRIBUTE_BYTES``, more
than ``MAX_ATTRIBUTES`` attributes or ``MAX_EVENTS`` events on a span, or a ``service.name``
over ``MAX_SERVICE_NAME`` characters is rejected alone (OTLP partial success). Of the
resource, only ``service.name`` is kept per span.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic_core
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from services.ingest.errors import IngestError
from services.ingest.schema import decode_json

CHAT_OPERATIONS = {"chat", "text_completion", "generate_content"}
AGENT_OPERATION = "invoke_agent"
TOOL_OPERATION = "execute_tool"
EVALUATION_EVENT = "gen_ai.evaluation.result"
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
MESSAGE_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
CHOICE_EVENT = "gen_ai.choice"
CONTENT_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages")
# Attributes holding JSON documents (as strings on spans): parsed once, at decode time.
STRUCTURED_KEYS = frozenset(
    {*CONTENT_KEYS, "gen_ai.system_instructions", "gen_ai.tool.definitions"}
)
ARGUMENTS_KEY = "gen_ai.tool.call.arguments"
MAX_ATTRIBUTES = 512  # per span, event or log record (the SDKs' default limit is 128)
MAX_EVENTS = 512  # per span
MAX_SERVICE_NAME = 256
# OTLP span flags: whether the exporter says if the parent is remote, and whether it is.
_FLAG_HAS_IS_REMOTE = 0x100
_FLAG_IS_REMOTE = 0x200


class ItemRejected(Exception):
    """One trace (or log record) of an export breaks a limit; the rest of the export goes on."""


@dataclass(frozen=True)
class Limits:
    """The caps of one export (from the settings; see the module docstring)."""

    max_traces: int
    max_spans: int
    max_attribute_bytes: int


# Decoding -----------------------------------------------------------------------------------


def _decode_protobuf(body: bytes, message: Message, what: str) -> None:
    try:
        message.ParseFromString(body)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise IngestError(
            400, "invalid_protobuf", f"the body is not an OTLP {what}: {exc}"
        ) from None


def _hex_to_b64(value: Any, where: str) -> Any:
    if not isinstance(value, str) or not value:
        return value
    try:
        return base64.b64encode(bytes.fromhex(value)).decode("ascii")
    except ValueError:
        raise IngestError(400, "invalid_otlp", f"{where} is not a hex id: {value[:64]!r}") from None


def _fix_ids(item: Any, keys: tuple[str, ...], where: str) -> None:
    if isinstance(item, dict):
        for key in keys:
            if key in item:
                item[key] = _hex_to_b64(item[key], f"{where}.{key}")


def _ids_to_base64(data: dict[str, Any]) -> None:
    """OTLP/JSON writes trace and span ids in hex; protobuf's JSON mapping expects base64."""
    for r, resource_spans in enumerate(_list(data.get("resourceSpans"))):
        for s, scope_spans in enumerate(_list(_dict(resource_spans).get("scopeSpans"))):
            for n, span in enumerate(_list(_dict(scope_spans).get("spans"))):
                where = f"resourceSpans.{r}.scopeSpans.{s}.spans.{n}"
                _fix_ids(span, ("traceId", "spanId", "parentSpanId"), where)
                for k, link in enumerate(_list(_dict(span).get("links"))):
                    _fix_ids(link, ("traceId", "spanId"), f"{where}.links.{k}")
    for r, resource_logs in enumerate(_list(data.get("resourceLogs"))):
        for s, scope_logs in enumerate(_list(_dict(resource_logs).get("scopeLogs"))):
            for n, record in enumerate(_list(_dict(scope_logs).get("logRecords"))):
                where = f"resourceLogs.{r}.scopeLogs.{s}.logRecords.{n}"
                _fix_ids(record, ("traceId", "spanId"), where)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _decode_json_message(body: bytes, message: Message, what: str) -> None:
    data = decode_json(body)
    if not isinstance(data, dict):
        raise IngestError(400, "invalid_otlp", "an OTLP/JSON body must be a JSON object")
    _ids_to_base64(data)
    try:
        json_format.ParseDict(data, message, ignore_unknown_fields=True)
    except (json_format.ParseError, RecursionError, ValueError, TypeError) as exc:
        raise IngestError(
            400, "invalid_otlp", f"the body is not an OTLP/JSON {what}: {exc}"
        ) from None


_Export = TypeVar("_Export", ExportTraceServiceRequest, ExportLogsServiceRequest)


def decode_export(body: bytes, message_type: type[_Export], *, protobuf: bool) -> _Export:
    """An OTLP export request from a protobuf or OTLP/JSON body; refusals name the message."""
    request = message_type()
    decode = _decode_protobuf if protobuf else _decode_json_message
    decode(body, request, message_type.DESCRIPTOR.name)
    return request


def _encode(response: Message, *, as_json: bool) -> bytes:
    if as_json:
        return json_format.MessageToJson(response, indent=None).encode("utf-8")
    return response.SerializeToString()


def encode_response(rejected_spans: int, message: str, *, as_json: bool) -> bytes:
    """An ExportTraceServiceResponse, with partial success when spans were rejected."""
    response = ExportTraceServiceResponse()
    if rejected_spans:
        response.partial_success.rejected_spans = rejected_spans
        response.partial_success.error_message = message
    return _encode(response, as_json=as_json)


def encode_logs_response(rejected_records: int, message: str, *, as_json: bool) -> bytes:
    """An ExportLogsServiceResponse, with partial success when records were rejected."""
    response = ExportLogsServiceResponse()
    if rejected_records:
        response.partial_success.rejected_log_records = rejected_records
        response.partial_success.error_message = message
    return _encode(response, as_json=as_json)


# Values -------------------------------------------------------------------------------------


class _Reader:
    """Turns OTLP values into plain JSON-able Python, checking the limits on the way."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def value(self, value: AnyValue, where: str) -> Any:
        kind = value.WhichOneof("value")
        if kind == "string_value":
            text = value.string_value
            # A character is at most 4 bytes: only long strings pay for the encode.
            if len(text) * 4 > self.limits.max_attribute_bytes:
                size = len(text.encode("utf-8", "surrogatepass"))
                if size > self.limits.max_attribute_bytes:
                    raise ItemRejected(
                        f"{where} is {size} bytes, over the limit of "
                        f"{self.limits.max_attribute_bytes}"
                    )
            return text
        if kind == "bool_value":
            return value.bool_value
        if kind == "int_value":
            return value.int_value
        if kind == "double_value":
            return value.double_value
        if kind == "array_value":
            return [self.value(item, where) for item in value.array_value.values]
        if kind == "kvlist_value":
            return self.attributes(value.kvlist_value.values, where)
        if kind == "bytes_value":
            if len(value.bytes_value) > self.limits.max_attribute_bytes:
                raise ItemRejected(
                    f"{where} is {len(value.bytes_value)} bytes, over the limit of "
                    f"{self.limits.max_attribute_bytes}"
                )
            return base64.b64encode(value.bytes_value).decode("ascii")
        return None

    def attributes(self, items: Any, where: str) -> dict[str, Any]:
        if len(items) > MAX_ATTRIBUTES:
            raise ItemRejected(f"{where} has {len(items)} attributes; at most {MAX_ATTRIBUTES}")
        result: dict[str, Any] = {}
        item: KeyValue
        for item in items:
            result[item.key[:256]] = self.value(item.value, f"{where} attribute {item.key[:64]!r}")
        return result


def parse_structured(value: Any, where: str) -> Any:
    """A JSON document held in a string attribute, parsed with the bounded parser.

    Hostile structure (nesting past the parser's recursion limit, a number past Python's
    4300-digit limit) is a 400 for the request; text that is simply not JSON is kept as it is
    (the episode is rejected with a clear reason when it is mapped).
    """
    if not isinstance(value, str):
        return value
    try:
        return pydantic_core.from_json(value, allow_inf_nan=False)
    except ValueError as exc:
        detail = str(exc)
        if "recursion limit" in detail or "number out of range" in detail:
            raise IngestError(
                400, "invalid_otlp", f"{where} is not acceptable JSON: {detail}"
            ) from None
        return value


def _parse_known(attributes: dict[str, Any], where: str) -> None:
    for key in STRUCTURED_KEYS & attributes.keys():
        attributes[key] = parse_structured(attributes[key], f"{where} attribute {key!r}")
    arguments = attributes.get(ARGUMENTS_KEY)
    if isinstance(arguments, str):
        parsed = parse_structured(arguments, f"{where} attribute {ARGUMENTS_KEY!r}")
        if isinstance(parsed, dict):
            attributes[ARGUMENTS_KEY] = parsed


# Spans and log records ----------------------------------------------------------------------


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
    service_name: str | None = None
    # Whether the parent is in another process, as the exporter said; None when it did not.
    remote_parent: bool | None = None

    @property
    def operation(self) -> str | None:
        value = self.attributes.get("gen_ai.operation.name")
        if isinstance(value, str):
            return value
        # Some instrumentations only name the span "<operation> <target>".
        head = self.name.split(" ", 1)[0]
        return head if head in CHAT_OPERATIONS | {AGENT_OPERATION, TOOL_OPERATION} else None

    @property
    def kind(self) -> str:
        """``agent`` (an episode's span), ``genai`` (part of one) or ``other`` (context)."""
        operation = self.operation
        if operation == AGENT_OPERATION:
            return "agent"
        if operation is not None or any(
            key.startswith(("gen_ai.", "ratchet.")) for key in self.attributes
        ):
            return "genai"
        return "other"

    @property
    def has_content(self) -> bool:
        return any(key in self.attributes for key in CONTENT_KEYS)

    def to_payload(self) -> str:
        """The span as stored while its episode is unfinished (see services.ingest.episodes)."""
        return _pending_json(
            {
                "name": self.name,
                "start": self.start_ns,
                "end": self.end_ns,
                "attributes": self.attributes,
                "events": [[e.name, e.time_ns, e.attributes] for e in self.events],
                "status": [self.status_code, self.status_message],
                "service": self.service_name,
            }
        )

    @classmethod
    def from_payload(
        cls, trace_id: str, span_id: str, parent_span_id: str, payload: str
    ) -> SpanView:
        data = json.loads(payload)
        return cls(
            trace_id=trace_id,
            span_id=span_id,
            parent_span_id=parent_span_id,
            name=data["name"],
            start_ns=data["start"],
            end_ns=data["end"],
            attributes=data["attributes"],
            events=[SpanEvent(name, time_ns, attrs) for name, time_ns, attrs in data["events"]],
            status_code=data["status"][0],
            status_message=data["status"][1],
            service_name=data["service"],
        )


def _pending_json(document: dict[str, Any], *, sort_keys: bool = False) -> str:
    """How a span or log record waits in Postgres for the rest of its episode: one encoding
    for both, compact (no spaces, non-ASCII text as is, not escaped)."""
    return json.dumps(document, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)


@dataclass
class LogView:
    """A GenAI event sent as an OTLP log record, joined to its span by trace and span id."""

    trace_id: str
    span_id: str
    event_name: str
    time_ns: int
    attributes: dict[str, Any]
    body: Any

    @property
    def record_id(self) -> str:
        """Stable per record, so the same record exported twice is stored once."""
        digest = hashlib.sha256(self.to_payload().encode("utf-8", "surrogatepass")).hexdigest()
        return f"{self.span_id}:{digest[:40]}"

    @property
    def has_content(self) -> bool:
        return (
            self.event_name in MESSAGE_EVENTS
            or self.event_name == CHOICE_EVENT
            or any(key in self.attributes for key in CONTENT_KEYS)
        )

    def to_payload(self) -> str:
        return _pending_json(
            {
                "event": self.event_name,
                "time": self.time_ns,
                "attributes": self.attributes,
                "body": self.body,
            },
            sort_keys=True,  # the record id hashes it: the same record, the same text
        )

    @classmethod
    def from_payload(cls, trace_id: str, span_id: str, payload: str) -> LogView:
        data = json.loads(payload)
        return cls(trace_id, span_id, data["event"], data["time"], data["attributes"], data["body"])


@dataclass
class DecodedExport:
    """What an export held: views by trace id, and the traces (or records) it rejects."""

    spans: dict[str, list[SpanView]] = field(default_factory=dict)
    logs: dict[str, list[LogView]] = field(default_factory=dict)
    rejected: int = 0  # spans or log records
    errors: list[str] = field(default_factory=list)
    total: int = 0


def _service_name(resource: Any, reader: _Reader, where: str) -> str | None:
    for item in resource.attributes:
        if item.key == "service.name":
            value = reader.value(item.value, f"{where} attribute 'service.name'")
            if not isinstance(value, str):
                return None
            if len(value) > MAX_SERVICE_NAME:
                raise ItemRejected(
                    f"{where} attribute 'service.name' is {len(value)} characters; "
                    f"at most {MAX_SERVICE_NAME}"
                )
            return value
    return None


def _too_many(count: int, limit: int, what: str, setting: str) -> IngestError:
    return IngestError(
        413,
        "batch_too_large",
        f"the export has {count} {what}; at most {limit} are accepted per request ({setting})",
    )


def read_spans(request: ExportTraceServiceRequest, limits: Limits) -> DecodedExport:
    """Spans by trace id (hex), within the limits; see the module docstring for which."""
    total = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
    if total > limits.max_spans:
        raise _too_many(total, limits.max_spans, "spans", "RATCHET_OTLP_MAX_SPANS_PER_EXPORT")
    trace_ids = {
        span.trace_id for r in request.resource_spans for s in r.scope_spans for span in s.spans
    }
    if len(trace_ids) > limits.max_traces:
        raise _too_many(len(trace_ids), limits.max_traces, "traces", "RATCHET_INGEST_MAX_BATCH")
    reader = _Reader(limits)
    grouped: dict[str, list[SpanView]] = defaultdict(list)
    refused: dict[str, str] = {}
    counts: dict[str, int] = defaultdict(int)
    for r, resource_spans in enumerate(request.resource_spans):
        try:
            service: str | None = _service_name(
                resource_spans.resource, reader, f"resourceSpans.{r}.resource"
            )
            service_error = None
        except ItemRejected as exc:
            service, service_error = None, str(exc)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                trace_id = span.trace_id.hex()
                counts[trace_id] += 1
                if trace_id in refused:
                    continue
                if service_error is not None:
                    refused[trace_id] = service_error
                    continue
                try:
                    grouped[trace_id].append(_span_view(span, trace_id, service, reader))
                except ItemRejected as exc:
                    refused[trace_id] = str(exc)
    decoded = DecodedExport(total=total)
    for trace_id, reason in refused.items():
        grouped.pop(trace_id, None)
        decoded.rejected += counts[trace_id]
        decoded.errors.append(f"trace {trace_id}: {reason}")
    decoded.spans = dict(grouped)
    return decoded


def _span_view(span: Any, trace_id: str, service: str | None, reader: _Reader) -> SpanView:
    span_id = span.span_id.hex()
    where = f"span {span_id}"
    if len(span.trace_id) != 16 or len(span.span_id) != 8:
        raise ItemRejected(f"{where} has no valid trace id (16 bytes) and span id (8 bytes)")
    if len(span.events) > MAX_EVENTS:
        raise ItemRejected(f"{where} has {len(span.events)} events; at most {MAX_EVENTS}")
    attributes = reader.attributes(span.attributes, where)
    _parse_known(attributes, where)
    flags = span.flags
    remote = bool(flags & _FLAG_IS_REMOTE) if flags & _FLAG_HAS_IS_REMOTE else None
    parent = span.parent_span_id.hex() if len(span.parent_span_id) == 8 else ""
    return SpanView(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent,
        name=span.name[:1024],
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes=attributes,
        events=[
            SpanEvent(
                e.name[:256],
                e.time_unix_nano,
                reader.attributes(e.attributes, f"{where} event {e.name[:64]!r}"),
            )
            for e in span.events
        ],
        status_code=span.status.code,
        status_message=span.status.message[:4096],
        service_name=service,
        remote_parent=remote if parent else None,
    )


def read_logs(request: ExportLogsServiceRequest, limits: Limits) -> DecodedExport:
    """GenAI events among the log records, by trace id; the others are rejected (counted)."""
    total = sum(len(s.log_records) for r in request.resource_logs for s in r.scope_logs)
    if total > limits.max_spans:
        raise _too_many(total, limits.max_spans, "log records", "RATCHET_OTLP_MAX_SPANS_PER_EXPORT")
    reader = _Reader(limits)
    grouped: dict[str, list[LogView]] = defaultdict(list)
    decoded = DecodedExport(total=total)
    reasons: dict[str, int] = defaultdict(int)
    for resource_logs in request.resource_logs:
        for scope_logs in resource_logs.scope_logs:
            for number, record in enumerate(scope_logs.log_records):
                try:
                    view = _log_view(record, reader, f"log record {number}")
                except ItemRejected as exc:
                    reasons[str(exc)] += 1
                    continue
                grouped[view.trace_id].append(view)
    if len(grouped) > limits.max_traces:
        raise _too_many(len(grouped), limits.max_traces, "traces", "RATCHET_INGEST_MAX_BATCH")
    for reason, count in reasons.items():
        decoded.rejected += count
        decoded.errors.append(f"{count} log record(s): {reason}" if count > 1 else reason)
    decoded.logs = dict(grouped)
    return decoded


def _log_view(record: Any, reader: _Reader, where: str) -> LogView:
    attributes = reader.attributes(record.attributes, where)
    name = record.event_name or attributes.get("event.name")
    if not isinstance(name, str) or not name.startswith("gen_ai."):
        raise ItemRejected(
            "not a GenAI event (event name gen_ai.*): only message content and evaluation "
            "events are taken"
        )
    if len(record.trace_id) != 16 or len(record.span_id) != 8:
        raise ItemRejected(f"{name} has no trace and span id, so it joins no span")
    _parse_known(attributes, f"{where} ({name})")
    body = reader.value(record.body, f"{where} ({name}) body")
    return LogView(
        trace_id=record.trace_id.hex(),
        span_id=record.span_id.hex(),
        event_name=name[:256],
        time_ns=record.time_unix_nano or record.observed_time_unix_nano,
        attributes=attributes,
        body=body,
    )
