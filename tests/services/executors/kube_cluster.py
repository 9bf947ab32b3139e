"""A Kubernetes API server for tests: kmock's KubernetesEmulator over real HTTP.

The emulator runs in a thread with its own event loop; tests talk to it with the real
``kubernetes`` client. It stores objects and streams watch events, but it is not a
cluster: no controllers run. Tests play the controllers' part through the same API (the
Job controller patching a Job's status, the Deployment controller rolling out), and the
emulator is taught the API-server behaviours the code under test relies on:
``metadata.generation`` increments when a Deployment's spec changes, a created Job gets a
``metadata.uid`` (what owner references name), and pod logs are served as text.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import kmock
from kubernetes import client

JOBS = kmock.resource("batch", "v1", "jobs")
PODS = kmock.resource("", "v1", "pods")
SERVICES = kmock.resource("", "v1", "services")
SECRETS = kmock.resource("", "v1", "secrets")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")


class EmulatedCluster:
    """The emulator, its URL, and a real API client pointed at it."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.emulator: Any = None
        self.url = ""
        self.pod_logs: dict[str, str] = {}
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start")
        configuration = client.Configuration(host=self.url.rstrip("/"))
        self.api_client = client.ApiClient(configuration)
        self.batch = client.BatchV1Api(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self.api_client.close()

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.url = str(server.url)
            for resource in (
                "batch/v1/jobs",
                "v1/pods",
                "v1/services",
                "v1/secrets",
                "apps/v1/deployments",
            ):
                emulator.resources[resource] = kmock.ResourceInfo()
            emulator["patch", DEPLOYMENTS] << self._bump_generation
            # Below the default priority: an injected failure (fail_next) answers first.
            (emulator["post", JOBS] ** -1) << self._assign_uid
            (
                emulator["get", PODS, kmock.subresource("log")]
                << {"Content-Type": "text/plain"}
                << self._serve_log
            )
            self._ready.set()
            await self._stop.wait()

    # API-server behaviour the emulator lacks ----------------------------------------------

    def _bump_generation(self, request: Any) -> dict[str, Any]:
        """A spec change increments metadata.generation (status patches do not)."""
        obj = self.emulator.objects[request.resource, request.namespace, request.name]
        if request.subresource != "status" and "spec" in (request.data or {}):
            generation = int(obj.get("metadata", {}).get("generation") or 1)
            obj.patch({"metadata": {"generation": generation + 1}})
        raw: dict[str, Any] = obj.raw
        return raw

    def _assign_uid(self, request: Any) -> dict[str, Any]:
        """A created object gets its uid from the server (owner references name it)."""
        name = (request.data or {}).get("metadata", {}).get("name")
        namespace = request.namespace or (request.data or {}).get("metadata", {}).get("namespace")
        obj = self.emulator.objects[request.resource, namespace, name]
        if not obj.get("metadata", {}).get("uid"):
            obj.patch({"metadata": {"uid": str(uuid.uuid4())}})
        raw: dict[str, Any] = obj.raw
        return raw

    def _serve_log(self, request: Any) -> bytes:
        return self.pod_logs.get(request.name, "").encode()

    # Failure injection --------------------------------------------------------------------

    def expire_next_watch(self, resource: Any = JOBS) -> None:
        """The next watch of ``resource`` gets ``410 Gone``, as after an etcd compaction."""
        gone = {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "code": 410,
                "reason": "Expired",
                "message": "too old resource version",
            },
        }
        self._in_loop(lambda: self.emulator["watch", resource] << _once(lambda: (gone,)))

    def fail_next(self, method: str, resource: Any, status: int, message: str) -> None:
        """The next ``method`` request on ``resource`` is answered with ``status``."""
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "code": status,
            "message": message,
        }
        response = kmock.Response(status=status, payload=body)
        self._in_loop(lambda: self.emulator[method, resource] << _once(lambda: response))

    def requests(self, method: str, resource: Any) -> list[Any]:
        return [
            r
            for r in self.emulator._requests
            if r.method.value == method.upper() and r.resource == resource
        ]

    def wait_for_watches(self, resource: Any, count: int, timeout: float = 10.0) -> None:
        """Block until ``count`` watch requests of ``resource`` have arrived."""
        deadline = time.monotonic() + timeout
        while len(self.watches(resource)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"expected {count} watches of {resource}")
            time.sleep(0.02)

    def watches(self, resource: Any) -> list[Any]:
        return [r for r in self.requests("GET", resource) if r.params.get("watch") == "true"]

    def objects(self, resource: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        for (res, _namespace, name), obj in list(self.emulator.objects.items()):
            if res == resource and not obj.deleted:
                yield name, obj.raw

    def _in_loop(self, fn: Callable[[], Any]) -> None:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(_call(fn), self._loop)
        future.result(10)

    # Controllers' part, through the API ----------------------------------------------------

    def set_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        body: Any = {"status": status}
        self.batch.patch_namespaced_job_status(
            name, namespace, body, _content_type="application/merge-patch+json"
        )

    def add_job_pod(
        self,
        namespace: str,
        job: str,
        pod: str,
        *,
        exit_code: int | None = None,
        message: str = "",
        logs: str = "",
    ) -> None:
        """A pod of ``job`` (with the labels the Job's template gives it), optionally ended."""
        manifest: Any = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod,
                "namespace": namespace,
                "labels": {"ratchet.dev/job-name": job},
            },
            "spec": {"containers": [{"name": "job", "image": "trainer"}]},
        }
        self.core.create_namespaced_pod(namespace, manifest)
        if exit_code is not None:
            terminated = {"exitCode": exit_code, "reason": "Error", "message": message}
            status: Any = {
                "status": {
                    "phase": "Failed" if exit_code else "Succeeded",
                    "containerStatuses": [
                        {
                            "name": "job",
                            "image": "trainer",
                            "imageID": "",
                            "ready": False,
                            "restartCount": 0,
                            "state": {"terminated": terminated},
                        }
                    ],
                }
            }
            self.core.patch_namespaced_pod_status(
                pod, namespace, status, _content_type="application/merge-patch+json"
            )
        self.pod_logs[pod] = logs


def _once(make: Callable[[], Any]) -> Callable[[Any], Any]:
    """A reaction that answers one request, then steps aside for the emulator's own."""
    fired: list[bool] = []

    def react(_request: Any) -> Any:
        if fired:
            return NotImplemented  # kmock: not mine; the reaction is retired
        fired.append(True)
        return make()

    return react


async def _call(fn: Callable[[], Any]) -> None:
    fn()
    await asyncio.sleep(0)
