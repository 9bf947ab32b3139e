"""Serving targets from a loop's ``serving_target`` configuration.

A loop picks where its champion serves; the deployment says what that place is. The loop's
JSON column (``services.loop.policies.ServingTarget``) names a kind registered in
:mod:`services.serving.kinds` (which says how to add one), and for a kind that deploys to
an endpoint (``openai``, ``kubernetes``) one of the serving endpoints in the worker's settings
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
A configured endpoint its kind refuses (an unknown kind, a ``kubernetes`` one without a
``deployment``) never gets that far: building :class:`ServingTargets`, as the worker does
when it starts, refuses it (:func:`services.serving.kinds.check_serving_endpoints`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from pydantic import ValidationError

from services.evaluation.probes import ProbeSet
from services.loop import policies
from services.loop.policies import RECORDED, describe_errors, serving_endpoint_problem
from services.modelserver.attestation import TraceAttestation, attestation_key, attested
from services.modelserver.usage import UsageUnavailable, VersionUsage, read_usage
from services.serving.base import BuildContext, CheckpointRef, DeployFailed, ServingTarget
from services.serving.client import ModelServerClient
from services.serving.delivery import NO_PROBE_SET, DeliveryProof, not_verified, prove_delivery
from services.serving.kinds import TargetKind, check_serving_endpoints, kind_names, target_kind
from services.settings import Settings

logger = logging.getLogger(__name__)


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
        """``start_local_server``: a local target starts the model server if none runs.

        A serving endpoint its kind refuses stops the worker here, as it starts
        (SettingsError naming the endpoint and the field), not at its first deploy."""
        check_serving_endpoints(settings.serving_endpoints)
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
        if _kind(parse_serving_target(serving_target)).build is None:
            logger.info("loop has no serving target; %s is champion offline", checkpoint_id[:12])
            return checkpoint_id
        target = self.target(serving_target)
        return target.deploy(CheckpointRef(id=checkpoint_id, uri=checkpoint_uri)).version

    def attestation(self, config: Mapping[str, Any]) -> TraceAttestation | None:
        """How the canary tells traces this target served from traces that only say so:
        a kind whose server this worker starts with the attestation key (``local``); an
        endpoint when the operator marked it ``attests`` (a ``ratchet serve`` given the same
        key). None: the serving path cannot sign, and the clients' word is all the canary
        has."""
        key = attestation_key(self._settings)
        if key is None:
            return None
        policy = parse_serving_target(config)
        endpoint = self._settings.serving_endpoints.get(policy.endpoint or "")
        if _kind(policy).attests or (endpoint is not None and endpoint.attests):
            return partial(attested, key=key)
        return None

    def usage(self, config: Mapping[str, Any]) -> dict[str, VersionUsage]:
        """The serving ledger's sample: the counters on the target's /metrics (none for a
        loop without a server); :class:`UsageUnavailable` when they cannot be read."""
        policy = parse_serving_target(config)
        kind = _kind(policy)
        if kind.needs_endpoint and policy.endpoint not in self._settings.serving_endpoints:
            raise UsageUnavailable(f"no serving endpoint named {policy.endpoint!r}")
        server = kind.address(policy, self._context(policy))
        if server is None:
            return {}
        return read_usage(server.url, api_key=server.api_key, timeout_s=server.timeout_s)

    def prove(
        self, serving_target: Mapping[str, Any], checkpoint_id: str, probes: ProbeSet | None
    ) -> DeliveryProof:
        """Proof of delivery (:mod:`services.serving.delivery`) of the checkpoint a deploy
        just verified: its probes sent to the loop's model name and compared. DeployFailed
        on a mismatch; a note, never silence, when there is nothing to prove with."""
        if _kind(parse_serving_target(serving_target)).build is None:
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
        problem = serving_endpoint_problem(policy, self._settings.serving_endpoints)
        if problem:
            raise DeployFailed(problem)
        kind = _kind(policy)
        if kind.build is None:
            raise DeployFailed(f"serving target kind {policy.kind!r} serves nowhere to deploy")
        return kind.build(policy, self._context(policy))

    def _context(self, policy: policies.ServingTarget) -> BuildContext:
        return BuildContext(
            settings=self._settings,
            endpoint=self._settings.serving_endpoints.get(policy.endpoint or ""),
            heartbeat=self._heartbeat,
            start_local_server=self._start_local_server,
            kubernetes_client=self._kubernetes_client,
        )


def _kind(policy: policies.ServingTarget) -> TargetKind:
    kind = target_kind(policy.kind)
    if kind is None:  # a recorded kind no release registers any more
        raise DeployFailed(
            f"serving target kind {policy.kind!r} cannot deploy; expected one of {kind_names()}"
        )
    return kind


def parse_serving_target(config: Mapping[str, Any]) -> policies.ServingTarget:
    """A loop's serving target as stored or recorded (a retired key parses, and is refused
    when the target is built); one that does not parse at all cannot deploy."""
    try:
        return policies.ServingTarget.model_validate(dict(config), context=RECORDED)
    except ValidationError as exc:
        raise DeployFailed(
            f"the loop's serving target is invalid: {describe_errors('serving_target', exc)}"
        ) from None
