"""GenAI span conventions → ratchet.trace/v1, on hand-built OTLP requests."""

from __future__ import annotations

import json
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from services.ingest.otlp import MappingError, convert_messages, map_export

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
