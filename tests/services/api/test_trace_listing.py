"""Every rejection explained: the traces listing, one trace, and the loop's curation counts."""

from __future__ import annotations

import base64
import datetime as dt
import json
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select, update

from services.db.models import Task, TaskSource, Trace
from services.db.queries.traces import Verdict, mark_traces_curated
from services.db.session import SessionFactory
from services.environments.base import TaskSpec
from services.environments.replay import ReplayEnvironment
from tests.services.api.support import ADMIN, body_of, make_trace, signed_headers
from tests.services.environments.replay_traces import failing_trace

# external id -> (success, curation verdict or None for pending)
TRACES: dict[str, tuple[bool | None, tuple[str, str] | None]] = {
    "t-task": (False, ("task", "task 1 (train)")),
    "t-dup": (False, ("duplicate", "exact duplicate of task 1")),
    "t-rej-1": (False, ("rejected", "unknown_api_version: tool list ['lookup'] matches none")),
    "t-rej-2": (False, ("rejected", "unknown_api_version: tool list ['search'] matches none")),
    "t-rej-3": (False, ("rejected", "too_large: 2 MB over the limit")),
    "t-skip": (None, ("skipped", "no outcome reported")),
    "t-ok": (True, ("skipped", "success outside the regression sample")),
    "t-pending": (False, None),
}


def seed(client: TestClient, loop: dict[str, Any], session_factory: SessionFactory) -> None:
    """The traces above, posted through the webhook (in this order) and given verdicts."""
    for external_id, (success, _) in TRACES.items():
        outcome: dict[str, Any] = {"success": success}
        if success is None:
            outcome = {}
        trace = make_trace(external_id, outcome=outcome)
        body = body_of(trace)
        response = client.post(
            f"/v1/loops/{loop['name']}/traces",
            content=body,
            headers=signed_headers(loop["signing_secret"], body),
        )
        assert response.status_code == 200 and response.json()["accepted"] == 1, response.text
    with session_factory.begin() as session:
        ids = dict(session.execute(select(Trace.external_id, Trace.id)).all())
        task = Task(
            loop_id=session.scalars(select(Trace.loop_id)).first(),
            content_hash="k" * 64,
            environment="toolcalc",
            spec={},
            cluster_id="c1",
            split="train",
        )
        session.add(task)
        session.flush()
        session.add(TaskSource(task_id=task.id, trace_id=ids["t-task"], relation="origin"))
        session.add(TaskSource(task_id=task.id, trace_id=ids["t-dup"], relation="duplicate"))
        mark_traces_curated(
            session=session,
            verdicts=[
                Verdict(ids[name], verdict[0], verdict[1])
                for name, (_, verdict) in TRACES.items()
                if verdict is not None
            ],
        )


def listing(client: TestClient, loop: dict[str, Any], **params: Any) -> Any:
    return client.get(f"/v1/loops/{loop['name']}/traces", params=params, headers=ADMIN)


def test_the_listing_pages_newest_first_without_gaps_or_repeats(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    seed(client, loop, session_factory)
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 3}
        if cursor:
            params["cursor"] = cursor
        response = listing(client, loop, **params)
        assert response.status_code == 200, response.text
        page = response.json()
        assert len(page["traces"]) <= 3
        seen += [t["external_id"] for t in page["traces"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(TRACES))
    assert pages == 3


def test_traces_received_together_page_by_id(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    """A batch is one transaction, so its traces share received_at: pages still split them
    without a gap or a repeat."""
    names = [f"batch-{i}" for i in range(5)]
    body = body_of({"traces": [make_trace(name) for name in names]})
    response = client.post(
        f"/v1/loops/{loop['name']}/traces",
        content=body,
        headers=signed_headers(loop["signing_secret"], body),
    )
    assert response.json()["accepted"] == 5
    with session_factory() as session:
        assert len(set(session.scalars(select(Trace.received_at)))) == 1
    seen: list[str] = []
    params: dict[str, Any] = {"limit": 2}
    while True:
        page = listing(client, loop, **params).json()
        seen += [t["external_id"] for t in page["traces"]]
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert seen == list(reversed(names))


def test_the_listing_filters_by_outcome_curation_reason_and_time(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    seed(client, loop, session_factory)

    def ids(**params: Any) -> set[str]:
        response = listing(client, loop, **params)
        assert response.status_code == 200, response.text
        return {t["external_id"] for t in response.json()["traces"]}

    assert ids(curation="rejected") == {"t-rej-1", "t-rej-2", "t-rej-3"}
    assert ids(curation="rejected", reason="unknown_api_version") == {"t-rej-1", "t-rej-2"}
    assert ids(reason="no outcome reported") == {"t-skip"}
    assert ids(curation="pending") == {"t-pending"}
    assert ids(outcome="success") == {"t-ok"}
    assert ids(outcome="unknown") == {"t-skip"}
    assert len(ids(outcome="failure")) == 6
    with session_factory.begin() as session:
        session.execute(
            update(Trace)
            .where(Trace.external_id == "t-task")
            .values(received_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
        )
    assert ids(until="2026-06-01T00:00:00Z") == {"t-task"}
    assert "t-task" not in ids(since="2026-06-01T00:00:00Z")

    [rejected] = listing(client, loop, reason="too_large").json()["traces"]
    assert rejected["curation_outcome"] == "rejected" and rejected["reason"] == "too_large"
    assert rejected["curation_detail"] == "too_large: 2 MB over the limit"
    assert rejected["outcome"] == "failure"


def test_bad_listing_parameters_name_the_field(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    seed(client, loop, session_factory)

    def forged(document: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(document).encode()).decode()

    for cursor in (
        "garbage",
        "%%%",
        forged({}),
        forged({"v": 1}),
        forged({"v": 2, "at": "2026-01-01T00:00:00+00:00", "id": 5}),
        forged({"v": 1, "at": "2026-01-01T00:00:00", "id": 5}),  # no time zone
        forged({"v": 1, "at": "yesterday", "id": 5}),
        forged({"v": 1, "at": "2026-01-01T00:00:00+00:00", "id": "5"}),
        forged({"v": 1, "at": "2026-01-01T00:00:00+00:00", "id": True}),
        forged([1, 2]),
    ):
        response = listing(client, loop, cursor=cursor)
        assert response.status_code == 400, (cursor, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_cursor"
        assert error["fields"][0]["path"] == "cursor"
    for params, path in (
        ({"curation": "maybe"}, "curation"),
        ({"outcome": "meh"}, "outcome"),
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-01-01T00:00:00"}, "since"),
        ({"limit": 0}, "limit"),
        ({"limit": 501}, "limit"),
    ):
        response = listing(client, loop, **params)
        assert response.status_code == 422, (params, response.text)
        assert [f["path"] for f in response.json()["error"]["fields"]] == [path]
    assert listing(client, {"name": "no-such-loop"}).status_code == 404
    assert client.get(f"/v1/loops/{loop['name']}/traces").status_code == 401


def test_one_trace_shows_its_verdict_task_and_feedback(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    seed(client, loop, session_factory)
    response = client.get(f"/v1/loops/{loop['name']}/traces/t-task", headers=ADMIN)
    assert response.status_code == 200, response.text
    shown = response.json()
    assert shown["curation_outcome"] == "task" and shown["reason"] is None
    [task] = shown["tasks"]
    assert task["relation"] == "origin" and task["split"] == "train"
    assert shown["body"]["external_id"] == "t-task"
    assert shown["feedback"] == []

    duplicate = client.get(f"/v1/loops/{loop['name']}/traces/t-dup", headers=ADMIN).json()
    assert [t["relation"] for t in duplicate["tasks"]] == ["duplicate"]
    assert duplicate["tasks"][0]["task_id"] == task["task_id"]

    missing = client.get(f"/v1/loops/{loop['name']}/traces/nope", headers=ADMIN)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "trace_not_found"


def test_the_loop_counts_traces_by_curation_outcome_and_reason(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    seed(client, loop, session_factory)
    shown = client.get(f"/v1/loops/{loop['name']}", headers=ADMIN).json()
    counts = {
        (c["outcome"], c["reason"]): (c["count"], c["example_external_id"])
        for c in shown["curation"]
    }
    assert counts == {
        ("pending", None): (1, "t-pending"),
        ("task", None): (1, "t-task"),
        ("duplicate", None): (1, "t-dup"),
        ("rejected", "unknown_api_version"): (2, "t-rej-2"),
        ("rejected", "too_large"): (1, "t-rej-3"),
        ("skipped", "no outcome reported"): (1, "t-skip"),
        ("skipped", "success outside the regression sample"): (1, "t-ok"),
    }
    assert [c["outcome"] for c in shown["curation"]][:3] == ["pending", "task", "duplicate"]


FLIGHT = "Your connection LX318 leaves 14:05 from gate D4; it is a 11 minute walk."


def _link_replay_task(session_factory: SessionFactory, external_id: str) -> int:
    """A replay task of the facts rule, made from a trace by the environment, as curation
    would store it, with ``external_id``'s trace as its origin."""
    task = ReplayEnvironment().task_from_trace(failing_trace(reference_answer=FLIGHT, metadata={}))
    assert isinstance(task, TaskSpec)
    with session_factory.begin() as session:
        trace = session.scalars(select(Trace).where(Trace.external_id == external_id)).one()
        row = Task(
            loop_id=trace.loop_id,
            content_hash="f" * 64,
            environment="replay",
            spec=task.to_dict(),
            cluster_id="c2",
            split="train",
        )
        session.add(row)
        session.flush()
        session.add(TaskSource(task_id=row.id, trace_id=trace.id, relation="origin"))
        return row.id


def test_the_listing_shows_the_facts_a_traces_task_checks(
    client: TestClient, loop: dict[str, Any], session_factory: SessionFactory
) -> None:
    seed(client, loop, session_factory)
    task_id = _link_replay_task(session_factory, "t-pending")
    expected = {
        "rule": "facts",
        "facts": [
            {"kind": "code", "value": "LX318", "text": "LX318"},
            {"kind": "time", "value": "14:05", "text": "14:05"},
            {"kind": "code", "value": "D4", "text": "D4"},
            {"kind": "number", "value": "11 minute", "text": "11 minute"},
        ],
        "judge": None,
    }
    page = listing(client, loop).json()
    checks = {t["external_id"]: t["check"] for t in page["traces"]}
    assert checks["t-pending"] == expected
    assert checks["t-task"] is None and checks["t-rej-1"] is None  # toolcalc; no task
    shown = client.get(f"/v1/loops/{loop['name']}/traces/t-pending", headers=ADMIN).json()
    assert shown["check"] == expected
    task = client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()
    assert task["check"] == expected
