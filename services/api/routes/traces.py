"""The webhook: ``POST /v1/loops/{loop}/traces``, signed native ``ratchet.trace/v1`` JSON.

Order of checks, cheapest and least trusting first: the loop exists (404), the signature
headers are present and fresh (401), the content type (415), the size (413, before and while
reading, and after gzip), the signature over the body (401), then JSON (400, with line and
column) and the schema (422, with each field path). Only then are traces queued for the
group-commit writer, and the answer waits for the commit.

This module owns the ingest service (writer and credential cache) for the whole api: its
``startup``/``shutdown`` hooks build and stop it; the OTLP route uses the same one.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from services.api.errors import ApiError
from services.api.schemas.traces import IngestResult, ItemResult
from services.api.state import AppState
from services.ingest.body import read_body
from services.ingest.errors import IngestError
from services.ingest.schema import inlined_schema, parse_native
from services.ingest.service import (
    EXTRAS_KEY,
    UNKNOWN_LOOP,
    IngestService,
    ItemOutcome,
    conninfo_from_engine,
)
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
    state.extras[EXTRAS_KEY] = service


async def shutdown(app: FastAPI) -> None:
    state: AppState = app.state.ratchet
    service = state.extras.pop(EXTRAS_KEY, None)
    if isinstance(service, IngestService):
        await service.stop()


async def get_ingest(request: Request) -> IngestService:
    """The ingest service (async, so the hot path takes no thread-pool hop to resolve it)."""
    state: AppState = request.app.state.ratchet
    service = state.extras.get(EXTRAS_KEY)
    if not isinstance(service, IngestService):
        raise ApiError(503, "ingest_unavailable", "the ingest service is not running")
    return service


IngestDep = Annotated[IngestService, Depends(get_ingest)]


def api_error(exc: IngestError) -> ApiError:
    return ApiError(exc.status_code, exc.code, exc.message, fields=exc.fields, headers=exc.headers)


def unavailable(exc: StorageUnavailable) -> ApiError:
    return ApiError(503, "unavailable", str(exc), headers={"Retry-After": str(exc.retry_after_s)})


def media_type(request: Request) -> tuple[str, str | None]:
    """The content type without parameters, and its charset if one is given."""
    raw = request.headers.get("content-type", "")
    kind, _, params = raw.partition(";")
    charset = None
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "charset":
            charset = value.strip().strip('"').lower()
    return kind.strip().lower(), charset


def check_json_content_type(request: Request) -> None:
    kind, charset = media_type(request)
    if kind not in JSON_TYPES or charset not in (None, "utf-8", "utf8"):
        raise IngestError(
            415,
            "unsupported_media_type",
            f"Content-Type must be application/json (UTF-8), got {kind or 'none'!r}",
        )


async def read_request_body(request: Request, limit: int) -> bytes:
    return await read_body(
        request.stream(),
        content_length=request.headers.get("content-length"),
        content_encoding=request.headers.get("content-encoding"),
        limit=limit,
    )


def ingest_result(outcomes: list[ItemOutcome]) -> IngestResult:
    counts = {"accepted": 0, "duplicate": 0, "rejected": 0}
    for outcome in outcomes:
        counts[outcome.status] += 1
    return IngestResult(
        accepted=counts["accepted"],
        duplicates=counts["duplicate"],
        rejected=counts["rejected"],
        results=[
            ItemResult(
                index=o.index,
                external_id=o.external_id,
                status=o.status,
                trace_id=o.trace_id,
                reason=o.reason,
                fields=o.fields,
            )
            for o in outcomes
        ],
    )


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Empty body, invalid JSON (says where), bad gzip"},
    401: {"description": "Missing, malformed, stale or wrong Standard Webhooks signature"},
    404: {"description": "No such loop"},
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
    label = UNKNOWN_LOOP
    try:
        keys = await service.webhook_loop(loop)
        label = keys.name
        signed = service.signed_headers(request.headers)
        check_json_content_type(request)
        body = await read_request_body(request, service.settings.ingest_max_body_bytes)
        service.count_bytes(SOURCE, len(body))
        await service.verify_signature(keys, signed, body)
        parsed = parse_native(body, max_batch=service.settings.ingest_max_batch)
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
        raise api_error(exc) from None
    except StorageUnavailable as exc:
        raise unavailable(exc) from None
    return Response(ingest_result(outcomes).model_dump_json(), media_type="application/json")
