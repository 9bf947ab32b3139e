"""The one place a Ratchet job becomes Kubernetes objects: pure functions, no API calls.

:func:`build_job` turns a :class:`~services.executors.base.JobRequest` and the operator's
:class:`~services.executors.kubernetes.template.JobTemplate` into a ``batch/v1`` Job, and
:func:`build_headless_service` adds the Service a multi-node job needs for rendezvous.
Being pure, both are tested by comparing dicts, and the launcher only sends what they built.

Names derive from the run id (``ratchet-<kind>-<run>``, at most 63 characters, a hash
suffix when the run id had to be shortened or changed to fit DNS rules), so a retried
submit asks for the same name and finds the Job that is already there.

A job's credentials (``JobRequest.secret_env``: the rollout server's key, judge and tool
endpoints) never appear in the Job: :func:`build_job_secret` puts them in a Secret of the
run's own, named like the Job and owned by it (deleted with it), which the container reads
through ``secretKeyRef``. A Job with credentials is created suspended, so no pod starts
before its Secret exists; the launcher creates the Secret, then lets the Job run.

The container runs with a read-only root filesystem: it writes its run's directories on the
artifact volume and an ``emptyDir`` at ``/tmp``, where ``HOME`` points (torch's, triton's and
Hugging Face's caches live under it) unless the template sets ``HOME``.

Multi-node jobs are Indexed Jobs (completions = parallelism = nodes). Each pod gets the
torchrun rendezvous environment: ``MASTER_ADDR`` is index 0's stable hostname through the
headless Service (``<job>-0.<service>``), ``NNODES``, ``NPROC_PER_NODE``, and ``NODE_RANK``
from the pod's completion index; the same values as ``PET_*`` so a bare ``torchrun`` in the
template's command picks them up. A train job of several processes whose command does not
start torchrun is started under one (:func:`_command`); its job document (the spec file every
pod reads) carries the rest, ``hyperparameters.sharding`` included.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import PurePosixPath
from typing import Any

from services.cores import THREAD_VARIABLES
from services.executors.base import CONFIG_EXIT_CODES, JobRequest, JobRequestError
from services.executors.kubernetes.template import GPU_RESOURCE, JobTemplate

MAX_NAME_LENGTH = 63
CONTAINER_NAME = "job"
ARTIFACTS_VOLUME = "artifacts"
SCRATCH_VOLUME = "tmp"
SCRATCH_PATH = "/tmp"
SCRATCH_HOME = "/tmp/home"  # HOME of a job: the image's own is on the read-only root
RENDEZVOUS_PORT = 29500

LABEL_LOOP = "ratchet.dev/loop"
LABEL_RUN = "ratchet.dev/run"
LABEL_CYCLE = "ratchet.dev/cycle"
LABEL_KIND = "ratchet.dev/kind"
LABEL_JOB_NAME = "ratchet.dev/job-name"
ANNOTATION_RUN_ID = "ratchet.dev/run-id"
ANNOTATION_CANCEL = "ratchet.dev/cancel-requested-at"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"

_INVALID = re.compile(r"[^a-z0-9-]+")
_LABEL_INVALID = re.compile(r"[^A-Za-z0-9._-]+")


def _digest(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _dns_part(text: str) -> str:
    return _INVALID.sub("-", text.lower()).strip("-")


def job_name(kind: str, run_id: str, *, nodes: int = 1) -> str:
    """``ratchet-<kind>-<run>``: deterministic, a valid DNS label, unique per run id.

    Indexed pods are named ``<job>-<index>`` as hostnames, so multi-node names leave room
    for the index within the 63 characters.
    """
    limit = MAX_NAME_LENGTH - (len(f"-{nodes - 1}") if nodes > 1 else 0)
    part = _dns_part(run_id)
    name = f"ratchet-{_dns_part(kind)}-{part}"
    if part == run_id and len(name) <= limit:
        return name
    suffix = _digest(run_id)
    return f"{name[: limit - len(suffix) - 1].rstrip('-')}-{suffix}"


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 characters; shortened with a hash suffix)."""
    value = _LABEL_INVALID.sub("-", text).strip("-._")
    if value == text and len(value) <= MAX_NAME_LENGTH:
        return value
    suffix = _digest(text)
    return f"{value[: MAX_NAME_LENGTH - len(suffix) - 1].rstrip('-._')}-{suffix}"


def ratchet_labels(spec: JobRequest, name: str) -> dict[str, str]:
    """The labels every object of a job carries (low cardinality first, the run last)."""
    labels = {
        "app.kubernetes.io/name": "ratchet",
        "app.kubernetes.io/component": f"{spec.job_kind}-job",
        "app.kubernetes.io/part-of": "ratchet",
        "app.kubernetes.io/managed-by": "ratchet",
        "app.kubernetes.io/instance": name,
        LABEL_LOOP: label_value(spec.loop),
        LABEL_KIND: spec.kind,
        LABEL_RUN: label_value(spec.run_id),
    }
    if spec.cycle is not None:
        labels[LABEL_CYCLE] = str(spec.cycle)
    return labels


def gpus_per_node(spec: JobRequest, template: JobTemplate) -> int:
    """The template decides GPUs per node; without one, the job's declared accelerators."""
    return template.gpus_per_node or spec.accelerators


def default_pod_failure_policy() -> dict[str, Any]:
    """Disruptions (preemption, node drain) do not count; a config exit code fails at once."""
    return {
        "rules": [
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER_NAME,
                    "operator": "In",
                    "values": list(CONFIG_EXIT_CODES),
                },
            },
        ]
    }


def _check_paths(spec: JobRequest, template: JobTemplate) -> None:
    """The job must find its files on the shared volume at the same paths as the worker."""
    mount = PurePosixPath(template.artifacts.mount_path)
    paths = {
        "run dir": str(spec.run_dir),
        "output dir": str(spec.output_dir),
        "logs dir": str(spec.logs_dir),
    }
    if spec.dataset:
        paths["dataset"] = spec.dataset
    if spec.base_checkpoint:
        paths["base checkpoint"] = spec.base_checkpoint
    for what, path in paths.items():
        if not PurePosixPath(path).is_relative_to(mount):
            raise JobRequestError(
                f"the job's {what} {path} is not under the artifacts volume mounted at {mount}; "
                "set RATCHET_ARTIFACT_ROOT to the mount path so the worker and the job see "
                "the same files"
            )


def _volume_mounts(spec: JobRequest, template: JobTemplate) -> list[dict[str, Any]]:
    """Only this run's own paths of the artifact volume, each at the path the worker uses.

    A job image is code the loop's owner brought; with the whole volume mounted it could read
    every loop's datasets and checkpoints and overwrite any of them. So it gets its run,
    output and logs directories writable, its dataset and base checkpoint read-only (the
    parent's weights cannot be changed under the lineage that records their hash), through
    ``subPath`` mounts, and nothing else.
    """
    mount = PurePosixPath(template.artifacts.mount_path)
    writable = _outermost({str(spec.run_dir), str(spec.output_dir), str(spec.logs_dir)})
    read_only = sorted({p for p in (spec.dataset, spec.base_checkpoint) if p} - set(writable))
    mounts = []
    for path, read_only_flag in [(p, False) for p in writable] + [(p, True) for p in read_only]:
        entry: dict[str, Any] = {
            "name": ARTIFACTS_VOLUME,
            "mountPath": path,
            "subPath": str(PurePosixPath(path).relative_to(mount)),
        }
        if read_only_flag:
            entry["readOnly"] = True
        mounts.append(entry)
    return mounts


def _outermost(paths: set[str]) -> list[str]:
    """The paths not inside another of them (a mount of the parent already holds them)."""
    return sorted(
        path
        for path in paths
        if not any(other != path and PurePosixPath(path).is_relative_to(other) for other in paths)
    )


def _resources(spec: JobRequest, template: JobTemplate) -> dict[str, Any]:
    requests = {key: str(value) for key, value in template.resources.requests.items()}
    limits = {key: str(value) for key, value in template.resources.limits.items()}
    gpus = gpus_per_node(spec, template)
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)
        if GPU_RESOURCE in requests:
            requests[GPU_RESOURCE] = str(gpus)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _env(spec: JobRequest, template: JobTemplate, name: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        var.model_dump(by_alias=True, exclude_none=True) for var in template.env
    ]
    clash = sorted({var.name for var in template.env} & {*spec.env, *spec.secret_env})
    if clash:
        raise JobRequestError(
            f"the job template's env sets {clash[0]}, which the worker sets for this job: "
            "remove it from the template (jobs.env)"
        )
    env += [{"name": key, "value": value} for key, value in sorted(spec.env.items())]
    env += [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}
        for key in sorted(spec.secret_env)
    ]
    env += [{"name": key, "value": value} for key, value in sorted(spec.contract_env().items())]
    if "HOME" not in {e["name"] for e in env}:
        env.append({"name": "HOME", "value": SCRATCH_HOME})
    env += _thread_env({e["name"] for e in env})
    if spec.nodes > 1:
        env += _rendezvous_env(spec, template, name)
    return env


def _thread_env(already_set: set[str]) -> list[dict[str, Any]]:
    """torch's and the BLAS libraries' thread pools sized to the container's CPU limit.

    Left alone they size themselves from the node's core count: a pod limited to 4 CPUs on
    a 64-core node runs 64 threads that the CFS quota then throttles in turn. The Downward
    API gives ``limits.cpu`` rounded up to whole cores (the node's allocatable CPU when the
    template sets no limit). A variable the template or the loop sets wins, and a job's own
    ``hyperparameters.threads`` still sets torch in the job (services.cores)."""
    return [
        {
            "name": variable,
            "valueFrom": {
                "resourceFieldRef": {
                    "containerName": CONTAINER_NAME,
                    "resource": "limits.cpu",
                    "divisor": "1",
                }
            },
        }
        for variable in THREAD_VARIABLES
        if variable not in already_set
    ]


def _rendezvous_env(spec: JobRequest, template: JobTemplate, name: str) -> list[dict[str, Any]]:
    """torchrun's rendezvous: index 0's hostname through the headless Service."""
    index_ref = f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"
    values = {
        "MASTER_ADDR": f"{name}-0.{name}",
        "MASTER_PORT": str(RENDEZVOUS_PORT),
        "NNODES": str(spec.nodes),
        "NPROC_PER_NODE": str(max(1, gpus_per_node(spec, template))),
    }
    env: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in values.items()]
    env.append({"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": index_ref}}})
    for key in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC_PER_NODE", "NODE_RANK"):
        env.append({"name": f"PET_{key}", "value": f"$({key})"})
    return env


def _command(spec: JobRequest, template: JobTemplate) -> list[str]:
    """The template's (or the loop's) command with the job kind and ``--spec`` appended.

    A train job of Ratchet's own trainer (``ratchet job``) with several processes (several
    nodes, or several GPUs on its node) is started under ``torchrun``, one process per GPU,
    with the rendezvous of :func:`_rendezvous_env`: without it each pod would run one
    process that trains alone, and a sharded (``sharding: fsdp``) or data-parallel job
    needs every rank. Another trainer's command (an external image's entrypoint) starts its
    own processes, as it does outside Ratchet, and is run as given; it finds the rendezvous
    in its env. Kubernetes expands the ``$(VAR)`` references from the pod's env."""
    command = [*(spec.command or template.command), spec.job_kind, "--spec", str(spec.spec_path)]
    per_node = max(1, gpus_per_node(spec, template))
    single = spec.nodes == 1 and per_node == 1
    if spec.job_kind != "train" or single or not _is_ratchet_trainer(command):
        return command
    if spec.nodes == 1:
        return ["torchrun", "--standalone", f"--nproc-per-node={per_node}", "--no-python", *command]
    return [
        "torchrun",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "--no-python",
        *command,
    ]


def _is_ratchet_trainer(command: list[str]) -> bool:
    """Whether ``command`` is Ratchet's own job entrypoint (``ratchet job``, the chart's
    default), which runs one rank per process; a command that starts ``torchrun`` itself,
    or another trainer's, launches its own."""
    return PurePosixPath(command[0]).name == "ratchet"


JOB_UID = 10001  # the user of docker/Dockerfile.job


def _pod_spec(spec: JobRequest, template: JobTemplate, name: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image or template.image,
        "imagePullPolicy": template.image_pull_policy,
        "command": _command(spec, template),
        "env": _env(spec, template, name),
        "volumeMounts": [
            *_volume_mounts(spec, template),
            {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_PATH},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    resources = _resources(spec, template)
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        # The job image runs as uid 10001; fsGroup makes the artifact volume writable by it.
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": JOB_UID,
            "runAsGroup": JOB_UID,
            "fsGroup": JOB_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {
                "name": ARTIFACTS_VOLUME,
                "persistentVolumeClaim": {"claimName": template.artifacts.claim_name},
            },
            {"name": SCRATCH_VOLUME, "emptyDir": {}},
        ],
    }
    if template.service_account_name:
        pod["serviceAccountName"] = template.service_account_name
    if template.priority_class_name:
        pod["priorityClassName"] = template.priority_class_name
    if template.node_selector:
        pod["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in template.tolerations
        ]
    if spec.nodes > 1:
        pod["subdomain"] = name
    return pod


def build_job(spec: JobRequest, template: JobTemplate, *, namespace: str) -> dict[str, Any]:
    """The ``batch/v1`` Job for ``spec``: same inputs, same object, every time."""
    _check_paths(spec, template)
    name = job_name(spec.kind, spec.run_id, nodes=spec.nodes)
    labels = {**template.labels, **ratchet_labels(spec, name)}
    annotations = {**template.annotations, ANNOTATION_RUN_ID: spec.run_id}
    job_labels = dict(labels)
    if template.kueue is not None:
        job_labels[KUEUE_QUEUE_LABEL] = template.kueue.queue_name
    job_spec: dict[str, Any] = {
        "backoffLimit": template.backoff_limit,
        "completions": spec.nodes,
        "parallelism": spec.nodes,
        "podFailurePolicy": template.pod_failure_policy or default_pod_failure_policy(),
        "template": {
            "metadata": {"labels": {**labels, LABEL_JOB_NAME: name}, "annotations": annotations},
            "spec": _pod_spec(spec, template, name),
        },
    }
    if spec.nodes > 1:
        job_spec["completionMode"] = "Indexed"
    if template.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = template.active_deadline_seconds
    if template.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = template.ttl_seconds_after_finished
    if template.kueue is not None or spec.secret_env:
        # Kueue admits it by unsuspending; a Job with credentials waits for its Secret.
        job_spec["suspend"] = True
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": job_labels,
            "annotations": annotations,
        },
        "spec": job_spec,
    }


def build_headless_service(
    spec: JobRequest,
    template: JobTemplate,
    *,
    namespace: str,
    owner_uid: str | None = None,
) -> dict[str, Any] | None:
    """The headless Service giving a multi-node job's pods stable DNS names; None for one node.

    With ``owner_uid`` the Job owns the Service, so deleting the Job deletes it too.
    """
    if spec.nodes <= 1:
        return None
    name = job_name(spec.kind, spec.run_id, nodes=spec.nodes)
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {**template.labels, **ratchet_labels(spec, name)},
        "annotations": {ANNOTATION_RUN_ID: spec.run_id},
    }
    if owner_uid:
        metadata["ownerReferences"] = owned_by_job(name, owner_uid)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB_NAME: name},
            "ports": [
                {
                    "name": "rendezvous",
                    "port": RENDEZVOUS_PORT,
                    "targetPort": RENDEZVOUS_PORT,
                    "protocol": "TCP",
                }
            ],
        },
    }


def owned_by_job(name: str, uid: str) -> list[dict[str, Any]]:
    """The owner reference that makes an object go when the Job ``name`` goes."""
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": name,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def build_job_secret(
    spec: JobRequest, template: JobTemplate, *, namespace: str, owner_uid: str
) -> dict[str, Any] | None:
    """The Secret holding the job's credentials, owned by its Job; None when it has none.

    Named like the Job (its container's ``secretKeyRef`` names it), one key per variable,
    immutable: nothing but the worker writes it, and it goes with the Job (the owner
    reference) or sooner, when the worker sees the run end."""
    if not spec.secret_env:
        return None
    name = job_name(spec.kind, spec.run_id, nodes=spec.nodes)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**template.labels, **ratchet_labels(spec, name)},
            "annotations": {ANNOTATION_RUN_ID: spec.run_id},
            "ownerReferences": owned_by_job(name, owner_uid),
        },
        "type": "Opaque",
        "immutable": True,
        "data": {
            key: base64.b64encode(value.encode()).decode()
            for key, value in sorted(spec.secret_env.items())
        },
    }
