"""The configuration the chart renders is what the processes' settings object reads.

Each container's environment is resolved the way the kubelet does it (ConfigMap via
envFrom, Secret keys via secretKeyRef, including a Secret the user manages), then
``services.settings.Settings`` is built from exactly that environment. Every RATCHET_*
name the chart renders must be a real Settings field, so a typo cannot hide.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from services.cores import usable_cores
from services.settings import ENV_PREFIX, Settings
from tests.helm.chart import (
    CI_FILES,
    EXTERNAL_SECRET_DATA,
    NAMESPACE,
    Manifest,
    Rendered,
    ci_values,
    render,
    render_ci,
)


@pytest.fixture(autouse=True)
def _clean_ratchet_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what the chart renders may reach Settings, not this machine's variables."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def _container(rendered: Rendered, component: str) -> Manifest:
    kind = "Job" if component == "migrate" else "Deployment"
    (container,) = rendered.named(kind, component)["spec"]["template"]["spec"]["containers"]
    return container


def _settings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()


def _rendered_setting_names(rendered: Rendered) -> set[str]:
    names: set[str] = set()
    for config_map in rendered.of_kind("ConfigMap"):
        names |= set(config_map.get("data", {}))
    for secret in rendered.of_kind("Secret"):
        names |= set(secret.get("stringData", {})) | set(secret.get("data", {}))
    for _, pod in rendered.pod_templates():
        for container in pod["containers"]:
            names |= {var["name"] for var in container.get("env", [])}
    return {name for name in names if name.startswith(ENV_PREFIX)}


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_every_rendered_ratchet_variable_is_a_settings_field(ci_file: str) -> None:
    names = _rendered_setting_names(render_ci(ci_file))
    assert names, "the chart rendered no RATCHET_* settings"
    fields = set(Settings.model_fields)
    unknown = {name for name in names if name.removeprefix(ENV_PREFIX).lower() not in fields}
    assert unknown == set(), f"not Settings fields (typos?): {sorted(unknown)}"


@pytest.mark.parametrize("ci_file", CI_FILES)
@pytest.mark.parametrize("component", ["api", "worker"])
def test_api_and_worker_settings_arrive_as_configured(
    ci_file: str, component: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = ci_values(ci_file)
    rendered = render_ci(ci_file)
    settings = _settings(monkeypatch, rendered.container_env(_container(rendered, component)))

    assert settings.executor == "kubernetes"
    assert settings.kubernetes_in_cluster is True
    assert settings.kubernetes_namespace == NAMESPACE
    assert settings.temporal_address == values["temporal"]["address"]
    assert settings.temporal_namespace == values["temporal"].get("namespace", "default")
    assert settings.temporal_task_queue == values["temporal"].get("taskQueue", "ratchet")
    assert settings.artifact_root == Path("/var/lib/ratchet/artifacts")
    assert settings.artifacts_dir == Path("/var/lib/ratchet/artifacts")
    assert settings.state_dir == Path("/var/lib/ratchet/state")
    assert settings.log_format == "json"
    assert settings.api_host == "0.0.0.0"
    assert settings.worker_host == "0.0.0.0"
    assert settings.uses_embedded_postgres is False
    assert settings.uses_embedded_temporal is False
    assert settings.kubernetes_job_template == Path("/etc/ratchet/job-template/job-template.yaml")
    expected_price = values.get("config", {}).get("acceleratorHourPriceUsd", 2.5)
    assert settings.accelerator_hour_price_usd == expected_price

    if values.get("secrets", {}).get("existingSecret"):
        assert settings.database_url == EXTERNAL_SECRET_DATA["database-url"]
        assert settings.admin_token is not None
        assert settings.admin_token.get_secret_value() == EXTERNAL_SECRET_DATA["admin-token"]
        assert settings.temporal_api_key is not None
        assert (
            settings.temporal_api_key.get_secret_value() == EXTERNAL_SECRET_DATA["temporal-api-key"]
        )
    else:
        assert settings.database_url == values["database"]["url"]
        token = values.get("secrets", {}).get("adminToken")
        assert (settings.admin_token.get_secret_value() if settings.admin_token else None) == (
            token or None
        )


def test_optional_secret_keys_may_be_absent_from_the_users_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rendered = render_ci("external-secrets-values.yaml")
    (name,) = rendered.external_secrets
    rendered.external_secrets[name] = {
        key: EXTERNAL_SECRET_DATA[key] for key in ("database-url", "secret-key")
    }
    settings = _settings(monkeypatch, rendered.container_env(_container(rendered, "worker")))
    assert settings.database_url == EXTERNAL_SECRET_DATA["database-url"]
    assert settings.admin_token is None
    assert settings.temporal_api_key is None


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_every_pod_that_touches_signing_secrets_gets_the_same_key(
    ci_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """api, worker and the migration (which encrypts secrets stored in clear) share one key."""
    rendered = render_ci(ci_file)
    keys = {
        component: _settings(monkeypatch, rendered.container_env(_container(rendered, component)))
        for component in ("api", "worker", "migrate")
    }
    values = {name: s.secret_key for name, s in keys.items()}
    assert all(value is not None for value in values.values())
    assert len({value.get_secret_value() for value in values.values() if value}) == 1


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_migration_job_gets_the_same_database(
    ci_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered = render_ci(ci_file)
    worker = rendered.container_env(_container(rendered, "worker"))
    migrate_env = rendered.container_env(_container(rendered, "migrate"))
    settings = _settings(monkeypatch, migrate_env)
    assert settings.database_url == worker["RATCHET_DATABASE_URL"]
    assert settings.uses_embedded_postgres is False
    assert settings.state_dir == Path(worker["RATCHET_STATE_DIR"])


def test_temporal_tls_files_are_mounted_where_settings_point() -> None:
    rendered = render_ci("gpu-kueue-values.yaml")
    for component in ("api", "worker"):
        container = _container(rendered, component)
        env = rendered.container_env(container)
        pod = rendered.named("Deployment", component)["spec"]["template"]["spec"]
        assert env["RATCHET_TEMPORAL_TLS"] == "true"
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "temporal-tls"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "temporal-tls"]
        assert volume["secret"]["secretName"] == "temporal-client-tls"
        assert mount["readOnly"] is True
        for variable, key in (
            ("RATCHET_TEMPORAL_TLS_CA_CERT", "ca.crt"),
            ("RATCHET_TEMPORAL_TLS_CLIENT_CERT", "tls.crt"),
            ("RATCHET_TEMPORAL_TLS_CLIENT_KEY", "tls.key"),
        ):
            assert env[variable] == f"{mount['mountPath']}/{key}"


def test_temporal_cloud_uses_server_tls_and_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    rendered = render_ci("external-secrets-values.yaml")
    container = _container(rendered, "worker")
    settings = _settings(monkeypatch, rendered.container_env(container))
    assert settings.temporal_tls is True
    assert settings.temporal_tls_ca_cert is None
    assert settings.temporal_tls_client_cert is None
    assert settings.temporal_api_key is not None
    pod = rendered.named("Deployment", "worker")["spec"]["template"]["spec"]
    assert "temporal-tls" not in {volume["name"] for volume in pod["volumes"]}


def test_temporal_tls_without_client_certificate_sets_only_the_ca() -> None:
    values = ci_values("minimal-values.yaml")
    values["temporal"]["tls"] = {
        "enabled": True,
        "secretName": "temporal-ca",
        "certKey": "",
        "keyKey": "",
    }
    data = render(values).get("ConfigMap", "rel-ratchet-config")["data"]
    assert data["RATCHET_TEMPORAL_TLS"] == "true"
    assert data["RATCHET_TEMPORAL_TLS_CA_CERT"].endswith("/ca.crt")
    assert "RATCHET_TEMPORAL_TLS_CLIENT_CERT" not in data
    assert "RATCHET_TEMPORAL_TLS_CLIENT_KEY" not in data


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_paths_in_settings_are_backed_by_the_right_volumes(ci_file: str) -> None:
    rendered = render_ci(ci_file)
    container = _container(rendered, "worker")
    env = rendered.container_env(container)
    pod = rendered.named("Deployment", "worker")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}

    artifacts = mounts[env["RATCHET_ARTIFACT_ROOT"]]
    assert not artifacts.get("readOnly")
    claim = volumes[artifacts["name"]]["persistentVolumeClaim"]["claimName"]
    existing = ci_values(ci_file).get("artifacts", {}).get("persistence", {}).get("existingClaim")
    if existing:
        assert claim == existing
    else:
        rendered.get("PersistentVolumeClaim", claim)

    template_path = Path(env["RATCHET_KUBERNETES_JOB_TEMPLATE"])
    template_mount = mounts[str(template_path.parent)]
    config_map = volumes[template_mount["name"]]["configMap"]["name"]
    assert template_path.name in rendered.get("ConfigMap", config_map)["data"]


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_ports_and_probes_match_the_settings(ci_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rendered = render_ci(ci_file)
    for component, port_field in (("api", "api_port"), ("worker", "worker_port")):
        container = _container(rendered, component)
        settings = _settings(monkeypatch, rendered.container_env(container))
        port = container["ports"][0]
        assert port["containerPort"] == getattr(settings, port_field)
        if component == "api":  # /metrics on a port of its own
            (metrics,) = [p for p in container["ports"] if p["name"] == "metrics"]
            assert metrics["containerPort"] == settings.api_metrics_port != settings.api_port
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
        assert container["args"] == [component]


def test_public_url_defaults_to_the_first_ingress_host(monkeypatch: pytest.MonkeyPatch) -> None:
    rendered = render_ci("ingress-networkpolicy-values.yaml")
    settings = _settings(monkeypatch, rendered.container_env(_container(rendered, "api")))
    assert settings.public_url == "https://ratchet.example.com"
    assert settings.api_base_url == "https://ratchet.example.com"
    assert settings.temporal_ui_url == "https://temporal.example.com"


def test_numbers_render_as_plain_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Helm holds values as floats; large ones must not come out as 5.24288e+06."""
    values = ci_values("minimal-values.yaml")
    values["config"] = {"ingest": {"maxBodyBytes": 52428800, "queueMax": 1000000}}
    rendered = render(values)
    settings = _settings(monkeypatch, rendered.container_env(_container(rendered, "worker")))
    assert settings.ingest_max_body_bytes == 52428800
    assert settings.ingest_queue_max == 1000000
    template = yaml.safe_load(
        rendered.get("ConfigMap", "rel-ratchet-job-template")["data"]["job-template.yaml"]
    )
    assert template["activeDeadlineSeconds"] == 86400


@pytest.mark.parametrize(("limit", "workers"), [("2", 2), ("1500m", 2), ("500m", 1), (4, 4)])
def test_api_workers_follow_the_containers_cpu_limit(
    limit: str | int, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = {
        **ci_values("minimal-values.yaml"),
        "api": {"resources": {"limits": {"cpu": limit, "memory": "1Gi"}}},
    }
    rendered = render(values)
    settings = _settings(monkeypatch, rendered.container_env(_container(rendered, "api")))
    assert settings.api_workers == workers


def test_without_a_cpu_limit_the_api_counts_its_usable_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rendered = render_ci("minimal-values.yaml")
    env = rendered.container_env(_container(rendered, "api"))
    assert "RATCHET_API_WORKERS" not in env
    assert _settings(monkeypatch, env).api_workers == min(usable_cores(), 64)
