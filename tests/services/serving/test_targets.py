"""Serving targets built from a loop's ``serving_target`` configuration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from services.serving.base import CheckpointRef, DeployFailed
from services.serving.kubernetes import KubernetesServingTarget
from services.serving.local import LocalServingTarget
from services.serving.openai_target import OpenAIServingTarget
from services.serving.targets import ServingTargets
from services.settings import Settings
from tests.services.executors.kube_cluster import EmulatedCluster
from tests.services.serving.conftest import ServerThread


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(state_dir=tmp_path / "state", kubernetes_namespace="serving")


def test_a_local_target_deploys_and_returns_the_verified_version(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef], settings: Settings
) -> None:
    server = serve(checkpoints[0])
    deploy = ServingTargets(settings, start_local_server=False)
    config = {"kind": "local", "url": server.url, "model": "ratchet"}

    served = deploy(config, checkpoints[1].id, checkpoints[1].uri)

    assert served == checkpoints[1].id
    assert isinstance(deploy.target(config), LocalServingTarget)
    assert deploy.target(config) is deploy.target(dict(config))  # built once


def test_an_openai_target_deploys_with_heartbeats(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef], settings: Settings
) -> None:
    server = serve(checkpoints[0], name="agent")
    beats: list[str] = []
    deploy = ServingTargets(settings, heartbeat=beats.append)
    config = {"kind": "openai", "url": server.url, "model": "agent"}

    assert deploy(config, checkpoints[1].id, checkpoints[1].uri) == checkpoints[1].id
    assert isinstance(deploy.target(config), OpenAIServingTarget)
    assert beats  # the activity running the deploy heartbeats through this


def test_no_serving_target_keeps_the_champion_offline(settings: Settings) -> None:
    assert ServingTargets(settings)({"kind": "none"}, "c" * 64, "file:///c") == "c" * 64


def test_unknown_and_incomplete_targets_are_refused(settings: Settings) -> None:
    targets = ServingTargets(settings, kubernetes_client=lambda: None)
    with pytest.raises(DeployFailed, match="kind 'ssh'"):
        targets.target({"kind": "ssh"})
    with pytest.raises(DeployFailed, match="needs `deployment`"):
        targets.target({"kind": "kubernetes"})
    with pytest.raises(DeployFailed, match="needs `url`"):
        targets.target({"kind": "kubernetes", "deployment": "model"})
    with pytest.raises(DeployFailed, match="needs `url` and `model`"):
        targets.target({"kind": "openai", "url": "http://x"})


def test_a_kubernetes_target_uses_the_settings_namespace(settings: Settings) -> None:
    with EmulatedCluster() as cluster:
        targets = ServingTargets(settings, kubernetes_client=lambda: cluster.api_client)
        target = targets.target(
            {"kind": "kubernetes", "deployment": "model", "url": "http://model:8000"}
        )
        assert isinstance(target, KubernetesServingTarget)
        # The namespace came from RATCHET_KUBERNETES_NAMESPACE: the read goes there.
        with pytest.raises(DeployFailed, match="serving/model: Kubernetes API answered 404"):
            target.rollback()


def test_deploy_heartbeats_from_inside_the_activity(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef], settings: Settings
) -> None:
    """What the worker wires: a deploy run as an activity heartbeats while it waits."""
    from temporalio.testing import ActivityEnvironment

    from workflows.registry import _heartbeat_if_in_activity

    server = serve(checkpoints[0], name="agent")
    deploy = ServingTargets(settings, heartbeat=_heartbeat_if_in_activity)
    config = {"kind": "openai", "url": server.url, "model": "agent"}
    environment = ActivityEnvironment()
    beats: list[object] = []
    environment.on_heartbeat = lambda *details: beats.append(details)

    served = environment.run(deploy, config, checkpoints[1].id, checkpoints[1].uri)

    assert served == checkpoints[1].id
    assert any("verifying" in str(beat) for beat in beats)
    _heartbeat_if_in_activity("outside an activity: a no-op")
