"""The chart's vLLM Deployment and Service (``serving.vllm.enabled``): valid, locked down, and
wired the way the Kubernetes serving target patches and verifies them."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.helm.chart import CHART_DIR, NAMESPACE, Rendered, render
from tests.helm.test_chart import KUBERNETES_VERSIONS, MINIMAL

VLLM: dict[str, Any] = {
    **MINIMAL,
    "serving": {"vllm": {"enabled": True, "servedModelName": "support-agent"}},
    "networkPolicy": {"enabled": True},
}


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    return render(VLLM)


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
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
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
    targets = [rule for rule in policy["spec"]["egress"] if "to" in rule]
    assert any(
        rule["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "vllm"
        and rule["ports"] == [{"protocol": "TCP", "port": 8000}]
        for rule in targets
    )
