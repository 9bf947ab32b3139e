"""OTLP/HTTP: ``POST /otlp/v1/traces`` and ``/otlp/v1/logs`` (also under ``/v1``), protobuf or JSON.

OpenTelemetry exporters cannot sign bodies, so this door takes ``Authorization: Bearer <ingest
token>`` and the loop comes from the token. It follows OTLP/HTTP's rules: gzip accepted, the
size limit applies after decompression (413), malformed data is a 400, an export over the
trace or span limits is a 413, and items that cannot be taken are a partial success (200 with
``rejected_spans`` / ``rejected_log_records`` and a message). A 200 means the spans and log
records are stored in Postgres: episodes complete now become traces before the answer, the
rest when they complete or go quiet (services.ingest.span_store, whose sweeper this module
starts). 503 with ``Retry-After`` only when retrying can succeed (Postgres down). The response
body is an ``ExportTraceServiceResponse`` / ``ExportLogsServiceResponse`` in the request's
encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from services.api.deps import bearer_token
from services.api.routes.traces import (
    IngestDep,
    media_type,
    read_request_body,
    unavailable,
)
from services.api.state import AppState
from services.ingest.errors import IngestError
from services.ingest.otlp import (
    DecodedExport,
    Limits,
    decode_export,
    encode_logs_response,
    encode_response,
    read_logs,
    read_spans,
)
from services.ingest.service import UNKNOWN_LOOP, IngestService
from services.ingest.span_store import EpisodeAssembler
from services.ingest.writer import StorageUnavailable

SOURCE = "otlp"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MAX_ERRORS_REPORTED = 5

router = APIRouter(tags=["ingest"])
Endpoint = Callable[..., Awaitable[Response]]


async def startup(app: FastAPI) -> None:
    state: AppState = app.state.ratchet
    assembler = EpisodeAssembler(settings=state.settings, session_factory=state.session_factory)
    state.otlp_assembler = assembler

    def current_service() -> IngestService | None:
        return state.ingest

    state.otlp_sweeper = asyncio.create_task(
        assembler.run_sweeper(current_service), name="otlp-sweeper"
    )


async def shutdown(app: FastAPI) -> None:
    state: AppState = app.state.ratchet
    state.otlp_assembler = None
    task, state.otlp_sweeper = state.otlp_sweeper, None
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _assembler(request: Request) -> EpisodeAssembler:
    state: AppState = request.app.state.ratchet
    assembler = state.otlp_assembler
    if assembler is None:
        raise IngestError(503, "ingest_unavailable", "the OTLP assembler is not running")
    return assembler


def _export_openapi(signal: str, items: str) -> dict[str, Any]:
    """The OpenAPI of an OTLP export door: a binary or JSON ``Export<signal>ServiceRequest``
    in, the matching response (with partial success for rejected ``items``) out."""
    binary_or_json = {
        PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
        JSON: {"schema": {"type": "object"}},
    }
    return {
        "requestBody": {
            "required": True,
            "content": {
                PROTOBUF: binary_or_json[PROTOBUF],
                JSON: {
                    "schema": {
                        "type": "object",
                        "description": f"OTLP/JSON Export{signal}ServiceRequest",
                    }
                },
            },
        },
        "responses": {
            "200": {
                "description": f"Export{signal}ServiceResponse, with partial_success when "
                f"{items} were rejected",
                "content": binary_or_json,
            }
        },
    }


_OPENAPI = _export_openapi("Trace", "spans")
_LOGS_OPENAPI = _export_openapi("Logs", "records")
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Malformed protobuf, JSON or gzip"},
    401: {"description": "Missing, unknown or expired ingest token"},
    413: {
        "description": "Body over the size limit after decompression, or more traces or spans "
        "than an export may hold"
    },
    415: {"description": "Neither application/x-protobuf nor application/json"},
    503: {"description": "Postgres down; retry after Retry-After seconds"},
}


def _summary(errors: list[str]) -> str:
    message = "; ".join(errors[:MAX_ERRORS_REPORTED])
    if len(errors) > MAX_ERRORS_REPORTED:
        message += f"; and {len(errors) - MAX_ERRORS_REPORTED} more"
    return message


async def _export(request: Request, service: IngestService, *, logs: bool) -> Response:
    label = UNKNOWN_LOOP
    try:
        found = await service.token_loop(bearer_token(request.headers.get("authorization")))
        label = found.name
        kind, _ = media_type(request.headers)
        if kind not in (PROTOBUF, JSON):
            raise IngestError(
                415,
                "unsupported_media_type",
                f"Content-Type must be {PROTOBUF} or {JSON}, got {kind or 'none'!r}",
            )
        body = await read_request_body(request, service.settings.ingest_max_body_bytes)
        service.count_bytes(SOURCE, len(body))
        settings = service.settings
        limits = Limits(
            max_traces=settings.ingest_max_batch,
            max_spans=settings.otlp_max_spans_per_export,
            max_attribute_bytes=settings.otlp_max_attribute_bytes,
        )
        decoded = _decode(body, kind, limits, logs=logs)
        report = await _assembler(request).ingest(
            service, loop_id=found.loop_id, loop_name=found.name, decoded=decoded
        )
    except IngestError as exc:
        service.count_request_rejected(label, SOURCE, exc.code)
        raise exc from None
    except StorageUnavailable as exc:
        raise unavailable(exc) from None
    rejected = decoded.rejected + report.rejected
    errors = [*decoded.errors, *report.errors]
    if errors:
        service.count_request_rejected(label, SOURCE, "unmapped_spans")
    encode = encode_logs_response if logs else encode_response
    return Response(encode(rejected, _summary(errors), as_json=kind == JSON), media_type=kind)


def _decode(body: bytes, kind: str, limits: Limits, *, logs: bool) -> DecodedExport:
    protobuf = kind == PROTOBUF
    if logs:
        return read_logs(decode_export(body, ExportLogsServiceRequest, protobuf=protobuf), limits)
    return read_spans(decode_export(body, ExportTraceServiceRequest, protobuf=protobuf), limits)


def _export_route(
    signal: str, summary: str, openapi_extra: dict[str, Any]
) -> Callable[[Endpoint], Endpoint]:
    """Serve an export at the collector's default path ``/otlp/v1/<signal>`` and, for clients
    that put every call under the api's version, at ``/v1/otlp/v1/<signal>`` too."""
    default = f"/otlp/v1/{signal}"
    versioned = f"OTLP/HTTP {signal[:-1]} export under the versioned prefix (same as {default})"

    def register(endpoint: Endpoint) -> Endpoint:
        for path, text in ((f"/v1{default}", versioned), (default, summary)):
            router.post(
                path,
                summary=text,
                openapi_extra=openapi_extra,
                responses=_ERRORS,
                response_class=Response,
            )(endpoint)
        return endpoint

    return register


@_export_route("traces", "OTLP/HTTP trace export (GenAI spans), Bearer ingest token", _OPENAPI)
async def export_traces(request: Request, service: IngestDep) -> Response:
    return await _export(request, service, logs=False)


@_export_route(
    "logs",
    "OTLP/HTTP log export: GenAI message content as log records, joined to spans",
    _LOGS_OPENAPI,
)
async def export_logs(request: Request, service: IngestDep) -> Response:
    return await _export(request, service, logs=True)
