"""The loop admin API: create (secrets shown once), list, show, rotate; validation; auth."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from services.api.app import create_app
from services.api.state import AppState
from services.db.models import Credential, Loop
from services.db.session import SessionFactory
from services.ingest.credentials import hash_token
from services.loop.policies import TrainingProfile, TriggerPolicy
from services.secrets import SecretBox
from services.settings import Settings
from tests.services.api.support import ADMIN, SECRET_KEY, create_loop


def test_create_returns_the_credentials_once(
    client: TestClient, session_factory: SessionFactory
) -> None:
    created = create_loop(
        client,
        "checkout-bot",
        executor="kubernetes",
        budget_usd=125.5,
        trigger_policy={"min_new_tasks": 20, "drift_enabled": True},
        gate_policy={"mode": "manual", "confidence": 0.95},
        serving_target={"kind": "openai", "endpoint": "vllm", "model": "agent"},
        training_profile={"hyperparameters": {"lr": 0.0003}},
    )
    assert created["name"] == "checkout-bot"
    assert created["signing_secret"].startswith("whsec_")
    assert created["ingest_token"].startswith("rit_")
    assert created["webhook_url"].endswith("/v1/loops/checkout-bot/traces")
    assert created["otlp_traces_url"].endswith("/otlp/v1/traces")
    # The policies as the loop runs them: what the caller set, the code's defaults beside.
    assert created["trigger_policy"] == TriggerPolicy(min_new_tasks=20).model_dump(mode="json")
    assert created["training_profile"]["hyperparameters"] == {"lr": 0.0003}
    assert created["training_profile"]["algorithm"] == TrainingProfile().algorithm
    assert created["budget_usd"] == 125.5
    with session_factory() as session:
        loop = session.scalars(select(Loop)).one()
        assert (loop.executor, loop.gate_policy["mode"]) == ("kubernetes", "manual")
        # Only what the caller set is stored: defaults stay the code's.
        assert loop.training_profile == {"hyperparameters": {"lr": 0.0003}}
        kinds = {c.kind: c for c in session.scalars(select(Credential))}
        # The signing secret is stored encrypted (services.secrets), never in clear.
        stored = kinds["signing_secret"].secret
        assert stored is not None and created["signing_secret"] not in stored
        assert SecretBox.from_keys(SECRET_KEY).decrypt(stored) == created["signing_secret"]
        # The ingest token is stored as its digest only.
        assert kinds["ingest_token"].secret is None
        assert kinds["ingest_token"].token_sha256 == hash_token(created["ingest_token"])
        # So is the capture gateway's key.
        assert created["gateway_key"].startswith("rgk_")
        assert kinds["gateway_key"].token_sha256 == hash_token(created["gateway_key"])
        assert kinds["gateway_key"].secret is None

    shown = client.get("/v1/loops/checkout-bot", headers=ADMIN).json()
    assert "signing_secret" not in shown and "ingest_token" not in shown
    assert "gateway_key" not in shown
    assert shown["trace_count"] == 0
    assert sorted(c["kind"] for c in shown["credentials"]) == [
        "gateway_key",
        "ingest_token",
        "signing_secret",
    ]
    listed = client.get("/v1/loops", headers=ADMIN).json()
    assert [loop["name"] for loop in listed] == ["checkout-bot"]


def test_unknown_policy_keys_are_refused(client: TestClient) -> None:
    """A typo in a policy must not silently become the default."""
    response = client.post(
        "/v1/loops",
        json={
            "name": "typo",
            "environment": "toolcalc",
            "trigger_policy": {"min_new_task": 3},
            "gate_policy": {"confidense": 0.9},
        },
        headers=ADMIN,
    )
    assert response.status_code == 422
    paths = {field["path"] for field in response.json()["error"]["fields"]}
    assert paths == {"trigger_policy.min_new_task", "gate_policy.confidense"}


def test_unknown_environment_and_curation_policy(client: TestClient) -> None:
    response = client.post(
        "/v1/loops", json={"name": "nowhere", "environment": "chess"}, headers=ADMIN
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "unknown_environment"
    assert response.json()["error"]["fields"][0]["path"] == "environment"
    bad = client.post(
        "/v1/loops",
        json={"name": "badcur", "environment": "toolcalc", "curation_policy": {"eval_fraction": 7}},
        headers=ADMIN,
    )
    assert bad.status_code == 422
    assert bad.json()["error"]["code"] == "invalid_curation_policy"


def test_a_duplicate_name_is_409(client: TestClient) -> None:
    create_loop(client, "twice")
    response = client.post(
        "/v1/loops", json={"name": "twice", "environment": "toolcalc"}, headers=ADMIN
    )
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "loop_exists"


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"name": "Upper"}, "name"),
        ({"name": "-dash"}, "name"),
        ({"name": "a" * 41}, "name"),
        ({"environment": ""}, "environment"),
        ({"executor": "slurm"}, "executor"),
        ({"budget_usd": -1}, "budget_usd"),
        ({"budget_usd": 1e12}, "budget_usd"),
        ({"budget_usd": 0.00001}, "budget_usd"),
        ({"gate_policy": {"mode": "sometimes"}}, "gate_policy.mode"),
        ({"gate_policy": {"confidence": 1.5}}, "gate_policy.confidence"),
        ({"gate_policy": {"eval_samples": 4, "eval_temperature": 0}}, "gate_policy"),
        ({"gate_policy": {"eval_temperature": 3}}, "gate_policy.eval_temperature"),
        ({"gate_policy": {"min_discordant_pairs": -1}}, "gate_policy.min_discordant_pairs"),
        ({"trigger_policy": {"min_new_tasks": 0}}, "trigger_policy.min_new_tasks"),
        ({"serving_target": {"kind": "ftp"}}, "serving_target.kind"),
        ({"curation_policy": {"a": "\u0000"}}, "curation_policy"),
        ({"trigger_policy": {"custom": "x"}}, "trigger_policy.custom"),
        ({"serving_target": {"url": "\u0000"}}, "serving_target.url"),
        (
            {"training_profile": {"hyperparameters": {"lr": "\u0000"}}},
            "training_profile.hyperparameters.lr",
        ),
        ({"training_profile": []}, "training_profile"),
        # Hyper-parameters are checked against the trainer of the profile's family/algorithm.
        (
            {"training_profile": {"hyperparameters": {"lrr": 0.1}}},
            "training_profile.hyperparameters.lrr",
        ),
        (
            {"training_profile": {"hyperparameters": {"lr": 0}}},
            "training_profile.hyperparameters.lr",
        ),
        (
            {"training_profile": {"hyperparameters": {"group_size": 1}}},
            "training_profile.hyperparameters.group_size",
        ),
        (
            {"training_profile": {"algorithm": "sft", "hyperparameters": {"augment_fraction": 2}}},
            "training_profile.hyperparameters.augment_fraction",
        ),
        (
            {
                "training_profile": {
                    "family": "hf",
                    "algorithm": "sft",
                    "hyperparameters": {"augment_fraction": 0.5},
                }
            },
            "training_profile.hyperparameters.augment_fraction",
        ),
        (
            {"training_profile": {"family": "hf", "hyperparameters": {"lora_dropout": 1}}},
            "training_profile.hyperparameters.lora_dropout",
        ),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_invalid_loops_are_422_naming_the_field(
    client: TestClient, fields: dict[str, Any], path: str
) -> None:
    response = client.post(
        "/v1/loops", json={"name": "ok", "environment": "toolcalc", **fields}, headers=ADMIN
    )
    assert response.status_code == 422, response.text
    paths = [f["path"] for f in response.json()["error"]["fields"]]
    assert any(p == path or p.startswith(path + ".") for p in paths), paths


def test_unknown_loop_is_404(client: TestClient) -> None:
    assert client.get("/v1/loops/nope", headers=ADMIN).status_code == 404
    response = client.post("/v1/loops/nope/secrets/rotate", json={}, headers=ADMIN)
    assert response.status_code == 404


def test_the_admin_api_needs_the_admin_token(client: TestClient) -> None:
    for method, path in (("GET", "/v1/loops"), ("POST", "/v1/loops"), ("GET", "/v1/loops/x")):
        assert client.request(method, path).status_code == 401
        wrong = {"Authorization": "Bearer wrong"}
        assert client.request(method, path, headers=wrong).status_code == 401


def test_without_an_admin_token_configured_the_admin_api_is_closed(
    database_url: str, app_state: AppState
) -> None:
    settings = Settings(database_url=database_url, admin_token=None)
    state = dataclasses.replace(app_state, settings=settings, ingest=None)
    with TestClient(create_app(settings, state=state)) as client:
        assert client.get("/v1/loops", headers=ADMIN).status_code in (401, 403)


def test_rotation_gives_a_grace_period_and_keeps_two_active(
    client: TestClient, session_factory: SessionFactory
) -> None:
    create_loop(client, "rot")
    before = dt.datetime.now(dt.UTC)
    first = client.post("/v1/loops/rot/secrets/rotate", json={"grace_seconds": 600}, headers=ADMIN)
    assert first.status_code == 200
    expires = dt.datetime.fromisoformat(first.json()["previous_expires_at"])
    assert dt.timedelta(seconds=590) < expires - before < dt.timedelta(seconds=610)
    second = client.post("/v1/loops/rot/secrets/rotate", headers=ADMIN)
    assert second.status_code == 200

    shown = client.get("/v1/loops/rot", headers=ADMIN).json()
    signing = [c for c in shown["credentials"] if c["kind"] == "signing_secret"]
    assert len(signing) == 2
    token = client.post(
        "/v1/loops/rot/secrets/rotate", json={"kind": "ingest_token"}, headers=ADMIN
    ).json()
    assert token["kind"] == "ingest_token" and token["secret"].startswith("rit_")
    bad = client.post("/v1/loops/rot/secrets/rotate", json={"grace_seconds": -1}, headers=ADMIN)
    assert bad.status_code == 422
