"""The webhook door end to end: real app, real Postgres, signed requests, every bad input."""

from __future__ import annotations

import gzip
import json
import time
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from services.api.asgi import PlainRoute
from services.api.routes import traces
from services.db.models import Trace
from services.db.session import SessionFactory
from services.ingest.schema import TraceV1
from services.metrics import REGISTRY
from tests.services.api.support import ADMIN, body_of, make_trace, signed_headers


def post(
    client: TestClient,
    loop: dict[str, Any],
    payload: Any,
    *,
    secret: str | None = None,
    headers: dict[str, str] | None = None,
    path_loop: str | None = None,
) -> Any:
    body = body_of(payload)
    all_headers = signed_headers(secret or loop["signing_secret"], body)
    all_headers.update(headers or {})
    return client.post(
        f"/v1/loops/{path_loop or loop['name']}/traces", content=body, headers=all_headers
    )


def stored(session_factory: SessionFactory) -> list[Trace]:
    with session_factory() as session:
        return list(session.scalars(select(Trace).order_by(Trace.id)))


def test_the_webhook_route_is_not_shadowed_by_another_route(client: TestClient) -> None:
    """POST /v1/loops/{loop}/traces must reach the webhook, not a catch-all loop action."""
    response = client.post("/v1/loops/no-such-loop/traces", content=b"{}")
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Webhook-Signature"


def test_the_plain_route_and_the_documented_route_answer_alike(
    client: TestClient, loop: dict[str, Any]
) -> None:
    """The webhook is served by a plain ASGI route; its FastAPI route (which documents it)
    must give the same answers: status, headers and body."""
    app: FastAPI = client.app  # type: ignore[assignment]
    assert isinstance(app.router.routes[0], PlainRoute)
    app.include_router(traces.router, prefix="/documented")  # the APIRoute, in the same app
    secret = loop["signing_secret"]
    cases: list[tuple[bytes, dict[str, str]]] = [
        (body_of(make_trace("same-1")), {}),
        (body_of(make_trace("same-1")), {}),  # a duplicate
        (body_of({"traces": [make_trace("same-2"), {"schema": "nope"}]}), {}),
        (body_of(make_trace(messages=[])), {}),
        (b'{"broken": ', {}),
        (b"", {}),
        (body_of(make_trace()), {"content-type": "text/plain"}),
        (body_of(make_trace()), {"webhook-signature": "v1,AAAA"}),
        (gzip.compress(body_of(make_trace("same-3"))), {"content-encoding": "gzip"}),
    ]
    for body, extra in cases:
        signed = gzip.decompress(body) if extra.get("content-encoding") else body
        headers = {**signed_headers(secret, signed), **extra}
        answers = []
        for prefix in ("", "/documented"):
            url = f"{prefix}/v1/loops/{loop['name']}/traces"
            response = client.post(url, content=body, headers=headers)
            answer = response.json()
            for item in answer.get("results", []):
                item.pop("trace_id", None)  # the first post stored it; the second is a duplicate
                if item["status"] in ("accepted", "duplicate"):
                    item["status"] = "stored"
            for key in ("accepted", "duplicates"):
                answer.pop(key, None)
            headers_seen = {k: v for k, v in response.headers.items() if k != "content-length"}
            answers.append((response.status_code, headers_seen, answer))
        assert answers[0] == answers[1], body[:80]


def test_a_signed_trace_is_stored_with_its_columns(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    trace = make_trace("ep-1")
    response = post(client, loop, trace)

    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["accepted"] == 1 and answer["duplicates"] == 0 and answer["rejected"] == 0
    [item] = answer["results"]
    assert item["status"] == "accepted" and item["external_id"] == "ep-1"
    [row] = stored(session_factory)
    assert row.id == item["trace_id"]
    assert row.source == "webhook"
    assert (row.success, row.score, row.error_kind) == (False, 0.2, "wrong_answer")
    assert row.model_version == "champion-1"
    assert row.started_at is not None and row.started_at.isoformat() == "2026-01-02T03:04:05+00:00"
    assert row.ended_at is not None and row.ended_at.isoformat() == "2026-01-02T03:04:07+00:00"
    assert row.body == TraceV1.model_validate(trace).model_dump(mode="json", by_alias=True)
    assert row.body["messages"][2]["tool_calls"][0]["arguments"] == {"a": 2, "b": 3}
    assert "tool_calls" not in row.body["messages"][0]  # optional keys only when present
    assert row.size_bytes == len(TraceV1.model_validate(trace).model_dump_json().encode())


def test_a_repost_is_a_duplicate_and_never_a_second_row(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    trace = make_trace("ep-dup")
    first = post(client, loop, trace).json()
    assert first["accepted"] == 1
    again = post(client, loop, make_trace("ep-dup", metadata={"changed": True}))

    assert again.status_code == 200
    assert again.json()["results"] == [
        {
            "index": 0,
            "external_id": "ep-dup",
            "status": "duplicate",
            "trace_id": first["results"][0]["trace_id"],  # the trace stored before
            "reason": None,
            "fields": [],
            "warnings": [],
        }
    ]
    [row] = stored(session_factory)
    assert "changed" not in row.body["metadata"]


def test_a_batch_reports_each_item(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    post(client, loop, make_trace("old"))
    batch = {
        "traces": [
            make_trace("new-1"),
            make_trace("old"),
            make_trace("bad", outcome={"success": "maybe"}),
            make_trace("new-2"),
            make_trace("new-2"),
        ]
    }
    response = post(client, loop, batch)

    assert response.status_code == 200, response.text
    answer = response.json()
    assert [(r["index"], r["status"]) for r in answer["results"]] == [
        (0, "accepted"),
        (1, "duplicate"),
        (2, "rejected"),
        (3, "accepted"),
        (4, "duplicate"),
    ]
    assert (answer["accepted"], answer["duplicates"], answer["rejected"]) == (2, 2, 1)
    assert answer["results"][2]["fields"][0]["path"] == "traces.2.outcome.success"
    assert sorted(r.external_id for r in stored(session_factory)) == ["new-1", "new-2", "old"]
    ids = {r.external_id: r.id for r in stored(session_factory)}
    trace_ids = [r["trace_id"] for r in answer["results"]]
    assert trace_ids == [ids["new-1"], ids["old"], None, ids["new-2"], ids["new-2"]]


def test_a_gzip_body_is_accepted_signed_over_the_uncompressed_json(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    body = body_of(make_trace("zipped"))
    headers = signed_headers(loop["signing_secret"], body)
    headers["content-encoding"] = "gzip"
    response = client.post(
        f"/v1/loops/{loop['name']}/traces", content=gzip.compress(body), headers=headers
    )
    assert response.status_code == 200, response.text
    assert [r.external_id for r in stored(session_factory)] == ["zipped"]


def test_any_of_several_signatures_may_match(client: TestClient, loop: dict[str, Any]) -> None:
    body = body_of(make_trace())
    headers = signed_headers(loop["signing_secret"], body)
    headers["webhook-signature"] = (
        "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= v2,abc " + headers["webhook-signature"]
    )
    response = client.post(f"/v1/loops/{loop['name']}/traces", content=body, headers=headers)
    assert response.status_code == 200, response.text


def test_rotation_keeps_the_old_secret_valid_for_the_grace_period(
    client: TestClient, loop: dict[str, Any]
) -> None:
    old = loop["signing_secret"]
    rotated = client.post(
        f"/v1/loops/{loop['name']}/secrets/rotate", json={"grace_seconds": 3600}, headers=ADMIN
    )
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()["secret"]
    assert new.startswith("whsec_") and new != old

    assert post(client, loop, make_trace(), secret=old).status_code == 200
    assert post(client, loop, make_trace(), secret=new).status_code == 200

    client.post(
        f"/v1/loops/{loop['name']}/secrets/rotate", json={"grace_seconds": 0}, headers=ADMIN
    )
    # The first secret was in its grace period: a second rotation ends it at once, and the
    # second one gets no grace either.
    assert post(client, loop, make_trace(), secret=old).status_code == 401
    assert post(client, loop, make_trace(), secret=new).status_code == 401


def test_metrics_count_accepted_duplicate_and_rejected(
    client: TestClient, loop: dict[str, Any]
) -> None:
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    labels = {"loop": loop["name"], "source": "webhook"}
    before = (
        value("ratchet_ingest_traces_accepted_total", **labels),
        value("ratchet_ingest_traces_duplicate_total", **labels),
        value("ratchet_ingest_traces_rejected_total", **labels, reason="unauthorized"),
    )
    post(client, loop, make_trace("m-1"))
    post(client, loop, make_trace("m-1"))
    post(client, loop, make_trace("m-2"), secret="whsec_" + "A" * 43)
    after = (
        value("ratchet_ingest_traces_accepted_total", **labels),
        value("ratchet_ingest_traces_duplicate_total", **labels),
        value("ratchet_ingest_traces_rejected_total", **labels, reason="unauthorized"),
    )
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
    text = client.get("/metrics").text
    assert "ratchet_ingest_commit_duration_seconds_bucket" in text
    assert "ratchet_ingest_queue_depth" in text


# Bad input ----------------------------------------------------------------------------------


def error_of(response: Any) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def test_an_unknown_loop_is_answered_like_a_wrong_secret(
    client: TestClient, loop: dict[str, Any]
) -> None:
    """Loop names cannot be probed: an unknown loop and a bad signature get the same 401."""
    body = body_of(make_trace())
    wrong_secret = signed_headers("whsec_" + "B" * 43, body)
    known = client.post(f"/v1/loops/{loop['name']}/traces", content=body, headers=wrong_secret)
    assert known.status_code == 401
    for name in ("no-such-loop", "Not_A_Valid_Name", "x" * 300):
        headers = signed_headers(loop["signing_secret"], body)
        response = client.post(f"/v1/loops/{name}/traces", content=body, headers=headers)
        assert response.status_code == 401, name
        assert response.json() == known.json()
        assert response.headers["www-authenticate"] == known.headers["www-authenticate"]


def test_missing_signature_headers_are_401_before_the_body_is_read(
    client: TestClient, loop: dict[str, Any]
) -> None:
    url = f"/v1/loops/{loop['name']}/traces"
    for missing in ("webhook-id", "webhook-timestamp", "webhook-signature"):
        headers = signed_headers(loop["signing_secret"], b"{}")
        del headers[missing]
        response = client.post(url, content=b"not json at all", headers=headers)
        assert response.status_code == 401, missing
        assert "missing signature headers" in error_of(response)["message"]
    # Not even the size is looked at: an oversized unsigned body is still a plain 401.
    huge = b"x" * (client.app.state.ratchet.settings.ingest_max_body_bytes + 10)  # type: ignore[attr-defined]
    response = client.post(url, content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 401


def test_a_wrong_signature_is_401_and_the_body_is_not_parsed(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    url = f"/v1/loops/{loop['name']}/traces"
    body = b'{"this is": not json'
    headers = signed_headers("whsec_" + "B" * 43, body)
    response = client.post(url, content=body, headers=headers)
    assert response.status_code == 401  # not 400: invalid JSON is never looked at
    assert response.headers["www-authenticate"] == "Webhook-Signature"

    # A body changed after signing fails too.
    signed = signed_headers(loop["signing_secret"], body_of(make_trace("a")))
    response = client.post(url, content=body_of(make_trace("b")), headers=signed)
    assert response.status_code == 401
    headers = signed_headers(loop["signing_secret"], b"{}")
    headers["webhook-signature"] = "v1,not-base64!!"
    assert client.post(url, content=b"{}", headers=headers).status_code == 401
    assert stored(session_factory) == []


def test_a_stale_or_future_timestamp_is_401(client: TestClient, loop: dict[str, Any]) -> None:
    url = f"/v1/loops/{loop['name']}/traces"
    body = body_of(make_trace())
    for skew in (-301, 301):
        headers = signed_headers(loop["signing_secret"], body, timestamp=int(time.time()) + skew)
        response = client.post(url, content=body, headers=headers)
        assert response.status_code == 401, skew
        assert "webhook-timestamp" in error_of(response)["message"]
    headers = signed_headers(loop["signing_secret"], body)
    headers["webhook-timestamp"] = "yesterday"
    assert client.post(url, content=body, headers=headers).status_code == 401


def test_wrong_content_type_is_415(client: TestClient, loop: dict[str, Any]) -> None:
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/json; charset=latin-1",
    ):
        response = post(client, loop, make_trace(), headers={"content-type": content_type})
        assert response.status_code == 415, content_type
    response = post(client, loop, make_trace(), headers={"content-encoding": "br"})
    assert response.status_code == 415
    ok = post(
        client, loop, make_trace(), headers={"content-type": "application/json; charset=UTF-8"}
    )
    assert ok.status_code == 200


def test_no_body_is_400(client: TestClient, loop: dict[str, Any]) -> None:
    response = post(client, loop, b"")
    assert response.status_code == 400
    assert error_of(response)["code"] == "empty_body"


def test_invalid_json_is_400_saying_where(client: TestClient, loop: dict[str, Any]) -> None:
    response = post(client, loop, b'{"schema": "ratchet.trace/v1",\n  "external_id": }')
    assert response.status_code == 400
    message = error_of(response)["message"]
    assert "line 2 column 18" in message, message


def test_non_utf8_is_400(client: TestClient, loop: dict[str, Any]) -> None:
    response = post(client, loop, b'{"schema": "ratchet.trace/v1", "external_id": "\xff\xfe"}')
    assert response.status_code == 400
    assert "UTF-8" in error_of(response)["message"]


def test_schema_violations_are_422_listing_each_field(
    client: TestClient, loop: dict[str, Any]
) -> None:
    trace = make_trace(
        messages=[{"role": "robot", "content": 5}],
        outcome={"success": "perhaps", "score": "high"},
        colour="blue",
    )
    del trace["external_id"]
    response = post(client, loop, trace)

    assert response.status_code == 422
    paths = {field["path"] for field in error_of(response)["fields"]}
    assert paths == {
        "external_id",
        "messages.0.role",
        "messages.0.content",
        "outcome.success",
        "outcome.score",
        "colour",
    }
    assert post(client, loop, [make_trace()]).status_code == 422  # an array is not a trace
    wrong_version = post(client, loop, make_trace(schema="ratchet.trace/v0"))
    assert [f["path"] for f in error_of(wrong_version)["fields"]] == ["schema"]


def test_a_batch_with_no_valid_trace_is_422(client: TestClient, loop: dict[str, Any]) -> None:
    response = post(client, loop, {"traces": [{"schema": "x"}, make_trace(messages=[])]})
    assert response.status_code == 422
    paths = {field["path"] for field in error_of(response)["fields"]}
    assert {"traces.0.schema", "traces.0.external_id", "traces.1.messages"} <= paths
    assert post(client, loop, {"traces": []}).status_code == 422
    assert post(client, loop, {"traces": {"a": 1}}).status_code == 422


def test_a_batch_over_the_item_limit_is_413(client: TestClient, loop: dict[str, Any]) -> None:
    limit = client.app.state.ratchet.settings.ingest_max_batch  # type: ignore[attr-defined]
    response = post(client, loop, {"traces": [make_trace(f"t{i}") for i in range(limit + 1)]})
    assert response.status_code == 413
    assert error_of(response)["code"] == "batch_too_large"


def test_a_body_over_the_limit_is_413(client: TestClient, loop: dict[str, Any]) -> None:
    limit = client.app.state.ratchet.settings.ingest_max_body_bytes  # type: ignore[attr-defined]
    trace = make_trace(reference_answer="y" * limit)
    assert post(client, loop, trace).status_code == 413

    # Without a Content-Length (chunked), the limit is enforced while streaming.
    body = body_of(trace)
    headers = signed_headers(loop["signing_secret"], body)
    chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
    response = client.post(f"/v1/loops/{loop['name']}/traces", content=chunks, headers=headers)
    assert response.status_code == 413


def test_a_gzip_bomb_is_413(client: TestClient, loop: dict[str, Any]) -> None:
    limit = client.app.state.ratchet.settings.ingest_max_body_bytes  # type: ignore[attr-defined]
    inflated = b'{"metadata": "' + b"0" * (limit * 4) + b'"}'
    bomb = gzip.compress(inflated, compresslevel=9)
    assert len(bomb) < limit // 100
    headers = signed_headers(loop["signing_secret"], inflated)
    headers["content-encoding"] = "gzip"
    response = client.post(f"/v1/loops/{loop['name']}/traces", content=bomb, headers=headers)
    assert response.status_code == 413
    assert "after decompression" in error_of(response)["message"]
    truncated = gzip.compress(body_of(make_trace()))[:-12]
    corrupt = client.post(f"/v1/loops/{loop['name']}/traces", content=truncated, headers=headers)
    assert corrupt.status_code == 400
    assert error_of(corrupt)["code"] == "invalid_gzip"


def test_deeply_nested_json_is_refused(client: TestClient, loop: dict[str, Any]) -> None:
    # Beyond the parser's recursion limit: a 400 before any Python recursion.
    deep = b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = post(client, loop, deep)
    assert response.status_code == 400
    assert "nested too deeply" in error_of(response)["message"]
    # Within the parser's limit but deeper than free-form objects may nest: a 422 naming it.
    nested: Any = "leaf"
    for _ in range(40):
        nested = {"k": nested}
    response = post(client, loop, make_trace(metadata=nested))
    assert response.status_code == 422
    assert error_of(response)["fields"][0]["path"] == "metadata"


def test_huge_strings(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    # Indexed columns are bounded ...
    response = post(client, loop, make_trace("e" * 10_000))
    assert response.status_code == 422
    assert error_of(response)["fields"][0]["path"] == "external_id"
    response = post(client, loop, make_trace(model_version="m" * 1_000))
    assert error_of(response)["fields"][0]["path"] == "model_version"
    # ... message content is bounded only by the body limit,
    big = "z" * 1_000_000
    trace = make_trace("big", messages=[{"role": "user", "content": big}])
    assert post(client, loop, trace).status_code == 200
    [row] = stored(session_factory)
    assert row.body["messages"][0]["content"] == big
    # ... and NUL, which Postgres cannot store, is refused with its path.
    response = post(client, loop, make_trace(metadata={"note": "a\u0000b"}))
    assert response.status_code == 422
    assert error_of(response)["fields"][0]["path"] == "metadata.note"
    escaped_backslash = json.dumps(make_trace("bs", metadata={"note": "\\u0000 is fine"}))
    assert post(client, loop, escaped_backslash.encode()).status_code == 200


def test_the_openapi_publishes_the_trace_schema(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    operation = spec["paths"]["/v1/loops/{loop}/traces"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    trace, batch = schema["anyOf"]
    assert "messages" in trace["properties"] and trace["additionalProperties"] is False
    assert batch["properties"]["traces"]["items"]["properties"]["schema"]["const"] == (
        "ratchet.trace/v1"
    )
    assert {p["name"] for p in operation["parameters"]} >= {"webhook-id", "webhook-signature"}
    assert "/otlp/v1/traces" in spec["paths"] and "/v1/otlp/v1/traces" in spec["paths"]
