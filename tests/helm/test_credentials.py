"""The chart's keys and the jobs' credentials (issue 43, items 2 and 8), each finding
reproduced first:

- the vLLM key was generated anew on every render without a cluster (helm template, Argo
  CD): two renders, two keys, and the pods drift apart from the worker. Now such a render
  fails and names the way that is stable (a Secret made once);
- the worker's cloud identity (serviceAccount.annotations) reached the jobs' account;
- jobs pointed at vLLM wrote their adapters to a directory they never mounted, and held the
  vLLM key in the job template's ConfigMap: now the worker points them at the rollout
  endpoint, the shared directory is inside the run dir they mount, and the key travels in a
  Secret of the run's own;
- vLLM's runtime adapter API was on whatever the serving target, so the key agents held
  could swap the served model: now it is on only where something loads adapters at runtime.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from services.executors.base import JobRequest
from services.executors.kubernetes.builder import build_job
from services.loop.job_documents import job_environment
from services.settings import ENV_PREFIX, Settings
from tests.helm.chart import CHART_DIR, NAMESPACE, Rendered, render
from tests.helm.test_chart import KUBERNETES_VERSIONS, MINIMAL
from tests.helm.test_job_template import executor_template
from tests.helm.test_vllm import VLLM, VLLM_ENABLED, VLLM_KEY, render_vllm

IDENTITY = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/ratchet-worker"}
ROLLOUTS: dict[str, Any] = {**VLLM, "jobs": {"rollouts": {"endpoint": "vllm"}}}


def test_a_generated_vllm_key_is_refused_where_no_cluster_can_keep_it() -> None:
    """Rendered as Argo CD renders (no cluster to look the release's Secret up in), a key
    made by the chart would be a new one every time: refused, naming what to do."""
    values = {**MINIMAL, "serving": {"vllm": {"enabled": True}}}
    with pytest.raises(Exception, match="existingSecret is empty and no cluster answered") as err:
        render(values)
    assert "kubectl -n ml-platform create secret generic vllm-api-key" in str(err.value)
    assert "serving.vllm.apiKey.existingSecret: vllm-api-key" in str(err.value)
    # Named, the key is the Secret's, the same on every render, and the chart makes none.
    first, again = render_vllm(VLLM), render_vllm(VLLM)
    for rendered in (first, again):
        vllm = rendered.named("Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
        assert rendered.container_env(vllm)["VLLM_API_KEY"] == VLLM_KEY
        assert [s for s in rendered.of_kind("Secret") if "vllm" in s["metadata"]["name"]] == []
    assert first.objects == again.objects


def _accounts(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {sa["metadata"]["name"]: sa for sa in render(values).of_kind("ServiceAccount")}


def test_the_workers_cloud_identity_never_reaches_the_jobs_account() -> None:
    accounts = _accounts({**MINIMAL, "serviceAccount": {"annotations": IDENTITY}})
    assert accounts["rel-ratchet-worker"]["metadata"]["annotations"] == IDENTITY
    assert "annotations" not in accounts["rel-ratchet-job"]["metadata"]
    own = {"iam.gke.io/gcp-service-account": "jobs@project.iam.gserviceaccount.com"}
    accounts = _accounts(
        {
            **MINIMAL,
            "serviceAccount": {"annotations": IDENTITY},
            "jobs": {"serviceAccount": {"annotations": own}},
        }
    )
    assert accounts["rel-ratchet-job"]["metadata"]["annotations"] == own
    assert accounts["rel-ratchet-worker"]["metadata"]["annotations"] == IDENTITY


def _worker_settings(rendered: Rendered, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The worker's settings, from exactly the environment the chart gives its container."""
    (container,) = rendered.named("Deployment", "worker")["spec"]["template"]["spec"]["containers"]
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in rendered.container_env(container).items():
        monkeypatch.setenv(name, value)
    return Settings()


def test_rollouts_on_vllm_reach_a_directory_the_job_writes_and_vllm_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job the worker builds (its settings from the chart, its Job from the chart's
    template) writes each step's adapter where the vLLM pods read it, at the same path, and
    holds the vLLM key only through its run's Secret."""
    rendered = render_vllm(ROLLOUTS)
    settings = _worker_settings(rendered, monkeypatch)
    assert (settings.rollout_endpoint, settings.rollout_model) == ("vllm", "support-agent")

    template = executor_template(rendered)
    root = PurePosixPath(template.artifacts.mount_path)
    run_dir = Path(str(root / "loops" / "support-agent" / "runs" / "r-1"))
    environment = job_environment({}, settings, run_dir)
    assert environment.credentials == {"RATCHET_ROLLOUT_API_KEY": VLLM_KEY}
    spec = JobRequest(
        run_id="r-1",
        loop="support-agent",
        kind="train",
        document={"schema": "ratchet.job/v1", "kind": "train", "run_id": "r-1"},
        run_dir=run_dir,
        output_dir=run_dir / "output",
        logs_dir=run_dir / "logs",
        env=environment.plain,
        secret_env=environment.credentials,
    )
    job = build_job(spec, template, namespace=NAMESPACE)
    kubernetes_validate.validate(job, KUBERNETES_VERSIONS[-1], strict=True)
    assert VLLM_KEY not in json.dumps(job)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {var["name"]: var for var in container["env"]}
    assert env["RATCHET_ROLLOUT_URL"]["value"] == "http://rel-ratchet-vllm:8000"
    shared = PurePosixPath(env["RATCHET_ROLLOUT_SHARED_DIR"]["value"])
    job_mounts = [m for m in container["volumeMounts"] if not m.get("readOnly")]
    assert any(shared.is_relative_to(m["mountPath"]) for m in job_mounts)
    vllm = rendered.named("Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
    (artifacts,) = [m for m in vllm["volumeMounts"] if m["name"] == "artifacts"]
    assert shared.is_relative_to(artifacts["mountPath"]) and "subPath" not in artifacts
    # vLLM takes runtime loads now, and no key sits in the job template's ConfigMap.
    assert rendered.container_env(vllm)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    for config_map in rendered.of_kind("ConfigMap"):
        assert VLLM_KEY not in json.dumps(config_map)


def test_the_jobs_and_vllm_reach_each_other_only_when_jobs_roll_out_there() -> None:
    def job_to_vllm(rendered: Rendered) -> tuple[bool, bool]:
        jobs = rendered.named("NetworkPolicy", "job")["spec"]["egress"]
        vllm = rendered.named("NetworkPolicy", "vllm")["spec"]["ingress"][0]["from"]
        egress = any(
            (rule.get("to") or [{}])[0]
            .get("podSelector", {})
            .get("matchLabels", {})
            .get("app.kubernetes.io/component")
            == "vllm"
            for rule in jobs
        )
        ingress = any(
            peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/managed-by")
            == "ratchet"
            for peer in vllm
        )
        return egress, ingress

    assert job_to_vllm(render_vllm(VLLM)) == (False, False)
    rendered = render_vllm(ROLLOUTS)
    assert job_to_vllm(rendered) == (True, True)
    for kind in ("job", "vllm"):
        policy = rendered.named("NetworkPolicy", kind)
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(policy, version, strict=True)


def test_runtime_loading_is_on_only_where_asked_for_or_needed() -> None:
    def runtime(values: dict[str, Any]) -> bool:
        rendered = render_vllm(values)
        vllm = rendered.named("Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
        return any(v["name"] == "VLLM_ALLOW_RUNTIME_LORA_UPDATING" for v in vllm["env"])

    lora = {"enabled": True, "runtimeLoading": True}
    assert runtime(VLLM) is False
    assert runtime(ROLLOUTS) is True
    assert runtime({**VLLM, "serving": {"vllm": {**VLLM_ENABLED, "lora": lora}}}) is True
    no_lora = {**ROLLOUTS, "serving": {"vllm": {**VLLM_ENABLED, "lora": {"enabled": False}}}}
    with pytest.raises(Exception, match="rollouts load adapters"):
        render_vllm(no_lora)


def test_a_rollout_endpoint_must_be_one_the_worker_knows() -> None:
    with pytest.raises(Exception, match=r'jobs\.rollouts\.endpoint "elsewhere" is neither'):
        render({**MINIMAL, "jobs": {"rollouts": {"endpoint": "elsewhere"}}})
    endpoints = {"pool": {"kind": "openai", "url": "http://rollouts:8000"}}
    with pytest.raises(Exception, match=r"jobs\.rollouts\.model is required"):
        render(
            {
                **MINIMAL,
                "serving": {"endpoints": endpoints},
                "jobs": {"rollouts": {"endpoint": "pool"}},
            }
        )
    rendered = render(
        {
            **MINIMAL,
            "serving": {"endpoints": endpoints},
            "jobs": {"rollouts": {"endpoint": "pool", "model": "base"}},
        }
    )
    (worker,) = rendered.named("Deployment", "worker")["spec"]["template"]["spec"]["containers"]
    env = rendered.container_env(worker)
    assert (env["RATCHET_ROLLOUT_ENDPOINT"], env["RATCHET_ROLLOUT_MODEL"]) == ("pool", "base")
    (api,) = rendered.named("Deployment", "api")["spec"]["template"]["spec"]["containers"]
    assert "RATCHET_ROLLOUT_ENDPOINT" not in rendered.container_env(api)  # the worker's alone


@pytest.mark.parametrize(
    "name", ["RATCHET_ROLLOUT_API_KEY", "RATCHET_ROLLOUT_SHARED_DIR", "RATCHET_JUDGE_ENDPOINTS"]
)
def test_jobs_env_cannot_carry_what_the_worker_hands_each_job(name: str) -> None:
    """The documented way to point jobs at vLLM was its key in jobs.env, a ConfigMap."""
    values = {**MINIMAL, "jobs": {"env": [{"name": name, "value": "x"}]}}
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(Exception, match="env"):
        chart.validate_schema(values)


def test_an_operators_job_credential_is_a_secret_reference() -> None:
    ref = {"secretKeyRef": {"name": "hub", "key": "token"}}
    rendered = render({**MINIMAL, "jobs": {"env": [{"name": "HF_TOKEN", "valueFrom": ref}]}})
    template = executor_template(rendered)
    (var,) = template.env
    assert var.model_dump(by_alias=True, exclude_none=True) == {
        "name": "HF_TOKEN",
        "valueFrom": ref,
    }
    with helm.Chart.load(CHART_DIR) as chart:
        for bad in (
            {"name": "HF_TOKEN"},
            {"name": "HF_TOKEN", "value": "x", "valueFrom": ref},
            {"name": "HF_TOKEN", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
        ):
            with pytest.raises(Exception, match="env"):
                chart.validate_schema({**MINIMAL, "jobs": {"env": [bad]}})
