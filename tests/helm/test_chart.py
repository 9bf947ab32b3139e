"""The chart lints, renders with every ci/ values file, and renders valid Kubernetes objects.

Validation is strict (unknown fields are errors) against the oldest Kubernetes the chart
supports (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
"""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from services.serving.kinds import TARGET_KINDS
from tests.helm.chart import (
    CHART_DIR,
    CI_DIR,
    CI_FILES,
    NAMESPACE,
    ci_values,
    render,
    render_ci,
    render_files,
)

OLDEST_KUBERNETES = "1.29.0"
KUBERNETES_VERSIONS = (OLDEST_KUBERNETES, kubernetes_validate.utils.latest_version())
# Custom resources kubernetes-validate has no schema for; checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor"}
MINIMAL = {
    "database": {"url": "postgresql://u:p@db:5432/ratchet"},
    "temporal": {"address": "temporal:7233"},
    # rendered without a cluster: the API server's address cannot be looked up
    "networkPolicy": {"kubernetesApiCidrs": ["10.0.0.1/32"]},
    # rendered without a cluster: a generated key would change on every render (refused)
    "secrets": {"secretKey": "sJQlxgB6CIqOHIJHU8oM_Iqo1YsdXug-7L9q1saDjHI="},
}


def test_ci_values_files_are_the_documented_set() -> None:
    assert sorted(path.name for path in CI_DIR.glob("*.yaml")) == sorted(CI_FILES)


def test_chart_declares_the_kubernetes_versions_it_is_validated_for() -> None:
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={OLDEST_KUBERNETES}-0"
    assert chart["apiVersion"] == "v2"


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_lint_is_clean_in_strict_mode(ci_file: str) -> None:
    report = helm.lint(
        CHART_DIR,
        ci_values(ci_file),
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBERNETES_VERSIONS[-1]}",
    )
    assert report["errors"] == []
    # Severity 1 is "info" (Helm recommends an icon); warnings and errors must not appear.
    assert [msg for msg in report["messages"] if msg["severity"] >= 2] == []


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_ci_values_satisfy_the_values_schema(ci_file: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(ci_values(ci_file))


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_every_rendered_object_is_valid_kubernetes(ci_file: str) -> None:
    rendered = render_ci(ci_file)
    assert rendered.objects
    for obj in rendered.objects:
        label = f"{obj['kind']}/{obj['metadata']['name']}"
        assert obj["metadata"].get("namespace") == NAMESPACE, label
        if obj["kind"] in CUSTOM_KINDS:
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(part) for part in exc.path)
                pytest.fail(f"{ci_file}: {label} invalid for Kubernetes {version}: {path}: {exc}")


def test_service_monitors_scrape_named_ports_of_the_services() -> None:
    rendered = render_ci("gpu-kueue-values.yaml")
    monitors = rendered.of_kind("ServiceMonitor")
    assert {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors} == {
        "api",
        "worker",
    }
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        selector = monitor["spec"]["selector"]["matchLabels"]
        services = [
            svc
            for svc in rendered.of_kind("Service")
            if selector.items() <= svc["metadata"]["labels"].items()
        ]
        assert len(services) == 1
        port_names = {port["name"] for port in services[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names
            assert endpoint["path"] == "/metrics"


def test_optional_objects_follow_their_switches() -> None:
    minimal = render_ci("minimal-values.yaml")
    assert minimal.of_kind("Ingress") == []
    # NetworkPolicies are on by default: api, worker, jobs and migrations.
    assert len(minimal.of_kind("NetworkPolicy")) == 4
    assert minimal.of_kind("ServiceMonitor") == []
    assert minimal.of_kind("HorizontalPodAutoscaler") == []
    assert len(minimal.of_kind("PodDisruptionBudget")) == 2
    assert len(minimal.of_kind("PersistentVolumeClaim")) == 1

    gpu = render_ci("gpu-kueue-values.yaml")
    (hpa,) = gpu.of_kind("HorizontalPodAutoscaler")
    assert (
        hpa["spec"]["scaleTargetRef"]["name"]
        == gpu.named("Deployment", "worker")["metadata"]["name"]
    )
    assert "replicas" not in gpu.named("Deployment", "worker")["spec"]

    external = render_ci("external-secrets-values.yaml")
    assert external.of_kind("PersistentVolumeClaim") == []
    assert [s["metadata"]["name"] for s in external.of_kind("Secret")] == []

    ingress = render_ci("ingress-networkpolicy-values.yaml")
    (ing,) = ingress.of_kind("Ingress")
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == ingress.named("Service", "api")["metadata"]["name"]
    assert backend["port"] == {"name": "http"}
    assert ing["spec"]["tls"][0]["secretName"] == "ratchet-example-tls"


def test_artifact_pvc_survives_uninstall_by_default() -> None:
    (pvc,) = render_ci("minimal-values.yaml").of_kind("PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_names_stay_within_63_characters_for_long_release_names() -> None:
    release = "a-very-long-release-name-for-the-ratchet-control-plane-xyz"
    rendered = render(MINIMAL, release=release)
    for obj in rendered.objects:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
        assert not obj["metadata"]["name"].endswith("-")


def test_notes_tell_how_to_reach_the_api() -> None:
    notes = render_files(ci_values("ingress-networkpolicy-values.yaml"))[
        "ratchet/templates/NOTES.txt"
    ]
    assert "port-forward svc/rel-ratchet-api" in notes
    assert "https://ratchet.example.com" in notes


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "temporal.address is required"),
        ({"temporal": {"address": "temporal:7233"}}, "database.url is required"),
        (
            {**MINIMAL, "secrets": {"existingSecret": "mine"}},
            "secrets.existingSecret is set",
        ),
        (
            {**MINIMAL, "temporal": {"address": "t:7233", "apiKey": "k"}},
            "temporal.apiKey needs temporal.tls.enabled",
        ),
        (
            {
                **MINIMAL,
                "temporal": {
                    "address": "t:7233",
                    "tls": {"enabled": True, "secretName": "tls", "keyKey": ""},
                },
            },
            "certKey and temporal.tls.keyKey go together",
        ),
        ({**MINIMAL, "api": {"ingress": {"enabled": True}}}, "needs at least one entry"),
        (
            {**MINIMAL, "jobs": {"resources": {"requests": {"nvidia.com/gpu": 2}}}},
            "jobs.resources.requests has nvidia.com/gpu 2 but jobs.gpusPerNode is 1",
        ),
        (
            {**MINIMAL, "jobs": {"resources": {"limits": {"nvidia.com/gpu": 8}}}},
            "jobs.resources.limits has nvidia.com/gpu 8 but jobs.gpusPerNode is 1",
        ),
    ],
)
def test_unusable_values_fail_at_render_time_with_a_clear_message(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render_files(values)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({**MINIMAL, "databse": {}}, "databse"),
        ({**MINIMAL, "database": {"url": "mysql://u@db/x"}}, "/database/url"),
        ({**MINIMAL, "temporal": {"address": "no-port"}}, "/temporal/address"),
        ({**MINIMAL, "config": {"logLevel": "LOUD"}}, "/config/logLevel"),
        ({**MINIMAL, "jobs": {"gpusPerNode": -1}}, "/jobs/gpusPerNode"),
        ({**MINIMAL, "jobs": {"kueue": {"queue": "typo"}}}, "queue"),
        ({**MINIMAL, "jobs": {"image": {"digest": "latest"}}}, "/jobs/image/digest"),
        ({**MINIMAL, "jobs": {"env": [{"name": "X", "value": 1}]}}, "/jobs/env/0/value"),
        ({**MINIMAL, "api": {"port": 70000}}, "/api/port"),
        (
            {**MINIMAL, "jobs": {"labels": {"app.kubernetes.io/name": "x"}}},
            "app.kubernetes.io/name",
        ),
        (
            {**MINIMAL, "jobs": {"env": [{"name": "RATCHET_OUTPUT_DIR", "value": "/x"}]}},
            "/jobs/env/0/name",
        ),
    ],
)
def test_schema_rejects_typos_and_wrong_types(values: dict[str, Any], where: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(values)


def _leaf_keys(values: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the values a user sets (opaque Kubernetes objects count as one)."""
    opaque = {
        "resources",
        "livenessProbe",
        "readinessProbe",
        "podSecurityContext",
        "containerSecurityContext",
    }
    keys = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in opaque:
            keys += _leaf_keys(value, f"{path}.")
        else:
            keys.append(path)
    return keys


def test_every_value_is_documented_in_the_values_reference() -> None:
    docs = (CHART_DIR.parents[1] / "docs" / "deploy.md").read_text()
    reference = docs[docs.index("## Values reference") :]
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    missing = [key for key in _leaf_keys(values) if f"`{key}`" not in reference]
    assert missing == []


def test_every_value_is_in_the_schema() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    for key in _leaf_keys(values):
        node = schema
        for part in key.split("."):
            assert part in node.get("properties", {}), f"{key} is not in values.schema.json"
            node = node["properties"][part]


def test_the_charts_endpoint_kinds_are_the_registrys() -> None:
    """values.schema.json is static JSON, so it spells out the endpoint kinds and their
    rules; this keeps them the registry's (services/serving/kinds.py), so a kind registered
    there and not here fails a test rather than an operator's install."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    endpoint = schema["properties"]["serving"]["properties"]["endpoints"]["additionalProperties"]
    with_endpoint = {name: kind for name, kind in TARGET_KINDS.items() if kind.needs_endpoint}
    assert endpoint["properties"]["kind"]["enum"] == list(with_endpoint)
    assert endpoint["if"]["properties"]["kind"]["const"] == "kubernetes"
    assert endpoint["then"]["required"] == list(with_endpoint["kubernetes"].endpoint_requires)
    refused = {branch["required"][0] for branch in endpoint["else"]["not"]["anyOf"]}
    assert refused == set(with_endpoint["openai"].endpoint_refuses) & set(endpoint["properties"])
