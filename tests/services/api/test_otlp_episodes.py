"""OTLP episodes as real deployments export them, with the real SDK and its OTLP/HTTP exporters.

Each setup of issue 17 becomes exactly one trace: a local root with a BatchSpanProcessor, an
agent under an upstream ``traceparent``, a SimpleSpanProcessor (children exported before the
root), one episode split over three exports, message content sent as log events; plus the
quiet period for an episode whose agent span never arrives.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry import context
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from sqlalchemy import Engine

from services.api.state import AppState, TemporalConnection
from services.db.session import SessionFactory
from services.settings import Settings
from tests.services.api.support import ADMIN_TOKEN, serve_with_loop
from tests.services.api.test_otlp import (
    export_batch,
    record_episode,
    spans_of_one_episode,
    stored,
    waiting_rows,
)
from tests.support import assert_eventually

EXPECTED_ROLES = ["system", "user", "assistant", "tool", "assistant"]
HOUR = 3600.0  # a quiet period no test waits for: what is stored was assembled on arrival


@contextmanager
def ratchet(
    database_url: str, engine: Engine, session_factory: SessionFactory, **overrides: Any
) -> Iterator[tuple[str, str]]:
    """The api under uvicorn with these settings, and a loop: (url, ingest token)."""
    settings = Settings(database_url=database_url, admin_token=ADMIN_TOKEN, **overrides)
    state = AppState(
        settings=settings,
        engine=engine,
        session_factory=session_factory,
        temporal=TemporalConnection(settings),
    )
    with serve_with_loop(state) as (url, loop):
        yield url, loop["ingest_token"]


@pytest.fixture
def api(
    database_url: str, engine: Engine, session_factory: SessionFactory
) -> Iterator[tuple[str, str]]:
    with ratchet(database_url, engine, session_factory, otlp_episode_quiet_s=HOUR) as served:
        yield served


def provider(*processors: Any) -> TracerProvider:
    tracer_provider = TracerProvider(resource=Resource.create({"service.name": "calc-service"}))
    for processor in processors:
        tracer_provider.add_span_processor(processor)
    return tracer_provider


def assert_the_episode(body: dict[str, Any]) -> None:
    assert [m["role"] for m in body["messages"]] == EXPECTED_ROLES
    assert body["messages"][2]["tool_calls"] == [
        {"id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}}
    ]
    assert body["messages"][4]["content"] == "6"
    assert body["outcome"]["error"]["kind"] == "wrong_answer"


def test_a_local_root_with_a_batch_span_processor_is_one_trace(
    api: tuple[str, str], session_factory: SessionFactory
) -> None:
    url, token = api
    tracer_provider = provider(BatchSpanProcessor(export_batch(url, token)))
    record_episode(tracer_provider)
    tracer_provider.shutdown()

    [row] = stored(session_factory)
    assert_the_episode(row.body)
    assert row.external_id == row.body["metadata"]["trace_id"]  # the agent span is the root
    assert waiting_rows(session_factory) == 0


def test_an_agent_under_an_upstream_traceparent_is_one_trace(
    api: tuple[str, str], session_factory: SessionFactory
) -> None:
    url, token = api
    upstream_trace, upstream_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    carrier = {"traceparent": f"00-{upstream_trace}-{upstream_span}-01"}
    exporter = export_batch(url, token)
    tracer_provider = provider(BatchSpanProcessor(exporter))
    attached = context.attach(TraceContextTextMapPropagator().extract(carrier))
    try:
        record_episode(tracer_provider)
    finally:
        context.detach(attached)
    tracer_provider.shutdown()

    [row] = stored(session_factory)
    assert_the_episode(row.body)
    agent_span = row.body["metadata"]["span_id"]
    assert row.body["metadata"]["trace_id"] == upstream_trace
    # Not the trace id alone: another agent under the same request is another episode.
    assert row.external_id == f"{upstream_trace}:{agent_span}"
    assert waiting_rows(session_factory) == 0


def test_a_simple_span_processor_is_one_trace(
    api: tuple[str, str], session_factory: SessionFactory
) -> None:
    url, token = api
    tracer_provider = provider(SimpleSpanProcessor(export_batch(url, token)))
    record_episode(tracer_provider)  # four exports, the agent span last
    tracer_provider.shutdown()

    [row] = stored(session_factory)
    assert_the_episode(row.body)
    assert row.body["metadata"]["usage"] == {"input_tokens": 42, "output_tokens": 7}


def test_one_episode_split_over_three_exports_is_one_trace(
    api: tuple[str, str], session_factory: SessionFactory
) -> None:
    url, token = api
    spans = spans_of_one_episode()  # in the order they ended: the agent span last
    exporter = export_batch(url, token)

    assert exporter.export(spans[:1]) == SpanExportResult.SUCCESS
    assert exporter.export(spans[1:3]) == SpanExportResult.SUCCESS
    assert stored(session_factory) == []
    assert waiting_rows(session_factory) == 3  # acknowledged: in Postgres, waiting
    assert exporter.export(spans[3:]) == SpanExportResult.SUCCESS

    [row] = stored(session_factory)
    assert_the_episode(row.body)
    # The same episode exported again, whole or in parts, is still one trace.
    assert exporter.export(spans) == SpanExportResult.SUCCESS
    assert exporter.export(spans[1:3]) == SpanExportResult.SUCCESS
    assert len(stored(session_factory)) == 1
    assert waiting_rows(session_factory) == 0


def record_episode_with_content_as_events(
    tracer_provider: TracerProvider, logger_provider: LoggerProvider
) -> None:
    """The episode as instrumentations that keep content off spans emit it: GenAI events
    (``gen_ai.*.message``, ``gen_ai.choice``) as log records in each chat span's context."""
    tracer = tracer_provider.get_tracer("calc-agent")
    logger = logger_provider.get_logger("calc-agent")
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})},
    }

    def history() -> None:
        logger.emit(event_name="gen_ai.system.message", body={"content": "Use the tools."})
        logger.emit(event_name="gen_ai.user.message", body={"content": "What is 2+3?"})

    chat = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "small-gpt"}
    with tracer.start_as_current_span(
        "invoke_agent calc-agent", attributes={"gen_ai.operation.name": "invoke_agent"}
    ) as agent:
        with tracer.start_as_current_span("chat small-gpt", attributes=chat):
            history()
            logger.emit(
                event_name="gen_ai.choice",
                body={"index": 0, "finish_reason": "tool_calls", "message": {"tool_calls": [call]}},
            )
        with tracer.start_as_current_span(
            "execute_tool add",
            attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "add"},
        ):
            pass
        with tracer.start_as_current_span("chat small-gpt", attributes=chat):
            history()
            logger.emit(event_name="gen_ai.assistant.message", body={"tool_calls": [call]})
            logger.emit(event_name="gen_ai.tool.message", body={"content": "5", "id": "c1"})
            logger.emit(
                event_name="gen_ai.choice",
                body={"index": 0, "finish_reason": "stop", "message": {"content": "6"}},
            )
        agent.set_attribute("error.type", "wrong_answer")
        logger.emit(
            event_name="gen_ai.evaluation.result",
            attributes={
                "gen_ai.evaluation.name": "exact_match",
                "gen_ai.evaluation.score.value": 0.0,
                "gen_ai.evaluation.score.label": "fail",
            },
        )


def test_content_sent_as_log_events_joins_its_spans_into_one_trace(
    api: tuple[str, str], session_factory: SessionFactory
) -> None:
    url, token = api
    headers = {"Authorization": f"Bearer {token}"}
    tracer_provider = provider(SimpleSpanProcessor(export_batch(url, token)))
    logger_provider = LoggerProvider(resource=Resource.create({"service.name": "calc-service"}))
    log_exporter = OTLPLogExporter(
        endpoint=f"{url}/otlp/v1/logs", headers=headers, compression=Compression.Gzip, timeout=30
    )
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(log_exporter))

    record_episode_with_content_as_events(tracer_provider, logger_provider)
    tracer_provider.shutdown()
    # The spans are in, without content: the episode waits for its log records ...
    assert stored(session_factory) == []
    logger_provider.shutdown()

    # ... which complete it at once (no quiet period).
    [row] = stored(session_factory)
    body = row.body
    assert [m["role"] for m in body["messages"]] == EXPECTED_ROLES
    assert body["messages"][0]["content"] == "Use the tools."
    assert body["messages"][2]["tool_calls"] == [
        {"id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}}
    ]
    assert body["messages"][3] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
    assert body["messages"][4]["content"] == "6"
    assert (row.success, row.score) == (False, 0.0)
    assert body["metadata"]["evaluation"]["name"] == "exact_match"
    assert waiting_rows(session_factory) == 0


def test_an_episode_whose_agent_span_never_arrives_is_stored_after_the_quiet_period(
    database_url: str, engine: Engine, session_factory: SessionFactory
) -> None:
    with ratchet(database_url, engine, session_factory, otlp_episode_quiet_s=0.3) as (url, token):
        children = [s for s in spans_of_one_episode() if s.parent is not None]
        assert export_batch(url, token).export(children) == SpanExportResult.SUCCESS

        def assembled() -> None:
            assert len(stored(session_factory)) == 1
            assert waiting_rows(session_factory) == 0

        assert_eventually(assembled, timeout=30, interval=0.1)
        [row] = stored(session_factory)
        # The chats and the tool call are one episode, known by the agent span they share.
        assert [m["role"] for m in row.body["messages"]] == EXPECTED_ROLES
        parent = format(children[0].parent.span_id, "016x")  # type: ignore[union-attr]
        assert row.external_id == f"{row.body['metadata']['trace_id']}:{parent}"
