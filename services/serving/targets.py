"""Serving targets from a loop's ``serving_target`` configuration.

A loop picks where its champion serves; the deployment says what that place is. The loop's
JSON column (``services.loop.policies.ServingTarget``) names a kind, and for ``openai`` and
``kubernetes`` one of the serving endpoints in the worker's settings
(``RATCHET_SERVING_ENDPOINTS``, ``services.settings.ServingEndpoint``)::

    {"kind": "local", "model": "ratchet"}
    {"kind": "openai", "endpoint": "vllm", "model": "agent"}
    {"kind": "kubernetes", "endpoint": "vllm-prod", "model": "agent"}
    {"kind": "none"}

The URL, the API key, where the server sees the artifact store and the Deployment a deploy
patches come only from the endpoint, so editing a loop cannot send a credential anywhere
the operator did not list, nor patch another Deployment. The admin token is never sent to
a model server: the local target sends ``RATCHET_SERVE_API_KEY`` (the model server's own
key), an endpoint its own ``api_key``.

:class:`ServingTargets` builds (and reuses) one target per configuration and is itself the
worker's deploy callable: ``deploy(serving_target, checkpoint_id, checkpoint_uri)`` returns
the version the target verified it serves; :meth:`ServingTargets.prove` then proves the
delivery with the checkpoint's probe set (``services.serving.delivery``). A configuration
that cannot deploy (an unknown endpoint, or a loop saved with a URL before serving
endpoints) fails with :class:`DeployFailed`, which is not retried, saying what to configure.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from pydantic import ValidationError

from services.cores import thread_budget
from services.evaluation.probes import ProbeSet
from services.loop import policies
from services.loop.policies import RECORDED, describe_errors, serving_endpoint_problem
from services.modelserver.attestation import TraceAttestation, attestation_key, attested
from services.modelserver.usage import UsageUnavailable, VersionUsage, read_usage
from services.serving.base import CheckpointRef, DeployFailed, ServingTarget
from services.serving.client import ModelServerClient
from services.serving.delivery import NO_PROBE_SET, DeliveryProof, not_verified, prove_delivery
from services.settings import ENV_PREFIX, ServingEndpoint, Settings, secret_field_names

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
        if parse_serving_target(serving_target).kind == "none":
            logger.info("loop has no serving target; %s is champion offline", checkpoint_id[:12])
            return checkpoint_id
        target = self.target(serving_target)
        return target.deploy(CheckpointRef(id=checkpoint_id, uri=checkpoint_uri)).version

    def attestation(self, config: Mapping[str, Any]) -> TraceAttestation | None:
        """How the canary tells traces this target served from traces that only say so:
        a ``local`` target is the model server this worker starts with the attestation key;
        an endpoint is one when the operator marked it ``attests`` (a ``ratchet serve`` given
        the same key). None: the serving path cannot sign, and the clients' word is all the
        canary has."""
        key = attestation_key(self._settings)
        if key is None:
            return None
        policy = parse_serving_target(config)
        if policy.kind == "local":
            return partial(attested, key=key)
        endpoint = self._settings.serving_endpoints.get(policy.endpoint or "")
        if endpoint is not None and endpoint.attests:
            return partial(attested, key=key)
        return None

    def usage(self, config: Mapping[str, Any]) -> dict[str, VersionUsage]:
        """The serving ledger's sample: the counters on the target's /metrics (none for a
        loop without a server); :class:`UsageUnavailable` when they cannot be read."""
        policy = parse_serving_target(config)
        if policy.kind == "none":
            return {}
        if policy.kind == "local":
            settings = self._settings
            key = settings.serve_api_key
            url = f"http://{settings.serve_host}:{settings.serve_port}"
            return read_usage(url, api_key=key.get_secret_value() if key else None)
        endpoint = self._settings.serving_endpoints.get(policy.endpoint or "")
        if endpoint is None:
            raise UsageUnavailable(f"no serving endpoint named {policy.endpoint!r}")
        return read_usage(endpoint.url, api_key=_key(endpoint), timeout_s=endpoint.timeout_s)

    def prove(
        self, serving_target: Mapping[str, Any], checkpoint_id: str, probes: ProbeSet | None
    ) -> DeliveryProof:
        """Proof of delivery (:mod:`services.serving.delivery`) of the checkpoint a deploy
        just verified: its probes sent to the loop's model name and compared. DeployFailed
        on a mismatch; a note, never silence, when there is nothing to prove with."""
        if parse_serving_target(serving_target).kind == "none":
            return not_verified(checkpoint_id, "not verified: the loop has no serving target")
        if probes is None:
            logger.warning("deploy of %s: %s", checkpoint_id[:12], NO_PROBE_SET)
            return not_verified(checkpoint_id)
        target = self.target(serving_target)
        client, model = getattr(target, "client", None), getattr(target, "model", None)
        if not isinstance(client, ModelServerClient) or not isinstance(model, str):
            return not_verified(
                checkpoint_id, f"not verified: a {target.kind} target takes no probes"
            )
        return prove_delivery(client, model, probes, checkpoint_id=checkpoint_id)

    def target(self, config: Mapping[str, Any]) -> ServingTarget:
        policy = parse_serving_target(config)
        key = json.dumps(policy.model_dump(mode="json"), sort_keys=True)
        with self._lock:
            if key not in self._targets:
                self._targets[key] = self._build(policy)
            return self._targets[key]

    def _build(self, policy: policies.ServingTarget) -> ServingTarget:
        endpoints = self._settings.serving_endpoints
        problem = serving_endpoint_problem(
            policy, {name: endpoint.kind for name, endpoint in endpoints.items()}
        )
        if problem:
            raise DeployFailed(problem)
        if policy.kind == "local":
            return self._local(policy)
        assert policy.endpoint is not None  # serving_endpoint_problem checked it
        endpoint = endpoints[policy.endpoint]
        if policy.kind == "openai":
            return self._openai(policy, endpoint)
        if policy.kind == "kubernetes":
            return self._kubernetes(policy, endpoint)
        raise DeployFailed(
            f"serving target kind {policy.kind!r} cannot deploy; expected one of "
            f"{', '.join(TARGET_KINDS)}"
        )

    def _local(self, policy: policies.ServingTarget) -> ServingTarget:
        from services.serving.local import LocalServerProcess, LocalServingTarget

        settings = self._settings
        key = settings.serve_api_key.get_secret_value() if settings.serve_api_key else None
        process = None
        if self._start_local_server:
            process = LocalServerProcess(
                host=settings.serve_host,
                port=settings.serve_port,
                logs_dir=settings.logs_dir,
                threads=thread_budget().server,  # the jobs beside it take the rest
                env=model_server_environment(settings),
            )
        return LocalServingTarget(
            f"http://{settings.serve_host}:{settings.serve_port}",
            model=policy.model or DEFAULT_MODEL,
            api_key=key,
            process=process,
            heartbeat=self._heartbeat,
            verify_timeout_s=policy.verify_timeout_s,
        )

    def _openai(self, policy: policies.ServingTarget, endpoint: ServingEndpoint) -> ServingTarget:
        from services.serving.openai_target import OpenAIServingTarget

        assert policy.model is not None  # the policy requires it of a new openai target
        return OpenAIServingTarget(
            endpoint.url,
            model=policy.model,
            api_key=_key(endpoint),
            timeout_s=endpoint.timeout_s,
            artifacts_root=self._settings.artifacts_dir if endpoint.artifacts_dir else None,
            server_artifacts_dir=endpoint.artifacts_dir,
            verify_timeout_s=policy.verify_timeout_s,
            heartbeat=self._heartbeat,
        )

    def _kubernetes(
        self, policy: policies.ServingTarget, endpoint: ServingEndpoint
    ) -> ServingTarget:
        from services.executors.kubernetes.api import api_client_from_settings
        from services.serving.kubernetes import KubernetesServingTarget
        from services.serving.openai_target import server_path

        assert endpoint.deployment is not None  # ServingEndpoint requires it of kubernetes
        api_client = (
            self._kubernetes_client()
            if self._kubernetes_client is not None
            else api_client_from_settings(self._settings)
        )
        root = self._settings.artifacts_dir
        return KubernetesServingTarget(
            api_client,
            namespace=endpoint.namespace or self._settings.kubernetes_namespace,
            deployment=endpoint.deployment,
            url=endpoint.url,
            model=policy.model or DEFAULT_MODEL,
            container=endpoint.container,
            env_var=endpoint.env_var,
            server_path=lambda ref: server_path(ref, root, endpoint.artifacts_dir),
            api_key=_key(endpoint),
            timeout_s=endpoint.timeout_s,
            rollout_timeout_s=endpoint.rollout_timeout_s,
            verify_timeout_s=policy.verify_timeout_s,
            heartbeat=self._heartbeat,
        )


def parse_serving_target(config: Mapping[str, Any]) -> policies.ServingTarget:
    """A loop's serving target as stored or recorded (a retired key parses, and is refused
    when the target is built); one that does not parse at all cannot deploy."""
    try:
        return policies.ServingTarget.model_validate(dict(config), context=RECORDED)
    except ValidationError as exc:
        raise DeployFailed(
            f"the loop's serving target is invalid: {describe_errors('serving_target', exc)}"
        ) from None


def model_server_environment(settings: Settings) -> dict[str, str]:
    """The environment of a model server this worker starts: its own, minus every secret
    setting (the admin token, the database URL, the secret key, endpoint keys), plus the
    model server's API key, its attestation key and the roots it may load checkpoints from
    (this worker's artifact store, whatever the worker's settings came from). The model
    server loads checkpoints; it holds no credential of the control plane."""
    hidden = {f"{ENV_PREFIX}{name.upper()}" for name in secret_field_names()}
    env = {name: value for name, value in os.environ.items() if name not in hidden}
    if settings.serve_api_key is not None:
        env[f"{ENV_PREFIX}SERVE_API_KEY"] = settings.serve_api_key.get_secret_value()
    if settings.serve_attestation_key is not None:
        key = settings.serve_attestation_key.get_secret_value()
        env[f"{ENV_PREFIX}SERVE_ATTESTATION_KEY"] = key
    roots = settings.serve_model_roots or [settings.artifacts_dir]
    env[f"{ENV_PREFIX}SERVE_MODEL_ROOTS"] = json.dumps([str(root.absolute()) for root in roots])
    return env


def _key(endpoint: ServingEndpoint) -> str | None:
    return endpoint.api_key.get_secret_value() if endpoint.api_key is not None else None
