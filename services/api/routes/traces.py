"""The webhook: ``POST /v1/loops/{loop}/traces``, signed native ``ratchet.trace/v1`` JSON.

Order of checks, cheapest and least trusting first: the signature headers are present and
fresh (401), the content type (415), the size (413, before and while reading, and after
gzip), the signature over the body under the loop's secrets (401; an unknown loop gets the
same 401 as a wrong secret, so loop names cannot be probed), the loop takes traces (409),
then JSON (400, with line and column) and the schema (422, with each field path). Only then
are traces queued for the group-commit writer, and the answer waits for the commit.

The route is served by ``WebhookEndpoint``, a plain ASGI app first in the routing table (see
services.api.asgi); the FastAPI route ``post_traces`` documents it and does the same work.

This module owns the ingest service (writer and credential cache) for the whole api: its
``startup``/``shutdown`` hooks build and stop it; the OTLP route uses the same one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

import pydantic_core
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from services.api.asgi import PlainRoute, body_chunks, send_bytes
from services.api.errors import ApiError
from services.api.schemas.traces import IngestResult
from services.api.state import AppState
from services.ingest.body import read_body
from services.ingest.errors import IngestError
from services.ingest.schema import inlined_schema, parse_native
from services.ingest.service import (
    UNKNOWN_LOOP,
    IngestService,
    ItemOutcome,
    conninfo_from_engine,
)
from services.ingest.warnings import screen_for
from services.ingest.writer import StorageUnavailable

SOURCE = "webhook"
JSON_TYPES = {"application/json"}

router = APIRouter(tags=["ingest"])


async def startup(app: FastAPI) -> None:
    state: AppState = app.state.ratchet
    service = IngestService(
        settings=state.settings,
        session_factory=state.session_factory,
        conninfo=conninfo_from_engine(state.engine),
    )
    await service.start()
    state.ingest = service


async def shutdown(app: FastAPI) -> None:
    state: AppState = app.state.ratchet
    service, state.ingest = state.ingest, None
    if service is not None:
        await service.stop()


def ingest_service(state: AppState) -> IngestService:
    service = state.ingest
    if service is None:
        raise ApiError(503, "ingest_unavailable", "the ingest service is not running")
    return service


async def get_ingest(request: Request) -> IngestService:
    """The ingest service (async, so the hot path takes no thread-pool hop to resolve it)."""
    return ingest_service(request.app.state.ratchet)


IngestDep = Annotated[IngestService, Depends(get_ingest)]


def unavailable(exc: StorageUnavailable) -> ApiError:
    return ApiError(503, "unavailable", str(exc), headers={"Retry-After": str(exc.retry_after_s)})


def media_type(headers: Mapping[str, str]) -> tuple[str, str | None]:
    """The content type without parameters, and its charset if one is given."""
    raw = headers.get("content-type", "")
    kind, _, params = raw.partition(";")
    charset = None
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "charset":
            charset = value.strip().strip('"').lower()
    return kind.strip().lower(), charset


def check_json_content_type(headers: Mapping[str, str]) -> None:
    kind, charset = media_type(headers)
    if kind not in JSON_TYPES or charset not in (None, "utf-8", "utf8"):
        raise IngestError(
            415,
            "unsupported_media_type",
            f"Content-Type must be application/json (UTF-8), got {kind or 'none'!r}",
        )


async def read_request_body(request: Request, limit: int) -> bytes:
    """The body of a FastAPI request, within ``limit`` (see services.ingest.body)."""
    return await read_body(
        request.stream(),
        content_length=request.headers.get("content-length"),
        content_encoding=request.headers.get("content-encoding"),
        limit=limit,
    )


def answer_json(outcomes: list[ItemOutcome]) -> bytes:
    """The answer, an :class:`IngestResult` in JSON, byte for byte what its ``model_dump_json``
    writes, without building a model per item (this runs for every trace of a batch)."""
    counts = {"accepted": 0, "duplicate": 0, "rejected": 0}
    for outcome in outcomes:
        counts[outcome.status] += 1
    return pydantic_core.to_json(
        {
            "accepted": counts["accepted"],
            "duplicates": counts["duplicate"],
            "rejected": counts["rejected"],
            "results": [
                {
                    "index": o.index,
                    "external_id": o.external_id,
                    "status": o.status,
                    "trace_id": o.trace_id,
                    "reason": o.reason,
                    # FieldError's keys, in its order (field_errors writes them so)
                    "fields": [{"path": f["path"], "message": f["message"]} for f in o.fields],
                    # TraceWarningPublic's keys, in its order
                    "warnings": [
                        {"code": w.code, "path": w.path, "message": w.message} for w in o.warnings
                    ],
                }
                for o in outcomes
            ],
        }
    )


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Empty body, invalid JSON (says where), bad gzip"},
    401: {
        "description": "Missing, malformed, stale or wrong Standard Webhooks signature, or no "
        "such loop (the two are not told apart)"
    },
    409: {"description": "The loop is archived"},
    413: {"description": "Body over the size limit (after decompression) or too many traces"},
    415: {"description": "Not application/json, or an unsupported Content-Encoding"},
    422: {"description": "The trace does not match ratchet.trace/v1; lists each field path"},
    503: {"description": "Postgres down or write queue full; retry after Retry-After seconds"},
}


@router.post(
    "/v1/loops/{loop}/traces",
    summary="Post one trace or a batch (Standard Webhooks signature)",
    response_model=IngestResult,
    responses=_ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inlined_schema()}},
        },
        "parameters": [
            {"name": name, "in": "header", "required": True, "schema": {"type": "string"}}
            for name in ("webhook-id", "webhook-timestamp", "webhook-signature")
        ],
    },
)
async def post_traces(loop: str, request: Request, service: IngestDep) -> Response:
    """Store traces durably; the answer (per item: accepted, duplicate, rejected) follows COMMIT."""
    answer = await ingest_webhook(service, loop, request.headers, request.stream())
    return Response(answer, media_type="application/json")


async def ingest_webhook(
    service: IngestService, loop: str, headers: Mapping[str, str], chunks: AsyncIterator[bytes]
) -> bytes:
    """The webhook's work, in the order of the module docstring: the JSON answer, or ApiError."""
    label = UNKNOWN_LOOP
    try:
        signed = service.signed_headers(headers)
        check_json_content_type(headers)
        found = await service.webhook_loop(loop)
        label = found.name if found is not None else UNKNOWN_LOOP
        body = await read_body(
            chunks,
            content_length=headers.get("content-length"),
            content_encoding=headers.get("content-encoding"),
            limit=service.settings.ingest_max_body_bytes,
        )
        service.count_bytes(SOURCE, len(body))
        keys = await service.verify_signature(found, signed, body)
        service.check_accepts_traces(keys)
        parsed = parse_native(
            body,
            max_batch=service.settings.ingest_max_batch,
            screen=screen_for(keys.environment),
        )
        outcomes = await service.store(
            loop_id=keys.loop_id,
            loop_name=keys.name,
            source=SOURCE,
            traces=parsed.traces,
            rejected=parsed.rejected,
            total=parsed.total,
        )
    except IngestError as exc:
        service.count_request_rejected(label, SOURCE, exc.code)
        raise exc from None
    except StorageUnavailable as exc:
        raise unavailable(exc) from None
    return answer_json(outcomes)


class WebhookEndpoint:
    """``post_traces`` as a plain ASGI app (see services.api.asgi): same work, same answers."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        service = ingest_service(scope["app"].state.ratchet)
        answer = await ingest_webhook(
            service, scope["path_params"]["loop"], Headers(scope=scope), body_chunks(receive)
        )
        await send_bytes(send, answer, media_type="application/json")


plain_routes = [
    PlainRoute(
        "/v1/loops/{loop}/traces", WebhookEndpoint(), methods=["POST"], include_in_schema=False
    )
]
