"""Render the chart the way Helm installs it, and read the result like the cluster would.

Rendering goes through helm-python-sdk (Helm's own Go SDK, no helm binary). The helpers
here turn the output into Kubernetes objects and resolve a container's environment the
way the kubelet does (envFrom first, then env; secretKeyRef and configMapKeyRef looked up
in the rendered objects or, for a Secret the user manages, in the data a test supplies;
``$(NAME)`` in a value expanded from the variables defined before it).
"""

from __future__ import annotations

import base64
import copy
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "ratchet"
CI_DIR = CHART_DIR / "ci"
RELEASE = "rel"
NAMESPACE = "ml-platform"
CI_FILES = (
    "minimal-values.yaml",
    "gpu-kueue-values.yaml",
    "external-secrets-values.yaml",
    "ingress-networkpolicy-values.yaml",
)
# What the Secret named by secrets.existingSecret holds in external-secrets-values.yaml.
EXTERNAL_SECRET_DATA = {
    "database-url": "postgresql://ratchet:from-vault@pg.databases:5432/ratchet",
    "admin-token": "token-from-vault",
    "temporal-api-key": "temporal-cloud-key-from-vault",
    "secret-key": "dmF1bHQtc2VjcmV0LWtleS1yYXRjaGV0LTMyLWJ5dGU=",
}

Manifest = dict[str, Any]
# libyaml's loader: the rendered chart is a few thousand lines per values file.
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def ci_values(name: str) -> dict[str, Any]:
    loaded = yaml.safe_load((CI_DIR / name).read_text())
    assert isinstance(loaded, dict), f"{name} is not a mapping"
    return loaded


@lru_cache(maxsize=32)
def _render_cached(values_yaml: str, release: str, namespace: str) -> tuple[tuple[str, str], ...]:
    values = yaml.safe_load(values_yaml) or {}
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values, name=release, namespace=namespace, is_install=True)
    return tuple(sorted(rendered.items()))


def render_files(
    values: Mapping[str, Any], *, release: str = RELEASE, namespace: str = NAMESPACE
) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included)."""
    return dict(_render_cached(yaml.safe_dump(dict(values)), release, namespace))


@dataclass
class Rendered:
    """The objects one install would create, plus the Secret a user manages, if any."""

    objects: list[Manifest]
    external_secrets: dict[str, dict[str, str]] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[Manifest]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def get(self, kind: str, name: str) -> Manifest:
        for obj in self.of_kind(kind):
            if obj["metadata"]["name"] == name:
                return obj
        names = [obj["metadata"]["name"] for obj in self.of_kind(kind)]
        raise AssertionError(f"no {kind} named {name!r}; rendered: {names}")

    def named(self, kind: str, component: str) -> Manifest:
        """The object of a kind for a chart component (api, worker, migrate, ...)."""
        matches = [
            obj
            for obj in self.of_kind(kind)
            if obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
        ]
        assert len(matches) == 1, f"expected one {kind} for {component}, got {len(matches)}"
        return matches[0]

    def pod_templates(self) -> Iterator[tuple[Manifest, Manifest]]:
        """(owner, pod spec) for every Deployment and Job."""
        for obj in self.objects:
            if obj["kind"] in {"Deployment", "Job"}:
                yield obj, obj["spec"]["template"]["spec"]

    def secret_data(self, name: str) -> dict[str, str]:
        if name in self.external_secrets:
            return self.external_secrets[name]
        secret = self.get("Secret", name)
        data = {
            key: base64.b64decode(value).decode() for key, value in secret.get("data", {}).items()
        }
        data.update(secret.get("stringData", {}))
        return data

    def container_env(self, container: Manifest) -> dict[str, str]:
        """The environment the kubelet would give this container."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                env.update(self.get("ConfigMap", source["configMapRef"]["name"])["data"])
            if "secretRef" in source:
                env.update(self.secret_data(source["secretRef"]["name"]))
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = _expand(var["value"], env)
                continue
            ref = var["valueFrom"]
            if "resourceFieldRef" in ref:
                env[var["name"]] = _resource_field(container, ref["resourceFieldRef"])
                continue
            if "secretKeyRef" in ref:
                selector = ref["secretKeyRef"]
                data = self.secret_data(selector["name"])
            else:
                selector = ref["configMapKeyRef"]
                data = self.get("ConfigMap", selector["name"])["data"]
            if selector["key"] in data:
                env[var["name"]] = data[selector["key"]]
            else:
                assert selector.get("optional"), (
                    f"{var['name']} needs key {selector['key']} of {selector['name']}, absent"
                )
        return env


def _expand(value: str, env: Mapping[str, str]) -> str:
    """The kubelet's dependent variables: ``$(NAME)`` of a variable defined earlier becomes
    its value, ``$$`` escapes, anything else stays as written."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


def _resource_field(container: Manifest, selector: Mapping[str, Any]) -> str:
    """A Downward API resource value as the kubelet renders it: CPU in whole ``divisor``
    units, rounded up (``500m`` with divisor 1 is ``1``)."""
    kind, _, name = selector["resource"].partition(".")
    raw = str(container["resources"][kind][name])
    assert name == "cpu", f"only CPU resource fields are resolved here, not {name}"
    millicores = int(raw[:-1]) if raw.endswith("m") else int(float(raw) * 1000)
    divisor = str(selector.get("divisor", "1"))
    per_unit = int(divisor[:-1]) if divisor.endswith("m") else int(float(divisor) * 1000)
    return str(-(-millicores // per_unit))


def render(
    values: Mapping[str, Any],
    *,
    external_secrets: Mapping[str, Mapping[str, str]] | None = None,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Rendered:
    objects: list[Manifest] = []
    for path, text in render_files(values, release=release, namespace=namespace).items():
        if path.endswith((".yaml", ".yml")):
            objects.extend(doc for doc in yaml.load_all(text, Loader=Loader) if doc)
    secrets = {name: dict(data) for name, data in (external_secrets or {}).items()}
    return Rendered(objects, secrets)


@lru_cache(maxsize=len(CI_FILES))
def _render_ci_cached(name: str) -> Rendered:
    values = ci_values(name)
    existing = values.get("secrets", {}).get("existingSecret")
    external = {existing: EXTERNAL_SECRET_DATA} if existing else {}
    return render(values, external_secrets=external)


def render_ci(name: str) -> Rendered:
    """The chart rendered with one ci/ values file (a fresh copy each call)."""
    return copy.deepcopy(_render_ci_cached(name))
