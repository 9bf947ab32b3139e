"""The Kubernetes client plumbing shared by the Job launcher and the Deployment target.

- :func:`api_client_from_settings` builds a real ``kubernetes`` client, in-cluster or from
  kubeconfig, and turns configuration problems into :class:`JobRequestError` (no retry helps);
- :func:`classify` sorts API failures into "try again" (connection errors, 429, 5xx) and
  "give up" (400, 401, 403, 422...);
- :func:`watch_object` follows one named object with list + watch from a resourceVersion,
  and recovers from ``410 Gone`` (the version expired) by listing again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from services.executors.base import ExecutorError, ExecutorUnavailable, JobRejected, JobRequestError
from services.settings import Settings

logger = logging.getLogger(__name__)

RETRYABLE_STATUSES = frozenset({0, 408, 429, 500, 502, 503, 504})
GONE = 410
# Client-side read timeout beyond the server-side watch timeout: a server that keeps the
# stream open past its own timeout (or a proxy that swallows it) cannot hang us.
WATCH_READ_SLACK_S = 5.0


def api_client_from_settings(settings: Settings) -> client.ApiClient:
    """A client for the configured cluster: the pod's service account or the kubeconfig."""
    configuration = client.Configuration()
    try:
        if settings.kubernetes_in_cluster:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(client_configuration=configuration)
    except (ConfigException, FileNotFoundError, OSError) as exc:
        where = "in-cluster service account" if settings.kubernetes_in_cluster else "kubeconfig"
        raise JobRequestError(
            f"cannot configure the Kubernetes client from the {where}: {exc}; set "
            "RATCHET_KUBERNETES_IN_CLUSTER=true inside a cluster, or point KUBECONFIG at a "
            "working config"
        ) from None
    return client.ApiClient(configuration)


def response_json(response: Any) -> dict[str, Any]:
    """A raw (``_preload_content=False``) response's JSON object; its connection goes back."""
    try:
        data = json.loads(response.data)
    finally:
        response.release_conn()
    return data if isinstance(data, dict) else {}


def api_reason(exc: ApiException) -> str:
    """The API server's message for a failed call (its Status body), or the HTTP reason."""
    try:
        body = json.loads(exc.body) if exc.body else {}
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return str(message or exc.reason or f"HTTP {exc.status}")


def classify(exc: BaseException, action: str) -> ExecutorError:
    """An :class:`ExecutorError` saying whether ``action`` may succeed on a retry."""
    if isinstance(exc, ApiException):
        status = int(exc.status or 0)
        detail = f"{action}: Kubernetes API answered {status} ({api_reason(exc)})"
        if status in RETRYABLE_STATUSES:
            return ExecutorUnavailable(detail)
        return JobRejected(detail)
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        return ExecutorUnavailable(f"{action}: cannot reach the Kubernetes API server: {exc}")
    return ExecutorUnavailable(f"{action}: {type(exc).__name__}: {exc}")


@dataclass
class Observed:
    """The latest state seen of a watched object and the resourceVersion to resume from."""

    obj: dict[str, Any] | None
    resource_version: str | None
    deleted: bool = False
    relists: int = 0


def watch_object(
    list_fn: Callable[..., Any],
    *,
    namespace: str,
    name: str,
    api_client: client.ApiClient,
    resource_version: str | None,
    timeout_s: float,
    changed: Callable[[dict[str, Any] | None], bool],
    read_slack_s: float = WATCH_READ_SLACK_S,
) -> Observed:
    """Follow one object until ``changed(obj)`` is true or ``timeout_s`` passes.

    Starts from ``resource_version`` when given (a previous call's), else lists first. A
    ``410 Gone`` means the version is too old: list again and continue from the list's
    version, so no change is missed. Returns the latest object (None once deleted).
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    observed = Observed(obj=None, resource_version=resource_version)
    if resource_version is None:
        observed = _list(list_fn, namespace, name, api_client)
        if changed(observed.obj):
            return observed
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0.05:
            return observed
        try:
            events = _watch(
                list_fn, namespace, name, observed.resource_version, remaining, read_slack_s
            )
            if _follow(observed, events, changed):
                return observed
        except ApiException as exc:
            if exc.status != GONE:
                raise
            logger.info("watch of %s/%s expired (410 Gone); listing again", namespace, name)
            relists = observed.relists + 1
            observed = _list(list_fn, namespace, name, api_client)
            observed.relists = relists
            if changed(observed.obj):
                return observed
        except (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError):
            # The stream ended without an event within the window: nothing changed.
            pass


def _follow(
    observed: Observed,
    events: Iterator[tuple[str, dict[str, Any] | None, str | None]],
    changed: Callable[[dict[str, Any] | None], bool],
) -> bool:
    """Apply one watch's events to ``observed`` in place; whether ``changed`` became true."""
    for event_type, obj, version in events:
        observed.resource_version = version or observed.resource_version
        if event_type == "DELETED":
            observed.obj, observed.deleted = None, True
        elif event_type in ("ADDED", "MODIFIED"):
            observed.obj, observed.deleted = obj, False
        if changed(observed.obj):
            return True
    return False


def _list(
    list_fn: Callable[..., Any], namespace: str, name: str, api_client: client.ApiClient
) -> Observed:
    result = list_fn(namespace, field_selector=f"metadata.name={name}", _preload_content=False)
    try:
        body = json.loads(result.data)
    finally:
        result.release_conn()
    items = [item for item in body.get("items", []) if item["metadata"]["name"] == name]
    version = (body.get("metadata") or {}).get("resourceVersion")
    obj = items[0] if items else None
    return Observed(obj=obj, resource_version=version, deleted=obj is None)


def _watch(
    list_fn: Callable[..., Any],
    namespace: str,
    name: str,
    resource_version: str | None,
    timeout_s: float,
    read_slack_s: float,
) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
    """Events of one watch request; an ERROR event (410 among them) raises ApiException."""
    watcher = watch.Watch()
    kwargs: dict[str, Any] = {
        "field_selector": f"metadata.name={name}",
        # A server-side timeout also stops the client from retrying on its own after 410.
        "timeout_seconds": max(1, int(timeout_s)),
        "_request_timeout": (10.0, timeout_s + read_slack_s),
        "allow_watch_bookmarks": True,
    }
    if resource_version:
        kwargs["resource_version"] = resource_version
    try:
        for event in watcher.stream(list_fn, namespace, **kwargs):
            raw = event.get("raw_object") or {}
            metadata = raw.get("metadata") or {}
            version = metadata.get("resourceVersion")
            if event.get("type") == "BOOKMARK":
                yield "BOOKMARK", None, version
                continue
            if metadata.get("name") != name:
                continue
            yield str(event.get("type")), raw, version
    finally:
        watcher.stop()
