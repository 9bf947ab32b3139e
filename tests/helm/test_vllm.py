"""The chart's vLLM Deployment and Service (``serving.vllm.enabled``): valid, locked down, and
wired the way the Kubernetes serving target patches and verifies them."""

from __future__ import annotations

import json
import os
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from services.settings import Settings
from tests.helm.chart import CHART_DIR, NAMESPACE, Rendered, render
from tests.helm.test_chart import KUBERNETES_VERSIONS, MINIMAL

# Rendered without a cluster, as helm template and Argo CD do: the key is a Secret made once.
VLLM_KEY = "vllm-key-made-once-for-this-release"
VLLM_SECRETS = {"vllm-api-key": {"api-key": VLLM_KEY}}
VLLM_ENABLED: dict[str, Any] = {"enabled": True, "apiKey": {"existingSecret": "vllm-api-key"}}
VLLM: dict[str, Any] = {
    **MINIMAL,
    "serving": {"vllm": {**VLLM_ENABLED, "servedModelName": "support-agent"}},
    "networkPolicy": {"enabled": True, "kubernetesApiCidrs": ["10.0.0.1/32"]},
}


def render_vllm(values: dict[str, Any]) -> Rendered:
    return render(values, external_secrets=VLLM_SECRETS)


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    return render_vllm(VLLM)


def test_off_by_default() -> None:
    names = [d["metadata"]["name"] for d in render(MINIMAL).of_kind("Deployment")]
    assert "rel-ratchet-vllm" not in names


def test_the_objects_are_valid_kubernetes_and_the_values_pass_the_schema(
    rendered: Rendered,
) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(VLLM)
    report = helm.lint(CHART_DIR, VLLM, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    for obj in (rendered.named("Deployment", "vllm"), rendered.named("Service", "vllm")):
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_refuses_bad_serving_values() -> None:
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(Exception, match="servedModelName"):
        chart.validate_schema({**MINIMAL, "serving": {"vllm": {"servedModelName": "a b"}}})


def test_the_pods_read_the_model_the_serving_target_patches(rendered: Rendered) -> None:
    deployment = rendered.named("Deployment", "vllm")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RATCHET_SERVED_MODEL"] == "support-agent"
    assert env["RATCHET_MODEL_PATH"] == "/var/lib/ratchet/artifacts/models/base"
    # The kubernetes target names the adapter in the environment: no runtime loads needed,
    # so the adapter routes (and a key that could swap the model) do not exist.
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    script = container["args"][0]
    assert 'vllm serve "$RATCHET_MODEL_PATH"' in script
    assert '--lora-modules "$name=$RATCHET_LORA_PATH"' in script
    assert "--enable-lora" in script
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/var/lib/ratchet/artifacts"]["readOnly"] is True  # same path as the worker's
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_the_service_exposes_the_openai_port(rendered: Rendered) -> None:
    service = rendered.named("Service", "vllm")
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    selector = service["spec"]["selector"]
    labels = rendered.named("Deployment", "vllm")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def test_the_worker_may_reach_the_vllm_pods(rendered: Rendered) -> None:
    policy = rendered.get("NetworkPolicy", "rel-ratchet-worker")
    targets = [
        rule for rule in policy["spec"]["egress"] if "podSelector" in rule.get("to", [{}])[0]
    ]
    assert any(
        rule["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "vllm"
        and rule["ports"] == [{"protocol": "TCP", "port": 8000}]
        for rule in targets
    )


def _container(rendered: Rendered, component: str) -> dict[str, Any]:
    (container,) = rendered.named("Deployment", component)["spec"]["template"]["spec"]["containers"]
    return container


def _endpoints(rendered: Rendered, component: str) -> dict[str, Any]:
    env = rendered.container_env(_container(rendered, component))
    endpoints: dict[str, Any] = json.loads(env["RATCHET_SERVING_ENDPOINTS"])
    return endpoints


def test_vllm_requires_an_api_key_from_a_secret_and_the_worker_holds_the_same(
    rendered: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --api-key anyone in the cluster could unload the served model or load another
    adapter under its name."""
    vllm = _container(rendered, "vllm")
    (key_var,) = [var for var in vllm["env"] if var["name"] == "VLLM_API_KEY"]
    reference = key_var["valueFrom"]["secretKeyRef"]
    assert reference == {"name": "vllm-api-key", "key": "api-key"}
    key = rendered.secret_data("vllm-api-key")["api-key"]
    assert key == VLLM_KEY
    assert 'if [ -z "$VLLM_API_KEY" ]' in vllm["args"][0]  # no key, no server
    assert key not in json.dumps(rendered.named("Deployment", "vllm"))  # not in the pod spec

    worker = _endpoints(rendered, "worker")
    assert worker == {
        "vllm": {
            "kind": "kubernetes",
            "url": "http://rel-ratchet-vllm:8000",
            "deployment": "rel-ratchet-vllm",
            "container": "vllm",
            "api_key": key,
        }
    }
    assert key not in json.dumps(rendered.named("Deployment", "worker"))  # only by reference
    assert "api_key" not in _endpoints(rendered, "api")["vllm"]  # the api checks names only

    for name in list(os.environ):
        if name.startswith("RATCHET_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RATCHET_SERVING_ENDPOINTS", json.dumps(worker))
    settings = Settings()
    endpoint = settings.serving_endpoints["vllm"]
    assert endpoint.api_key is not None and endpoint.api_key.get_secret_value() == key


def test_a_users_secret_holds_the_key_when_named() -> None:
    values = {
        **VLLM,
        "serving": {
            "vllm": {"enabled": True, "apiKey": {"existingSecret": "vllm-key", "key": "token"}},
            "endpoints": {
                "ext": {
                    "kind": "openai",
                    "url": "http://sglang:30000",
                    "apiKeySecret": {"name": "sglang-key", "key": "k"},
                }
            },
        },
    }
    rendered = render(
        values, external_secrets={"vllm-key": {"token": "users-key"}, "sglang-key": {"k": "s"}}
    )
    assert "rel-ratchet-vllm-api-key" not in {
        s["metadata"]["name"] for s in rendered.of_kind("Secret")
    }
    env = rendered.container_env(_container(rendered, "vllm"))
    assert env["VLLM_API_KEY"] == "users-key"
    worker = _endpoints(rendered, "worker")
    assert worker["vllm"]["api_key"] == "users-key"
    assert worker["ext"] == {"kind": "openai", "url": "http://sglang:30000", "api_key": "s"}


def test_only_the_worker_and_the_agents_reach_the_vllm_pods(rendered: Rendered) -> None:
    policy = rendered.named("NetworkPolicy", "vllm")["spec"]
    labels = rendered.named("Deployment", "vllm")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    (worker,) = rule["from"]  # no agents configured: the worker alone
    assert worker["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert {port["port"] for e in policy["egress"] for port in e["ports"]} == {53}

    agents = {"namespaceSelector": {"matchLabels": {"team": "agents"}}}
    opened = render_vllm({**VLLM, "serving": {"vllm": {**VLLM_ENABLED, "agentsFrom": [agents]}}})
    (rule,) = opened.named("NetworkPolicy", "vllm")["spec"]["ingress"]
    assert rule["from"][1:] == [agents]
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(opened.named("NetworkPolicy", "vllm"), version, strict=True)
