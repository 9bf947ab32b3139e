"""Serving endpoints are held to their kind's registry entry where endpoints are read.

Settings take an endpoint's ``kind`` as a name only (they import no serving code); the api
and the worker refuse, as they start, an endpoint whose kind is not registered or that
lacks (or sets) a field its kind needs (or refuses): one line naming
``RATCHET_SERVING_ENDPOINTS``, the endpoint and the field, never its key. The published
OpenAPI says what each registered kind needs.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from services.api.app import create_app
from services.loop.policies import ServingTarget, serving_endpoint_problem
from services.serving.kinds import check_serving_endpoints
from services.serving.targets import ServingTargets
from services.settings import ServingEndpoint, Settings, SettingsError, load_settings
from workflows.worker import run_worker

KEY = "do-not-print-this-key"

BAD_ENDPOINTS = [
    pytest.param(
        '{"kind": "ssh", "url": "http://p:8000"}',
        "(vllm.kind): unknown serving endpoint kind 'ssh'; "
        "registered endpoint kinds: openai, kubernetes",
        id="unknown-kind",
    ),
    pytest.param(
        '{"kind": "local", "url": "http://p:8000"}',
        "(vllm.kind): a local serving target deploys to no endpoint",
        id="kind-without-endpoint",
    ),
    pytest.param(
        '{"kind": "kubernetes", "url": "http://p:8000"}',
        "(vllm.deployment): a kubernetes serving endpoint needs `deployment`",
        id="kubernetes-without-deployment",
    ),
    pytest.param(
        '{"kind": "openai", "url": "http://p:8000", "deployment": "d"}',
        "(vllm.deployment): an openai serving endpoint takes no `deployment`; it belongs to "
        "a kubernetes serving endpoint",
        id="openai-naming-a-deployment",
    ),
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("RATCHET_"):
            monkeypatch.delenv(key)


def configured(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> Settings:
    """Settings whose ``vllm`` endpoint is ``endpoint`` (with an API key), as a process
    loads them from RATCHET_SERVING_ENDPOINTS: they parse."""
    spliced = endpoint[:-1] + f', "api_key": "{KEY}"}}'
    monkeypatch.setenv("RATCHET_SERVING_ENDPOINTS", f'{{"vllm": {spliced}}}')
    return load_settings()


@pytest.mark.parametrize(("endpoint", "message"), BAD_ENDPOINTS)
def test_a_bad_endpoint_stops_the_api_and_the_worker_as_they_start(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, message: str
) -> None:
    settings = configured(monkeypatch, endpoint)
    starts = {
        "check": lambda: check_serving_endpoints(settings.serving_endpoints),
        "api": lambda: create_app(settings),
        "worker": lambda: asyncio.run(run_worker(settings)),  # before it connects to anything
        "worker's serving targets": lambda: ServingTargets(settings),
    }
    for where, start in starts.items():
        with pytest.raises(SettingsError) as refused:
            start()
        text = str(refused.value)
        assert text.startswith(f"invalid setting RATCHET_SERVING_ENDPOINTS {message}"), where
        assert KEY not in text


def test_every_bad_endpoint_is_named_in_the_one_line() -> None:
    endpoints = {
        "ok": ServingEndpoint(kind="openai", url="http://ok"),
        "a": ServingEndpoint(kind="ssh", url="http://a"),
        "b": ServingEndpoint(kind="kubernetes", url="http://b"),
    }
    with pytest.raises(SettingsError) as refused:
        check_serving_endpoints(endpoints)
    text = str(refused.value)
    assert "(a.kind)" in text and "(b.deployment)" in text and "(ok" not in text


@pytest.mark.parametrize(("endpoint", "message"), BAD_ENDPOINTS)
def test_a_loop_naming_a_bad_endpoint_is_told_why_not_a_server_error(
    endpoint: str, message: str
) -> None:
    """Where a process skipped the start check (a test's app state), a loop saved or
    deployed with the endpoint gets the same words, not a 5xx."""
    endpoints = {"vllm": ServingEndpoint.model_validate_json(endpoint)}
    for kind in ("openai", "kubernetes"):
        target = ServingTarget(kind=kind, endpoint="vllm", model="agent")
        assert message in serving_endpoint_problem(target, endpoints)


def test_good_endpoints_of_every_built_in_kind_pass() -> None:
    endpoints = {
        "vllm": ServingEndpoint(kind="openai", url="http://vllm:8000"),
        "prod": ServingEndpoint(
            kind="kubernetes", url="http://prod:8000", deployment="prod", namespace="serving"
        ),
    }
    check_serving_endpoints(endpoints)
    check_serving_endpoints({})
    target = ServingTarget(kind="kubernetes", endpoint="prod")
    assert serving_endpoint_problem(target, endpoints) == ""


def published_serving_target() -> dict[str, Any]:
    schema: dict[str, Any] = create_app(Settings()).openapi()["components"]["schemas"]
    return dict(schema["ServingTarget"])


def branches() -> dict[str, dict[str, Any]]:
    schema = published_serving_target()
    return {branch["properties"]["kind"]["const"]: branch for branch in schema["oneOf"]}


def test_the_openapi_publishes_one_branch_per_kind_discriminated_by_kind() -> None:
    schema = published_serving_target()
    assert schema["discriminator"] == {"propertyName": "kind"}
    assert list(branches()) == ["local", "openai", "kubernetes", "none"]
    assert schema["properties"]["kind"]["enum"] == list(branches())
    published = branches()
    assert set(published["openai"]["required"]) == {"kind", "endpoint", "model"}
    assert set(published["kubernetes"]["required"]) == {"kind", "endpoint"}
    # kind defaults to local: its branch is the one a target without `kind` matches
    assert not {"kind", "endpoint", "model"} & set(published["local"].get("required", []))
    assert published["none"]["required"] == ["kind"]
    assert "Kubernetes Deployment" in published["kubernetes"]["description"]
