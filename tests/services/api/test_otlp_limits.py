"""Hostile OTLP exports (issue 15, items 4 and 5): never a 5xx, nothing amplified, no 503 that
retrying cannot cure."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from sqlalchemy import Engine

from services.db.session import SessionFactory
from tests.services.api.test_otlp import (
    Recorder,
    otlp_json,
    post_protobuf,
    spans_of_one_episode,
    stored,
)
from tests.services.api.test_otlp_episodes import HOUR, ratchet

QuietRatchet = Callable[..., AbstractContextManager[tuple[str, str]]]


@pytest.fixture
def quiet_ratchet(
    database_url: str, engine: Engine, session_factory: SessionFactory
) -> QuietRatchet:
    """``ratchet`` whose episodes never close on their own (quiet for an hour), so a test sees
    only what its export did; keyword arguments override more settings."""
    return functools.partial(
        ratchet, database_url, engine, session_factory, otlp_episode_quiet_s=HOUR
    )


def one_chat(attributes: dict[str, Any], service: str = "calc-service") -> list[ReadableSpan]:
    """A one-span episode (a chat call) with these attributes on top of valid content."""
    recorder = Recorder()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(recorder))
    content = {
        "gen_ai.operation.name": "chat",
        "gen_ai.input.messages": json.dumps([{"role": "user", "content": "hi"}]),
        "gen_ai.output.messages": json.dumps([{"role": "assistant", "content": "hello"}]),
    }
    with provider.get_tracer("t").start_as_current_span(
        "chat m", attributes={**content, **attributes}
    ):
        pass
    provider.shutdown()
    return list(recorder.get_finished_spans())


def partial(response: httpx.Response) -> tuple[int, str]:
    answer = ExportTraceServiceResponse.FromString(response.content)
    return answer.partial_success.rejected_spans, answer.partial_success.error_message


def error_code(response: httpx.Response) -> str:
    return str(response.json()["error"]["code"])


def test_hostile_attribute_json_is_a_400_not_a_500(
    quiet_ratchet: QuietRatchet, session_factory: SessionFactory
) -> None:
    deep = "[" * 5000 + "]" * 5000  # RecursionError in json.loads
    huge_number = '[{"role": "user", "content": ' + "9" * 5000 + "}]"  # ValueError in int()
    with quiet_ratchet() as (url, token):
        for key in ("gen_ai.input.messages", "gen_ai.tool.definitions"):
            for value in (deep, huge_number):
                spans = one_chat({key: value})
                response = post_protobuf(url, token, spans)
                assert (response.status_code, error_code(response)) == (400, "invalid_otlp")
                assert key in response.json()["error"]["message"]
                # The same in OTLP/JSON.
                response = httpx.post(
                    f"{url}/otlp/v1/traces",
                    json=otlp_json(spans),
                    headers={"authorization": f"Bearer {token}"},
                )
                assert (response.status_code, error_code(response)) == (400, "invalid_otlp")
        assert stored(session_factory) == []


def test_a_huge_service_name_is_not_copied_into_every_trace(
    quiet_ratchet: QuietRatchet, session_factory: SessionFactory
) -> None:
    with quiet_ratchet() as (url, token):
        huge = one_chat({}, service="s" * 200_000) + one_chat({}, service="s" * 200_000)
        response = post_protobuf(url, token, huge + one_chat({}))
        assert response.status_code == 200
        rejected, message = partial(response)
        assert rejected == 2
        assert "service.name" in message and "at most 256" in message
        [row] = stored(session_factory)
        assert row.body["metadata"]["service_name"] == "calc-service"


def test_an_attribute_over_the_size_limit_rejects_only_its_trace(
    quiet_ratchet: QuietRatchet, session_factory: SessionFactory
) -> None:
    with quiet_ratchet(otlp_max_attribute_bytes=4096) as (url, token):
        big = one_chat({"gen_ai.request.model": "m" * 5000})
        response = post_protobuf(url, token, big + one_chat({}))
        assert response.status_code == 200
        rejected, message = partial(response)
        assert rejected == 1
        assert "'gen_ai.request.model' is 5000 bytes, over the limit of 4096" in message
        assert len(stored(session_factory)) == 1


def test_more_traces_or_spans_than_an_export_may_hold_is_a_413(
    quiet_ratchet: QuietRatchet, session_factory: SessionFactory
) -> None:
    with quiet_ratchet(ingest_max_batch=3, otlp_max_spans_per_export=6) as (url, token):
        four_traces = [span for _ in range(4) for span in one_chat({})]
        response = post_protobuf(url, token, four_traces)
        assert (response.status_code, error_code(response)) == (413, "batch_too_large")
        assert "RATCHET_INGEST_MAX_BATCH" in response.json()["error"]["message"]
        seven_spans = spans_of_one_episode() + spans_of_one_episode()[:3]
        response = post_protobuf(url, token, seven_spans)
        assert (response.status_code, error_code(response)) == (413, "batch_too_large")
        assert "RATCHET_OTLP_MAX_SPANS_PER_EXPORT" in response.json()["error"]["message"]
        assert stored(session_factory) == []
        # Within the limits, the same kind of export is taken.
        assert post_protobuf(url, token, four_traces[:3]).status_code == 200
        assert len(stored(session_factory)) == 3


def test_an_export_bigger_than_the_write_queue_is_stored_not_refused(
    quiet_ratchet: QuietRatchet, session_factory: SessionFactory
) -> None:
    with quiet_ratchet(ingest_queue_max=2) as (url, token):
        five_episodes = [span for _ in range(5) for span in spans_of_one_episode()]
        response = post_protobuf(url, token, five_episodes)
        assert response.status_code == 200, response.text
        assert partial(response) == (0, "")
        assert len(stored(session_factory)) == 5


def test_log_records_that_join_nothing_are_rejected_by_count(quiet_ratchet: QuietRatchet) -> None:
    logs = {
        "resourceLogs": [
            {
                "scopeLogs": [
                    {
                        "logRecords": [
                            {"eventName": "gen_ai.user.message", "body": {"stringValue": "x"}},
                            {
                                "traceId": "0" * 31 + "1",
                                "spanId": "0" * 15 + "1",
                                "body": {"stringValue": "an application log line"},
                            },
                            {
                                "traceId": "0" * 31 + "1",
                                "spanId": "0" * 15 + "1",
                                "eventName": "gen_ai.user.message",
                                "body": {"kvlistValue": {"values": []}},
                            },
                        ]
                    }
                ]
            }
        ]
    }
    with quiet_ratchet() as (url, token):
        response = httpx.post(
            f"{url}/otlp/v1/logs", json=logs, headers={"authorization": f"Bearer {token}"}
        )
        assert response.status_code == 200, response.text
        answer = json.loads(response.content)
        assert answer["partialSuccess"]["rejectedLogRecords"] == "2"
        assert "no trace and span id" in answer["partialSuccess"]["errorMessage"]
        assert "not a GenAI event" in answer["partialSuccess"]["errorMessage"]
        # Protobuf, malformed: a 400 naming the message type.
        bad = httpx.post(
            f"{url}/otlp/v1/logs",
            content=b"\xff\xff\xff",
            headers={"authorization": f"Bearer {token}", "content-type": "application/x-protobuf"},
        )
        assert (bad.status_code, error_code(bad)) == (400, "invalid_protobuf")
        assert "ExportLogsServiceRequest" in bad.json()["error"]["message"]
        empty = httpx.post(
            f"{url}/otlp/v1/logs",
            content=b"",
            headers={"authorization": f"Bearer {token}", "content-type": "application/x-protobuf"},
        )
        assert empty.status_code == 200
        assert (
            ExportLogsServiceResponse.FromString(empty.content).partial_success.rejected_log_records
            == 0
        )
        no_token = httpx.post(f"{url}/otlp/v1/logs", content=b"", headers={})
        assert no_token.status_code == 401
        # Hostile message JSON in a log record's attributes is a 400, as on spans.
        hostile = {
            "resourceLogs": [
                {
                    "scopeLogs": [
                        {
                            "logRecords": [
                                {
                                    "traceId": "0" * 31 + "1",
                                    "spanId": "0" * 15 + "1",
                                    "eventName": "gen_ai.client.inference.operation.details",
                                    "attributes": [
                                        {
                                            "key": "gen_ai.input.messages",
                                            "value": {"stringValue": "[" * 5000 + "]" * 5000},
                                        }
                                    ],
                                }
                            ]
                        }
                    ]
                }
            ]
        }
        response = httpx.post(
            f"{url}/otlp/v1/logs", json=hostile, headers={"authorization": f"Bearer {token}"}
        )
        assert (response.status_code, error_code(response)) == (400, "invalid_otlp")
