"""Feedback after the fact: signed like the webhook, idempotent, re-curates its trace."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select, update

from services.db.models import Task, TaskSource, Trace, TraceFeedback
from services.db.queries.retention import retire_trace_bodies
from services.db.session import SessionFactory
from tests.services.api.support import body_of, make_trace, signed_headers


def post_trace(client: TestClient, loop: dict[str, Any], trace: dict[str, Any]) -> None:
    body = body_of(trace)
    response = client.post(
        f"/v1/loops/{loop['name']}/traces",
        content=body,
        headers=signed_headers(loop["signing_secret"], body),
    )
    assert response.status_code == 200, response.text


def post_feedback(
    client: TestClient,
    loop: dict[str, Any],
    external_id: str,
    payload: Any,
    *,
    secret: str | None = None,
    loop_name: str | None = None,
    headers: dict[str, str] | None = None,
    name_trace: bool = True,
) -> Any:
    """Post signed feedback; a dict payload names the trace (``external_id``) unless it
    does itself or ``name_trace`` is false."""
    if isinstance(payload, dict) and name_trace:
        payload = {"external_id": external_id, **payload}
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    all_headers = signed_headers(secret or loop["signing_secret"], body)
    all_headers.update(headers or {})
    return client.post(
        f"/v1/loops/{loop_name or loop['name']}/traces/{external_id}/feedback",
        content=body,
        headers=all_headers,
    )


def mark_curated(session_factory: SessionFactory, external_id: str) -> None:
    with session_factory.begin() as session:
        session.execute(
            update(Trace)
            .where(Trace.external_id == external_id)
            .values(
                curated_at=Trace.received_at,
                curation_outcome="rejected",
                curation_detail="no_reward: nothing can score this trace",
            )
        )


def feedback_rows(session_factory: SessionFactory) -> list[TraceFeedback]:
    with session_factory() as session:
        return list(session.scalars(select(TraceFeedback).order_by(TraceFeedback.id)))


def test_feedback_is_stored_once_and_sends_the_trace_back_to_curation(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    post_trace(client, loop, make_trace("ticket-1"))
    mark_curated(session_factory, "ticket-1")
    feedback = {"score": 0.0, "label": "wrong", "correction": "Refund issued", "comment": "late"}

    first = post_feedback(client, loop, "ticket-1", feedback)
    assert first.status_code == 201, first.text
    assert first.json()["status"] == "accepted"
    with session_factory() as session:
        trace = session.scalars(select(Trace).where(Trace.external_id == "ticket-1")).one()
        assert (trace.curated_at, trace.curation_outcome, trace.curation_detail) == (
            None,
            None,
            None,
        )
    [row] = feedback_rows(session_factory)
    assert (row.score, row.label, row.correction, row.comment) == (
        0.0,
        "wrong",
        "Refund issued",
        "late",
    )
    assert row.trace_id == trace.id and row.loop_id == trace.loop_id

    mark_curated(session_factory, "ticket-1")
    again = post_feedback(client, loop, "ticket-1", feedback)
    assert again.status_code == 200, again.text
    assert again.json() == {**first.json(), "status": "duplicate"}
    assert len(feedback_rows(session_factory)) == 1
    with session_factory() as session:
        trace = session.scalars(select(Trace).where(Trace.external_id == "ticket-1")).one()
        assert trace.curation_outcome == "rejected"  # a no-op: not sent back again

    other = post_feedback(client, loop, "ticket-1", {"score": 1.0})
    assert other.status_code == 201
    assert len(feedback_rows(session_factory)) == 2


def test_a_client_id_makes_a_retry_a_no_op_and_refuses_reuse(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    post_trace(client, loop, make_trace("ticket-2"))
    first = post_feedback(client, loop, "ticket-2", {"id": "fb-1", "label": "helpful"})
    assert first.status_code == 201
    retry = post_feedback(client, loop, "ticket-2", {"id": "fb-1", "label": "helpful"})
    assert retry.status_code == 200 and retry.json()["id"] == first.json()["id"]
    reused = post_feedback(client, loop, "ticket-2", {"id": "fb-1", "label": "unhelpful"})
    assert reused.status_code == 409
    error = reused.json()["error"]
    assert error["code"] == "feedback_id_reused" and "label" in error["message"]
    assert error["fields"] == [{"path": "id", "message": "already used for other feedback"}]
    assert [r.label for r in feedback_rows(session_factory)] == ["helpful"]


def test_feedback_for_an_unknown_trace_is_a_404(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    response = post_feedback(client, loop, "no-such-trace", {"score": 1})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "trace_not_found" and "no-such-trace" in error["message"]
    assert feedback_rows(session_factory) == []


def test_feedback_is_authenticated_like_the_webhook(
    client: TestClient, loop: dict[str, Any]
) -> None:
    post_trace(client, loop, make_trace("ticket-3"))
    wrong_secret = post_feedback(
        client, loop, "ticket-3", {"score": 1}, secret="whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFB"
    )
    assert wrong_secret.status_code == 401
    unknown_loop = post_feedback(client, loop, "ticket-3", {"score": 1}, loop_name="nope")
    assert unknown_loop.status_code == 401
    assert unknown_loop.json()["error"]["code"] == wrong_secret.json()["error"]["code"]
    unsigned = client.post(
        f"/v1/loops/{loop['name']}/traces/ticket-3/feedback",
        json={"score": 1},
    )
    assert unsigned.status_code == 401
    assert unsigned.headers["www-authenticate"] == "Webhook-Signature"
    text = post_feedback(
        client, loop, "ticket-3", {"score": 1}, headers={"content-type": "text/plain"}
    )
    assert text.status_code == 415


def test_bad_feedback_bodies_name_the_field(client: TestClient, loop: dict[str, Any]) -> None:
    post_trace(client, loop, make_trace("ticket-4"))
    cases: list[tuple[Any, int, str, list[str]]] = [
        (b"", 400, "empty_body", []),
        (b'{"score": ', 400, "invalid_json", []),
        (b'{"score": NaN}', 400, "invalid_json", []),
        ({"comment": "only a comment"}, 422, "invalid_feedback", ["(root)"]),
        ({}, 422, "invalid_feedback", ["(root)"]),
        ({"score": "high"}, 422, "invalid_feedback", ["score"]),
        ({"label": ""}, 422, "invalid_feedback", ["label"]),
        ({"label": "x" * 201}, 422, "invalid_feedback", ["label"]),
        ({"score": 1, "stars": 5}, 422, "invalid_feedback", ["stars"]),
        ({"score": 1, "external_id": ""}, 422, "invalid_feedback", ["external_id"]),
        ({"score": 1, "external_id": "ticket-5"}, 422, "trace_mismatch", ["external_id"]),
        ({"correction": "a\u0000b"}, 422, "invalid_feedback", ["correction"]),
        ([1, 2], 422, "invalid_feedback", ["(root)"]),
    ]
    for payload, status, code, paths in cases:
        response = post_feedback(client, loop, "ticket-4", payload)
        assert response.status_code == status, (payload, response.text)
        error = response.json()["error"]
        assert error["code"] == code, (payload, error)
        assert [f["path"] for f in error.get("fields", [])] == paths, (payload, error)


def test_feedback_unlinks_a_curated_trace_from_its_task(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    """Curation links the trace again when it re-curates it; the old link must be gone by
    then (task_sources is keyed by task and trace), and the task's weight, the number of
    traces folded into it, loses this one."""
    post_trace(client, loop, make_trace("ticket-6"))
    post_trace(client, loop, make_trace("ticket-7"))
    with session_factory.begin() as session:
        ids = dict(session.execute(select(Trace.external_id, Trace.id)).all())
        task = Task(
            loop_id=session.scalars(select(Trace.loop_id)).first(),
            content_hash="f" * 64,
            environment="toolcalc",
            spec={},
            cluster_id="c1",
            split="train",
            weight=2,
        )
        session.add(task)
        session.flush()
        task_id = task.id
        session.add(TaskSource(task_id=task_id, trace_id=ids["ticket-6"], relation="origin"))
        session.add(TaskSource(task_id=task_id, trace_id=ids["ticket-7"], relation="duplicate"))
    mark_curated(session_factory, "ticket-6")

    assert post_feedback(client, loop, "ticket-6", {"label": "wrong"}).status_code == 201
    with session_factory() as session:
        links = session.execute(select(TaskSource.trace_id, TaskSource.relation)).all()
        assert links == [(ids["ticket-7"], "duplicate")]
        assert session.get_one(Task, task_id).weight == 1
    # A repeat is a no-op: nothing more is unlinked or counted down.
    assert post_feedback(client, loop, "ticket-6", {"label": "wrong"}).status_code == 200
    with session_factory() as session:
        assert session.get_one(Task, task_id).weight == 1


def test_a_body_that_does_not_name_its_trace_is_refused(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    post_trace(client, loop, make_trace("ticket-8"))
    response = post_feedback(client, loop, "ticket-8", {"score": 1}, name_trace=False)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_feedback"
    assert [f["path"] for f in error["fields"]] == ["external_id"]
    assert feedback_rows(session_factory) == []


def test_a_signed_feedback_cannot_be_replayed_onto_another_trace(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    """Issue 43: the signature covers the body, and the body names its trace, so a captured
    thumbs-down for one trace is refused at another trace's URL; replayed where it was sent
    (within the timestamp tolerance) it is the same feedback, and changes nothing."""
    post_trace(client, loop, make_trace("ticket-a"))
    post_trace(client, loop, make_trace("ticket-b"))
    body = json.dumps({"external_id": "ticket-a", "score": 0.0, "label": "wrong"}).encode()
    captured = signed_headers(loop["signing_secret"], body)
    url = f"/v1/loops/{loop['name']}/traces/{{}}/feedback"

    sent = client.post(url.format("ticket-a"), content=body, headers=captured)
    assert sent.status_code == 201, sent.text
    replayed_elsewhere = client.post(url.format("ticket-b"), content=body, headers=captured)
    assert replayed_elsewhere.status_code == 422
    assert replayed_elsewhere.json()["error"]["code"] == "trace_mismatch"
    replayed = client.post(url.format("ticket-a"), content=body, headers=captured)
    assert replayed.status_code == 200 and replayed.json()["status"] == "duplicate"
    with session_factory() as session:
        trace_a = session.scalars(select(Trace.id).where(Trace.external_id == "ticket-a")).one()
    assert [row.trace_id for row in feedback_rows(session_factory)] == [trace_a]


def test_feedback_on_a_purged_trace_is_a_clear_410(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    """Retention purged the body: nothing could curate the trace again, so feedback is
    refused with the reason, and the trace keeps its verdict and links."""
    post_trace(client, loop, make_trace("ticket-old"))
    mark_curated(session_factory, "ticket-old")
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=400)  # no partition: the default
    with session_factory.begin() as session:
        session.execute(
            update(Trace).where(Trace.external_id == "ticket-old").values(received_at=long_ago)
        )
        retired = retire_trace_bodies(
            session=session,
            received_before=long_ago + dt.timedelta(seconds=1),
            now=dt.datetime.now(dt.UTC),
        )
    assert retired is not None and [r.rows for r in retired] == [1]

    response = post_feedback(client, loop, "ticket-old", {"label": "wrong"})

    assert response.status_code == 410, response.text
    error = response.json()["error"]
    assert error["code"] == "trace_purged" and "ticket-old" in error["message"]
    assert feedback_rows(session_factory) == []
    with session_factory() as session:
        trace = session.scalars(select(Trace).where(Trace.external_id == "ticket-old")).one()
        assert trace.curation_outcome == "rejected" and trace.curated_at is not None
