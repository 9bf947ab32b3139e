"""The training Job template the chart renders for the Kubernetes executor.

The rendered file goes through the executor's own parser (``parse_template``, which
refuses unknown keys and bad values) and builder (``build_job``), and the Job that comes
out must be valid Kubernetes: the chart's values and the executor agree before any GPU is
asked for.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.executors.base import JobRequest
from services.executors.kubernetes.builder import KUEUE_QUEUE_LABEL, build_job
from services.executors.kubernetes.template import JobTemplate, parse_template
from tests.helm.chart import CI_FILES, NAMESPACE, Rendered, ci_values, render, render_ci

# The keys the chart renders; podFailurePolicy, kueue and priorityClassName only when set.
ALWAYS = {
    "image",
    "imagePullPolicy",
    "serviceAccountName",
    "command",
    "resources",
    "gpusPerNode",
    "nodeSelector",
    "tolerations",
    "artifacts",
    "backoffLimit",
    "activeDeadlineSeconds",
    "ttlSecondsAfterFinished",
    "env",
    "labels",
    "annotations",
}
WHEN_SET = {"priorityClassName", "kueue", "podFailurePolicy"}
KUBERNETES = kubernetes_validate.utils.latest_version()


def template_data(rendered: Rendered) -> dict[str, Any]:
    text = rendered.get("ConfigMap", "rel-ratchet-job-template")["data"]["job-template.yaml"]
    loaded = yaml.safe_load(text)
    assert isinstance(loaded, dict)
    return loaded


def executor_template(rendered: Rendered) -> JobTemplate:
    return parse_template(template_data(rendered), source="rendered job template")


def train_job(template: JobTemplate, *, nodes: int = 1) -> dict[str, Any]:
    """The Job the executor builds for a training run with this template."""
    root = PurePosixPath(template.artifacts.mount_path)
    run_dir = root / "runs" / "r-0001"
    spec = JobRequest(
        run_id="r-0001",
        loop="support-agent",
        kind="train",
        document={"schema": "ratchet.job/v1", "kind": "train", "run_id": "r-0001"},
        run_dir=run_dir,  # type: ignore[arg-type]
        output_dir=run_dir / "output",  # type: ignore[arg-type]
        logs_dir=run_dir / "logs",  # type: ignore[arg-type]
        cycle=3,
        dataset=str(root / "datasets" / "d1.jsonl"),
        base_checkpoint=str(root / "checkpoints" / "c0"),
        nodes=nodes,
    )
    return build_job(spec, template, namespace=NAMESPACE)


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_the_executor_accepts_the_rendered_template(ci_file: str) -> None:
    data = template_data(render_ci(ci_file))
    assert ALWAYS <= set(data) <= ALWAYS | WHEN_SET
    parse_template(data, source=ci_file)


@pytest.mark.parametrize("ci_file", CI_FILES)
@pytest.mark.parametrize("nodes", [1, 2])
def test_the_job_the_executor_builds_is_valid_kubernetes(ci_file: str, nodes: int) -> None:
    job = train_job(executor_template(render_ci(ci_file)), nodes=nodes)
    kubernetes_validate.validate(job, KUBERNETES, strict=True)


def test_defaults_ask_for_one_gpu_and_run_the_reference_job() -> None:
    rendered = render_ci("minimal-values.yaml")
    data = template_data(rendered)
    assert "kueue" not in data and "priorityClassName" not in data
    template = executor_template(rendered)
    assert template.image == "ratchet-job:0.1.0"
    assert template.command == ["ratchet", "job"]
    assert template.gpus_per_node == 1
    assert template.active_deadline_seconds == 86400
    container = train_job(template)["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["command"][:3] == ["ratchet", "job", "train"]


def test_gpu_kueue_values_reach_the_job() -> None:
    values = ci_values("gpu-kueue-values.yaml")["jobs"]
    template = executor_template(render_ci("gpu-kueue-values.yaml"))
    job = train_job(template, nodes=2)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == f"{values['image']['repository']}@{values['image']['digest']}"
    # torchrun starts one process per GPU; the executor appends the job kind and spec.
    assert container["command"][:5] == values["command"]
    assert container["command"][5] == "train"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["resources"]["requests"]["cpu"] == "32"
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
    assert pod["nodeSelector"] == values["nodeSelector"]
    assert pod["tolerations"] == values["tolerations"]
    assert pod["priorityClassName"] == "training-low"
    assert pod["serviceAccountName"] == "rel-ratchet-job"
    assert job["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "ml-training"
    assert job["metadata"]["labels"]["team"] == "agents"
    assert job["metadata"]["annotations"]["cost-center"] == "ml-platform"
    assert job["spec"]["suspend"] is True
    assert job["spec"]["activeDeadlineSeconds"] == 43200
    assert job["spec"]["completionMode"] == "Indexed"


@pytest.mark.parametrize("ci_file", CI_FILES)
def test_jobs_use_the_release_account_and_the_workers_artifact_volume(ci_file: str) -> None:
    rendered = render_ci(ci_file)
    pod = train_job(executor_template(rendered))["spec"]["template"]["spec"]
    account = rendered.get("ServiceAccount", pod["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    worker = rendered.named("Deployment", "worker")["spec"]["template"]["spec"]
    (worker_volume,) = [v for v in worker["volumes"] if v["name"] == "artifacts"]
    (job_volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    # Jobs write where the worker reads: the same claim at the same path.
    assert job_volume["persistentVolumeClaim"] == {
        "claimName": worker_volume["persistentVolumeClaim"]["claimName"]
    }
    (worker_mount,) = [
        m for m in worker["containers"][0]["volumeMounts"] if m["name"] == "artifacts"
    ]
    # Each of the job's mounts is its own run's path, at the path the worker uses for it.
    root = PurePosixPath(worker_mount["mountPath"])
    scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    for job_mount in pod["containers"][0]["volumeMounts"]:
        if job_mount["name"] in scratch:  # /tmp on the read-only root
            continue
        assert job_mount["name"] == job_volume["name"]
        assert PurePosixPath(job_mount["mountPath"]) == root / job_mount["subPath"]
    read_only = {m["subPath"] for m in pod["containers"][0]["volumeMounts"] if m.get("readOnly")}
    assert read_only == {"datasets/d1.jsonl", "checkpoints/c0"}


def test_job_network_policy_selects_the_pods_the_executor_labels() -> None:
    rendered = render_ci("ingress-networkpolicy-values.yaml")
    job = train_job(executor_template(rendered))
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    policy = rendered.named("NetworkPolicy", "job")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    for chart_pod in ("api", "worker"):
        labels = rendered.named("Deployment", chart_pod)["spec"]["template"]["metadata"]["labels"]
        assert not policy["podSelector"]["matchLabels"].items() <= labels.items()


def test_an_external_trainer_image_plugs_in() -> None:
    values = ci_values("minimal-values.yaml")
    values["jobs"] = {
        "image": {"repository": "nvcr.io/acme/nemo-rl-ratchet", "tag": "24.12"},
        "command": ["/opt/trainer/entrypoint.sh"],
        "gpusPerNode": 4,
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": "job", "operator": "In", "values": [3]},
                }
            ]
        },
    }
    job = train_job(executor_template(render(values)))
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "nvcr.io/acme/nemo-rl-ratchet:24.12"
    assert container["command"][0] == "/opt/trainer/entrypoint.sh"
    assert container["command"][1:] == [
        "train",
        "--spec",
        "/var/lib/ratchet/artifacts/runs/r-0001/spec.json",
    ]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert job["spec"]["podFailurePolicy"] == values["jobs"]["podFailurePolicy"]
    kubernetes_validate.validate(job, KUBERNETES, strict=True)


def test_cpu_only_jobs_ask_for_no_gpu() -> None:
    values = ci_values("minimal-values.yaml")
    values["jobs"] = {"gpusPerNode": 0}
    container = train_job(executor_template(render(values)))["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
