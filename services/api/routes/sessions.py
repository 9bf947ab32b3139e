"""The capture gateway's sessions: ``POST /v1/loops/{loop}/sessions/{id}/close`` and
``.../outcome`` (services.gateway).

An ``id`` names a session as the agent knows it: the session id it gave the gateway
(``X-Ratchet-Session``, ``metadata.session_id`` or ``user``), or, for a session grouped by
conversation, the ``X-Ratchet-Call-Id`` or the response ``id`` of any of its calls.

**Close** takes the loop's gateway key (``Authorization: Bearer``, what the agent holds) or a
Standard Webhooks signature. It first places the calls already in Postgres (a call still in
a gateway's spool arrives after the close and starts a new session), then closes the
session into its trace.

**Outcome** is signed like the webhook, checked in its order (signature headers, content
type, size, signature, archived loop, JSON, schema). Its ``webhook-id`` is accepted once per
loop: a replayed request is refused (409), inside the timestamp window and after it. The
outcome joins its session whenever it comes: before the close it waits and becomes the
trace's outcome and reference answer; after, it reaches the trace as feedback, which sends
the trace back to curation.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from services.api.errors import ApiError
from services.api.routes.traces import check_json_content_type, ingest_service
from services.api.schemas.sessions import OutcomeIn, OutcomeResult, SessionClosed
from services.api.state import AppState
from services.db.models import GatewayOutcome, GatewaySession
from services.db.queries.credentials import GATEWAY_KEY, loop_for_token
from services.gateway import queries
from services.gateway.assembler import (
    apply_outcome,
    close_session,
    place_calls,
    resolve_outcomes,
)
from services.gateway.sessions import external_id
from services.ingest.body import read_body
from services.ingest.credentials import hash_token
from services.ingest.errors import IngestError
from services.ingest.schema import decode_json, field_errors

router = APIRouter(tags=["gateway"])

_SIGNED_HEADERS = [
    {"name": name, "in": "header", "required": False, "schema": {"type": "string"}}
    for name in ("webhook-id", "webhook-timestamp", "webhook-signature")
]
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid JSON (says where)"},
    401: {"description": "No valid gateway key or signature for this loop"},
    404: {"description": "The loop has no session by this id"},
    409: {"description": "The loop is archived, or the webhook-id was used before (a replay)"},
    413: {"description": "Body over the size limit"},
    422: {"description": "The body is not a valid outcome; lists each field"},
}


async def _loop_by_gateway_key(state: AppState, loop: str, key: str) -> int | None:
    def read() -> int | None:
        with state.session_factory() as session:
            found = loop_for_token(
                session=session,
                token_sha256=hash_token(key),
                now=dt.datetime.now(dt.UTC),
                kind=GATEWAY_KEY,
            )
            return found[0].id if found is not None and found[0].name == loop else None

    return await asyncio.to_thread(read)


async def _signed_loop(state: AppState, loop: str, request: Request, body: bytes) -> int:
    service = ingest_service(state)
    signed = service.signed_headers(request.headers)
    keys = await service.verify_signature(await service.webhook_loop(loop), signed, body)
    service.check_accepts_traces(keys)
    return keys.loop_id


def close(state: AppState, *, loop_id: int, ref: str) -> SessionClosed:
    """Place what Postgres holds, then close the session ``ref`` names (one transaction)."""
    with state.session_factory.begin() as session:
        queries.lock_loop(session=session, loop_id=loop_id)
        place_calls(session, loop_id=loop_id)
        resolve_outcomes(session, loop_id=loop_id)
        row = queries.session_for_ref(session=session, loop_id=loop_id, ref=ref)
        if row is None:
            raise ApiError(
                404,
                "session_not_found",
                f"the loop has no session {ref[:256]!r} (a session id, or a call's "
                "X-Ratchet-Call-Id or response id)",
                fields=[{"path": "id", "message": "unknown session"}],
            )
        status = "already_closed"
        if row.status == queries.OPEN:
            close_session(session, row, reason="api")
            status = "closed"
        return SessionClosed(
            session=row.key,
            session_id=row.id,
            status=status,
            calls=row.call_count,
            trace_id=row.trace_id,
            external_id=external_id(row.id),
        )


@router.post(
    "/v1/loops/{loop}/sessions/{session_id:path}/close",
    summary="Close a gateway session now: it becomes a trace (gateway key or signature)",
    response_model=SessionClosed,
    responses=_ERRORS,
    openapi_extra={"parameters": _SIGNED_HEADERS},
)
async def close_route(loop: str, session_id: str, request: Request) -> SessionClosed:
    state: AppState = request.app.state.ratchet
    scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
    loop_id = None
    if scheme.lower() == "bearer" and key.strip():
        loop_id = await _loop_by_gateway_key(state, loop, key.strip())
    if loop_id is None:
        if "webhook-signature" not in request.headers:
            raise ApiError(
                401,
                "unauthorized",
                "send the loop's gateway key (Authorization: Bearer) or sign the request as "
                "the webhook",
            )
        body = await _read(request, state)
        loop_id = await _signed_loop(state, loop, request, body)
    return await asyncio.to_thread(close, state, loop_id=loop_id, ref=session_id)


async def _read(request: Request, state: AppState) -> bytes:
    return await read_body(
        request.stream(),
        content_length=request.headers.get("content-length"),
        content_encoding=request.headers.get("content-encoding"),
        limit=state.settings.api_max_body_bytes,
    )


def parse_outcome(body: bytes) -> OutcomeIn:
    if not body.strip():
        raise IngestError(400, "empty_body", 'the request has no body; send {"success": ...}')
    try:
        return OutcomeIn.model_validate(decode_json(body))
    except ValidationError as exc:
        raise IngestError(
            422, "invalid_outcome", "the body is not a valid outcome", field_errors(exc)
        ) from None


def store_outcome(
    state: AppState, *, loop_id: int, ref: str, webhook_id: str, outcome: OutcomeIn
) -> OutcomeResult:
    """Store the outcome and join it now if its session has a trace (one transaction)."""
    with state.session_factory.begin() as session:
        queries.lock_loop(session=session, loop_id=loop_id)
        values = {
            "webhook_id": webhook_id,
            "session_ref": ref,
            **outcome.model_dump(include={"success", "score", "reference_answer", "label"}),
        }
        outcome_id = queries.add_outcome(session=session, loop_id=loop_id, values=values)
        if outcome_id is None:
            raise ApiError(
                409,
                "replayed",
                f"webhook-id {webhook_id[:256]!r} was received before for this loop: a "
                "replayed request is refused (send a new webhook-id for a new outcome)",
                fields=[{"path": "webhook-id", "message": "already used"}],
            )
        place_calls(session, loop_id=loop_id)
        resolve_outcomes(session, loop_id=loop_id)
        stored = session.get_one(GatewayOutcome, outcome_id)
        row = session.get(GatewaySession, stored.session_id) if stored.session_id else None
        if row is not None and row.trace_id is not None:
            apply_outcome(session, stored, trace_id=row.trace_id)
            return OutcomeResult(
                id=outcome_id, session=ref, status="applied", trace_id=row.trace_id
            )
        return OutcomeResult(id=outcome_id, session=ref, status="waiting")


@router.post(
    "/v1/loops/{loop}/sessions/{session_id:path}/outcome",
    summary="Post a gateway session's outcome (success, score, reference answer, label), "
    "signed as the webhook",
    response_model=OutcomeResult,
    status_code=201,
    responses=_ERRORS,
    openapi_extra={
        "parameters": [{**h, "required": True} for h in _SIGNED_HEADERS],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": OutcomeIn.model_json_schema()}},
        },
    },
)
async def outcome_route(loop: str, session_id: str, request: Request) -> Response:
    state: AppState = request.app.state.ratchet
    service = ingest_service(state)
    signed = service.signed_headers(request.headers)
    check_json_content_type(request.headers)
    found = await service.webhook_loop(loop)
    body = await _read(request, state)
    keys = await service.verify_signature(found, signed, body)
    service.check_accepts_traces(keys)
    outcome = parse_outcome(body)
    result = await asyncio.to_thread(
        store_outcome,
        state,
        loop_id=keys.loop_id,
        ref=session_id,
        webhook_id=signed.msg_id,
        outcome=outcome,
    )
    return Response(result.model_dump_json(), status_code=201, media_type="application/json")
