"""Feedback after the fact: ``POST /v1/loops/{loop}/traces/{external_id}/feedback``.

A user's verdict on an episode often comes later than the trace (a thumbs-down, a support
agent's correction, a test that failed in CI): the convention of Langfuse's scores and
LangSmith's feedback. The request is signed like the webhook (Standard Webhooks, the loop's
signing secrets) and checked in the webhook's order (signature headers, content type, size,
signature, archived loop, JSON, schema); only then is the trace looked up, so an unknown
trace (404) is told only to a sender that holds the loop's secret.

Feedback is stored once per content (or per client ``id``): a re-post answers 200 with the
first row and changes nothing; new feedback answers 201 and sends the trace back to curation,
whose next pass reads the feedback as a reward source.

The signature covers the body, and the body names its trace (``external_id``, which must be
the URL's): a captured request cannot be replayed onto another trace. Replayed as it was,
within the timestamp tolerance, it is the same feedback on the same trace: a 200 that
changes nothing, so the api keeps no memory of webhook ids for it (issue 43). Feedback on a
trace whose body retention purged is refused (410): its tasks keep their own copies, and
nothing could curate the trace again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from services.api.errors import ApiError
from services.api.routes.traces import check_json_content_type, ingest_service
from services.api.schemas.traces import FeedbackIn, FeedbackResult
from services.api.state import AppState
from services.db.models import TraceFeedback
from services.db.queries.trace_bodies import trace_purge_state
from services.db.queries.traces import add_feedback
from services.ingest.body import read_body
from services.ingest.errors import IngestError
from services.ingest.schema import decode_json, field_errors

router = APIRouter(tags=["ingest"])

_CONTENT_FIELDS = ("score", "label", "correction", "comment")

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Empty body or invalid JSON (says where)"},
    410: {"description": "Retention purged the trace's body: feedback can change nothing"},
    401: {
        "description": "Missing, malformed, stale or wrong Standard Webhooks signature, or no "
        "such loop (the two are not told apart)"
    },
    404: {"description": "The loop has no trace with this external id"},
    409: {"description": "The loop is archived, or the feedback id was used for other content"},
    413: {"description": "Body over the size limit"},
    415: {"description": "Not application/json"},
    422: {"description": "The body does not match the feedback schema; lists each field"},
}


def content_hash(feedback: FeedbackIn) -> str:
    """The feedback's identity: its client id when it has one, else its content."""
    if feedback.id is not None:
        identity: dict[str, Any] = {"id": feedback.id}
    else:
        identity = {name: getattr(feedback, name) for name in _CONTENT_FIELDS}
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def parse_feedback(body: bytes, external_id: str) -> FeedbackIn:
    """The body as feedback on the trace the URL names (422 when it names another)."""
    if not body.strip():
        raise IngestError(
            400,
            "empty_body",
            'the request has no body; send {"external_id": ..., "score": ..., "label": ...}',
        )
    data = decode_json(body)
    try:
        feedback = FeedbackIn.model_validate(data)
    except ValidationError as exc:
        raise IngestError(
            422, "invalid_feedback", "the body is not valid feedback", field_errors(exc)
        ) from None
    if feedback.external_id != external_id:
        raise IngestError(
            422,
            "trace_mismatch",
            "the body's external_id is not the trace in the URL: the signed body must name "
            "the trace the feedback is about",
            [{"path": "external_id", "message": "does not match the trace in the URL"}],
        )
    return feedback


def store_feedback(
    state: AppState, *, loop_id: int, external_id: str, feedback: FeedbackIn
) -> tuple[int, bool]:
    """The feedback's row id and whether it is new (one transaction, the caller's thread)."""
    digest = content_hash(feedback)
    with state.session_factory.begin() as session:
        found = trace_purge_state(session=session, loop_id=loop_id, external_id=external_id)
        if found is None:
            raise ApiError(
                404,
                "trace_not_found",
                f"the loop has no trace with external_id {external_id[:256]!r}",
                fields=[{"path": "external_id", "message": "unknown trace"}],
            )
        trace_id, purged_at = found
        if purged_at is not None:
            raise ApiError(
                410,
                "trace_purged",
                f"retention purged the body of trace {external_id[:256]!r} on "
                f"{purged_at.date().isoformat()}: feedback can no longer change what it taught",
                fields=[{"path": "external_id", "message": "trace body purged"}],
            )
        row_id, created = add_feedback(
            session=session,
            loop_id=loop_id,
            trace_id=trace_id,
            score=feedback.score,
            label=feedback.label,
            correction=feedback.correction,
            comment=feedback.comment,
            content_hash=digest,
        )
        if not created and feedback.id is not None:
            _same_content_or_409(session.get_one(TraceFeedback, row_id), feedback)
        return row_id, created


def _same_content_or_409(stored: TraceFeedback, feedback: FeedbackIn) -> None:
    """A client id names one piece of feedback: reusing it for other content is an error, not
    a silent no-op that would drop the new verdict."""
    differing = [
        name for name in _CONTENT_FIELDS if getattr(stored, name) != getattr(feedback, name)
    ]
    if differing:
        raise ApiError(
            409,
            "feedback_id_reused",
            f"feedback id {feedback.id!r} was stored before with other content "
            f"({', '.join(differing)} differ); use a new id for new feedback",
            fields=[{"path": "id", "message": "already used for other feedback"}],
        )


@router.post(
    "/v1/loops/{loop}/traces/{external_id:path}/feedback",
    summary="Post feedback on a trace (score, label, correction, comment), signed as the webhook",
    response_model=FeedbackResult,
    status_code=201,
    responses={
        200: {"description": "The same feedback was stored before: nothing changed"},
        **_ERRORS,
    },
    openapi_extra={
        "parameters": [
            {"name": name, "in": "header", "required": True, "schema": {"type": "string"}}
            for name in ("webhook-id", "webhook-timestamp", "webhook-signature")
        ],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": FeedbackIn.model_json_schema()}},
        },
    },
)
async def post_feedback(loop: str, external_id: str, request: Request) -> Response:
    """Store feedback on a trace and send the trace back to curation (see the module)."""
    state: AppState = request.app.state.ratchet
    service = ingest_service(state)
    headers = request.headers
    signed = service.signed_headers(headers)
    check_json_content_type(headers)
    found = await service.webhook_loop(loop)
    body = await read_body(
        request.stream(),
        content_length=headers.get("content-length"),
        content_encoding=headers.get("content-encoding"),
        limit=state.settings.api_max_body_bytes,
    )
    keys = await service.verify_signature(found, signed, body)
    service.check_accepts_traces(keys)
    feedback = parse_feedback(body, external_id)
    row_id, created = await asyncio.to_thread(
        store_feedback, state, loop_id=keys.loop_id, external_id=external_id, feedback=feedback
    )
    result = FeedbackResult(
        id=row_id, external_id=external_id, status="accepted" if created else "duplicate"
    )
    return Response(
        result.model_dump_json(), status_code=201 if created else 200, media_type="application/json"
    )
