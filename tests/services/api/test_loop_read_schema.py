"""A loop's policies on reads are typed: the OpenAPI names their schemas, and a read parses
a stored policy as recorded (what the loop runs with), defaults filled in."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi.testclient import TestClient

from services.api.schemas.loops import LoopPublic
from services.loop.policies import GatePolicy, ServingTarget, TrainingProfile, TriggerPolicy


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """A property's schema, its ``$ref`` followed (also under ``allOf``)."""
    if "allOf" in schema:
        (schema,) = schema["allOf"]
    ref = schema["$ref"]
    return spec["components"]["schemas"][ref.rsplit("/", 1)[-1]]


def test_the_openapi_has_the_policies_schemas_on_loop_reads(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    properties = spec["components"]["schemas"]["LoopPublic"]["properties"]
    for name, policy in [
        ("training_profile", TrainingProfile),
        ("serving_target", ServingTarget),
        ("gate_policy", GatePolicy),
        ("trigger_policy", TriggerPolicy),
    ]:
        schema = _resolve(spec, properties[name])
        assert set(schema["properties"]) == set(policy.model_fields), name


def _public(**policies: Any) -> dict[str, Any]:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return {
        "name": "bot",
        "environment": "toolcalc",
        "executor": "local",
        "status": "active",
        "status_reason": None,
        "training_profile": {},
        "serving_target": {},
        "gate_policy": {},
        "trigger_policy": {},
        "curation_policy": {},
        "budget_usd": None,
        "champion_checkpoint_id": None,
        "created_at": now,
        "updated_at": now,
        "webhook_url": "http://api/v1/loops/bot/traces",
        "otlp_traces_url": "http://api/otlp/v1/traces",
        **policies,
    }


def test_a_read_fills_the_defaults_and_round_trips_through_json() -> None:
    loop = LoopPublic.model_validate(_public(gate_policy={"confidence": 0.9}))
    assert loop.gate_policy == GatePolicy(confidence=0.9)
    assert loop.training_profile == TrainingProfile()
    # The typed client reads the api's JSON back into the same model.
    assert LoopPublic.model_validate_json(loop.model_dump_json()) == loop


def test_a_stored_policy_is_read_as_recorded_not_refused() -> None:
    """A serving target saved before serving endpoints, and hyper-parameters a later trainer
    no longer takes, still read: a loop's row is a fact (its deploy says what to fix)."""
    loop = LoopPublic.model_validate(
        _public(
            serving_target={"kind": "local", "url": "http://old:8000"},
            training_profile={"hyperparameters": {"no_such_key": 1}},
        )
    )
    assert loop.serving_target.retired_keys == ("url",)
    assert loop.training_profile.hyperparameters == {"no_such_key": 1}
    again = LoopPublic.model_validate_json(loop.model_dump_json())
    assert again.serving_target.retired_keys == ("url",)
