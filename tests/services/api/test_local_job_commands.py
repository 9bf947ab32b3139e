"""A loop's own job command on the local executor needs the deployment's consent
(RATCHET_LOCAL_JOB_COMMANDS_ENABLED): it runs as the worker's user on the worker's machine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.api.state import AppState
from services.settings import Settings
from tests.services.api.support import ADMIN

OWN_TRAINER = {"train_job": {"command": ["python", "/opt/trainer/train.py"]}}


def _create(client: TestClient, name: str, **body: Any) -> Any:
    return client.post(
        "/v1/loops", json={"name": name, "environment": "toolcalc", **body}, headers=ADMIN
    )


def test_a_loop_command_on_the_local_executor_is_refused_by_default(client: TestClient) -> None:
    response = _create(client, "own", executor="local", training_profile=OWN_TRAINER)
    assert response.status_code == 422, response.text
    (field,) = response.json()["error"]["fields"]
    assert field["path"] == "training_profile.train_job.command"
    assert "RATCHET_LOCAL_JOB_COMMANDS_ENABLED" in field["message"]
    assert "local_job_commands_enabled" in field["message"]


def test_the_eval_command_too_and_a_change_to_the_local_executor(client: TestClient) -> None:
    response = _create(
        client,
        "own-eval",
        executor="local",
        training_profile={"eval_job": {"command": ["/opt/eval"]}},
    )
    assert response.status_code == 422
    assert response.json()["error"]["fields"][0]["path"] == "training_profile.eval_job.command"
    # Allowed on the kubernetes executor; moving the loop to the local one is refused.
    created = _create(client, "own-k8s", executor="kubernetes", training_profile=OWN_TRAINER)
    assert created.status_code == 201, created.text
    moved = client.patch("/v1/loops/own-k8s", json={"executor": "local"}, headers=ADMIN)
    assert moved.status_code == 422
    assert moved.json()["error"]["fields"][0]["path"] == "training_profile.train_job.command"
    added = client.patch(
        "/v1/loops/own-k8s",
        json={"executor": "kubernetes", "training_profile": {"eval_job": {"command": ["/e"]}}},
        headers=ADMIN,
    )
    assert added.status_code == 200, added.text


@pytest.fixture
def enabled_client(settings: Settings, app_state: AppState) -> Iterator[TestClient]:
    enabled = settings.model_copy(update={"local_job_commands_enabled": True})
    state = AppState(
        settings=enabled,
        engine=app_state.engine,
        session_factory=app_state.session_factory,
        temporal=app_state.temporal,
    )
    with TestClient(create_app(enabled, state=state)) as test_client:
        yield test_client


def test_enabled_it_is_accepted_and_an_ignored_image_is_said(enabled_client: TestClient) -> None:
    profile = {"train_job": {"image": "ghcr.io/acme/trainer:1", "command": ["python", "t.py"]}}
    response = _create(enabled_client, "own-ok", executor="local", training_profile=profile)
    assert response.status_code == 201, response.text
    (warning,) = response.json()["warnings"]
    assert "training_profile.train_job.image" in warning and "ignores" in warning
    changed = enabled_client.patch(
        "/v1/loops/own-ok",
        json={"training_profile": {"eval_job": {"image": "e:1"}}},
        headers=ADMIN,
    )
    assert changed.status_code == 200, changed.text
    assert len(changed.json()["warnings"]) == 2
