"""The Kubernetes serving target against kmock's emulated API server, with the real client.

The emulator runs no controllers, so the test plays the Deployment controller (through the
API: it rolls out when the generation moves) and the pods: a real ``ratchet serve`` app
(vLLM itself needs CUDA) that, on each rollout, serves what the new pod template's
environment names, as the chart's vLLM pods do when they restart. Verification goes to that
server, as it goes to the Service in a cluster.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from services.modelserver.registry import ModelRegistry
from services.serving.base import CheckpointRef, DeployFailed
from services.serving.kubernetes import (
    ANNOTATION_PREVIOUS_VERSION,
    ANNOTATION_VERSION,
    KubernetesServingTarget,
    rollout_state,
)
from services.settings import ServingEndpoint
from tests.services.executors.kube_cluster import DEPLOYMENTS, EmulatedCluster
from tests.services.modelserver.conftest import ServerThread, path_of

NAMESPACE = "serving"
NAME = "agent-model"
USER_AGENT = "ratchet-serving-target"
SERVING_VERBS = frozenset({"get", "patch", "list", "watch"})


def audited_verbs(cluster: EmulatedCluster, user_agent: str) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every request ``user_agent`` made, from the emulator's
    own record: the RBAC verbs a Role must grant for that client's code paths."""
    used = set()
    for request in cluster.emulator._requests:
        if request.headers.get("User-Agent") != user_agent or request.resource is None:
            continue
        resource = request.resource
        name = resource.plural + (f"/{request.subresource}" if request.subresource else "")
        method = request.method.value
        if method == "GET":
            verb = "get" if request.name else "watch" if request.params.get("watch") else "list"
        else:
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, "delete")
            if method == "DELETE" and not request.name:
                verb = "deletecollection"
        used.add((resource.group, name, verb))
    return used


def used_verbs(cluster: EmulatedCluster) -> set[str]:
    return {verb for _, _, verb in audited_verbs(cluster, USER_AGENT)}


def audited_client(cluster: EmulatedCluster) -> client.ApiClient:
    """An API client of its own, so the audit tells the target's requests from the test's."""
    api_client = client.ApiClient(client.Configuration(host=cluster.url.rstrip("/")))
    api_client.user_agent = USER_AGENT
    return api_client


class DeploymentController:
    """Rolls out a new generation (what kube-controller-manager does), unless told to stall."""

    def __init__(self, cluster: EmulatedCluster) -> None:
        self.cluster = cluster
        self.mode = "rollout"  # or "stall", "deadline"
        self.rolled_out_version: str | None = None
        self.pods: Pods | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DeploymentController:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            raw: Any = self.cluster.apps.read_namespaced_deployment(
                NAME, NAMESPACE, _preload_content=False
            )
            deployment = json.loads(raw.data)
            generation = deployment["metadata"].get("generation", 1)
            status = deployment.get("status") or {}
            if status.get("observedGeneration", 0) >= generation:
                continue
            if self.mode == "stall":
                continue
            replicas = deployment["spec"].get("replicas", 1)
            new_status: dict[str, Any] = {"observedGeneration": generation}
            if self.mode == "deadline":
                new_status["conditions"] = [
                    {
                        "type": "Progressing",
                        "status": "False",
                        "reason": "ProgressDeadlineExceeded",
                        "message": "ReplicaSet has timed out progressing.",
                    }
                ]
            else:
                new_status.update(
                    replicas=replicas,
                    updatedReplicas=replicas,
                    readyReplicas=replicas,
                    availableReplicas=replicas,
                )
                annotations = deployment["spec"]["template"]["metadata"].get("annotations") or {}
                self.rolled_out_version = annotations.get(ANNOTATION_VERSION)
                if self.pods is not None:
                    self.pods.restart(deployment["spec"]["template"])
            body: Any = {"status": new_status}
            self.cluster.apps.patch_namespaced_deployment_status(
                NAME, NAMESPACE, body, _content_type="application/merge-patch+json"
            )


class Pods:
    """The Deployment's pods: a model server that loads what the rolled-out template names."""

    def __init__(self, first: CheckpointRef) -> None:
        registry = ModelRegistry(device="cpu")
        registry.load("agent", path_of(first))
        self.server = ServerThread(registry)
        self.url = self.server.url
        self.ignore_rollouts = False

    def restart(self, template: dict[str, Any]) -> None:
        if self.ignore_rollouts:
            return
        server = next(c for c in template["spec"]["containers"] if c["name"] == "server")
        env = {e["name"]: e["value"] for e in server.get("env") or []}
        self.server.registry.load("agent", Path(env["RATCHET_MODEL_PATH"]), replace=True)

    def __enter__(self) -> Pods:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__()


def create_deployment(cluster: EmulatedCluster, containers: list[dict[str, Any]]) -> None:
    manifest: Any = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "generation": 1},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": NAME}},
            "template": {"metadata": {"labels": {"app": NAME}}, "spec": {"containers": containers}},
        },
        "status": {
            "observedGeneration": 1,
            "replicas": 2,
            "updatedReplicas": 2,
            "availableReplicas": 2,
        },
    }
    cluster.apps.create_namespaced_deployment(NAMESPACE, manifest)


SERVER = {
    "name": "server",
    "image": "ratchet:1",
    "env": [{"name": "LOG_LEVEL", "value": "INFO"}],
}
SIDECAR = {"name": "proxy", "image": "envoy:1"}


@pytest.fixture
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster() as emulated:
        yield emulated


@pytest.fixture
def controller(cluster: EmulatedCluster) -> Iterator[DeploymentController]:
    create_deployment(cluster, [SERVER, SIDECAR])
    with DeploymentController(cluster) as running:
        yield running


@pytest.fixture
def servers(controller: DeploymentController, checkpoints: list[CheckpointRef]) -> Iterator[Pods]:
    with Pods(checkpoints[2]) as running:
        controller.pods = running
        yield running


def make_target(
    cluster: EmulatedCluster, servers: Pods | None = None, **overrides: Any
) -> KubernetesServingTarget:
    """A target of the test's Deployment; ``overrides`` are serving-endpoint fields or the
    target's own keywords."""
    fields: dict[str, Any] = {
        "kind": "kubernetes",
        "url": servers.url if servers else "http://127.0.0.1:9",
        "namespace": NAMESPACE,
        "deployment": NAME,
        "container": "server",
        "rollout_timeout_s": 20,
    }
    options: dict[str, Any] = {"model": "agent", "verify_timeout_s": 2, "watch_read_slack_s": 0.3}
    for key, value in overrides.items():
        (fields if key in ServingEndpoint.model_fields else options)[key] = value
    return KubernetesServingTarget(audited_client(cluster), ServingEndpoint(**fields), **options)


def deployment(cluster: EmulatedCluster) -> dict[str, Any]:
    return dict(cluster.objects(DEPLOYMENTS))[NAME]


def test_deploy_patches_the_model_waits_for_the_rollout_and_verifies(
    cluster: EmulatedCluster, servers: Pods, checkpoints: list[CheckpointRef]
) -> None:
    a = checkpoints[0]
    beats: list[str] = []
    target = make_target(cluster, servers, heartbeat=beats.append)
    current = target.current()  # what the pods serve before Ratchet touched them
    assert current is not None and current.version == checkpoints[2].id

    outcome = target.deploy(a)

    assert (outcome.version, outcome.previous_version, outcome.changed) == (a.id, None, True)
    live = deployment(cluster)
    containers = live["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server", "proxy"]
    assert containers[0]["image"] == "ratchet:1"
    assert containers[0]["env"] == [
        {"name": "LOG_LEVEL", "value": "INFO"},
        {"name": "RATCHET_MODEL_PATH", "value": str(path_of(a))},
    ]
    assert "env" not in containers[1]
    assert live["spec"]["template"]["metadata"]["annotations"][ANNOTATION_VERSION] == a.id
    assert live["metadata"]["annotations"][ANNOTATION_VERSION] == a.id
    served = target.current()
    assert served is not None and served.version == a.id
    assert target.stats()["available_replicas"] == 2
    assert any("waiting for the rollout" in b for b in beats)
    assert any("verifying" in b for b in beats)


def test_the_target_uses_exactly_the_verbs_the_chart_grants(
    cluster: EmulatedCluster, servers: Pods, checkpoints: list[CheckpointRef]
) -> None:
    """The emulator's audit of a deploy and a rollback: get, patch, list and watch, nothing
    else (tests/helm/test_rbac.py checks the chart's Role grants them)."""
    target = make_target(cluster, servers)
    target.deploy(checkpoints[0])
    target.deploy(checkpoints[1])
    target.rollback()
    assert used_verbs(cluster) <= SERVING_VERBS
    assert {"get", "patch", "watch"} <= used_verbs(cluster)


def test_redeploying_the_served_version_changes_nothing(
    cluster: EmulatedCluster, servers: Pods, checkpoints: list[CheckpointRef]
) -> None:
    target = make_target(cluster, servers)
    target.deploy(checkpoints[0])
    patches = len(cluster.requests("PATCH", DEPLOYMENTS))

    again = target.deploy(checkpoints[0])

    assert again.changed is False
    assert len(cluster.requests("PATCH", DEPLOYMENTS)) == patches  # no patch, no rollout


def test_rollback_serves_the_previous_model_again(
    cluster: EmulatedCluster, servers: Pods, checkpoints: list[CheckpointRef]
) -> None:
    a, b = checkpoints[0], checkpoints[1]
    target = make_target(cluster, servers)
    target.deploy(a)
    target.deploy(b)
    assert deployment(cluster)["metadata"]["annotations"][ANNOTATION_PREVIOUS_VERSION] == a.id

    rolled = target.rollback()

    assert (rolled.version, rolled.previous_version) == (a.id, b.id)
    env = deployment(cluster)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RATCHET_MODEL_PATH", "value": str(path_of(a))} in env
    served = target.current()
    assert served is not None and served.version == a.id


def test_rollback_without_a_previous_model_fails(
    cluster: EmulatedCluster, servers: Pods, checkpoints: list[CheckpointRef]
) -> None:
    target = make_target(cluster, servers)
    target.deploy(checkpoints[0])
    with pytest.raises(DeployFailed, match="no previous model"):
        target.rollback()


def test_a_stalled_rollout_fails_the_deploy(
    cluster: EmulatedCluster, controller: DeploymentController, checkpoints: list[CheckpointRef]
) -> None:
    controller.mode = "stall"
    target = make_target(cluster, rollout_timeout_s=1)
    with pytest.raises(DeployFailed, match="did not complete within 1s"):
        target.deploy(checkpoints[0])


def test_an_exceeded_progress_deadline_fails_the_deploy(
    cluster: EmulatedCluster, controller: DeploymentController, checkpoints: list[CheckpointRef]
) -> None:
    controller.mode = "deadline"
    target = make_target(cluster)
    with pytest.raises(DeployFailed, match="progress deadline exceeded"):
        target.deploy(checkpoints[0])


def test_pods_that_ignore_the_new_model_fail_the_deploy(
    cluster: EmulatedCluster, servers: Pods, checkpoints: list[CheckpointRef]
) -> None:
    """The Deployment says the new model (Ratchet wrote it); the servers say otherwise."""
    target = make_target(cluster, servers)
    target.deploy(checkpoints[0])
    servers.ignore_rollouts = True
    with pytest.raises(DeployFailed, match="do not serve"):
        target.deploy(checkpoints[1])


def test_unreachable_model_servers_fail_verification(
    cluster: EmulatedCluster, controller: DeploymentController, checkpoints: list[CheckpointRef]
) -> None:
    with pytest.raises(DeployFailed, match="do not serve"):
        make_target(cluster, verify_timeout_s=0.5).deploy(checkpoints[1])


def test_several_containers_need_the_container_named(
    cluster: EmulatedCluster, controller: DeploymentController, checkpoints: list[CheckpointRef]
) -> None:
    with pytest.raises(DeployFailed, match="set the serving target's `container`"):
        make_target(cluster, container=None).deploy(checkpoints[0])
    with pytest.raises(DeployFailed, match="no container 'model'"):
        make_target(cluster, container="model").deploy(checkpoints[0])


def test_a_missing_deployment_is_a_clear_error(
    cluster: EmulatedCluster, checkpoints: list[CheckpointRef]
) -> None:
    target = make_target(cluster, deployment="nope")
    with pytest.raises(DeployFailed, match="404"):
        target.deploy(checkpoints[0])


def observed_deployment(wanted: int, /, **status: int) -> dict[str, Any]:
    """A Deployment whose controller has seen generation 2, wanting ``wanted`` replicas,
    with ``status``'s replica counts."""
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": wanted},
        "status": {"observedGeneration": 2, **status},
    }


@pytest.mark.parametrize(
    ("deployment_state", "expected"),
    [
        ({"metadata": {"generation": 2}, "status": {"observedGeneration": 1}}, "progressing"),
        (observed_deployment(3, updatedReplicas=2), "progressing"),
        (
            observed_deployment(2, replicas=3, updatedReplicas=2, availableReplicas=2),
            "progressing",
        ),
        (observed_deployment(2, replicas=2, updatedReplicas=2, availableReplicas=2), "complete"),
    ],
)
def test_rollout_state_follows_kubectl(deployment_state: dict[str, Any], expected: str) -> None:
    assert rollout_state(deployment_state) == expected
