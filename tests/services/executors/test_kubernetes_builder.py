"""The pure Job builder and the job template: objects compared as dicts, schema-validated."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from services.executors.base import CONFIG_EXIT_CODES, JobRequest, JobRequestError
from services.executors.kubernetes.builder import (
    build_headless_service,
    build_job,
    job_name,
    label_value,
)
from services.executors.kubernetes.template import (
    JobTemplate,
    JobTemplateError,
    load_template,
    parse_template,
)

K8S_VERSION = "1.30"


def template(tmp_path: Path, **overrides: Any) -> JobTemplate:
    data: dict[str, Any] = {
        "image": "ghcr.io/acme/trainer:1.0",
        "artifacts": {"claimName": "ratchet-artifacts", "mountPath": str(tmp_path / "artifacts")},
    }
    data.update(overrides)
    return parse_template(data)


def container(job: dict[str, Any]) -> dict[str, Any]:
    containers = job["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(job)["env"]}


def assert_valid(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_single_node_job_carries_command_env_volume_and_labels(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    spec = make_spec(dataset=str(tmp_path / "artifacts" / "ds" / "train.jsonl"))
    job = build_job(spec, template(tmp_path), namespace="ml")

    assert_valid(job)
    assert job["metadata"]["name"] == "ratchet-train-demo-c1-train"
    assert job["metadata"]["namespace"] == "ml"
    assert (
        job["metadata"]["labels"].items()
        >= {
            "app.kubernetes.io/name": "ratchet",
            "app.kubernetes.io/component": "train-job",
            "ratchet.dev/loop": "demo",
            "ratchet.dev/run": "demo-c1-train",
            "ratchet.dev/cycle": "1",
        }.items()
    )
    assert job["metadata"]["annotations"]["ratchet.dev/run-id"] == "demo-c1-train"
    assert "completionMode" not in job["spec"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1
    assert job["spec"]["backoffLimit"] == 0
    assert "suspend" not in job["spec"]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["volumes"] == [
        {"name": "artifacts", "persistentVolumeClaim": {"claimName": "ratchet-artifacts"}},
        {"name": "tmp", "emptyDir": {}},  # the only writable path off the artifact volume
    ]
    main = container(job)
    assert main["image"] == "ghcr.io/acme/trainer:1.0"
    assert main["command"] == ["ratchet", "job", "train", "--spec", str(spec.spec_path)]
    # Only the run's own paths: its run dir writable (output and logs are inside it), its
    # dataset read-only; never the whole artifact volume with every loop's files.
    assert main["volumeMounts"] == [
        {
            "name": "artifacts",
            "mountPath": str(spec.run_dir),
            "subPath": "loops/demo/runs/demo-c1-train",
        },
        {
            "name": "artifacts",
            "mountPath": str(tmp_path / "artifacts" / "ds" / "train.jsonl"),
            "subPath": "ds/train.jsonl",
            "readOnly": True,
        },
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    assert main["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "resources" not in main
    env = env_of(job)
    assert env["RATCHET_JOB_SPEC"] == str(spec.spec_path)
    assert env["RATCHET_OUTPUT_DIR"] == str(spec.output_dir)
    assert env["RATCHET_DATASET"] == spec.dataset
    assert "RATCHET_BASE_CHECKPOINT" not in env
    assert "MASTER_ADDR" not in env
    assert build_headless_service(spec, template(tmp_path), namespace="ml") is None


def test_thread_pools_follow_the_containers_cpu_limit_unless_set(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    """A pod's torch must not size its pools from the node's cores (64 threads throttled
    under a 4-CPU limit): the Downward API hands it the limit; what the loop sets wins."""
    job = build_job(make_spec(), template(tmp_path), namespace="ml")
    assert_valid(job)
    limit = {"resourceFieldRef": {"containerName": "job", "resource": "limits.cpu", "divisor": "1"}}
    env = env_of(job)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == limit
    assert env["OPENBLAS_NUM_THREADS"] == limit
    pinned = build_job(make_spec(env={"OMP_NUM_THREADS": "2"}), template(tmp_path), namespace="ml")
    names = [e["name"] for e in container(pinned)["env"]]
    assert names.count("OMP_NUM_THREADS") == 1
    assert env_of(pinned)["OMP_NUM_THREADS"] == "2"
    assert env_of(pinned)["MKL_NUM_THREADS"] == limit


def test_default_pod_failure_policy_ignores_disruptions_and_fails_on_config_codes(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    job = build_job(make_spec(), template(tmp_path), namespace="ml")
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert rules[1]["action"] == "FailJob"
    assert rules[1]["onExitCodes"] == {
        "containerName": "job",
        "operator": "In",
        "values": list(CONFIG_EXIT_CODES),
    }


def test_template_settings_reach_the_pod(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    tpl = template(
        tmp_path,
        imagePullPolicy="Always",
        serviceAccountName="ratchet-job",
        command=["torchrun", "--no-python", "ratchet", "job"],
        resources={"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}},
        nodeSelector={"nvidia.com/gpu.product": "H100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        priorityClassName="training",
        backoffLimit=2,
        activeDeadlineSeconds=3600,
        ttlSecondsAfterFinished=600,
        env=[{"name": "HF_HUB_OFFLINE", "value": "1"}],
        labels={"team": "a"},
        annotations={"owner": "ml-platform"},
        podFailurePolicy={
            "rules": [{"action": "Count", "onExitCodes": {"operator": "In", "values": [1]}}]
        },
    )
    job = build_job(make_spec(kind="eval", run_id="demo-c1-eval"), tpl, namespace="ml")

    assert_valid(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ratchet-job"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["priorityClassName"] == "training"
    assert job["spec"]["backoffLimit"] == 2
    assert job["spec"]["activeDeadlineSeconds"] == 3600
    assert job["spec"]["ttlSecondsAfterFinished"] == 600
    assert job["spec"]["podFailurePolicy"]["rules"][0]["action"] == "Count"
    assert job["metadata"]["labels"]["team"] == "a"
    assert job["spec"]["template"]["metadata"]["labels"]["team"] == "a"
    assert job["metadata"]["annotations"]["owner"] == "ml-platform"
    main = container(job)
    assert main["imagePullPolicy"] == "Always"
    assert main["command"][:4] == ["torchrun", "--no-python", "ratchet", "job"]
    assert main["command"][4] == "eval"
    assert main["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi"},
        "limits": {"memory": "16Gi"},
    }
    assert env_of(job)["HF_HUB_OFFLINE"] == "1"


def test_gpus_per_node_become_gpu_limits(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    job = build_job(make_spec(), template(tmp_path, gpusPerNode=8), namespace="ml")
    assert_valid(job)
    assert container(job)["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_declared_accelerators_apply_when_the_template_sets_no_gpus(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    job = build_job(make_spec(accelerators=2), template(tmp_path), namespace="ml")
    assert container(job)["resources"] == {"limits": {"nvidia.com/gpu": "2"}}


def test_kueue_labels_the_job_and_creates_it_suspended(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    job = build_job(make_spec(), template(tmp_path, kueue={"queueName": "team-a"}), namespace="ml")
    assert_valid(job)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["spec"]["suspend"] is True


def test_multi_node_is_an_indexed_job_with_rendezvous_env_and_headless_service(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    spec = make_spec(nodes=4)
    tpl = template(tmp_path, gpusPerNode=8)
    job = build_job(spec, tpl, namespace="ml")
    service = build_headless_service(spec, tpl, namespace="ml", owner_uid="uid-1")
    assert service is not None

    assert_valid(job)
    assert_valid(service)
    name = job["metadata"]["name"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    assert job["spec"]["template"]["spec"]["subdomain"] == name
    env = env_of(job)
    assert env["MASTER_ADDR"] == f"{name}-0.{name}"
    assert env["MASTER_PORT"] == "29500"
    assert env["NNODES"] == "4"
    assert env["NPROC_PER_NODE"] == "8"
    assert env["NODE_RANK"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    assert env["PET_NODE_RANK"] == "$(NODE_RANK)"
    assert service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"ratchet.dev/job-name": name}
    assert job["spec"]["template"]["metadata"]["labels"]["ratchet.dev/job-name"] == name
    assert service["metadata"]["ownerReferences"][0] == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": name,
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def test_build_is_deterministic(tmp_path: Path, make_spec: Callable[..., JobRequest]) -> None:
    tpl = template(tmp_path)
    first = json.dumps(build_job(make_spec(), tpl, namespace="ml"), sort_keys=True)
    second = json.dumps(build_job(make_spec(), tpl, namespace="ml"), sort_keys=True)
    assert first == second


def test_names_fit_dns_rules_and_stay_unique() -> None:
    assert job_name("train", "demo-c1-train") == "ratchet-train-demo-c1-train"
    long_a = "a" * 40 + "-c12-eval-candidate-regression"
    long_b = "a" * 40 + "-c12-eval-champion-regression"
    name_a, name_b = job_name("eval", long_a), job_name("eval", long_b)
    assert len(name_a) <= 63 and len(name_b) <= 63
    assert name_a != name_b
    assert name_a == job_name("eval", long_a)
    # Case and characters DNS forbids change the name, so the hash keeps it unique.
    assert job_name("train", "Demo_C1") != job_name("train", "demo-c1")
    assert job_name("train", "Demo_C1").startswith("ratchet-train-demo-c1-")
    # Indexed pods are named <job>-<index>: multi-node names leave room for the index.
    indexed = job_name("train", "x" * 60, nodes=16)
    assert len(f"{indexed}-15") <= 63
    assert len(label_value("r" * 100)) <= 63


def test_paths_outside_the_artifacts_mount_are_refused(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    spec = make_spec(base_checkpoint="/somewhere/else/ckpt")
    with pytest.raises(JobRequestError, match="base checkpoint /somewhere/else/ckpt is not under"):
        build_job(spec, template(tmp_path), namespace="ml")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"image": ""}, "image"),
        ({"imagee": "x"}, "imagee: unknown key (allowed:"),
        ({"kueue": {"queue": "a"}}, "kueue.queue: unknown key"),
        ({"gpusPerNode": -1}, "gpusPerNode"),
        ({"resources": {"limits": {"memory": "lots"}}}, "not a Kubernetes quantity"),
        (
            {"gpusPerNode": 2, "resources": {"limits": {"nvidia.com/gpu": 4}}},
            "but gpusPerNode is 2",
        ),
        ({"env": [{"name": "RATCHET_OUTPUT_DIR", "value": "/x"}]}, "cannot be overridden"),
        ({"env": [{"name": "MASTER_ADDR", "value": "x"}]}, "cannot be overridden"),
        ({"labels": {"ratchet.dev/run": "x"}}, "cannot be overridden"),
        ({"artifacts": {"claimName": "c", "mountPath": "relative"}}, "absolute path"),
        ({"podFailurePolicy": {"rules": []}}, "at least one rule"),
        ({"imagePullPolicy": "Sometimes"}, "imagePullPolicy"),
    ],
)
def test_invalid_templates_fail_with_the_key_at_fault(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(JobTemplateError, match="job template") as raised:
        template(tmp_path, **overrides)
    assert message in str(raised.value)


def test_the_artifacts_volume_is_required() -> None:
    with pytest.raises(JobTemplateError, match="artifacts: Field required"):
        parse_template({"image": "x"})


def test_templates_load_from_yaml_and_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "template.yaml"
    yaml_file.write_text(
        "image: trainer:1\n"
        "gpusPerNode: 1\n"
        "kueue:\n  queueName: q\n"
        "artifacts:\n  claimName: c\n  mountPath: /artifacts\n"
    )
    loaded = load_template(yaml_file)
    assert loaded.gpus_per_node == 1
    assert loaded.kueue is not None and loaded.kueue.queue_name == "q"
    json_file = tmp_path / "template.json"
    json_file.write_text(
        json.dumps({"image": "t", "artifacts": {"claimName": "c", "mountPath": "/a"}})
    )
    assert load_template(json_file).command == ["ratchet", "job"]


def test_unreadable_templates_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(JobTemplateError, match="RATCHET_KUBERNETES_JOB_TEMPLATE"):
        load_template(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("image: [unclosed\n")
    with pytest.raises(JobTemplateError, match="not valid YAML/JSON"):
        load_template(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(JobTemplateError, match="must be a mapping"):
        load_template(scalar)


def test_outputs_outside_the_run_dir_and_the_base_checkpoint_get_their_own_mounts(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    root = tmp_path / "artifacts"
    spec = make_spec(
        output_dir=root / "checkpoints" / "new",
        base_checkpoint=str(root / "checkpoints" / "champion"),
    )
    mounts = container(build_job(spec, template(tmp_path), namespace="ml"))["volumeMounts"]
    mounts = [m for m in mounts if m["name"] == "artifacts"]
    by_path = {m["mountPath"]: m for m in mounts}
    assert set(by_path) == {
        str(spec.run_dir),
        str(root / "checkpoints" / "new"),
        str(root / "checkpoints" / "champion"),
    }
    assert by_path[str(root / "checkpoints" / "champion")]["readOnly"] is True
    assert "readOnly" not in by_path[str(root / "checkpoints" / "new")]
    assert all(m["subPath"] and not m["subPath"].startswith("/") for m in mounts)


def test_a_sharded_multi_node_train_job_starts_every_rank_under_torchrun(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    """Issue 44 item 2: a sharded (FSDP) train job on 2 nodes of 4 GPUs each, with the
    default command: each pod runs torchrun with the rendezvous its env carries (8 ranks in
    all), and reads the spec whose hyperparameters ask for the sharding."""
    document = {"algorithm": "grpo", "hyperparameters": {"sharding": "fsdp"}}
    spec = make_spec(nodes=2, document=document)
    job = build_job(spec, template(tmp_path, gpusPerNode=4), namespace="ml")

    assert_valid(job)
    name = job["metadata"]["name"]
    assert container(job)["command"] == [
        "torchrun",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "--no-python",
        "ratchet",
        "job",
        "train",
        "--spec",
        str(spec.spec_path),
    ]
    env = env_of(job)
    assert (env["NNODES"], env["NPROC_PER_NODE"], env["MASTER_PORT"]) == ("2", "4", "29500")
    assert env["MASTER_ADDR"] == f"{name}-0.{name}"
    names = [e["name"] for e in container(job)["env"]]  # defined before the command uses them
    assert {"NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"} <= set(names)
    assert job["spec"]["completionMode"] == "Indexed"
    assert spec.document["hyperparameters"] == {"sharding": "fsdp"}  # what every rank reads
    assert container(job)["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_torchrun_is_added_only_where_a_train_job_needs_more_than_one_process(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
) -> None:
    four_gpus = template(tmp_path, gpusPerNode=4)
    one_node = container(build_job(make_spec(), four_gpus, namespace="ml"))["command"]
    assert one_node[:5] == [
        "torchrun",
        "--standalone",
        "--nproc-per-node=4",
        "--no-python",
        "ratchet",
    ]
    # a command that starts torchrun itself is left as it is
    own = template(
        tmp_path,
        gpusPerNode=4,
        command=["torchrun", "--nproc-per-node=gpu", "--no-python", "ratchet", "job"],
    )
    assert container(build_job(make_spec(nodes=2), own, namespace="ml"))["command"][:2] == [
        "torchrun",
        "--nproc-per-node=gpu",
    ]
    module = template(
        tmp_path, command=["python", "-m", "torch.distributed.run", "-m", "services", "job"]
    )
    assert (
        container(build_job(make_spec(nodes=2), module, namespace="ml"))["command"][0] == "python"
    )
    # another trainer's entrypoint launches its own processes: run as given
    external = template(tmp_path, gpusPerNode=4, command=["/opt/trainer/entrypoint.sh"])
    assert container(build_job(make_spec(nodes=2), external, namespace="ml"))["command"][:2] == [
        "/opt/trainer/entrypoint.sh",
        "train",
    ]
    # one process: the command as the template gives it; an eval job never is a torchrun group
    single = container(build_job(make_spec(), template(tmp_path), namespace="ml"))["command"]
    assert single[:3] == ["ratchet", "job", "train"]
    evaluation = make_spec(kind="eval", run_id="demo-c1-eval")
    assert container(build_job(evaluation, four_gpus, namespace="ml"))["command"][:3] == [
        "ratchet",
        "job",
        "eval",
    ]
