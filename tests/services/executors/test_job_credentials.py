"""A job's credentials travel in a Secret of its run's own (issue 43, item 2), and its pod runs
on a read-only root filesystem (item 8).

The rollout server's key, the judge's and the tool endpoints' keys used to be plain ``value``
entries of the Job's pod spec: whoever may read Jobs in the namespace (the ``view`` role)
read them, for as long as the Job was kept. Now the Job only names a Secret, which the
launcher makes after the Job (owned by it, so it goes with the Job) and deletes when the run
ends; the Job waits suspended until its Secret exists. The builder is compared as dicts and
validated; the launcher runs against kmock's emulated API server with the real client.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from services.executors.base import JobRequest, JobRequestError
from services.executors.kubernetes.builder import build_job, build_job_secret, job_name
from services.executors.kubernetes.launcher import KubernetesExecutor
from services.executors.kubernetes.template import JobTemplateError, parse_template
from tests.services.executors.kube_cluster import JOBS, SECRETS, EmulatedCluster
from tests.services.executors.test_kubernetes_launcher import COMPLETE, NAMESPACE, make_template

JUDGE_KEY = "sk-judge-of-the-operator"
ROLLOUT_KEY = "vllm-key-that-loads-adapters"
CREDENTIALS = {
    "RATCHET_JUDGE_ENDPOINTS": json.dumps(
        {"grader": {"url": "https://judge.example/v1", "api_key": JUDGE_KEY, "timeout_s": 30}}
    ),
    "RATCHET_ROLLOUT_API_KEY": ROLLOUT_KEY,
}
PLAIN = {"RATCHET_ROLLOUT_URL": "http://vllm:8000", "RATCHET_ROLLOUT_MODEL": "agent"}
K8S = kubernetes_validate.utils.latest_version()


def with_credentials(make_spec: Callable[..., JobRequest], **overrides: Any) -> JobRequest:
    return make_spec(env=PLAIN, secret_env=CREDENTIALS, **overrides)


def container(job: dict[str, Any]) -> dict[str, Any]:
    (main,) = job["spec"]["template"]["spec"]["containers"]
    return dict(main)


def assert_no_credential_in(obj: object) -> None:
    text = json.dumps(obj)
    assert JUDGE_KEY not in text and ROLLOUT_KEY not in text


def test_the_job_names_its_secret_and_holds_no_credential(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    spec = with_credentials(make_spec)
    job = build_job(spec, make_template(tmp_path), namespace=NAMESPACE)
    name = job_name("train", spec.run_id)

    kubernetes_validate.validate(job, K8S, strict=True)
    assert_no_credential_in(job)
    env = {var["name"]: var for var in container(job)["env"]}
    for variable in CREDENTIALS:
        assert env[variable] == {
            "name": variable,
            "valueFrom": {"secretKeyRef": {"name": name, "key": variable}},
        }
    assert env["RATCHET_ROLLOUT_URL"] == {
        "name": "RATCHET_ROLLOUT_URL",
        "value": "http://vllm:8000",
    }
    assert job["spec"]["suspend"] is True  # no pod before its Secret exists
    assert "suspend" not in build_job(make_spec(), make_template(tmp_path), namespace="x")["spec"]
    assert "secret_env" not in repr(spec) and JUDGE_KEY not in repr(spec)


def test_the_secret_is_the_runs_own_owned_by_its_job_and_immutable(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    spec = with_credentials(make_spec)
    template = make_template(tmp_path)
    secret = build_job_secret(spec, template, namespace=NAMESPACE, owner_uid="uid-1")
    assert secret is not None
    kubernetes_validate.validate(secret, K8S, strict=True)
    name = job_name("train", spec.run_id)
    assert secret["metadata"]["name"] == name
    assert secret["metadata"]["labels"]["ratchet.dev/run"] == spec.run_id
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", name, "uid-1")
    assert secret["immutable"] is True
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    assert data == CREDENTIALS
    assert build_job_secret(make_spec(), template, namespace=NAMESPACE, owner_uid="u") is None


def test_a_name_is_plain_or_secret_never_both(make_spec: Callable[..., JobRequest]) -> None:
    with pytest.raises(JobRequestError, match="both as plain and as secret"):
        make_spec(env={"RATCHET_ROLLOUT_API_KEY": "x"}, secret_env={"RATCHET_ROLLOUT_API_KEY": "y"})
    with pytest.raises(JobRequestError, match="set by the executor"):
        make_spec(secret_env={"RATCHET_JOB_SPEC": "x"})
    with pytest.raises(JobRequestError, match="not valid"):
        make_spec(secret_env={"bad name": "x"})


@pytest.mark.parametrize(
    "name", ["RATCHET_ROLLOUT_API_KEY", "RATCHET_ROLLOUT_URL", "RATCHET_JUDGE_ENDPOINTS"]
)
def test_the_template_cannot_carry_what_the_worker_hands_each_job(
    tmp_path: Path, name: str
) -> None:
    """The template is a ConfigMap (``view`` reads it): the old way of pointing jobs at vLLM,
    its key in ``jobs.env``, is refused with the way that works."""
    with pytest.raises(JobTemplateError, match=f"env.0.name: {name} is set by the worker"):
        make_template(tmp_path, env=[{"name": name, "value": "x"}])


def test_an_operators_credential_comes_from_its_own_secret(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    ref = {"secretKeyRef": {"name": "hub-token", "key": "token"}}
    template = make_template(tmp_path, env=[{"name": "HF_TOKEN", "valueFrom": ref}])
    env = {
        var["name"]: var
        for var in container(build_job(make_spec(), template, namespace="x"))["env"]
    }
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": ref}
    with pytest.raises(JobTemplateError, match="exactly one of value, valueFrom"):
        make_template(tmp_path, env=[{"name": "HF_TOKEN", "value": "x", "valueFrom": ref}])
    with pytest.raises(JobTemplateError, match="exactly one of value, valueFrom"):
        make_template(tmp_path, env=[{"name": "HF_TOKEN"}])
    with pytest.raises(JobTemplateError, match="configMapKeyRef"):
        parse_template(
            {
                "image": "i",
                "artifacts": {"claimName": "a", "mountPath": "/a"},
                "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}],
            }
        )


def test_a_template_variable_the_worker_also_sets_is_refused_at_build(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    template = make_template(tmp_path, env=[{"name": "TOOL_TOKEN", "value": "x"}])
    with pytest.raises(JobRequestError, match="sets TOOL_TOKEN, which the worker sets"):
        build_job(make_spec(secret_env={"TOOL_TOKEN": "y"}), template, namespace="x")


def test_the_job_runs_on_a_read_only_root_with_tmp_and_home_writable(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    job = build_job(make_spec(), make_template(tmp_path), namespace="x")
    main = container(job)
    context = main["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["runAsNonRoot"] is True and context["privileged"] is False
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}
    env = {var["name"]: var.get("value") for var in main["env"]}
    assert env["HOME"] == "/tmp/home"  # torch's, triton's and the hub's caches
    # Everything else it writes is its run's own paths on the artifact volume.
    writable = [m for m in main["volumeMounts"] if not m.get("readOnly")]
    assert {m["name"] for m in writable} == {"artifacts", "tmp"}
    own = make_template(tmp_path, env=[{"name": "HOME", "value": "/scratch"}])
    home = [
        v
        for v in container(build_job(make_spec(), own, namespace="x"))["env"]
        if v["name"] == "HOME"
    ]
    assert home == [{"name": "HOME", "value": "/scratch"}]


# The launcher, against the emulated API server -------------------------------------------


@pytest.fixture
def executor(cluster: EmulatedCluster, tmp_path: Path) -> KubernetesExecutor:
    return KubernetesExecutor(
        cluster.api_client,
        namespace=NAMESPACE,
        template=make_template(tmp_path),
        watch_read_slack_s=0.3,
    )


def secrets(cluster: EmulatedCluster) -> dict[str, dict[str, Any]]:
    return dict(cluster.objects(SECRETS))


def test_submit_makes_the_secret_owned_by_the_job_then_lets_the_job_run(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    spec = with_credentials(make_spec)
    handle = executor.submit(spec)

    name = handle["job_name"]
    assert handle["secret_name"] == name
    job = dict(cluster.objects(JOBS))[name]
    assert_no_credential_in(job)
    assert job["spec"]["suspend"] is False  # let run once its Secret exists
    secret = secrets(cluster)[name]
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == job["metadata"]["uid"]
    assert base64.b64decode(secret["data"]["RATCHET_ROLLOUT_API_KEY"]).decode() == ROLLOUT_KEY
    # The order: the Job (suspended), its Secret, then the Job let run.
    order = [
        (r.method.value, r.resource)
        for r in cluster.emulator._requests
        if r.method.value in ("POST", "PATCH") and r.resource in (JOBS, SECRETS)
    ]
    assert order == [("POST", JOBS), ("POST", SECRETS), ("PATCH", JOBS)]
    assert not spec.spec_path.read_text().count(ROLLOUT_KEY)


def test_a_resubmit_or_a_squatter_gets_the_runs_own_secret(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    spec = with_credentials(make_spec)
    name = job_name("train", spec.run_id)
    squatter: Any = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "data": {"RATCHET_ROLLOUT_API_KEY": base64.b64encode(b"planted").decode()},
    }
    cluster.core.create_namespaced_secret(NAMESPACE, squatter)
    executor.submit(spec)
    executor.submit(spec)  # a retried activity

    secret = secrets(cluster)[name]
    assert base64.b64decode(secret["data"]["RATCHET_ROLLOUT_API_KEY"]).decode() == ROLLOUT_KEY
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "Job"
    assert len(list(cluster.objects(JOBS))) == 1


def test_the_secret_goes_when_the_run_ends(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(with_credentials(make_spec))
    assert executor.status(handle).state == "pending"
    assert handle["secret_name"] in secrets(cluster)  # the running job still reads it

    cluster.set_job_status(NAMESPACE, handle["job_name"], COMPLETE)
    assert executor.wait(handle, 5).state == "succeeded"
    assert secrets(cluster) == {}
    assert executor.status(handle).state == "succeeded"  # asking again is harmless

    other = executor.submit(with_credentials(make_spec, run_id="demo-c2-train"))
    assert other["secret_name"] in secrets(cluster)
    executor.cancel(other)
    assert secrets(cluster) == {}


def test_without_credentials_there_is_no_secret_and_no_extra_call(
    cluster: EmulatedCluster, executor: KubernetesExecutor, make_spec: Callable[..., JobRequest]
) -> None:
    handle = executor.submit(make_spec(env=PLAIN))
    assert handle["secret_name"] is None
    assert secrets(cluster) == {}
    assert cluster.requests("PATCH", JOBS) == []


def test_under_kueue_the_job_waits_for_kueue_not_for_ratchet(
    cluster: EmulatedCluster, make_spec: Callable[..., JobRequest], tmp_path: Path
) -> None:
    executor = KubernetesExecutor(
        cluster.api_client,
        namespace=NAMESPACE,
        template=make_template(tmp_path, kueue={"queueName": "team-a"}),
        watch_read_slack_s=0.3,
    )
    handle = executor.submit(with_credentials(make_spec))
    assert dict(cluster.objects(JOBS))[handle["job_name"]]["spec"]["suspend"] is True
    assert handle["secret_name"] in secrets(cluster)
    assert cluster.requests("PATCH", JOBS) == []
