"""OTLP/HTTP traces: ``POST /otlp/v1/traces`` (and ``/v1/otlp/v1/traces``), protobuf or JSON.

OpenTelemetry exporters cannot sign bodies, so this door takes ``Authorization: Bearer <ingest
token>`` and the loop comes from the token. It follows OTLP/HTTP's rules: gzip accepted, the
size limit applies after decompression (413), malformed data is a 400, spans that cannot be
mapped are a partial success (200 with ``rejected_spans`` and a message), and 503 with
``Retry-After`` only when retrying can succeed (Postgres down, queue full). The response
body is an ``ExportTraceServiceResponse`` in the request's encoding.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from services.api.deps import bearer_token
from services.api.routes.traces import (
    IngestDep,
    media_type,
    read_request_body,
    unavailable,
)
from services.ingest.errors import IngestError
from services.ingest.otlp import decode_json_request, decode_protobuf, encode_response, map_export
from services.ingest.service import UNKNOWN_LOOP
from services.ingest.writer import StorageUnavailable

SOURCE = "otlp"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MAX_ERRORS_REPORTED = 5

router = APIRouter(tags=["ingest"])

_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
            JSON: {
                "schema": {"type": "object", "description": "OTLP/JSON ExportTraceServiceRequest"}
            },
        },
    },
    "responses": {
        "200": {
            "description": "ExportTraceServiceResponse, with partial_success when spans were "
            "rejected",
            "content": {
                PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
                JSON: {"schema": {"type": "object"}},
            },
        }
    },
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Malformed protobuf, JSON or gzip"},
    401: {"description": "Missing, unknown or expired ingest token"},
    413: {"description": "Body over the size limit after decompression"},
    415: {"description": "Neither application/x-protobuf nor application/json"},
    503: {"description": "Postgres down or write queue full; retry after Retry-After seconds"},
}


async def _export(request: Request, service: IngestDep) -> Response:
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
        export = decode_protobuf(body) if kind == PROTOBUF else decode_json_request(body)
        mapped = map_export(export)
        outcomes = await service.store(
            loop_id=found.loop_id,
            loop_name=found.name,
            source=SOURCE,
            traces=list(enumerate(trace for _, trace in mapped.traces)),
            rejected=[],
            total=len(mapped.traces),
        )
    except IngestError as exc:
        service.count_request_rejected(label, SOURCE, exc.code)
        raise exc from None
    except StorageUnavailable as exc:
        raise unavailable(exc) from None
    rejected_spans = mapped.rejected_spans
    errors = list(mapped.errors)
    for outcome, (span_count, _) in zip(outcomes, mapped.traces, strict=True):
        if outcome.status == "rejected":
            rejected_spans += span_count
            errors.append(f"trace {outcome.external_id}: {outcome.reason}")
    if errors:
        service.count_request_rejected(label, SOURCE, "unmapped_spans")
    message = "; ".join(errors[:MAX_ERRORS_REPORTED])
    if len(errors) > MAX_ERRORS_REPORTED:
        message += f"; and {len(errors) - MAX_ERRORS_REPORTED} more"
    return Response(
        encode_response(rejected_spans, message, as_json=kind == JSON),
        media_type=kind,
    )


@router.post(
    "/otlp/v1/traces",
    summary="OTLP/HTTP trace export (GenAI spans), Bearer ingest token",
    openapi_extra=_OPENAPI,
    responses=_ERRORS,
    response_class=Response,
)
async def export_traces(request: Request, service: IngestDep) -> Response:
    return await _export(request, service)


@router.post(
    "/v1/otlp/v1/traces",
    summary="OTLP/HTTP trace export under the versioned prefix (same as /otlp/v1/traces)",
    openapi_extra=_OPENAPI,
    responses=_ERRORS,
    response_class=Response,
)
async def export_traces_v1(request: Request, service: IngestDep) -> Response:
    return await _export(request, service)
