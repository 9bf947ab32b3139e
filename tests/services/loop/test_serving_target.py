"""A loop's serving target names one of the deployment's serving endpoints, never a URL.

What a loop saved (or a workflow history recorded) before serving endpoints still loads, so
no running loop stops reading its history; its deploy is what fails, saying what to set.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from services.loop.policies import (
    RECORDED,
    RETIRED_SERVING_KEYS,
    ServingTarget,
    describe_errors,
    parse_policies,
    serving_endpoint_problem,
)
from services.settings import ServingEndpoint

OPENAI = ServingEndpoint(kind="openai", url="http://vllm:8000")
KUBERNETES = ServingEndpoint(kind="kubernetes", url="http://prod:8000", deployment="prod")

# What LoopConfig.to_payload recorded for a kubernetes target before serving endpoints.
RECORDED_KUBERNETES = {
    "kind": "kubernetes",
    "url": "http://agent-model.serving:8000",
    "model": "agent",
    "artifacts_dir": "/artifacts",
    "verify_timeout_s": 60.0,
    "namespace": "serving",
    "deployment": "agent-model",
    "container": None,
    "env_var": "RATCHET_MODEL_PATH",
    "version_url": None,
    "rollout_timeout_s": 600.0,
}
# ... and for a local one (the defaults of the old keys, none given).
RECORDED_LOCAL = {
    **{key: value for key, value in RETIRED_SERVING_KEYS.items()},
    "kind": "local",
    "model": None,
    "verify_timeout_s": 60.0,
}


@pytest.mark.parametrize("key", sorted(RETIRED_SERVING_KEYS))
def test_a_new_target_naming_a_retired_key_is_refused_naming_it(key: str) -> None:
    value: Any = 5 if key == "rollout_timeout_s" else "x"
    with pytest.raises(ValidationError) as refused:
        ServingTarget.model_validate({"kind": "openai", "endpoint": "vllm", key: value})
    message = describe_errors("serving_target", refused.value)
    assert message.startswith(f"serving_target.{key}: ")
    assert "RATCHET_SERVING_ENDPOINTS" in message


def test_new_targets_need_what_their_kind_needs() -> None:
    assert ServingTarget.model_validate({}).kind == "local"
    ServingTarget.model_validate({"kind": "openai", "endpoint": "vllm", "model": "agent"})
    ServingTarget.model_validate({"kind": "kubernetes", "endpoint": "prod"})
    for bad, field in [
        ({"kind": "openai", "model": "agent"}, "endpoint"),
        ({"kind": "openai", "endpoint": "vllm"}, "model"),
        ({"kind": "local", "endpoint": "vllm"}, "endpoint"),
        ({"kind": "openai", "endpoint": "../x", "model": "a"}, "endpoint"),
        ({"retired_keys": ["url"]}, "retired_keys"),
        ({"kind": "ftp"}, "kind"),
    ]:
        with pytest.raises(ValidationError) as refused:
            ServingTarget.model_validate(bad)
        assert describe_errors("serving_target", refused.value).startswith(
            f"serving_target.{field}: "
        ), bad


def test_a_recorded_target_with_a_url_still_loads_and_cannot_deploy() -> None:
    target = ServingTarget.model_validate(RECORDED_KUBERNETES, context=RECORDED)

    assert target.retired_keys == ("artifacts_dir", "deployment", "namespace", "url")
    # what it records now reads back the same
    dumped = target.model_dump(mode="json")
    assert ServingTarget.model_validate(dumped, context=RECORDED) == target
    problem = serving_endpoint_problem(target, {"prod": KUBERNETES})
    assert "url" in problem and "RATCHET_SERVING_ENDPOINTS" in problem and "`endpoint`" in problem


def test_a_recorded_local_target_with_only_old_defaults_deploys_as_before() -> None:
    target = ServingTarget.model_validate(RECORDED_LOCAL, context=RECORDED)
    assert target.retired_keys == ()
    assert serving_endpoint_problem(target, {}) == ""


def test_a_stored_loop_with_a_url_still_loads_its_policies() -> None:
    """load_loop_config parses the row: the loop keeps running; its deploy says what to set."""
    *_, serving = parse_policies(None, None, None, {"kind": "openai", "url": "http://x:1"})
    assert serving.retired_keys == ("url",)


def test_the_loop_config_of_a_recorded_history_reads_an_old_serving_target() -> None:
    from workflows.payloads.loop import LoopConfig

    config = LoopConfig.from_payload(
        {
            "loop": "demo",
            "loop_id": 1,
            "status": "active",
            "environment": "toolcalc",
            "executor": "local",
            "champion_checkpoint_id": None,
            "champion_uri": None,
            "gate_policy": {},
            "trigger_policy": {},
            "serving_target": RECORDED_KUBERNETES,
        }
    )
    assert config.serving_target.kind == "kubernetes"
    assert "url" in config.serving_target.retired_keys


def test_an_endpoint_must_be_configured_and_of_the_targets_kind() -> None:
    openai = ServingTarget(kind="openai", endpoint="vllm", model="agent")
    assert serving_endpoint_problem(openai, {"vllm": OPENAI}) == ""
    assert "configured: none" in serving_endpoint_problem(openai, {})
    assert "configured: a, b" in serving_endpoint_problem(openai, {"b": OPENAI, "a": OPENAI})
    assert "of kind kubernetes" in serving_endpoint_problem(openai, {"vllm": KUBERNETES})
    assert serving_endpoint_problem(ServingTarget(kind="none"), {}) == ""
