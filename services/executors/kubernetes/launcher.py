"""The Kubernetes executor: creates, adopts, watches, reads and cancels ``batch/v1`` Jobs.

Everything about the objects comes from :mod:`~services.executors.kubernetes.builder`; this
module only talks to the API server:

- ``submit`` creates the Job (and, for multi-node, its headless Service owned by the Job).
  ``409 AlreadyExists`` means an earlier attempt created it: the Job is read and adopted if
  it carries this run id, refused if it belongs to another run. A job with credentials gets
  its Secret (owned by the Job; one found in the way is replaced, never trusted), and only
  then is its Job, created suspended, let run (unless Kueue admits it);
- ``status`` reads the Job and maps its conditions (Complete, Failed, Suspended...) to a
  :class:`~services.executors.base.JobStatus`, with the failing container's exit code and
  termination message from the Job's pods;
- ``wait`` watches the Job from the last resourceVersion it saw and re-lists on ``410 Gone``;
- ``logs`` reads the logs of the Job's pods; ``cancel`` marks the Job and deletes it with
  foreground propagation, so its pods go first;
- the run's Secret goes as soon as the executor sees the job end (or cancels it), not only
  with the Job when its TTL expires.

Accounting: wall time from the Job's start to its completion x GPUs per node x nodes; CPU
seconds are the cores the pods reserved x wall time (what a cluster bills), since the Job
API does not report usage.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from services.executors.base import (
    ExecutorError,
    Handle,
    JobRejected,
    JobRequest,
    JobStatus,
    last_line,
    tail,
    write_spec_file,
)
from services.executors.kubernetes.api import api_reason, classify, response_json, watch_object
from services.executors.kubernetes.builder import (
    ANNOTATION_CANCEL,
    ANNOTATION_RUN_ID,
    CONTAINER_NAME,
    LABEL_JOB_NAME,
    build_headless_service,
    build_job,
    build_job_secret,
    gpus_per_node,
)
from services.executors.kubernetes.template import JobTemplate
from services.loop.states import RunStatus

logger = logging.getLogger(__name__)


class KubernetesExecutor:
    """Runs jobs as Kubernetes Jobs in one namespace. Safe to share between threads."""

    name = "kubernetes"

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        namespace: str,
        template: JobTemplate,
        watch_read_slack_s: float = 5.0,
    ) -> None:
        self._api_client = api_client
        self._batch = client.BatchV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._namespace = namespace
        self._template = template
        self._watch_read_slack_s = watch_read_slack_s
        # Last resourceVersion seen per Job, so consecutive waits resume the same watch.
        self._versions: dict[str, str | None] = {}
        # Jobs this process cancelled: once deleted they read as cancelled, not lost.
        self._cancelled: set[str] = set()
        # Secrets of ended runs this process deleted already.
        self._released: set[str] = set()
        self._lock = threading.Lock()

    # Submit ------------------------------------------------------------------------------

    def submit(self, spec: JobRequest) -> Handle:
        """Create the Job, or adopt the one an earlier attempt created for this run id."""
        # Plain dicts go to the client as they are (every client generation accepts them).
        job: Any = build_job(spec, self._template, namespace=self._namespace)
        name = job["metadata"]["name"]
        write_spec_file(spec)
        spec.output_dir.mkdir(parents=True, exist_ok=True)
        spec.logs_dir.mkdir(parents=True, exist_ok=True)
        try:
            created = self._call(
                f"create Job {name}",
                lambda: self._batch.create_namespaced_job(self._namespace, job),
                allow={409},
            )
        except _Allowed:
            created = self._adopt(name, spec.run_id)
        uid = created.metadata.uid if created is not None and created.metadata else None
        secret_name = self._hand_over_credentials(spec, name, uid)
        service: Any = build_headless_service(
            spec, self._template, namespace=self._namespace, owner_uid=uid
        )
        if service is not None:
            try:
                self._call(
                    f"create Service {name}",
                    lambda: self._core.create_namespaced_service(self._namespace, service),
                    allow={409},
                )
            except _Allowed:
                logger.info("headless service %s already exists; keeping it", name)
        logger.info("submitted Kubernetes Job %s/%s for run %s", self._namespace, name, spec.run_id)
        return {
            "executor": self.name,
            "run_id": spec.run_id,
            "namespace": self._namespace,
            "job_name": name,
            "uid": uid,
            "service_name": name if service is not None else None,
            "secret_name": secret_name,
            "nodes": spec.nodes,
            "accelerators": gpus_per_node(spec, self._template) * spec.nodes,
            "cpu_per_node": self._template.cpu_per_node(),
            "output_dir": str(spec.output_dir),
            "submitted_at": time.time(),
        }

    def _hand_over_credentials(self, spec: JobRequest, name: str, uid: str | None) -> str | None:
        """The run's Secret, owned by its Job, then the Job let run (it was created suspended
        so that no pod starts without it); None for a job without credentials.

        A Secret already there is replaced, not trusted: an earlier attempt's holds the same
        keys, and anything else under the Job's name must not reach its pods. The Job is let
        run only where Ratchet suspended it: under Kueue, Kueue admits it."""
        if not spec.secret_env:
            return None
        if not uid:
            raise JobRejected(f"Job {self._namespace}/{name} has no uid to own its Secret")
        secret: Any = build_job_secret(
            spec, self._template, namespace=self._namespace, owner_uid=uid
        )
        try:
            self._call(
                f"create Secret {name}",
                lambda: self._core.create_namespaced_secret(self._namespace, secret),
                allow={409},
            )
        except _Allowed:
            self._delete_secret(name)
            self._call(
                f"create Secret {name}",
                lambda: self._core.create_namespaced_secret(self._namespace, secret),
            )
        with self._lock:
            self._released.discard(name)  # made anew: the run's end deletes it again
        if self._template.kueue is None:
            self._call(
                f"start Job {name}",
                lambda: self._batch.patch_namespaced_job(
                    name,
                    self._namespace,
                    {"spec": {"suspend": False}},
                    _content_type="application/merge-patch+json",
                ),
            )
        return name

    def _delete_secret(self, name: str) -> None:
        with contextlib.suppress(_Allowed):  # already gone
            self._call(
                f"delete Secret {name}",
                lambda: self._core.delete_namespaced_secret(name, self._namespace),
                allow={404},
            )

    def _release(self, handle: Handle, status: JobStatus) -> JobStatus:
        """Delete an ended run's Secret (the owner reference would only when the Job's TTL
        runs out). A failure to delete is logged, never raised: the Job still owns it."""
        name = handle.get("secret_name")
        if not name or not status.terminal:
            return status
        with self._lock:
            if name in self._released:
                return status
        try:
            self._delete_secret(name)
        except ExecutorError as exc:
            logger.warning(
                "run %s: its Secret %s stays until its Job goes: %s",
                handle.get("run_id"),
                name,
                exc,
            )
            return status
        with self._lock:
            self._released.add(name)
        return status

    def _adopt(self, name: str, run_id: str) -> client.V1Job:
        existing: client.V1Job = self._call(
            f"read Job {name}", lambda: self._batch.read_namespaced_job(name, self._namespace)
        )
        metadata = existing.metadata
        owner = (metadata.annotations or {}).get(ANNOTATION_RUN_ID) if metadata else None
        if owner != run_id:
            raise JobRejected(
                f"Job {self._namespace}/{name} already exists for run {owner!r}, not {run_id!r}; "
                "delete it or choose another run id"
            )
        logger.info("Job %s/%s exists for run %s; adopting it", self._namespace, name, run_id)
        return existing

    # Status ------------------------------------------------------------------------------

    def status(self, handle: Handle) -> JobStatus:
        name = handle["job_name"]
        try:
            job = self._call(
                f"read Job {name}",
                lambda: self._batch.read_namespaced_job(
                    name, handle["namespace"], _preload_content=False
                ),
                allow={404},
            )
        except _Allowed:
            return self._release(handle, self._from_job(handle, None))
        return self._release(handle, self._from_job(handle, response_json(job)))

    def wait(self, handle: Handle, timeout_s: float) -> JobStatus:
        """Watch the Job until its state changes (or it ends) or ``timeout_s`` passes."""
        name = handle["job_name"]
        before = self.status(handle)
        if before.terminal:
            return before
        with self._lock:
            version = self._versions.get(name)

        def changed(obj: dict[str, Any] | None) -> bool:
            return self._from_job(handle, obj, fetch_pods=False).state != before.state

        try:
            observed = watch_object(
                self._batch.list_namespaced_job,
                namespace=handle["namespace"],
                name=name,
                api_client=self._api_client,
                resource_version=version,
                timeout_s=timeout_s,
                changed=changed,
                read_slack_s=self._watch_read_slack_s,
            )
        except Exception as exc:
            raise classify(exc, f"watch Job {name}") from exc
        with self._lock:
            self._versions[name] = observed.resource_version
        if changed(observed.obj):
            return self._release(handle, self._from_job(handle, observed.obj))
        # Nothing changed within the window: confirm with a fresh read, which costs one
        # request and guards against an event the watch never delivered.
        return self.status(handle)

    def _from_job(
        self, handle: Handle, job: dict[str, Any] | None, *, fetch_pods: bool = True
    ) -> JobStatus:
        accelerators = int(handle.get("accelerators", 0))
        if job is None:
            with self._lock:
                cancelled = handle["job_name"] in self._cancelled
            if cancelled:
                return JobStatus(
                    state=RunStatus.CANCELLED, reason="Cancelled", accelerators=accelerators
                )
            return JobStatus(
                state=RunStatus.LOST,
                reason="Deleted",
                message=f"Job {handle['namespace']}/{handle['job_name']} no longer exists",
                accelerators=accelerators,
            )
        metadata = job.get("metadata") or {}
        status = job.get("status") or {}
        spec = job.get("spec") or {}
        conditions = {
            c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"
        }
        started = _timestamp(status.get("startTime"))
        ended = _timestamp(status.get("completionTime"))
        cancel_requested = ANNOTATION_CANCEL in (metadata.get("annotations") or {})

        def accounted(**fields: Any) -> JobStatus:
            end = fields.get("ended_at") or (time.time() if started else None)
            wall = max(0.0, end - started) if started and end else 0.0
            cpu = wall * float(handle.get("cpu_per_node") or 0.0) * int(handle.get("nodes", 1))
            return JobStatus(
                started_at=started,
                wall_seconds=wall,
                cpu_seconds=cpu,
                accelerators=accelerators,
                **fields,
            )

        if "Complete" in conditions or "SuccessCriteriaMet" in conditions:
            return accounted(
                state=RunStatus.SUCCEEDED, ended_at=ended or _condition_time(conditions)
            )
        failed = conditions.get("Failed") or conditions.get("FailureTarget")
        if failed is not None:
            ended = ended or _timestamp(failed.get("lastTransitionTime")) or time.time()
            exit_code, message = (None, None)
            if fetch_pods:
                exit_code, message = self._failure_detail(handle)
            return accounted(
                state=RunStatus.CANCELLED if cancel_requested else RunStatus.FAILED,
                ended_at=ended,
                exit_code=exit_code,
                reason=failed.get("reason") or "Failed",
                message=message or failed.get("message"),
            )
        if metadata.get("deletionTimestamp"):
            return accounted(
                state=RunStatus.CANCELLED if cancel_requested else RunStatus.LOST,
                ended_at=_timestamp(metadata.get("deletionTimestamp")),
                reason="Deleted",
                message="the Job is being deleted",
            )
        if spec.get("suspend"):
            return accounted(
                state=RunStatus.PENDING,
                reason="Suspended",
                message="the Job is suspended, waiting for its queue to admit it",
            )
        if status.get("active") or status.get("ready"):
            return accounted(state=RunStatus.RUNNING)
        return accounted(state=RunStatus.PENDING, reason="Created")

    def _failure_detail(self, handle: Handle) -> tuple[int | None, str | None]:
        """The exit code and termination message of the Job's failed container, if any."""
        try:
            pods = self._pods(handle)
        except JobRejected:
            return None, None
        for pod in pods:
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                if container.get("name") != CONTAINER_NAME:
                    continue
                terminated = (container.get("state") or {}).get("terminated") or (
                    container.get("lastState") or {}
                ).get("terminated")
                if terminated and terminated.get("exitCode"):
                    message = last_line(terminated.get("message") or "") or terminated.get("reason")
                    return int(terminated["exitCode"]), message
        return None, None

    # Logs and cancel ---------------------------------------------------------------------

    def logs(self, handle: Handle, *, tail_lines: int | None = None) -> str:
        """The logs of the Job's pods, in completion-index order, each under a header."""
        chunks = []
        pods = sorted(self._pods(handle), key=lambda pod: pod["metadata"]["name"])
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            kwargs: dict[str, Any] = {"container": CONTAINER_NAME}
            if tail_lines is not None:
                kwargs["tail_lines"] = tail_lines
            try:
                text = self._core.read_namespaced_pod_log(pod_name, handle["namespace"], **kwargs)
            except ApiException as exc:
                if exc.status in (400, 404):  # not started yet, or already gone
                    text = f"(no logs: {api_reason(exc)})\n"
                else:
                    raise classify(exc, f"read logs of pod {pod_name}") from exc
            except Exception as exc:
                raise classify(exc, f"read logs of pod {pod_name}") from exc
            if len(pods) > 1:
                text = f"==> pod {pod_name} <==\n{text}"
            chunks.append(text if text.endswith("\n") or not text else text + "\n")
        return tail("".join(chunks), tail_lines) if len(pods) > 1 else "".join(chunks)

    def cancel(self, handle: Handle) -> None:
        """Mark the Job as cancelled by us, then delete it (pods first: foreground)."""
        name, namespace = handle["job_name"], handle["namespace"]
        with self._lock:
            self._cancelled.add(name)
        marker = {"metadata": {"annotations": {ANNOTATION_CANCEL: _now_iso()}}}
        try:
            self._call(
                f"mark Job {name} cancelled",
                lambda: self._batch.patch_namespaced_job(
                    name, namespace, marker, _content_type="application/merge-patch+json"
                ),
                allow={404},
            )
            self._call(
                f"delete Job {name}",
                lambda: self._batch.delete_namespaced_job(
                    name, namespace, propagation_policy="Foreground"
                ),
                allow={404},
            )
        except _Allowed:
            logger.info("Job %s/%s is already gone", namespace, name)
        if handle.get("secret_name"):
            self._delete_secret(handle["secret_name"])
        if handle.get("service_name"):
            with contextlib.suppress(_Allowed):  # already gone with its Job
                self._call(
                    f"delete Service {name}",
                    lambda: self._core.delete_namespaced_service(handle["service_name"], namespace),
                    allow={404},
                )
        logger.info("cancelled Kubernetes Job %s/%s", namespace, name)

    # Helpers -----------------------------------------------------------------------------

    def _pods(self, handle: Handle) -> list[dict[str, Any]]:
        selector = f"{LABEL_JOB_NAME}={handle['job_name']}"
        response = self._call(
            f"list pods of Job {handle['job_name']}",
            lambda: self._core.list_namespaced_pod(
                handle["namespace"], label_selector=selector, _preload_content=False
            ),
        )
        items = response_json(response).get("items") or []
        # The selector again, client-side: a proxy or an old server may not apply it.
        return [
            pod
            for pod in items
            if ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB_NAME)
            == handle["job_name"]
        ]

    def _call(self, action: str, fn: Any, *, allow: frozenset[int] | set[int] = frozenset()) -> Any:
        """Run one API call; statuses in ``allow`` raise :class:`_Allowed`, others classify."""
        try:
            return fn()
        except ApiException as exc:
            if exc.status in allow:
                raise _Allowed(exc.status) from exc
            raise classify(exc, action) from exc
        except Exception as exc:
            raise classify(exc, action) from exc


class _Allowed(Exception):
    """An expected API status (404 when reading, 409 when creating) the caller handles."""

    def __init__(self, status: int | None) -> None:
        super().__init__(status)
        self.status = status


def _timestamp(value: Any) -> float | None:
    if not value:
        return None
    if isinstance(value, dt.datetime):
        return value.timestamp()
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def _condition_time(conditions: dict[str, Any]) -> float | None:
    for key in ("Complete", "SuccessCriteriaMet"):
        if key in conditions:
            return _timestamp(conditions[key].get("lastTransitionTime"))
    return None


def _now_iso() -> str:
    return dt.datetime.now(tz=dt.UTC).isoformat()
