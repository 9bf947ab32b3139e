"""Serving targets from a loop's ``serving_target`` configuration.

The configuration is the loop's JSON column (validated by the API with
``services.loop.policies.ServingTarget``)::

    {"kind": "local", "url": "http://127.0.0.1:8100", "model": "ratchet"}
    {"kind": "openai", "url": "http://vllm.serving:8000", "model": "agent",
     "artifacts_dir": "/artifacts"}
    {"kind": "kubernetes", "namespace": "serving", "deployment": "agent-model",
     "url": "http://agent-model.serving:8000", "model": "agent",
     "artifacts_dir": "/artifacts", "rollout_timeout_s": 600}
    {"kind": "none"}

:class:`ServingTargets` builds (and reuses) one target per configuration and is itself the
worker's deploy callable: ``deploy(serving_target, checkpoint_id, checkpoint_uri)`` returns
the version the target verified it serves.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from services.serving.base import CheckpointRef, DeployFailed, ServingTarget
from services.settings import Settings

logger = logging.getLogger(__name__)

TARGET_KINDS = ("local", "openai", "kubernetes", "none")
DEFAULT_MODEL = "ratchet"  # `ratchet serve --served-model-name`'s default


class ServingTargets:
    """Targets by configuration, built on first use. Safe to share between threads."""

    def __init__(
        self,
        settings: Settings,
        *,
        start_local_server: bool = True,
        kubernetes_client: Callable[[], Any] | None = None,
        heartbeat: Callable[[str], None] | None = None,
    ) -> None:
        """``start_local_server``: a local target starts the model server if none runs."""
        self._settings = settings
        self._heartbeat = heartbeat
        self._start_local_server = start_local_server
        self._kubernetes_client = kubernetes_client
        self._targets: dict[str, ServingTarget] = {}
        self._lock = threading.Lock()

    def __call__(
        self, serving_target: Mapping[str, Any], checkpoint_id: str, checkpoint_uri: str
    ) -> str:
        """Deploy and return the version the target verified it serves."""
        if serving_target.get("kind", "local") == "none":
            logger.info("loop has no serving target; %s is champion offline", checkpoint_id[:12])
            return checkpoint_id
        target = self.target(serving_target)
        return target.deploy(CheckpointRef(id=checkpoint_id, uri=checkpoint_uri)).version

    def target(self, config: Mapping[str, Any]) -> ServingTarget:
        key = json.dumps(dict(config), sort_keys=True, default=str)
        with self._lock:
            if key not in self._targets:
                self._targets[key] = self._build(config)
            return self._targets[key]

    def _build(self, config: Mapping[str, Any]) -> ServingTarget:
        kind = config.get("kind", "local")
        if kind == "local":
            return self._local(config)
        if kind == "openai":
            return self._openai(config)
        if kind == "kubernetes":
            return self._kubernetes(config)
        raise DeployFailed(
            f"serving target kind {kind!r} cannot deploy; expected one of {', '.join(TARGET_KINDS)}"
        )

    def _local(self, config: Mapping[str, Any]) -> ServingTarget:
        from services.serving.local import LocalServerProcess, LocalServingTarget

        settings = self._settings
        default_url = f"http://{settings.serve_host}:{settings.serve_port}"
        url = str(config.get("url") or default_url)
        process = None
        if self._start_local_server and url == default_url:
            process = LocalServerProcess(
                host=settings.serve_host, port=settings.serve_port, logs_dir=settings.logs_dir
            )
        token = settings.admin_token.get_secret_value() if settings.admin_token else None
        return LocalServingTarget(
            url,
            model=str(config.get("model") or DEFAULT_MODEL),
            admin_token=token,
            process=process,
            heartbeat=self._heartbeat,
            verify_timeout_s=float(config.get("verify_timeout_s") or 60.0),
        )

    def _openai(self, config: Mapping[str, Any]) -> ServingTarget:
        from services.serving.openai_target import OpenAIServingTarget

        url, model = config.get("url"), config.get("model")
        if not url or not model:
            raise DeployFailed("an openai serving target needs `url` and `model`")
        artifacts_dir = config.get("artifacts_dir")
        return OpenAIServingTarget(
            str(url),
            model=str(model),
            api_key=self._api_key(),
            artifacts_root=self._settings.artifacts_dir if artifacts_dir else None,
            server_artifacts_dir=str(artifacts_dir) if artifacts_dir else None,
            verify_timeout_s=float(config.get("verify_timeout_s") or 60.0),
            heartbeat=self._heartbeat,
        )

    def _api_key(self) -> str | None:
        settings = self._settings
        key = settings.serving_api_key or settings.admin_token
        return key.get_secret_value() if key is not None else None

    def _kubernetes(self, config: Mapping[str, Any]) -> ServingTarget:
        from services.executors.kubernetes.api import api_client_from_settings
        from services.serving.kubernetes import KubernetesServingTarget
        from services.serving.openai_target import server_path

        deployment = config.get("deployment")
        if not deployment:
            raise DeployFailed("a kubernetes serving target needs `deployment`")
        api_client = (
            self._kubernetes_client()
            if self._kubernetes_client is not None
            else api_client_from_settings(self._settings)
        )
        url = config.get("url") or _url_from_version_url(config.get("version_url"))
        if not url:
            raise DeployFailed(
                "a kubernetes serving target needs `url` (the model servers' OpenAI base URL)"
            )
        artifacts_dir = config.get("artifacts_dir")
        root = self._settings.artifacts_dir
        return KubernetesServingTarget(
            api_client,
            namespace=str(config.get("namespace") or self._settings.kubernetes_namespace),
            deployment=str(deployment),
            url=str(url),
            model=str(config.get("model") or DEFAULT_MODEL),
            container=config.get("container"),
            env_var=str(config.get("env_var") or "RATCHET_MODEL_PATH"),
            server_path=lambda ref: server_path(ref, root, artifacts_dir or None),
            api_key=self._api_key(),
            rollout_timeout_s=float(config.get("rollout_timeout_s") or 600.0),
            verify_timeout_s=float(config.get("verify_timeout_s") or 60.0),
            heartbeat=self._heartbeat,
        )


def _url_from_version_url(version_url: Any) -> str | None:
    """The base URL behind the deprecated ``version_url`` (``.../v1/model``)."""
    if isinstance(version_url, str) and version_url.rstrip("/").endswith("/v1/model"):
        return version_url.rstrip("/").removesuffix("/v1/model")
    return None
