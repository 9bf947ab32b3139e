"""Serving targets built from a loop's ``serving_target`` configuration."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from starlette.requests import Request

from services.modelserver.registry import ModelRegistry
from services.serving.base import CheckpointRef, DeployFailed, ServingError
from services.serving.kubernetes import KubernetesServingTarget
from services.serving.local import LocalServingTarget, address, model_server_environment
from services.serving.openai_target import OpenAIServingTarget
from services.serving.targets import ServingTargets
from services.settings import ServingEndpoint, Settings
from tests.services.executors.kube_cluster import EmulatedCluster
from tests.services.modelserver.conftest import ServerThread, path_of

ADMIN_TOKEN = "admin-token-of-the-control-plane"
SERVE_KEY = "key-of-the-local-model-server"
SERVE_ADMIN_KEY = "admin-key-of-the-local-model-server"
ENDPOINT_KEY = "key-of-the-vllm-endpoint"
REMOTE_SECRET = "what-the-remote-put-in-its-body"


class Listener:
    """An HTTP server on 127.0.0.1 that records who called it with which Authorization
    header, and answers every request with ``status`` and a body holding REMOTE_SECRET:
    what a loop could once point a serving target at."""

    def __init__(self, status: int = 500) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        listener = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                listener.seen.append((self.command, self.path, self.headers["authorization"]))
                body = json.dumps({"error": {"message": REMOTE_SECRET}}).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Listener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def tokens(self) -> set[str | None]:
        return {authorization for _method, _path, authorization in self.seen}


@pytest.fixture
def listener() -> Iterator[Listener]:
    with Listener() as running:
        yield running


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        state_dir=tmp_path / "state",
        kubernetes_namespace="serving",
        admin_token=SecretStr(ADMIN_TOKEN),
        serve_api_key=SecretStr(SERVE_KEY),
        serve_admin_key=SecretStr(SERVE_ADMIN_KEY),
    )


def with_endpoints(settings: Settings, **endpoints: dict[str, Any]) -> Settings:
    parsed = {name: ServingEndpoint.model_validate(value) for name, value in endpoints.items()}
    return settings.model_copy(update={"serving_endpoints": parsed})


def test_a_local_target_deploys_and_returns_the_verified_version(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef], settings: Settings
) -> None:
    server = serve(checkpoints[0])
    settings = settings.model_copy(update={"serve_port": server.port})
    deploy = ServingTargets(settings, start_local_server=False)
    config = {"kind": "local", "model": "ratchet"}

    served = deploy(config, checkpoints[1].id, checkpoints[1].uri)

    assert served == checkpoints[1].id
    assert isinstance(deploy.target(config), LocalServingTarget)
    assert deploy.target(config) is deploy.target(dict(config))  # built once


def test_an_openai_target_deploys_to_its_endpoint_with_heartbeats(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef], settings: Settings
) -> None:
    server = serve(checkpoints[0], name="agent")
    settings = with_endpoints(settings, vllm={"kind": "openai", "url": server.url})
    beats: list[str] = []
    deploy = ServingTargets(settings, heartbeat=beats.append)
    config = {"kind": "openai", "endpoint": "vllm", "model": "agent"}

    assert deploy(config, checkpoints[1].id, checkpoints[1].uri) == checkpoints[1].id
    assert isinstance(deploy.target(config), OpenAIServingTarget)
    assert beats  # the activity running the deploy heartbeats through this


@pytest.fixture
def recording_server(checkpoints: list[CheckpointRef]) -> Iterator[tuple[ServerThread, list[str]]]:
    """The real model server (serving checkpoints[0] as ``agent``), recording the
    Authorization header of every request it gets."""
    registry = ModelRegistry(device="cpu")
    registry.load("agent", path_of(checkpoints[0]))
    server = ServerThread(registry)
    seen: list[str] = []

    @server.app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        seen.append(request.headers.get("authorization", ""))
        return await call_next(request)

    with server:
        yield server, seen


def deploy_and_roll_back(
    targets: ServingTargets, config: dict[str, Any], ref: CheckpointRef
) -> None:
    assert targets(config, ref.id, ref.uri) == ref.id
    targets.target(config).rollback()


def test_the_local_target_sends_the_model_servers_key_never_the_admin_token(
    recording_server: tuple[ServerThread, list[str]],
    checkpoints: list[CheckpointRef],
    settings: Settings,
) -> None:
    """Every call of a deploy and a rollback to the local model server carries
    RATCHET_SERVE_ADMIN_KEY (a deploy loads models: the API key, the agents', may not); the
    control plane's admin token stays in the control plane."""
    server, seen = recording_server
    settings = settings.model_copy(update={"serve_port": server.port})

    deploy_and_roll_back(
        ServingTargets(settings, start_local_server=False),
        {"kind": "local", "model": "agent"},
        checkpoints[1],
    )

    assert seen and set(seen) == {f"Bearer {SERVE_ADMIN_KEY}"}


def test_an_endpoint_gets_its_own_key_and_no_key_is_never_the_admin_token(
    recording_server: tuple[ServerThread, list[str]],
    checkpoints: list[CheckpointRef],
    settings: Settings,
) -> None:
    server, seen = recording_server
    config = {"kind": "openai", "endpoint": "vllm", "model": "agent"}
    keyed = with_endpoints(
        settings, vllm={"kind": "openai", "url": server.url, "api_key": ENDPOINT_KEY}
    )
    deploy_and_roll_back(ServingTargets(keyed), config, checkpoints[1])
    assert seen and set(seen) == {f"Bearer {ENDPOINT_KEY}"}

    seen.clear()  # an endpoint without a key gets none: the admin token is no fallback
    keyless = with_endpoints(settings, vllm={"kind": "openai", "url": server.url})
    deploy_and_roll_back(ServingTargets(keyless), config, checkpoints[2])
    assert seen and set(seen) == {""}


@pytest.mark.parametrize(
    "recorded",
    [
        {"kind": "local", "url": "LISTENER", "model": "ratchet"},
        {"kind": "openai", "url": "LISTENER", "model": "agent", "artifacts_dir": "/a"},
        {
            "kind": "kubernetes",
            "url": "LISTENER",
            "deployment": "rel-ratchet-worker",
            "env_var": "PYTHONPATH",
            "model": "agent",
        },
    ],
    ids=["local", "openai", "kubernetes"],
)
def test_a_loop_saved_with_a_url_gets_no_request_and_a_non_retryable_refusal(
    listener: Listener,
    checkpoints: list[CheckpointRef],
    settings: Settings,
    recorded: dict[str, Any],
) -> None:
    """A serving target stored (or recorded in a history) before serving endpoints still
    parses, but its deploy sends nothing anywhere and says what to configure."""
    config = {**recorded, "url": listener.url}
    targets = ServingTargets(settings, kubernetes_client=lambda: None)

    with pytest.raises(DeployFailed, match="RATCHET_SERVING_ENDPOINTS") as refused:
        targets(config, checkpoints[0].id, checkpoints[0].uri)

    assert not refused.value.retryable
    assert "url" in str(refused.value) and "`endpoint`" in str(refused.value)
    assert listener.seen == []


def test_remote_bodies_never_reach_an_error(
    checkpoints: list[CheckpointRef], settings: Settings
) -> None:
    """Errors land in Temporal histories: a status code and Ratchet's own words only."""
    for status in (500, 429, 401, 404, 400, 418):
        with Listener(status) as listener:
            settings_here = with_endpoints(settings, vllm={"kind": "openai", "url": listener.url})
            targets = ServingTargets(settings_here)
            with pytest.raises(ServingError) as failed:
                targets(
                    {"kind": "openai", "endpoint": "vllm", "model": "agent"},
                    checkpoints[0].id,
                    checkpoints[0].uri,
                )
        assert REMOTE_SECRET not in str(failed.value)
        assert f"({status})" in str(failed.value) or f"status {status}" in str(failed.value)


def test_no_serving_target_keeps_the_champion_offline(settings: Settings) -> None:
    assert ServingTargets(settings)({"kind": "none"}, "c" * 64, "file:///c") == "c" * 64


def test_unknown_endpoints_and_kinds_are_refused_naming_the_configured_ones(
    settings: Settings,
) -> None:
    settings = with_endpoints(
        settings,
        vllm={"kind": "openai", "url": "http://vllm:8000"},
        prod={"kind": "kubernetes", "url": "http://prod:8000", "deployment": "prod"},
    )
    targets = ServingTargets(settings, kubernetes_client=lambda: None)
    with pytest.raises(DeployFailed, match="kind") as bad_kind:
        targets.target({"kind": "ssh"})
    assert not bad_kind.value.retryable
    with pytest.raises(DeployFailed, match=r"'other'.*configured: prod, vllm"):
        targets.target({"kind": "openai", "endpoint": "other", "model": "agent"})
    with pytest.raises(DeployFailed, match="'vllm' is of kind openai, not kubernetes"):
        targets.target({"kind": "kubernetes", "endpoint": "vllm"})
    with pytest.raises(DeployFailed, match="needs `endpoint`"):
        targets.target({"kind": "kubernetes"})


def test_a_kubernetes_target_patches_only_its_endpoints_deployment(settings: Settings) -> None:
    settings = with_endpoints(
        settings,
        prod={"kind": "kubernetes", "url": "http://model:8000", "deployment": "model"},
    )
    with EmulatedCluster() as cluster:
        targets = ServingTargets(settings, kubernetes_client=lambda: cluster.api_client)
        target = targets.target({"kind": "kubernetes", "endpoint": "prod"})
        assert isinstance(target, KubernetesServingTarget)
        # The namespace came from RATCHET_KUBERNETES_NAMESPACE, the name from the endpoint.
        with pytest.raises(DeployFailed, match="serving/model: Kubernetes API answered 404"):
            target.rollback()


def test_the_model_server_the_worker_starts_holds_no_control_plane_secret(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RATCHET_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("RATCHET_DATABASE_URL", "postgresql://u:p@db/ratchet")
    monkeypatch.setenv("RATCHET_SERVING_ENDPOINTS", "{}")
    monkeypatch.setenv("RATCHET_LOG_LEVEL", "DEBUG")

    settings = Settings(
        serve_api_key=SERVE_KEY, serve_admin_key=SERVE_ADMIN_KEY, artifact_root=tmp_path / "store"
    )
    env = model_server_environment(settings)

    assert env["RATCHET_SERVE_API_KEY"] == SERVE_KEY
    assert env["RATCHET_SERVE_ADMIN_KEY"] == SERVE_ADMIN_KEY
    # What reads its counters or forwards an agent's call holds the key that serves only.
    assert address(settings).api_key == SERVE_KEY
    assert json.loads(env["RATCHET_SERVE_MODEL_ROOTS"]) == [str(tmp_path / "store")]
    assert env["RATCHET_LOG_LEVEL"] == "DEBUG"
    for name in ("RATCHET_ADMIN_TOKEN", "RATCHET_DATABASE_URL", "RATCHET_SERVING_ENDPOINTS"):
        assert name not in env
    assert ADMIN_TOKEN not in " ".join(env.values())


def test_deploy_heartbeats_from_inside_the_activity(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef], settings: Settings
) -> None:
    """What the worker wires: a deploy run as an activity heartbeats while it waits."""
    from temporalio.testing import ActivityEnvironment

    from workflows.registry import _heartbeat_if_in_activity

    server = serve(checkpoints[0], name="agent")
    settings = with_endpoints(settings, vllm={"kind": "openai", "url": server.url})
    deploy = ServingTargets(settings, heartbeat=_heartbeat_if_in_activity)
    config = {"kind": "openai", "endpoint": "vllm", "model": "agent"}
    environment = ActivityEnvironment()
    beats: list[object] = []
    environment.on_heartbeat = lambda *details: beats.append(details)

    served = environment.run(deploy, config, checkpoints[1].id, checkpoints[1].uri)

    assert served == checkpoints[1].id
    assert any("verifying" in str(beat) for beat in beats)
    _heartbeat_if_in_activity("outside an activity: a no-op")


def test_the_model_server_the_worker_starts_takes_its_share_of_the_cores(
    settings: Settings,
) -> None:
    from services.cores import thread_budget

    target = ServingTargets(settings).target({"kind": "local", "model": "ratchet"})
    assert isinstance(target, LocalServingTarget) and target._process is not None
    command = target._process.command(Path("/ckpt"), "ratchet")
    assert command[command.index("--threads") + 1] == str(thread_budget().server)
