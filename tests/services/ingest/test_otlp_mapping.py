"""GenAI span conventions → ratchet.trace/v1, on hand-built OTLP requests."""

from __future__ import annotations

import json
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from services.ingest.otlp import LogView, SpanView
from services.ingest.otlp_mapping import (
    MappingError,
    apply_logs,
    convert_messages,
    map_export,
    validate_episode,
)

TRACE = bytes(range(16))


def kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def request(*spans: dict[str, Any]) -> ExportTraceServiceRequest:
    export = ExportTraceServiceRequest()
    scope = export.resource_spans.add().scope_spans.add()
    for number, spec in enumerate(spans, start=1):
        span = scope.spans.add()
        span.trace_id = spec.get("trace_id", TRACE)
        span.span_id = number.to_bytes(8, "big")
        span.parent_span_id = spec.get("parent", b"")
        span.name = spec["name"]
        span.start_time_unix_nano = 1_700_000_000_000_000_000 + number
        span.end_time_unix_nano = 1_700_000_001_000_000_000 + number
        span.attributes.extend(kv(k, v) for k, v in spec.get("attributes", {}).items())
    return export


def test_tool_spans_alone_make_a_conversation_and_ratchet_attributes_override() -> None:
    export = request(
        {
            "name": "invoke_agent",
            "attributes": {
                "gen_ai.operation.name": "invoke_agent",
                "ratchet.external_id": "ep-42",
                "ratchet.model_version": "v7",
                "ratchet.outcome.success": True,
                "ratchet.outcome.score": 0.9,
                "ratchet.reference_answer": "5",
            },
        },
        {
            "name": "execute_tool price",
            "parent": (1).to_bytes(8, "big"),
            "attributes": {
                "gen_ai.tool.name": "price",
                "gen_ai.tool.description": "look up a price",
                "gen_ai.tool.call.arguments": '{"item": "apple"}',
                "gen_ai.tool.call.result": "3",
            },
        },
    )
    mapped = map_export(export)
    assert mapped.rejected_spans == 0, mapped.errors
    [(spans, stored)] = mapped.traces
    body = json.loads(stored.body_json)
    assert spans == 2
    assert (stored.external_id, stored.model_version, stored.success, stored.score) == (
        "ep-42",
        "v7",
        True,
        0.9,
    )
    assert body["reference_answer"] == "5"
    assert body["messages"][0]["tool_calls"][0]["arguments"] == {"item": "apple"}
    assert body["messages"][1] == {
        "role": "tool",
        "content": "3",
        "tool_call_id": "call_0000000000000002",
        "name": "price",
    }
    assert body["tools"] == [{"name": "price", "description": "look up a price", "parameters": {}}]


def test_bad_message_json_rejects_only_that_trace() -> None:
    good = {
        "name": "chat m",
        "attributes": {
            "gen_ai.operation.name": "chat",
            "gen_ai.input.messages": '[{"role": "user", "content": "hi"}]',
        },
    }
    bad = {
        "name": "chat m",
        "trace_id": b"\x01" * 16,
        "attributes": {"gen_ai.operation.name": "chat", "gen_ai.input.messages": "[{"},
    }
    mapped = map_export(request(good, bad))
    assert len(mapped.traces) == 1 and mapped.rejected_spans == 1
    assert "not valid JSON" in mapped.errors[0]


def test_message_parts() -> None:
    messages = convert_messages(
        [
            {"role": "developer", "parts": [{"type": "text", "content": "be brief"}]},
            {"role": "user", "content": "flat form"},
            {
                "role": "assistant",
                "parts": [
                    {"type": "text", "content": "a"},
                    {"type": "text", "content": "b"},
                    {"type": "tool_call", "name": "f", "arguments": "[1"},
                ],
            },
            {
                "role": "tool",
                "parts": [{"type": "tool_call_response", "id": "x", "response": {"v": 1}}],
            },
        ],
        "input",
    )
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "flat form"},
        {
            "role": "assistant",
            "content": "a\nb",
            "tool_calls": [{"id": "call_0", "name": "f", "arguments": "[1"}],
        },
        {"role": "tool", "content": '{"v": 1}', "tool_call_id": "x"},
    ]
    with pytest.raises(MappingError, match="unsupported role"):
        convert_messages([{"role": "narrator", "content": "x"}], "input")
    with pytest.raises(MappingError, match="JSON array"):
        convert_messages({"role": "user"}, "input")


def chat_span(**attributes: Any) -> SpanView:
    return SpanView(
        trace_id="ab" * 16,
        span_id="01" * 8,
        parent_span_id="",
        name="chat m",
        start_ns=1_700_000_000_000_000_000,
        end_ns=1_700_000_001_000_000_000,
        attributes={"gen_ai.operation.name": "chat", **attributes},
        events=[],
        status_code=0,
        status_message="",
    )


def event(name: str, body: Any = None, **attributes: Any) -> LogView:
    return LogView("ab" * 16, "01" * 8, name, 1, attributes, body)


def test_the_inference_details_event_carries_the_content_and_the_span_wins() -> None:
    span = chat_span(**{"gen_ai.output.messages": '[{"role": "assistant", "content": "on span"}]'})
    details = event(
        "gen_ai.client.inference.operation.details",
        **{
            "gen_ai.input.messages": [
                {"role": "user", "parts": [{"type": "text", "content": "q"}]}
            ],
            "gen_ai.output.messages": [{"role": "assistant", "content": "from the event"}],
            "gen_ai.system_instructions": [{"type": "text", "content": "be brief"}],
        },
    )
    apply_logs([span], [details])
    stored = validate_episode(span.trace_id, None, [span], external_id=span.trace_id)
    body = json.loads(stored.body_json)
    assert [(m["role"], m["content"]) for m in body["messages"]] == [
        ("system", "be brief"),
        ("user", "q"),
        ("assistant", "on span"),
    ]


def test_legacy_message_events_in_time_order_and_an_evaluation_record() -> None:
    span = chat_span()
    records = [
        event("gen_ai.choice", {"index": 0, "message": {"content": "4"}}),
        event("gen_ai.user.message", {"content": "2+2?"}),
        event("gen_ai.evaluation.result", None, **{"gen_ai.evaluation.score.label": "pass"}),
    ]
    records[0].time_ns, records[1].time_ns, records[2].time_ns = 3, 1, 4
    apply_logs([span], records)
    stored = validate_episode(span.trace_id, None, [span], external_id="ep")
    body = json.loads(stored.body_json)
    assert [(m["role"], m["content"]) for m in body["messages"]] == [
        ("user", "2+2?"),
        ("assistant", "4"),
    ]
    assert (stored.external_id, stored.success) == ("ep", True)


def test_mapping_never_raises_anything_but_a_mapping_error() -> None:
    hostile = chat_span(**{"gen_ai.input.messages": "[" * 3000 + "]" * 3000})
    with pytest.raises(MappingError, match="not valid JSON"):
        validate_episode(hostile.trace_id, None, [hostile], external_id="x")
