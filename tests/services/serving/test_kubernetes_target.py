"""The Kubernetes serving target against kmock's emulated API server, with the real client.

The emulator runs no controllers, so the test plays the Deployment controller (through the
API: it rolls out when the generation moves) and the model servers behind ``version_url``
(they serve the version of the pod template that was rolled out last).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from services.serving.base import CheckpointRef, DeployFailed
from services.serving.kubernetes import (
    ANNOTATION_PREVIOUS_VERSION,
    ANNOTATION_VERSION,
    KubernetesServingTarget,
    rollout_state,
)
from tests.services.executors.kube_cluster import DEPLOYMENTS, EmulatedCluster

NAMESPACE = "serving"
NAME = "agent-model"


class DeploymentController:
    """Rolls out a new generation (what kube-controller-manager does), unless told to stall."""

    def __init__(self, cluster: EmulatedCluster) -> None:
        self.cluster = cluster
        self.mode = "rollout"  # or "stall", "deadline"
        self.rolled_out_version: str | None = None
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
            body: Any = {"status": new_status}
            self.cluster.apps.patch_namespaced_deployment_status(
                NAME, NAMESPACE, body, _content_type="application/merge-patch+json"
            )


class ModelServers:
    """What the Deployment's pods answer on /v1/model: the version last rolled out."""

    def __init__(self, controller: DeploymentController) -> None:
        self.controller = controller
        self.frozen: str | None = None
        servers = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                version = servers.frozen or servers.controller.rolled_out_version
                body = json.dumps({"model_version": version}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/v1/model"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> ModelServers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


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
def servers(controller: DeploymentController) -> Iterator[ModelServers]:
    with ModelServers(controller) as running:
        yield running


def make_target(
    cluster: EmulatedCluster, servers: ModelServers | None = None, **overrides: Any
) -> KubernetesServingTarget:
    options: dict[str, Any] = {
        "namespace": NAMESPACE,
        "deployment": NAME,
        "container": "server",
        "version_url": servers.url if servers else None,
        "rollout_timeout_s": 20,
        "verify_timeout_s": 2,
        "watch_read_slack_s": 0.3,
    }
    options.update(overrides)
    return KubernetesServingTarget(cluster.api_client, **options)


def deployment(cluster: EmulatedCluster) -> dict[str, Any]:
    return dict(cluster.objects(DEPLOYMENTS))[NAME]


CKPT_A = CheckpointRef(id="a" * 64, uri="file:///artifacts/checkpoints/" + "a" * 64)
CKPT_B = CheckpointRef(id="b" * 64, uri="file:///artifacts/checkpoints/" + "b" * 64)


def test_deploy_patches_the_model_waits_for_the_rollout_and_verifies(
    cluster: EmulatedCluster, servers: ModelServers
) -> None:
    target = make_target(cluster, servers)
    assert target.current() is None

    outcome = target.deploy(CKPT_A)

    assert (outcome.version, outcome.previous_version, outcome.changed) == (CKPT_A.id, None, True)
    live = deployment(cluster)
    containers = live["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server", "proxy"]
    assert containers[0]["image"] == "ratchet:1"
    assert containers[0]["env"] == [
        {"name": "LOG_LEVEL", "value": "INFO"},
        {"name": "RATCHET_MODEL_URI", "value": CKPT_A.uri},
    ]
    assert "env" not in containers[1]
    assert live["spec"]["template"]["metadata"]["annotations"][ANNOTATION_VERSION] == CKPT_A.id
    assert live["metadata"]["annotations"][ANNOTATION_VERSION] == CKPT_A.id
    served = target.current()
    assert served is not None and served.version == CKPT_A.id
    assert target.stats()["available_replicas"] == 2


def test_redeploying_the_served_version_changes_nothing(
    cluster: EmulatedCluster, servers: ModelServers
) -> None:
    target = make_target(cluster, servers)
    target.deploy(CKPT_A)
    patches = len(cluster.requests("PATCH", DEPLOYMENTS))

    again = target.deploy(CKPT_A)

    assert again.changed is False
    assert len(cluster.requests("PATCH", DEPLOYMENTS)) == patches  # no patch, no rollout


def test_rollback_serves_the_previous_model_again(
    cluster: EmulatedCluster, servers: ModelServers
) -> None:
    target = make_target(cluster, servers)
    target.deploy(CKPT_A)
    target.deploy(CKPT_B)
    assert deployment(cluster)["metadata"]["annotations"][ANNOTATION_PREVIOUS_VERSION] == CKPT_A.id

    rolled = target.rollback()

    assert (rolled.version, rolled.previous_version) == (CKPT_A.id, CKPT_B.id)
    env = deployment(cluster)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RATCHET_MODEL_URI", "value": CKPT_A.uri} in env
    assert servers.controller.rolled_out_version == CKPT_A.id


def test_rollback_without_a_previous_model_fails(
    cluster: EmulatedCluster, servers: ModelServers
) -> None:
    target = make_target(cluster, servers)
    target.deploy(CKPT_A)
    with pytest.raises(DeployFailed, match="no previous model"):
        target.rollback()


def test_a_stalled_rollout_fails_the_deploy(
    cluster: EmulatedCluster, controller: DeploymentController
) -> None:
    controller.mode = "stall"
    target = make_target(cluster, rollout_timeout_s=1)
    with pytest.raises(DeployFailed, match="did not complete within 1s"):
        target.deploy(CKPT_A)


def test_an_exceeded_progress_deadline_fails_the_deploy(
    cluster: EmulatedCluster, controller: DeploymentController
) -> None:
    controller.mode = "deadline"
    target = make_target(cluster)
    with pytest.raises(DeployFailed, match="progress deadline exceeded"):
        target.deploy(CKPT_A)


def test_pods_serving_another_version_fail_the_deploy(
    cluster: EmulatedCluster, servers: ModelServers
) -> None:
    target = make_target(cluster, servers)
    target.deploy(CKPT_A)
    servers.frozen = CKPT_A.id  # the pods ignore the new model
    with pytest.raises(DeployFailed, match=r"serves 'a+', expected 'b+'"):
        target.deploy(CKPT_B)


def test_without_a_version_url_the_live_template_is_checked(
    cluster: EmulatedCluster, controller: DeploymentController
) -> None:
    outcome = make_target(cluster).deploy(CKPT_B)
    assert outcome.version == CKPT_B.id


def test_several_containers_need_the_container_named(
    cluster: EmulatedCluster, controller: DeploymentController
) -> None:
    with pytest.raises(DeployFailed, match="set the serving target's `container`"):
        make_target(cluster, container=None).deploy(CKPT_A)
    with pytest.raises(DeployFailed, match="no container 'model'"):
        make_target(cluster, container="model").deploy(CKPT_A)


def test_a_missing_deployment_is_a_clear_error(cluster: EmulatedCluster) -> None:
    target = make_target(cluster, deployment="nope")
    with pytest.raises(DeployFailed, match="404"):
        target.deploy(CKPT_A)


@pytest.mark.parametrize(
    ("deployment_state", "expected"),
    [
        ({"metadata": {"generation": 2}, "status": {"observedGeneration": 1}}, "progressing"),
        (
            {
                "metadata": {"generation": 2},
                "spec": {"replicas": 3},
                "status": {"observedGeneration": 2, "updatedReplicas": 2},
            },
            "progressing",
        ),
        (
            {
                "metadata": {"generation": 2},
                "spec": {"replicas": 2},
                "status": {
                    "observedGeneration": 2,
                    "replicas": 3,
                    "updatedReplicas": 2,
                    "availableReplicas": 2,
                },
            },
            "progressing",
        ),
        (
            {
                "metadata": {"generation": 2},
                "spec": {"replicas": 2},
                "status": {
                    "observedGeneration": 2,
                    "replicas": 2,
                    "updatedReplicas": 2,
                    "availableReplicas": 2,
                },
            },
            "complete",
        ),
    ],
)
def test_rollout_state_follows_kubectl(deployment_state: dict[str, Any], expected: str) -> None:
    assert rollout_state(deployment_state) == expected
