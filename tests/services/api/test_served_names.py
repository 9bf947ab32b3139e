"""Two loops never deploy under one served model name on one server (issue 43, item 8).

On main a second loop with the same serving target (the defaults, for one) was accepted,
and each deploy moved the other loop's model name to its own checkpoint. Now the api
refuses the collision (409 naming the other loop) and many loops on one endpoint, each
under its own name, stay allowed. The worker refuses such a deploy too (a loop saved before
the check): tests/workflows/test_served_names.py.
"""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import update

from services.db.models import Loop
from services.db.session import SessionFactory
from tests.services.api.support import ADMIN, create_loop


def post_loop(client: TestClient, name: str, **fields: Any) -> Any:
    return client.post(
        "/v1/loops", json={"name": name, "environment": "toolcalc", **fields}, headers=ADMIN
    )


def test_a_second_loop_under_the_same_name_on_the_same_server_is_refused(
    client: TestClient,
) -> None:
    create_loop(client, "first")  # the defaults: the local model server, model "ratchet"

    second = post_loop(client, "second")

    assert second.status_code == 409, second.text
    error = second.json()["error"]
    assert error["code"] == "served_name_taken"
    assert (
        "loop 'first' already serves under the model name 'ratchet' on local" in (error["message"])
    )
    assert error["fields"] == [
        {"path": "serving_target.model", "message": "loop 'first' serves it"}
    ]
    assert client.get("/v1/loops/second", headers=ADMIN).status_code == 404


def test_many_loops_share_an_endpoint_each_under_its_own_name(client: TestClient) -> None:
    for name in ("alpha", "beta"):
        create_loop(
            client, name, serving_target={"kind": "openai", "endpoint": "vllm", "model": name}
        )
    # The same name on another server is another model.
    create_loop(client, "gamma", serving_target={"kind": "local", "model": "alpha"})
    taken = post_loop(
        client, "delta", serving_target={"kind": "openai", "endpoint": "vllm", "model": "beta"}
    )
    assert taken.status_code == 409
    assert "on endpoint vllm" in taken.json()["error"]["message"]


def test_a_change_that_would_take_another_loops_name_is_refused(client: TestClient) -> None:
    create_loop(client, "one", serving_target={"model": "one"})
    create_loop(client, "two", serving_target={"model": "two"})

    response = client.patch(
        "/v1/loops/two", json={"serving_target": {"model": "one"}}, headers=ADMIN
    )

    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "served_name_taken"
    shown = client.get("/v1/loops/two", headers=ADMIN).json()
    assert shown["serving_target"]["model"] == "two"


def test_an_archived_loop_gives_its_name_back(
    client: TestClient, session_factory: SessionFactory
) -> None:
    create_loop(client, "old")
    with session_factory.begin() as session:
        session.execute(update(Loop).where(Loop.name == "old").values(status="archived"))
    assert post_loop(client, "new").status_code == 201
