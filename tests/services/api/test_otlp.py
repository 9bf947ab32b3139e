"""The OTLP door with the real OpenTelemetry SDK and its OTLP/HTTP exporter, over uvicorn."""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from sqlalchemy import select

from services.api.state import AppState
from services.db.models import OtlpSpan, Trace
from services.db.session import SessionFactory
from tests.services.api.support import serve_with_loop

TOOLS = [
    {
        "type": "function",
        "name": "add",
        "description": "add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    }
]


def record_episode(provider: TracerProvider, *, answer: str = "6", label: str = "fail") -> None:
    """One agent episode as GenAI-instrumented code emits it: agent, two chats, one tool."""
    tracer = provider.get_tracer("calc-agent")
    system = json.dumps([{"type": "text", "content": "Use the tools."}])
    user = {"role": "user", "parts": [{"type": "text", "content": "What is 2+3?"}]}
    call = {
        "role": "assistant",
        "parts": [{"type": "tool_call", "id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}}],
    }
    result = {
        "role": "tool",
        "parts": [{"type": "tool_call_response", "id": "c1", "response": "5"}],
    }
    final = {
        "role": "assistant",
        "parts": [{"type": "text", "content": answer}],
        "finish_reason": "stop",
    }
    with tracer.start_as_current_span(
        "invoke_agent calc-agent",
        attributes={
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": "calc-agent",
            "gen_ai.conversation.id": "conv-1",
        },
    ) as agent:
        with tracer.start_as_current_span(
            "chat small-gpt",
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "ratchet",
                "gen_ai.request.model": "small-gpt",
                "gen_ai.response.model": "small-gpt-2026-01",
                "gen_ai.response.id": "chatcmpl-first",
                "gen_ai.system_instructions": system,
                "gen_ai.tool.definitions": json.dumps(TOOLS),
                "gen_ai.input.messages": json.dumps([user]),
                "gen_ai.output.messages": json.dumps([call]),
                "gen_ai.usage.input_tokens": 12,
                "gen_ai.usage.output_tokens": 5,
            },
        ):
            pass
        with tracer.start_as_current_span(
            "execute_tool add",
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "add",
                "gen_ai.tool.call.id": "c1",
                "gen_ai.tool.call.arguments": '{"a": 2, "b": 3}',
                "gen_ai.tool.call.result": "5",
            },
        ):
            pass
        with tracer.start_as_current_span(
            "chat small-gpt",
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": "small-gpt",
                "gen_ai.response.model": "small-gpt-2026-01",
                "gen_ai.response.id": "chatcmpl-second",
                "gen_ai.system_instructions": system,
                "gen_ai.input.messages": json.dumps([user, call, result]),
                "gen_ai.output.messages": json.dumps([final]),
                "gen_ai.usage.input_tokens": 30,
                "gen_ai.usage.output_tokens": 2,
            },
        ):
            pass
        agent.add_event(
            "gen_ai.evaluation.result",
            {
                "gen_ai.evaluation.name": "exact_match",
                "gen_ai.evaluation.score.value": 1.0 if label == "pass" else 0.0,
                "gen_ai.evaluation.score.label": label,
            },
        )
        if label == "fail":
            agent.set_attribute("error.type", "wrong_answer")
            agent.set_status(Status(StatusCode.ERROR, "expected 5"))


@pytest.fixture
def server(app_state: AppState) -> Iterator[tuple[str, dict[str, Any]]]:
    with serve_with_loop(app_state) as served:
        yield served


def provider_with(exporter: Any) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "calc-service"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def export_batch(url: str, token: str, path: str = "/otlp/v1/traces") -> OTLPSpanExporter:
    return OTLPSpanExporter(
        endpoint=f"{url}{path}",
        headers={"Authorization": f"Bearer {token}"},
        compression=Compression.Gzip,
        timeout=30,
    )


class Recorder(InMemorySpanExporter):
    """Keeps the SDK's spans so a test can export them as one batch, as BatchSpanProcessor does."""


def spans_of_one_episode(**kwargs: Any) -> list[ReadableSpan]:
    recorder = Recorder()
    provider = provider_with(recorder)
    record_episode(provider, **kwargs)
    provider.shutdown()
    return list(recorder.get_finished_spans())


def stored(session_factory: SessionFactory) -> list[Trace]:
    with session_factory() as session:
        return list(session.scalars(select(Trace).order_by(Trace.id)))


def waiting_rows(session_factory: SessionFactory) -> int:
    """Spans and log records stored but not yet assembled into a trace."""
    with session_factory() as session:
        return len(
            list(session.scalars(select(OtlpSpan.id).where(OtlpSpan.assembled_at.is_(None))))
        )


def test_the_sdk_exporter_posts_an_episode_that_becomes_one_trace(
    server: tuple[str, dict[str, Any]],
    session_factory: SessionFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, loop = server
    spans = spans_of_one_episode()
    exporter = export_batch(url, loop["ingest_token"])
    assert exporter.export(spans) == SpanExportResult.SUCCESS, caplog.text

    [row] = stored(session_factory)
    trace_id = format(spans[0].context.trace_id, "032x")
    assert row.external_id == trace_id
    assert row.source == "otlp"
    assert row.model_version == "small-gpt-2026-01"
    # the model server's ids of its completions, in order: what the canary checks
    assert row.body["response_ids"] == ["chatcmpl-first", "chatcmpl-second"]
    assert (row.success, row.score, row.error_kind) == (False, 0.0, "wrong_answer")
    body = row.body
    assert [m["role"] for m in body["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert body["messages"][0]["content"] == "Use the tools."
    assert body["messages"][2]["tool_calls"] == [
        {"id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}}
    ]
    assert body["messages"][3] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
    assert body["messages"][4]["content"] == "6"
    assert body["tools"] == [
        {
            "name": "add",
            "description": "add two integers",
            "parameters": TOOLS[0]["parameters"],
        }
    ]
    assert body["outcome"]["error"] == {"kind": "wrong_answer", "message": "expected 5"}
    assert body["metadata"]["service_name"] == "calc-service"
    assert body["metadata"]["usage"] == {"input_tokens": 42, "output_tokens": 7}
    assert body["started_at"] is not None and body["ended_at"] is not None

    # Exporting the same spans again is a duplicate: success, no second row.
    assert exporter.export(spans) == SpanExportResult.SUCCESS, caplog.text
    assert len(stored(session_factory)) == 1


def test_the_sdk_pipeline_works_on_the_versioned_path_too(
    server: tuple[str, dict[str, Any]],
    session_factory: SessionFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, loop = server
    exporter = export_batch(url, loop["ingest_token"], "/v1/otlp/v1/traces")
    assert exporter.export(spans_of_one_episode(label="pass")) == SpanExportResult.SUCCESS, (
        caplog.text
    )
    [row] = stored(session_factory)
    assert (row.success, row.score, row.error_kind) == (True, 1.0, None)


def otlp_json(spans: list[ReadableSpan]) -> dict[str, Any]:
    """OTLP/JSON of spans: the protobuf JSON mapping with hex trace and span ids."""
    data = json_format.MessageToDict(encode_spans(spans))
    for resource in data["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return data


def test_otlp_json_with_gzip_is_accepted(
    server: tuple[str, dict[str, Any]], session_factory: SessionFactory
) -> None:
    url, loop = server
    body = json.dumps(otlp_json(spans_of_one_episode())).encode()
    response = httpx.post(
        f"{url}/otlp/v1/traces",
        content=gzip.compress(body),
        headers={
            "authorization": f"Bearer {loop['ingest_token']}",
            "content-type": "application/json",
            "content-encoding": "gzip",
        },
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {}  # full success: no partial_success
    [row] = stored(session_factory)
    assert row.body["messages"][-1]["content"] == "6"


def post_protobuf(url: str, token: str, spans: list[ReadableSpan]) -> httpx.Response:
    return httpx.post(
        f"{url}/otlp/v1/traces",
        content=encode_spans(spans).SerializeToString(),
        headers={"authorization": f"Bearer {token}", "content-type": "application/x-protobuf"},
    )


def test_unmappable_spans_are_a_partial_success_and_orphans_wait(
    server: tuple[str, dict[str, Any]], session_factory: SessionFactory
) -> None:
    url, loop = server
    good = spans_of_one_episode()
    orphans = [s for s in spans_of_one_episode() if s.parent is not None]  # agent span missing
    recorder = Recorder()
    provider = provider_with(recorder)
    with provider.get_tracer("plain").start_as_current_span("GET /health"):
        pass  # a trace with no gen_ai content at all
    plain = list(recorder.get_finished_spans())

    response = post_protobuf(url, loop["ingest_token"], good + orphans + plain)

    assert response.status_code == 200
    answer = ExportTraceServiceResponse.FromString(response.content)
    # The plain trace is refused; the orphans are stored and wait for their agent span.
    assert answer.partial_success.rejected_spans == len(plain)
    assert "no gen_ai spans" in answer.partial_success.error_message
    assert len(stored(session_factory)) == 1
    assert waiting_rows(session_factory) == len(orphans)


def test_bad_otlp_requests(server: tuple[str, dict[str, Any]], app_state: AppState) -> None:
    url, loop = server
    token = loop["ingest_token"]
    spans = spans_of_one_episode()
    path = f"{url}/otlp/v1/traces"
    protobuf = {"authorization": f"Bearer {token}", "content-type": "application/x-protobuf"}

    def code(response: httpx.Response) -> str:
        return str(response.json()["error"]["code"])

    # Missing, unknown token: 401 without reading the body.
    no_token = httpx.post(path, content=b"junk", headers={"content-type": "application/x-protobuf"})
    assert no_token.status_code == 401
    wrong = httpx.post(
        path, content=b"junk", headers={**protobuf, "authorization": "Bearer rit_nope"}
    )
    assert wrong.status_code == 401
    assert export_batch(url, "rit_nope").export(spans) == SpanExportResult.FAILURE
    # Content type.
    assert (
        httpx.post(
            path, content=b"{}", headers={**protobuf, "content-type": "text/plain"}
        ).status_code
        == 415
    )
    # Malformed protobuf, JSON, hex ids.
    bad = httpx.post(path, content=b"\xff\xff\xff\xff", headers=protobuf)
    assert (bad.status_code, code(bad)) == (400, "invalid_protobuf")
    as_json = {**protobuf, "content-type": "application/json"}
    bad_json = httpx.post(path, content=b'{"resourceSpans": [', headers=as_json)
    assert bad_json.status_code == 400 and "line 1" in bad_json.json()["error"]["message"]
    data = otlp_json(spans)
    data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = "not-hex"
    assert httpx.post(path, json=data, headers=as_json).status_code == 400
    # The limit applies after decompression (gzip bomb).
    limit = app_state.settings.ingest_max_body_bytes
    bomb = gzip.compress(b"\x00" * (limit * 3))
    response = httpx.post(path, content=bomb, headers={**protobuf, "content-encoding": "gzip"})
    assert (response.status_code, code(response)) == (413, "body_too_large")
    # An empty export is valid and stores nothing.
    empty = httpx.post(path, content=b"", headers=protobuf)
    assert empty.status_code == 200
