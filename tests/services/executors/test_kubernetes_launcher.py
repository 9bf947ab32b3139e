"""The Kubernetes executor against kmock's emulated API server, with the real client.

The emulator runs no controllers: where a Job would start, finish or fail, the test patches
the Job's status through the API as the Job controller would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from services.executors.base import ExecutorUnavailable, Handle, JobRejected, JobRequest, JobStatus
from services.executors.kubernetes.builder import job_name
from services.executors.kubernetes.launcher import KubernetesExecutor
from services.executors.kubernetes.template import JobTemplate, parse_template
from tests.services.executors.kube_cluster import JOBS, SERVICES, EmulatedCluster

NAMESPACE = "ml"
COMPLETE = {
    "startTime": "2026-01-01T00:00:00Z",
    "completionTime": "2026-01-01T00:10:00Z",
    "succeeded": 1,
    "conditions": [
        {"type": "SuccessCriteriaMet", "status": "True"},
        {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:10:00Z"},
    ],
}


def failed(reason: str) -> dict[str, Any]:
    return {
        "startTime": "2026-01-01T00:00:00Z",
        "failed": 1,
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": reason,
                "message": "the job failed",
                "lastTransitionTime": "2026-01-01T00:05:00Z",
            }
        ],
    }


def make_template(tmp_path: Path, **overrides: Any) -> JobTemplate:
    data: dict[str, Any] = {
        "image": "trainer:1",
        "gpusPerNode": 2,
        "resources": {"requests": {"cpu": "4"}},
        "artifacts": {"claimName": "artifacts", "mountPath": str(tmp_path / "artifacts")},
    }
    data.update(overrides)
    return parse_template(data)


@pytest.fixture
def executor(cluster: EmulatedCluster, tmp_path: Path) -> KubernetesExecutor:
    return KubernetesExecutor(
        cluster.api_client,
        namespace=NAMESPACE,
        template=make_template(tmp_path),
        watch_read_slack_s=0.3,
    )


def test_submit_creates_the_job_and_writes_the_spec(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    spec = make_spec()
    handle = executor.submit(spec)

    name = job_name("train", spec.run_id)
    assert handle["job_name"] == name
    assert handle["accelerators"] == 2
    jobs = dict(cluster.objects(JOBS))
    assert list(jobs) == [name]
    assert jobs[name]["spec"]["template"]["spec"]["containers"][0]["image"] == "trainer:1"
    assert spec.spec_path.is_file()
    assert executor.status(handle).state == "pending"


def test_resubmitting_the_same_run_adopts_the_existing_job(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    first = executor.submit(make_spec())
    second = executor.submit(make_spec())

    assert second["job_name"] == first["job_name"]
    assert len(cluster.requests("POST", JOBS)) == 2
    assert len(list(cluster.objects(JOBS))) == 1


def test_a_job_of_another_run_with_the_same_name_is_refused(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    spec = make_spec()
    squatter: Any = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name("train", spec.run_id),
            "namespace": NAMESPACE,
            "annotations": {"ratchet.dev/run-id": "someone-else"},
        },
        "spec": {"template": {"spec": {"containers": [{"name": "x", "image": "x"}]}}},
    }
    cluster.batch.create_namespaced_job(NAMESPACE, squatter)
    with pytest.raises(JobRejected, match="already exists for run 'someone-else'"):
        executor.submit(spec)


def test_status_follows_the_job_from_pending_to_succeeded(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec())
    assert executor.status(handle).state == "pending"

    cluster.set_job_status(
        NAMESPACE, handle["job_name"], {"active": 1, "startTime": "2026-01-01T00:00:00Z"}
    )
    assert executor.status(handle).state == "running"

    cluster.set_job_status(NAMESPACE, handle["job_name"], COMPLETE)
    done = executor.status(handle)
    assert done.state == "succeeded"
    assert done.wall_seconds == 600
    assert done.accelerators == 2
    assert done.cpu_seconds == 600 * 4  # reserved cores x wall time


def states_of_a_wait(
    cluster: EmulatedCluster,
    executor: KubernetesExecutor,
    handle: Handle,
    *,
    watches: int,
    change: Callable[[], object],
) -> list[str]:
    """Run ``executor.wait`` in a thread, make ``change`` once the cluster has seen
    ``watches`` watches of Jobs (the wait's is open), and return what the wait returned."""
    seen: list[JobStatus] = []
    waiter = threading.Thread(target=lambda: seen.append(executor.wait(handle, 30)))
    waiter.start()
    cluster.wait_for_watches(JOBS, watches)
    change()
    waiter.join(35)
    return [status.state for status in seen]


def test_wait_returns_when_the_watch_sees_the_change(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec())
    assert executor.wait(handle, 0.5).state == "pending"  # nothing happens: times out

    watches = len(cluster.watches(JOBS))
    complete = partial(cluster.set_job_status, NAMESPACE, handle["job_name"], COMPLETE)
    states = states_of_a_wait(cluster, executor, handle, watches=watches + 1, change=complete)
    assert states == ["succeeded"]


def test_watch_recovers_from_410_gone_by_listing_again(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec())
    executor.wait(handle, 0.5)  # leaves a resourceVersion to resume from
    cluster.expire_next_watch()
    watches, lists = len(cluster.watches(JOBS)), len(job_lists(cluster))

    complete = partial(cluster.set_job_status, NAMESPACE, handle["job_name"], COMPLETE)
    # The resumed watch gets 410 Gone; the executor lists again and watches anew.
    states = states_of_a_wait(cluster, executor, handle, watches=watches + 2, change=complete)

    assert states == ["succeeded"]
    assert len(job_lists(cluster)) == lists + 1


def job_lists(cluster: EmulatedCluster) -> list[Any]:
    return [
        r
        for r in cluster.requests("GET", JOBS)
        if r.name is None and r.params.get("watch") != "true"
    ]


def test_a_failed_job_reports_the_exit_code_and_message_of_its_pod(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec())
    name = handle["job_name"]
    cluster.add_job_pod(
        NAMESPACE, name, f"{name}-abcde", exit_code=1, message="step 3\nCUDA out of memory\n"
    )
    cluster.set_job_status(NAMESPACE, name, failed("BackoffLimitExceeded"))

    status = executor.status(handle)
    assert status.state == "failed"
    assert status.exit_code == 1
    assert status.reason == "BackoffLimitExceeded"
    assert status.message == "CUDA out of memory"
    assert not status.config_error


def test_a_config_exit_code_is_a_config_error(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec())
    name = handle["job_name"]
    cluster.add_job_pod(NAMESPACE, name, f"{name}-xyz12", exit_code=78, message="bad spec: lr")
    cluster.set_job_status(NAMESPACE, name, failed("PodFailurePolicy"))

    status = executor.status(handle)
    assert (status.state, status.exit_code, status.config_error) == ("failed", 78, True)


def test_a_job_deleted_under_us_is_lost(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec())
    cluster.batch.delete_namespaced_job(handle["job_name"], NAMESPACE)
    status = executor.status(handle)
    assert status.state == "lost"
    assert "no longer exists" in (status.message or "")


def test_a_deletion_seen_by_the_watch_ends_the_wait(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec())
    delete = partial(cluster.batch.delete_namespaced_job, handle["job_name"], NAMESPACE)
    assert states_of_a_wait(cluster, executor, handle, watches=1, change=delete) == ["lost"]


def test_cancel_marks_and_deletes_the_job_with_foreground_propagation(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec())
    executor.cancel(handle)

    assert list(cluster.objects(JOBS)) == []
    deletes = cluster.requests("DELETE", JOBS)
    assert len(deletes) == 1
    assert deletes[0].params.get("propagationPolicy") == "Foreground"
    patches = cluster.requests("PATCH", JOBS)
    assert "ratchet.dev/cancel-requested-at" in patches[0].data["metadata"]["annotations"]
    assert executor.status(handle).state == "cancelled"
    executor.cancel(handle)  # idempotent: the Job is already gone


def test_kueue_jobs_wait_suspended(
    cluster: EmulatedCluster, tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    queued = KubernetesExecutor(
        cluster.api_client,
        namespace=NAMESPACE,
        template=make_template(tmp_path, kueue={"queueName": "team-a"}),
    )
    handle = queued.submit(make_spec())
    job = dict(cluster.objects(JOBS))[handle["job_name"]]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["spec"]["suspend"] is True
    status = queued.status(handle)
    assert (status.state, status.reason) == ("pending", "Suspended")


def test_multi_node_jobs_get_their_headless_service(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec(nodes=2))
    assert handle["accelerators"] == 4
    services = dict(cluster.objects(SERVICES))
    assert list(services) == [handle["job_name"]]
    assert services[handle["job_name"]]["spec"]["clusterIP"] == "None"
    executor.submit(make_spec(nodes=2))  # adopting leaves the Service as it is
    executor.cancel(handle)
    assert list(cluster.objects(SERVICES)) == []


def test_logs_come_from_the_jobs_pods(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec())
    name = handle["job_name"]
    cluster.add_job_pod(NAMESPACE, name, f"{name}-0-aaaaa", logs="rank 0 step 1\nrank 0 done\n")
    cluster.add_job_pod(NAMESPACE, name, f"{name}-1-bbbbb", logs="rank 1 done\n")
    cluster.add_job_pod(NAMESPACE, "other-job", "other-pod", logs="not ours\n")

    text = executor.logs(handle)
    assert "rank 0 step 1\nrank 0 done\n" in text
    assert "rank 1 done" in text
    assert "not ours" not in text
    assert text.index("rank 0") < text.index("rank 1")


def test_api_failures_are_classified_for_retry(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    cluster.fail_next("post", JOBS, 503, "etcd leader changed")
    with pytest.raises(ExecutorUnavailable, match="503"):
        executor.submit(make_spec())
    # The create went through before the error reached us: the retry adopts that Job.
    handle = executor.submit(make_spec())
    assert list(dict(cluster.objects(JOBS))) == [handle["job_name"]]

    cluster.fail_next("post", JOBS, 422, "spec.template.spec.containers[0].image: Required value")
    with pytest.raises(JobRejected, match=r"422.*Required value"):
        executor.submit(make_spec(run_id="demo-c2-train"))
