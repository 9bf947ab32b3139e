"""The Kubernetes serving target: a Deployment of model servers (vLLM, or any OpenAI-compatible
server) whose pods serve the model named in their environment.

``deploy(checkpoint)`` patches the Deployment: the checkpoint's directory, as the pods see
the shared artifact store, goes into the container's environment (``RATCHET_MODEL_PATH``
for a full model; ``RATCHET_LORA_PATH`` for a LoRA adapter, served on the base model the
pods already load) and, with the version, into annotations on the pod template (which is
what rolls the pods) and on the Deployment (which records the previous model for
``rollback``). The chart's vLLM Deployment reads both variables (see
helm/ratchet/templates/vllm-deployment.yaml). The target then watches the rollout to
completion, as ``kubectl rollout status`` does (observed generation caught up, every
replica updated and available, no ``ProgressDeadlineExceeded``), heartbeating all along,
and finally asks the model servers themselves through ``url``: ``/v1/models`` must list the
served name loaded from the checkpoint's directory and a probe must be answered by it. What
Ratchet wrote on the Deployment is never taken as proof.

``rollback()`` deploys the previous model recorded on the Deployment. Ratchet owns only the
model fields of the Deployment: a rollback restores the previous *model*, not the whole
previous pod template, so an operator's unrelated change (image, resources) is never
reverted by a model rollback.

The API calls are exactly ``get``, ``patch``, ``list`` and ``watch`` on deployments: the
chart's Role grants those (tests/helm/test_rbac.py checks it against what this code calls).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from services.artifacts import uri_to_path
from services.executors.base import ExecutorError
from services.executors.kubernetes.api import (
    api_client_from_settings,
    api_reason,
    response_json,
    watch_object,
)
from services.metrics import SERVING_SWAP_DURATION
from services.serving.base import (
    DEFAULT_MODEL,
    BuildContext,
    CheckpointRef,
    DeployFailed,
    DeployOutcome,
    ServedVersion,
    ServingUnavailable,
)
from services.serving.client import ModelServerClient
from services.serving.openai_target import Heartbeat, server_path, version_of, wait_until_served

if TYPE_CHECKING:
    from pathlib import Path

    from services.loop.policies import ServingTarget as ServingConfig
    from services.settings import ServingEndpoint

logger = logging.getLogger(__name__)

ANNOTATION_VERSION = "ratchet.dev/model-version"
ANNOTATION_URI = "ratchet.dev/model-uri"
ANNOTATION_PREVIOUS_VERSION = "ratchet.dev/previous-model-version"
ANNOTATION_PREVIOUS_URI = "ratchet.dev/previous-model-uri"
CHANGE_CAUSE = "kubernetes.io/change-cause"
LORA_ENV_VAR = "RATCHET_LORA_PATH"  # an adapter's directory, served on the pods' base model
RETRYABLE = frozenset({0, 408, 429, 500, 502, 503, 504})
WATCH_CHUNK_S = 20.0  # heartbeat at least this often while the rollout runs


class KubernetesServingTarget:
    """Deploys checkpoints to one Deployment and verifies the rollout."""

    kind = "kubernetes"

    def __init__(
        self,
        api_client: client.ApiClient,
        endpoint: ServingEndpoint,
        *,
        model: str,
        default_namespace: str = "default",
        artifacts_root: Path | None = None,
        verify_timeout_s: float = 60.0,
        watch_read_slack_s: float = 5.0,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        """``endpoint``: the deployment's serving endpoint, never a loop's: the model servers'
        OpenAI base URL (the Service) and key, the Deployment (in ``default_namespace`` when
        the endpoint names none), its container and variable, and where the pods see the
        artifact store that is ``artifacts_root`` here. ``model``: the name the servers serve
        the loop's model under."""
        if endpoint.deployment is None:
            raise ValueError("a kubernetes serving endpoint needs `deployment`")
        api_key = endpoint.api_key.get_secret_value() if endpoint.api_key is not None else None
        self._api_client = api_client
        self._apps = client.AppsV1Api(api_client)
        self._namespace = endpoint.namespace or default_namespace
        self._name = endpoint.deployment
        self._container = endpoint.container
        self._env_var = endpoint.env_var
        self._artifacts_root = artifacts_root
        self._server_artifacts_dir = endpoint.artifacts_dir
        self._servers = ModelServerClient(
            endpoint.url, api_key=api_key, timeout_s=endpoint.timeout_s
        )
        self._model = model
        self._rollout_timeout_s = endpoint.rollout_timeout_s
        self._verify_timeout_s = verify_timeout_s
        self._watch_read_slack_s = watch_read_slack_s
        self._heartbeat = heartbeat or (lambda _detail: None)

    @property
    def client(self) -> ModelServerClient:
        """The model servers behind the Service (what proof of delivery probes)."""
        return self._servers

    @property
    def model(self) -> str:
        return self._model

    # ServingTarget -----------------------------------------------------------------------

    def current(self) -> ServedVersion | None:
        """What the model servers say they serve under the loop's name."""
        card = self._servers.models().get(self._model)
        version = version_of(card)
        if card is None or version is None:
            return None
        annotations = self._read()["metadata"].get("annotations") or {}
        return ServedVersion(
            version=version,
            uri=card.root,
            previous_version=annotations.get(ANNOTATION_PREVIOUS_VERSION),
        )

    def deploy(self, checkpoint: CheckpointRef) -> DeployOutcome:
        started = time.perf_counter()
        deployment = self._read()
        annotations = deployment["metadata"].get("annotations") or {}
        current = annotations.get(ANNOTATION_VERSION)
        changed = current != checkpoint.id
        path = server_path(checkpoint, self._artifacts_root, self._server_artifacts_dir)
        if changed:
            self._heartbeat(f"patching {self._namespace}/{self._name}")
            deployment = self._patch(deployment, checkpoint, path, previous=annotations)
        self._wait_for_rollout(deployment)
        self._verify(checkpoint.id, path)
        latency_ms = (time.perf_counter() - started) * 1000.0
        SERVING_SWAP_DURATION.observe(latency_ms / 1000.0)
        logger.info(
            "deployment %s/%s serves %s (%.0f ms)",
            self._namespace,
            self._name,
            checkpoint.id[:12],
            latency_ms,
        )
        return DeployOutcome(
            version=checkpoint.id,
            previous_version=current,
            latency_ms=latency_ms,
            changed=changed,
            details={"generation": deployment["metadata"].get("generation")},
        )

    def rollback(self) -> DeployOutcome:
        annotations = self._read()["metadata"].get("annotations") or {}
        version = annotations.get(ANNOTATION_PREVIOUS_VERSION)
        uri = annotations.get(ANNOTATION_PREVIOUS_URI)
        if not version or not uri:
            raise DeployFailed(
                f"deployment {self._namespace}/{self._name} records no previous model to "
                "roll back to"
            )
        return self.deploy(CheckpointRef(id=version, uri=uri))

    def stats(self) -> dict[str, Any]:
        deployment = self._read()
        status = deployment.get("status") or {}
        annotations = deployment["metadata"].get("annotations") or {}
        return {
            "model_version": annotations.get(ANNOTATION_VERSION),
            "replicas": (deployment.get("spec") or {}).get("replicas", 1),
            "ready_replicas": status.get("readyReplicas", 0),
            "updated_replicas": status.get("updatedReplicas", 0),
            "available_replicas": status.get("availableReplicas", 0),
        }

    # Steps -------------------------------------------------------------------------------

    def _patch(
        self,
        deployment: dict[str, Any],
        checkpoint: CheckpointRef,
        path: str,
        *,
        previous: dict[str, str],
    ) -> dict[str, Any]:
        """Set the model in env and annotations; a JSON merge patch with the full container list.

        Lists are replaced whole by a merge patch, so the containers go complete (only the
        model variable changed), and the resourceVersion makes a concurrent edit a conflict
        instead of a lost update.
        """
        spec = deployment.get("spec") or {}
        containers = [dict(c) for c in spec["template"]["spec"]["containers"]]
        target = self._target_container(containers)
        adapter = (uri_to_path(checkpoint.uri) / "adapter_config.json").is_file()
        if adapter:  # the base stays; the adapter goes on top of it
            names, value = {LORA_ENV_VAR}, {"name": LORA_ENV_VAR, "value": path}
        else:  # a full model replaces the base, and no adapter goes on top of it
            names = {self._env_var, LORA_ENV_VAR}
            value = {"name": self._env_var, "value": path}
        env = [e for e in target.get("env") or [] if e.get("name") not in names]
        target["env"] = [*env, value]
        model_annotations = {ANNOTATION_VERSION: checkpoint.id, ANNOTATION_URI: checkpoint.uri}
        metadata: dict[str, Any] = {
            "annotations": {
                **model_annotations,
                ANNOTATION_PREVIOUS_VERSION: previous.get(ANNOTATION_VERSION),
                ANNOTATION_PREVIOUS_URI: previous.get(ANNOTATION_URI),
                CHANGE_CAUSE: f"ratchet: serve checkpoint {checkpoint.id[:12]}",
            }
        }
        version = deployment["metadata"].get("resourceVersion")
        if version:
            metadata["resourceVersion"] = version
        body: Any = {
            "metadata": metadata,
            "spec": {
                "template": {
                    "metadata": {"annotations": model_annotations},
                    "spec": {"containers": containers},
                }
            },
        }
        try:
            patched = self._apps.patch_namespaced_deployment(
                self._name,
                self._namespace,
                body,
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        except ApiException as exc:
            raise self._error(exc, "patch") from exc
        except Exception as exc:
            raise ServingUnavailable(f"cannot reach the Kubernetes API: {exc}") from exc
        return response_json(patched)

    def _target_container(self, containers: list[dict[str, Any]]) -> dict[str, Any]:
        if self._container is None:
            if len(containers) != 1:
                raise DeployFailed(
                    f"deployment {self._name} has {len(containers)} containers; set the "
                    "serving target's `container` to the model server's"
                )
            return containers[0]
        for container in containers:
            if container.get("name") == self._container:
                return container
        raise DeployFailed(f"deployment {self._name} has no container {self._container!r}")

    def _wait_for_rollout(self, deployment: dict[str, Any]) -> None:
        """Watch until the rollout completes; raise if it fails or times out."""
        deadline = time.monotonic() + self._rollout_timeout_s
        latest: dict[str, Any] | None = deployment
        version: str | None = None
        while True:
            state = rollout_state(latest)
            if state == "complete":
                return
            if state != "progressing":
                raise DeployFailed(
                    f"rollout of {self._namespace}/{self._name} failed: {state}; run "
                    f"`kubectl -n {self._namespace} describe deployment {self._name}`"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeployFailed(
                    f"rollout of {self._namespace}/{self._name} did not complete within "
                    f"{self._rollout_timeout_s:.0f}s"
                )
            self._heartbeat(f"waiting for the rollout of {self._namespace}/{self._name}")
            try:
                observed = watch_object(
                    self._apps.list_namespaced_deployment,
                    namespace=self._namespace,
                    name=self._name,
                    api_client=self._api_client,
                    resource_version=version,
                    timeout_s=min(remaining, WATCH_CHUNK_S),
                    changed=lambda obj: rollout_state(obj) != "progressing",
                    read_slack_s=self._watch_read_slack_s,
                )
            except ApiException as exc:
                raise self._error(exc, "watch") from exc
            except ExecutorError as exc:
                raise ServingUnavailable(str(exc)) from exc
            except Exception as exc:
                raise ServingUnavailable(f"watching the rollout failed: {exc}") from exc
            version = observed.resource_version
            latest = observed.obj
            if latest is None:
                raise DeployFailed(f"deployment {self._namespace}/{self._name} was deleted")

    def _verify(self, version: str, path: str) -> None:
        """Ask the model servers (through the Service) until they serve ``version``."""
        problem = wait_until_served(
            self._servers,
            (self._model,),
            path,
            version,
            timeout_s=self._verify_timeout_s,
            heartbeat=lambda: self._heartbeat(
                f"verifying {self._model} at {self._servers.display_url}"
            ),
            # pods of the old and the new model answer side by side until the rollout settles
            not_yet=(ServingUnavailable, DeployFailed),
        )
        if problem:
            raise DeployFailed(
                f"rollout of {self._namespace}/{self._name} completed but the model "
                f"servers do not serve {version[:12]}: {problem}"
            )

    def _read(self) -> dict[str, Any]:
        try:
            response = self._apps.read_namespaced_deployment(
                self._name, self._namespace, _preload_content=False
            )
        except ApiException as exc:
            raise self._error(exc, "read") from exc
        except Exception as exc:
            raise ServingUnavailable(f"cannot reach the Kubernetes API: {exc}") from exc
        return response_json(response)

    def _error(self, exc: ApiException, action: str) -> Exception:
        message = (
            f"{action} deployment {self._namespace}/{self._name}: Kubernetes API answered "
            f"{exc.status} ({api_reason(exc)})"
        )
        if int(exc.status or 0) in RETRYABLE or exc.status == 409:
            return ServingUnavailable(message)
        return DeployFailed(message)


def rollout_state(deployment: dict[str, Any] | None) -> str:
    """``complete``, ``progressing``, or why the rollout failed (kubectl's rollout status)."""
    if deployment is None:
        return "deleted"
    metadata = deployment.get("metadata") or {}
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Progressing" and condition.get("reason") == (
            "ProgressDeadlineExceeded"
        ):
            return f"progress deadline exceeded ({condition.get('message', '')})"
    if int(status.get("observedGeneration") or 0) < int(metadata.get("generation") or 0):
        return "progressing"
    replicas = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas") or 0)
    if updated < replicas:
        return "progressing"
    if int(status.get("replicas") or 0) > updated:
        return "progressing"  # old replicas are still terminating
    if int(status.get("availableReplicas") or 0) < updated:
        return "progressing"
    return "complete"


def build(config: ServingConfig, context: BuildContext) -> KubernetesServingTarget:
    """The ``kubernetes`` kind: the endpoint's Deployment (its namespace, name and container
    come only from the operator's settings), verified through the endpoint's URL."""
    endpoint, settings = context.endpoint, context.settings
    assert endpoint is not None  # the kind requires one
    api_client = (
        context.kubernetes_client()
        if context.kubernetes_client is not None
        else api_client_from_settings(settings)
    )
    return KubernetesServingTarget(
        api_client,
        endpoint,
        model=config.model or DEFAULT_MODEL,
        default_namespace=settings.kubernetes_namespace,
        artifacts_root=settings.artifacts_dir,
        verify_timeout_s=config.verify_timeout_s,
        heartbeat=context.heartbeat,
    )
