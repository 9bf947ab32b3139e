"""The admin API's tasks and datasets: listings paged by cursor, one by its id, pinning all
or none, and every bad input a 4xx naming its field."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from services.artifacts import ArtifactStore
from services.curation.snapshot import snapshot
from services.db.models import Demonstration, Task
from services.db.queries.runs import NewRun, upsert_run
from services.db.session import SessionFactory
from tests.services.api.support import ADMIN
from tests.services.curation.support import add_traces, curate_all, make_loop, trace_body
from tests.services.curation.test_snapshot import questions

LOOP = "routes-loop"


@pytest.fixture
def dataset_id(session_factory: SessionFactory, tmp_path: Path) -> int:
    """A loop with four curated tasks (one standing for two traces) and one snapshot."""
    loop_id = make_loop(session_factory, name=LOOP, curation_policy={"heldout_fraction": 0.0})
    texts = questions(4, seed=3)
    bodies = [trace_body(f"t{i}", text, answer=str(i)) for i, text in enumerate(texts)]
    add_traces(session_factory, loop_id, [*bodies, trace_body("dup", texts[0], answer="0")])
    curate_all(session_factory, loop_id)
    return snapshot(session_factory, ArtifactStore(tmp_path / "a"), loop_name=LOOP).dataset_id


def get(client: TestClient, path: str, **params: Any) -> Any:
    return client.get(path, params=params, headers=ADMIN)


def test_tasks_page_newest_first_without_gaps_or_repeats(
    client: TestClient, dataset_id: int
) -> None:
    seen: list[int] = []
    params: dict[str, Any] = {"limit": 3}
    while True:
        response = get(client, f"/v1/loops/{LOOP}/tasks", **params)
        assert response.status_code == 200, response.text
        page = response.json()
        seen += [task["id"] for task in page["tasks"]]
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert len(seen) == 4 and seen == sorted(seen, reverse=True)
    train = get(client, f"/v1/loops/{LOOP}/tasks", split="train").json()["tasks"]
    assert train and {task["split"] for task in train} == {"train"}


def test_one_task_shows_its_loop_spec_and_sources(client: TestClient, dataset_id: int) -> None:
    tasks = get(client, f"/v1/loops/{LOOP}/tasks").json()["tasks"]
    (heavy,) = [task for task in tasks if task["weight"] == 2]
    detail = get(client, f"/v1/tasks/{heavy['id']}").json()
    assert detail["loop"] == LOOP and detail["prompt"] == detail["spec"]["prompt"]
    assert sorted(s["relation"] for s in detail["sources"]) == ["duplicate", "origin"]


def test_a_tasks_demonstrations_are_the_admins_to_read(
    client: TestClient, dataset_id: int, session_factory: SessionFactory
) -> None:
    """What the dashboard's task page fetches with the token: its pages carry neither the
    prompt nor the episodes (issue 43)."""
    task_id = get(client, f"/v1/loops/{LOOP}/tasks").json()["tasks"][0]["id"]
    with session_factory.begin() as session:
        task = session.get_one(Task, task_id)
        run = NewRun(run_id="r1", loop_id=task.loop_id, kind="probe", executor="local", spec={})
        upsert_run(session=session, run=run)
        session.add(
            Demonstration(
                loop_id=task.loop_id,
                task_id=task.id,
                task_hash="h",
                run_id="r1",
                sample=0,
                source="probe",
                checkpoint_id=None,
                family="tiny",
                passed=True,
                reward=1.0,
                text="the answer",
                tokens=2,
                sequences=[[[1, 2], [False, True]]],
            )
        )
    shown = get(client, f"/v1/tasks/{task_id}/demonstrations")
    assert shown.status_code == 200, shown.text
    assert [(d["text"], d["passed"], d["source"]) for d in shown.json()] == [
        ("the answer", True, "probe")
    ]
    assert client.get(f"/v1/tasks/{task_id}/demonstrations").status_code == 401
    assert get(client, "/v1/tasks/999999/demonstrations").status_code == 404


def test_datasets_list_and_show(client: TestClient, dataset_id: int) -> None:
    page = get(client, f"/v1/loops/{LOOP}/datasets").json()
    assert [d["id"] for d in page["datasets"]] == [dataset_id] and page["next_cursor"] is None
    shown = get(client, f"/v1/datasets/{dataset_id}").json()
    assert shown["loop"] == LOOP and shown["source_traces"] == 5
    assert shown["train_count"] + shown["eval_count"] == 4


def test_pinning_is_all_or_none(
    client: TestClient, dataset_id: int, session_factory: SessionFactory
) -> None:
    ids = [task["id"] for task in get(client, f"/v1/loops/{LOOP}/tasks").json()["tasks"]]
    with session_factory.begin() as session:
        session.execute(update(Task).where(Task.id == ids[0]).values(split="heldout"))
    refused = client.post(
        f"/v1/loops/{LOOP}/tasks/pin", json={"task_ids": [ids[1], ids[0]]}, headers=ADMIN
    )
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["code"] == "tasks_not_pinnable" and "nothing was pinned" in error["message"]
    assert [f["path"] for f in error["fields"]] == ["task_ids.1"]
    with session_factory() as session:
        assert not session.scalar(select(Task.pinned).where(Task.id == ids[1]))
    pinned = client.post(f"/v1/loops/{LOOP}/tasks/pin", json={"task_ids": [ids[1]]}, headers=ADMIN)
    assert pinned.status_code == 200 and pinned.json() == {"loop": LOOP, "pinned": [ids[1]]}


def forged(document: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(document).encode()).decode()


@pytest.mark.parametrize("resource", ["tasks", "datasets"])
def test_bad_inputs_name_the_field(client: TestClient, dataset_id: int, resource: str) -> None:
    listing = f"/v1/loops/{LOOP}/{resource}"
    for cursor in ("garbage", forged({"v": 1}), forged({"v": 1, "before": "5"}), forged([1])):
        response = get(client, listing, cursor=cursor)
        assert response.status_code == 400, (cursor, response.text)
        assert response.json()["error"]["fields"] == [
            {"path": "cursor", "message": "not a cursor from this API"}
        ]
    for params, path in (({"limit": 0}, "limit"), ({"limit": 501}, "limit")):
        response = get(client, listing, **params)
        assert response.status_code == 422
        assert [f["path"] for f in response.json()["error"]["fields"]] == [path]
    assert get(client, f"/v1/loops/no-such-loop/{resource}").json()["error"]["code"] == (
        "loop_not_found"
    )
    one = f"/v1/{resource}"
    missing = get(client, f"{one}/999999")
    assert missing.status_code == 404 and missing.json()["error"]["code"].endswith("_not_found")
    for bad in ("0", "x", str(2**63)):
        response = get(client, f"{one}/{bad}")
        assert response.status_code == 422, bad
        assert [f["path"] for f in response.json()["error"]["fields"]] == [
            "task_id" if resource == "tasks" else "dataset_id"
        ]
    assert client.get(listing).status_code == 401
    assert client.get(f"{one}/1").status_code == 401


def test_bad_pin_bodies_name_the_field(client: TestClient, dataset_id: int) -> None:
    path = f"/v1/loops/{LOOP}/tasks/pin"
    for body, field in (
        ({"task_ids": []}, "task_ids"),
        ({"task_ids": ["one"]}, "task_ids.0"),
        ({}, "task_ids"),
        ({"task_ids": [1], "extra": True}, "extra"),
    ):
        response = client.post(path, json=body, headers=ADMIN)
        assert response.status_code == 422, body
        assert [f["path"] for f in response.json()["error"]["fields"]] == [field], body
    assert client.post(path, json={"task_ids": [1]}).status_code == 401
    missing = client.post("/v1/loops/no-such-loop/tasks/pin", json={"task_ids": [1]}, headers=ADMIN)
    assert missing.status_code == 404


def test_the_routes_are_in_the_openapi(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/v1/loops/{loop}/tasks",
        "/v1/loops/{loop}/tasks/pin",
        "/v1/tasks/{task_id}",
        "/v1/tasks/{task_id}/demonstrations",
        "/v1/loops/{loop}/datasets",
        "/v1/datasets/{dataset_id}",
    ):
        assert path in paths, path
    schema = paths["/v1/tasks/{task_id}"]["get"]["responses"]["200"]["content"]
    assert schema["application/json"]["schema"]["$ref"].endswith("/TaskDetail")
