"""The worker's Role holds every verb the code calls: derived from the emulator's audit.

The Kubernetes executor (a multi-node job: submit, wait, status, logs, cancel) and the
Kubernetes serving target (deploy, redeploy, rollback) run against kmock's emulated API
server with an API client of their own; every request that client made is turned into the
(API group, resource, verb) RBAC would check, and each must be granted by the Role the chart
renders, with and without named Deployments. A verb the code starts calling without the
chart granting it (the 403 after the patch that a missing ``watch`` gave) fails here.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from services.executors.base import JobRequest
from services.executors.kubernetes.launcher import KubernetesExecutor
from services.serving.kubernetes import KubernetesServingTarget
from services.settings import ServingEndpoint
from tests.helm.chart import Manifest, render
from tests.services.executors.kube_cluster import EmulatedCluster
from tests.services.executors.test_kubernetes_launcher import COMPLETE, make_template
from tests.services.modelserver.conftest import write_checkpoint
from tests.services.serving.test_kubernetes_target import (
    NAME,
    NAMESPACE,
    SERVER,
    DeploymentController,
    Pods,
    audited_verbs,
    create_deployment,
)

MINIMAL = {
    "database": {"url": "postgresql://u:p@db:5432/ratchet"},
    "temporal": {"address": "temporal:7233"},
    # rendered without a cluster: the API server's address cannot be looked up
    "networkPolicy": {"kubernetesApiCidrs": ["10.0.0.1/32"]},
}
USER_AGENT = "ratchet-worker"


def audited_client(cluster: EmulatedCluster) -> client.ApiClient:
    api_client = client.ApiClient(client.Configuration(host=cluster.url.rstrip("/")))
    api_client.user_agent = USER_AGENT
    return api_client


def grants(role: Manifest, group: str, resource: str, verb: str) -> bool:
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in role["rules"]
    )


@pytest.fixture(scope="module")
def used() -> set[tuple[str, str, str]]:
    """What the worker's code paths call, as the emulator saw it."""
    with EmulatedCluster() as cluster:
        run_the_executor(cluster)
        run_the_serving_target(cluster)
        return audited_verbs(cluster, USER_AGENT)


def run_the_executor(cluster: EmulatedCluster) -> None:
    with _tmp() as tmp:
        executor = KubernetesExecutor(
            audited_client(cluster),
            namespace=NAMESPACE,
            template=make_template(tmp),
            watch_read_slack_s=0.3,
        )
        # With credentials: the run's Secret, made, replaced on a retry, deleted at the end.
        spec = _spec(tmp, "demo-c1-train", nodes=2, secret_env={"RATCHET_ROLLOUT_API_KEY": "k"})
        handle = executor.submit(spec)
        executor.submit(spec)  # a retried activity adopts the Job
        cluster.set_job_status(NAMESPACE, handle["job_name"], COMPLETE)
        executor.wait(handle, 5)
        executor.status(handle)
        executor.logs(handle)
        other = executor.submit(_spec(tmp, "demo-c2-train"))
        executor.cancel(other)


def run_the_serving_target(cluster: EmulatedCluster) -> None:
    with _tmp() as tmp:
        checkpoints = [write_checkpoint(tmp / f"ckpt-{seed}", seed) for seed in range(3)]
        create_deployment(cluster, [SERVER])
        with DeploymentController(cluster) as controller, Pods(checkpoints[2]) as pods:
            controller.pods = pods
            endpoint = ServingEndpoint(
                kind="kubernetes",
                url=pods.url,
                namespace=NAMESPACE,
                deployment=NAME,
                rollout_timeout_s=20,
            )
            target = KubernetesServingTarget(
                audited_client(cluster),
                endpoint,
                model="agent",
                verify_timeout_s=5,
                watch_read_slack_s=0.3,
            )
            target.current()
            target.deploy(checkpoints[0])
            target.deploy(checkpoints[1])
            target.deploy(checkpoints[1])
            target.rollback()
            target.stats()


def test_the_audit_saw_both_components(used: set[tuple[str, str, str]]) -> None:
    resources = {(group, resource) for group, resource, _ in used}
    assert ("batch", "jobs") in resources
    assert {("", "secrets", "create"), ("", "secrets", "delete")} <= used  # never get or list
    assert ("apps", "deployments") in resources
    assert ("apps", "deployments", "watch") in used  # the rollout is followed, not polled


@pytest.mark.parametrize(
    "values",
    [
        {**MINIMAL, "rbac": {"servingTarget": {"deploymentNames": [NAME]}}},
        {
            **MINIMAL,
            "serving": {
                "endpoints": {
                    "prod": {"kind": "kubernetes", "url": "http://m:8000", "deployment": NAME}
                }
            },
        },
        {**MINIMAL, "serving": {"vllm": {"enabled": True, "apiKey": {"existingSecret": "k"}}}},
    ],
    ids=["named-deployments", "endpoint-deployment", "with-vllm"],
)
def test_the_role_grants_every_verb_the_code_uses(
    used: set[tuple[str, str, str]], values: dict[str, Any]
) -> None:
    (role,) = render(values).of_kind("Role")
    missing = sorted(used - {u for u in used if grants(role, *u)})
    assert missing == [], f"the chart's Role lacks {missing}"


def test_named_deployments_include_the_charts_vllm_deployment() -> None:
    values = {
        **MINIMAL,
        "rbac": {"servingTarget": {"deploymentNames": ["agent-model"]}},
        "serving": {"vllm": {"enabled": True, "apiKey": {"existingSecret": "k"}}},
    }
    (role,) = render(values).of_kind("Role")
    (rule,) = [r for r in role["rules"] if r["resources"] == ["deployments"]]
    assert rule["resourceNames"] == ["agent-model", "rel-ratchet-vllm"]


def _spec(root: Path, run_id: str, **overrides: Any) -> JobRequest:
    run_dir = root / "artifacts" / "loops" / "demo" / "runs" / run_id
    document = {"schema": "ratchet.job/v1", "kind": "train", "run_id": run_id}
    fields: dict[str, Any] = {
        "run_id": run_id,
        "loop": "demo",
        "kind": "train",
        "document": document,
        "run_dir": run_dir,
        "output_dir": run_dir / "output",
        "logs_dir": run_dir / "logs",
        "cycle": 1,
        **overrides,
    }
    return JobRequest(**fields)


@contextmanager
def _tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)
