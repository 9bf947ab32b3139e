"""Security properties of what the chart renders, for every ci/ values file.

Non-root, read-only root filesystem, no privilege escalation, all capabilities dropped;
a namespaced Role with no wildcard and nothing beyond what the executor and the serving
target use; secrets only in Secrets; migrations as a pre-install/pre-upgrade hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import helm_python as helm
import pytest
from cryptography.fernet import Fernet

from tests.helm.chart import (
    CHART_DIR,
    CI_FILES,
    EXTERNAL_SECRET_DATA,
    Manifest,
    Rendered,
    ci_values,
    render,
    render_ci,
)

# What the worker may do: the Kubernetes executor (Jobs, their pods and logs, headless
# Services for multi-node) and the Kubernetes serving target (get/patch a Deployment, list and
# watch it to follow the rollout; tests/helm/test_rbac.py checks them against the code).
ALLOWED_RULES = {
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"get", "list"},
    ("", "pods/log"): {"get"},
    ("", "services"): {"create", "delete"},
    # A job's credentials, in a Secret of its run's own: written and deleted, never read.
    ("", "secrets"): {"create", "delete"},
    ("apps", "deployments"): {"get", "list", "watch", "patch"},
}
SECRET_SETTINGS = {"RATCHET_DATABASE_URL", "RATCHET_ADMIN_TOKEN", "RATCHET_TEMPORAL_API_KEY"}


@dataclass(frozen=True)
class Case:
    values: dict[str, Any]
    rendered: Rendered


@pytest.fixture(params=CI_FILES)
def case(request: pytest.FixtureRequest) -> Case:
    return Case(ci_values(request.param), render_ci(request.param))


@pytest.fixture
def rendered(case: Case) -> Rendered:
    return case.rendered


def _containers(pod: Manifest) -> list[Manifest]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_every_pod_runs_as_non_root_with_a_locked_down_container(rendered: Rendered) -> None:
    pods = list(rendered.pod_templates())
    assert {owner["metadata"]["labels"]["app.kubernetes.io/component"] for owner, _ in pods} == {
        "api",
        "worker",
        "gateway",
        "migrate",
    }
    for owner, pod in pods:
        name = owner["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID"), name
        for container in _containers(pod):
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["privileged"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in context["capabilities"], name
            assert container["resources"]["requests"], name
            assert container["resources"]["limits"]["memory"], name


def test_read_only_root_filesystem_has_writable_scratch_for_state_and_tmp(
    rendered: Rendered,
) -> None:
    state_dir = rendered.get("ConfigMap", "rel-ratchet-config")["data"]["RATCHET_STATE_DIR"]
    for owner, pod in rendered.pod_templates():
        empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in _containers(pod):
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts.get("/tmp") in empty_dirs, owner["metadata"]["name"]
            assert mounts.get(state_dir) in empty_dirs, owner["metadata"]["name"]


def test_only_the_worker_holds_a_kubernetes_token(rendered: Rendered) -> None:
    for owner, pod in rendered.pod_templates():
        component = owner["metadata"]["labels"]["app.kubernetes.io/component"]
        assert pod["automountServiceAccountToken"] is (component == "worker"), component
    accounts = {sa["metadata"]["name"]: sa for sa in rendered.of_kind("ServiceAccount")}
    assert accounts["rel-ratchet-api"]["automountServiceAccountToken"] is False
    assert accounts["rel-ratchet-job"]["automountServiceAccountToken"] is False
    worker_pod = rendered.named("Deployment", "worker")["spec"]["template"]["spec"]
    assert worker_pod["serviceAccountName"] == "rel-ratchet-worker"


def test_rbac_is_one_namespaced_role_without_wildcards(rendered: Rendered) -> None:
    assert rendered.of_kind("ClusterRole") == []
    assert rendered.of_kind("ClusterRoleBinding") == []
    (role,) = rendered.of_kind("Role")
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert "*" not in rule.get(field, []), rule
        assert "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                allowed = ALLOWED_RULES.get((group, resource))
                assert allowed is not None, f"{group}/{resource} is not needed by the worker"
                assert set(rule["verbs"]) <= allowed, (resource, rule["verbs"])
    covered = {
        (g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert covered - {("apps", "deployments")} == set(ALLOWED_RULES) - {("apps", "deployments")}
    for rule in role["rules"]:  # Deployments only ever by name: never every one, its own
        if "deployments" in rule["resources"]:
            assert rule["resourceNames"], rule
    (binding,) = rendered.of_kind("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-ratchet-worker", "namespace": "ml-platform"}
    ]


def test_serving_target_access_can_be_narrowed_to_named_deployments() -> None:
    (role,) = render_ci("external-secrets-values.yaml").of_kind("Role")
    (deployments,) = [rule for rule in role["rules"] if rule["resources"] == ["deployments"]]
    assert deployments["resourceNames"] == ["agent-policy-server"]
    assert deployments["verbs"] == ["get", "list", "watch", "patch"]


def _deployment_rules(values: dict[str, Any]) -> list[dict[str, Any]]:
    (role,) = render(values).of_kind("Role")
    return [rule for rule in role["rules"] if "deployments" in rule["resources"]]


def test_the_worker_may_patch_only_the_serving_deployments_never_its_own() -> None:
    """A Role rule on Deployments without resourceNames would let the worker rewrite any of
    them, its own included (a loop once could name it and an env var such as PYTHONPATH)."""
    minimal = ci_values("minimal-values.yaml")
    assert _deployment_rules(minimal) == []  # nothing to serve to, nothing granted
    endpoints = {
        "prod": {"kind": "kubernetes", "url": "http://vllm-prod:8000", "deployment": "vllm-prod"},
        "ext": {"kind": "openai", "url": "http://sglang:30000"},
    }
    (rule,) = _deployment_rules(
        {
            **minimal,
            "serving": {
                "endpoints": endpoints,
                "vllm": {"enabled": True, "apiKey": {"existingSecret": "vllm-key"}},
            },
        }
    )
    assert rule["resourceNames"] == ["rel-ratchet-vllm", "vllm-prod"]
    for own in ("rel-ratchet-worker", "rel-ratchet-api"):  # the schema knows the pattern
        prod = {"kind": "kubernetes", "url": "http://x:8000", "deployment": own}
        for values in (
            {**minimal, "rbac": {"servingTarget": {"deploymentNames": [own]}}},
            {**minimal, "serving": {"endpoints": {"prod": prod}}},
        ):
            with pytest.raises(Exception, match="schema"):
                render(values)
    for own in ("acme-worker", "acme-api"):  # ... the templates know the names
        prod = {"kind": "kubernetes", "url": "http://x:8000", "deployment": own}
        for values in (
            {**minimal, "rbac": {"servingTarget": {"deploymentNames": [own]}}},
            {**minimal, "serving": {"endpoints": {"prod": prod}}},
        ):
            with pytest.raises(Exception, match=f"never patch Ratchet's own .* {own}"):
                render({**values, "fullnameOverride": "acme"})


def test_the_schema_refuses_serving_endpoints_a_process_would_refuse() -> None:
    minimal = ci_values("minimal-values.yaml")
    bad = [
        {"kind": "kubernetes", "url": "http://x:8000"},  # no deployment
        {"kind": "openai", "url": "http://x:8000", "deployment": "d"},
        {"kind": "ssh", "url": "http://x"},
        {"kind": "openai", "url": "ftp://x"},
        {"kind": "openai", "url": "http://x", "apiKey": "inline"},  # keys come from Secrets
    ]
    with helm.Chart.load(CHART_DIR) as chart:
        for endpoint in bad:
            with pytest.raises(Exception, match="endpoints"):
                chart.validate_schema({**minimal, "serving": {"endpoints": {"e": endpoint}}})


def test_the_worker_reaches_the_api_servers_ports_only_at_the_api_server() -> None:
    rendered = render_ci("ingress-networkpolicy-values.yaml")
    policy = rendered.named("NetworkPolicy", "worker")["spec"]
    api_rules = [
        rule
        for rule in policy["egress"]
        if {port["port"] for port in rule.get("ports", [])} & {443, 6443}
    ]
    assert api_rules and all(rule.get("to") for rule in api_rules)
    (rule,) = api_rules
    assert rule["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    values = ci_values("ingress-networkpolicy-values.yaml")
    values["networkPolicy"]["kubernetesApiCidrs"] = []
    with pytest.raises(Exception, match="kubernetesApiCidrs is empty"):
        render(values)  # no cluster to look the API server up in: refused, not opened


def test_secrets_never_land_in_a_config_map(case: Case) -> None:
    rendered, values = case.rendered, case.values
    secret_values = {
        values.get("database", {}).get("url"),
        values.get("secrets", {}).get("adminToken"),
        values.get("temporal", {}).get("apiKey"),
        *EXTERNAL_SECRET_DATA.values(),
    } - {None, ""}
    for config_map in rendered.of_kind("ConfigMap"):
        data = config_map.get("data", {})
        assert not SECRET_SETTINGS & set(data), config_map["metadata"]["name"]
        for text in data.values():
            for secret in secret_values:
                assert secret not in text, config_map["metadata"]["name"]
    for _, pod in rendered.pod_templates():
        for container in _containers(pod):
            for var in container.get("env", []):
                if var["name"] in SECRET_SETTINGS:
                    assert "secretKeyRef" in var["valueFrom"], var["name"]
            for var in container.get("env", []):
                assert var.get("value") not in secret_values, var["name"]


def test_chart_secret_holds_exactly_the_given_secrets() -> None:
    minimal = render_ci("minimal-values.yaml")
    data = minimal.secret_data("rel-ratchet-secrets")
    assert data.pop("RATCHET_DATABASE_URL") == (
        "postgresql://ratchet:ratchet@postgres.databases:5432/ratchet"
    )
    # A Fernet key made for the release when none is given (services.secrets).
    assert set(data) == {"RATCHET_SECRET_KEY"}
    Fernet(data["RATCHET_SECRET_KEY"])
    gpu = render_ci("gpu-kueue-values.yaml")
    assert set(gpu.secret_data("rel-ratchet-secrets")) == {
        "RATCHET_DATABASE_URL",
        "RATCHET_ADMIN_TOKEN",
        "RATCHET_SECRET_KEY",
    }


def test_migrations_run_as_a_pre_install_and_pre_upgrade_hook(rendered: Rendered) -> None:
    job = rendered.named("Job", "migrate")
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == {
        "before-hook-creation",
        "hook-succeeded",
    }
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["db", "upgrade"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] >= 1
    assert job["spec"]["activeDeadlineSeconds"] > 0
    # A hook runs before the release's own objects exist: everything it reads must be a
    # hook made earlier (lower weight) or a Secret the user made.
    env_refs = {
        var["valueFrom"]["secretKeyRef"]["name"] for var in container["env"] if "valueFrom" in var
    }
    assert "envFrom" not in container
    for name in env_refs:
        if name in rendered.external_secrets:
            continue
        secret = rendered.get("Secret", name)
        hook = secret["metadata"]["annotations"]
        assert hook["helm.sh/hook"] == annotations["helm.sh/hook"]
        assert int(hook["helm.sh/hook-weight"]) < int(annotations["helm.sh/hook-weight"])
    for volume in job["spec"]["template"]["spec"]["volumes"]:
        assert "emptyDir" in volume, "a hook pod can only mount what exists before install"


def test_migrations_read_the_users_secret_when_one_is_named() -> None:
    rendered = render_ci("external-secrets-values.yaml")
    job = rendered.named("Job", "migrate")
    (url,) = [
        var
        for var in job["spec"]["template"]["spec"]["containers"][0]["env"]
        if var["name"] == "RATCHET_DATABASE_URL"
    ]
    assert url["valueFrom"]["secretKeyRef"] == {
        "name": "ratchet-prod-credentials",
        "key": "database-url",
    }
    assert rendered.of_kind("Secret") == []


def test_pods_roll_when_their_configuration_changes() -> None:
    before = render_ci("minimal-values.yaml")
    values = ci_values("minimal-values.yaml")
    values["config"] = {"logLevel": "DEBUG"}
    values["jobs"] = {"activeDeadlineSeconds": 3600}
    after = render(values)
    for component in ("api", "worker"):
        old = before.named("Deployment", component)["spec"]["template"]["metadata"]["annotations"]
        new = after.named("Deployment", component)["spec"]["template"]["metadata"]["annotations"]
        assert old["checksum/config"] != new["checksum/config"], component
    old = before.named("Deployment", "worker")["spec"]["template"]["metadata"]["annotations"]
    new = after.named("Deployment", "worker")["spec"]["template"]["metadata"]["annotations"]
    assert old["checksum/job-template"] != new["checksum/job-template"]


def test_network_policies_fence_every_component() -> None:
    rendered = render_ci("ingress-networkpolicy-values.yaml")
    policies = {
        p["metadata"]["labels"]["app.kubernetes.io/component"]: p["spec"]
        for p in rendered.of_kind("NetworkPolicy")
    }
    assert set(policies) == {"api", "worker", "job", "migrate"}
    for component, spec in policies.items():
        assert set(spec["policyTypes"]) == {"Ingress", "Egress"}, component
        if component != "job":  # job pods carry the executor's labels (test_job_template)
            selector = spec["podSelector"]["matchLabels"]
            assert selector["app.kubernetes.io/component"] == component
    # The api only from the ingress controller (and metrics scrapers); no open rule.
    for rule in policies["api"]["ingress"]:
        assert rule["from"], "api ingress rule without a source"
    # Jobs: ingress only from jobs; egress to jobs, DNS and the one extra rule.
    job_peers = policies["job"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert job_peers == policies["job"]["podSelector"]["matchLabels"]
    egress_ports = {
        port["port"] for rule in policies["job"]["egress"] for port in rule.get("ports", [])
    }
    assert egress_ports == {53, 443}
    # Worker egress reaches the Kubernetes API, Postgres and the Temporal port from the address.
    worker_ports = {
        port["port"] for rule in policies["worker"]["egress"] for port in rule.get("ports", [])
    }
    assert {443, 6443, 5432, 7233} <= worker_ports
    migrate_ports = {
        port["port"] for rule in policies["migrate"]["egress"] for port in rule.get("ports", [])
    }
    assert migrate_ports == {53, 5432}


def test_the_public_ingress_routes_only_the_ingest_doors() -> None:
    """Not the dashboard, /docs, /openapi.json, the admin API or /metrics."""
    rendered = render_ci("ingress-networkpolicy-values.yaml")
    (ingress,) = rendered.of_kind("Ingress")
    paths = {
        (path["path"], path["pathType"])
        for rule in ingress["spec"]["rules"]
        for path in rule["http"]["paths"]
    }
    assert paths == {
        ("/otlp/v1/traces", "Exact"),
        ("/v1/otlp/v1/traces", "Exact"),
        ("/v1/loops/support-agent/traces", "Exact"),
    }


def test_metrics_have_their_own_port_and_network_policies_are_on_by_default() -> None:
    rendered = render_ci("minimal-values.yaml")
    container = rendered.named("Deployment", "api")["spec"]["template"]["spec"]["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert set(ports) == {"http", "metrics"} and ports["http"] != ports["metrics"]
    api_policy = rendered.named("NetworkPolicy", "api")["spec"]
    assert {rule["ports"][0]["port"] for rule in api_policy["ingress"]} == {"http", "metrics"}
    scraped = render({**ci_values("minimal-values.yaml"), "serviceMonitor": {"enabled": True}})
    monitor = scraped.named("ServiceMonitor", "api")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
