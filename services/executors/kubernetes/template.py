"""The job template: everything about a cluster Job that is the operator's choice.

The template is a YAML or JSON file named by ``RATCHET_KUBERNETES_JOB_TEMPLATE`` (the Helm
chart renders it from values into a ConfigMap). It holds exactly these keys, and nothing
else, so a typo fails loudly instead of being ignored::

    image: ghcr.io/acme/ratchet-trainer:1.2.0     # required
    imagePullPolicy: IfNotPresent
    serviceAccountName: ratchet-job
    command: ["ratchet", "job"]                   # the kind and --spec <path> are appended
    resources: {requests: {cpu: "4", memory: 16Gi}, limits: {nvidia.com/gpu: 1}}
    gpusPerNode: 1
    nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
    priorityClassName: training
    kueue: {queueName: team-a}                    # label + create the Job suspended
    artifacts: {claimName: ratchet-artifacts, mountPath: /artifacts}   # required
    backoffLimit: 0
    activeDeadlineSeconds: 86400
    ttlSecondsAfterFinished: 604800
    env: [{name: HF_HUB_OFFLINE, value: "1"},            # plain values, or a key of a
          {name: HF_TOKEN, valueFrom: {secretKeyRef: {name: hub, key: token}}}]  # Secret
    labels: {team: a}
    annotations: {}
    podFailurePolicy: {rules: [...]}   # default: ignore disruptions, fail on config exit codes

Validation happens once, when the template is loaded, and every error names the file and
the key at fault.

The template is read from a ConfigMap, which whoever may ``view`` the namespace reads: it
holds no credential. A job's own credentials (the rollout server's key, judge and tool
endpoints) are the worker's to hand over, in a Secret of the run's own (the builder), so
the variables that carry them cannot be set here; an operator's credential goes in through
``valueFrom.secretKeyRef`` to a Secret of theirs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.environments.replay.endpoints import ENV_JUDGES, ENV_TOOLS
from services.executors.base import CONTRACT_ENV, JobRequestError
from services.inference.rollout_env import ENV_PREFIX as ROLLOUT_ENV_PREFIX

GPU_RESOURCE = "nvidia.com/gpu"

# Environment variables the executor sets for multi-node jobs; a template may not set them.
RENDEZVOUS_ENV: frozenset[str] = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "NNODES",
        "NODE_RANK",
        "NPROC_PER_NODE",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
        "PET_NNODES",
        "PET_NODE_RANK",
        "PET_NPROC_PER_NODE",
    }
)
# Variables the worker sets for each job from its own settings (the rollout server, the judge
# and tool endpoints): credentials among them, so never in the template's ConfigMap.
WORKER_ENV: frozenset[str] = frozenset({ENV_JUDGES, ENV_TOOLS})
WORKER_ENV_PREFIXES = (ROLLOUT_ENV_PREFIX,)
RESERVED_LABEL_PREFIXES = ("ratchet.dev/", "app.kubernetes.io/", "kueue.x-k8s.io/")

_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkKMGTPE]i?)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class JobTemplateError(JobRequestError):
    """The job template file is missing, unreadable or invalid."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Resources(_Strict):
    requests: dict[str, str | int | float] = Field(default_factory=dict)
    limits: dict[str, str | int | float] = Field(default_factory=dict)

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, value: dict[str, str | int | float]) -> dict[str, str | int | float]:
        for name, quantity in value.items():
            if isinstance(quantity, bool) or not _QUANTITY.match(str(quantity)):
                raise ValueError(f"{name}: {quantity!r} is not a Kubernetes quantity")
        return value


class Kueue(_Strict):
    queue_name: str = Field(alias="queueName", min_length=1, max_length=63)


class Artifacts(_Strict):
    claim_name: str = Field(alias="claimName", min_length=1, max_length=253)
    mount_path: str = Field(alias="mountPath")

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path")
        return value.rstrip("/") or "/"


class SecretKeySelector(_Strict):
    name: str = Field(min_length=1, max_length=253)
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    optional: bool | None = None


class EnvVarSource(_Strict):
    secret_key_ref: SecretKeySelector = Field(alias="secretKeyRef")


class EnvVar(_Strict):
    """``{name, value}``, or ``{name, valueFrom: {secretKeyRef: {name, key}}}`` for a
    credential of the operator's (the template itself is no place for one)."""

    name: str
    value: str | None = None
    value_from: EnvVarSource | None = Field(default=None, alias="valueFrom")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _ENV_NAME.match(value):
            raise ValueError(f"{value!r} is not a valid environment variable name")
        if value in CONTRACT_ENV or value in RENDEZVOUS_ENV:
            raise ValueError(f"{value} is set by Ratchet and cannot be overridden")
        if value in WORKER_ENV or value.startswith(WORKER_ENV_PREFIXES):
            raise ValueError(
                f"{value} is set by the worker for each job, its credentials in a Secret of "
                "the run's own: configure the rollout server (RATCHET_ROLLOUT_ENDPOINT, the "
                "chart's jobs.rollouts) or the endpoints on the worker instead "
                "(docs/deploy.md, Job credentials)"
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"{self.name} needs exactly one of value, valueFrom")
        return self


class Toleration(_Strict):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, alias="tolerationSeconds")


class JobTemplate(_Strict):
    """The operator's part of every Job (see the module docstring for the file format)."""

    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", alias="imagePullPolicy"
    )
    service_account_name: str | None = Field(default=None, alias="serviceAccountName")
    command: list[str] = Field(default_factory=lambda: ["ratchet", "job"], min_length=1)
    resources: Resources = Field(default_factory=Resources)
    gpus_per_node: int = Field(default=0, ge=0, le=64, alias="gpusPerNode")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: list[Toleration] = Field(default_factory=list)
    priority_class_name: str | None = Field(default=None, alias="priorityClassName")
    kueue: Kueue | None = None
    artifacts: Artifacts
    backoff_limit: int = Field(default=0, ge=0, le=100, alias="backoffLimit")
    active_deadline_seconds: int | None = Field(default=None, ge=1, alias="activeDeadlineSeconds")
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, alias="ttlSecondsAfterFinished"
    )
    env: list[EnvVar] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    pod_failure_policy: dict[str, Any] | None = Field(default=None, alias="podFailurePolicy")

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if key.startswith(RESERVED_LABEL_PREFIXES):
                raise ValueError(f"label {key!r} is set by Ratchet and cannot be overridden")
        return value

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        if any(not part for part in value):
            raise ValueError("command entries must be non-empty strings")
        return value

    @field_validator("service_account_name", "priority_class_name")
    @classmethod
    def _dns_name(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", value):
            raise ValueError(f"{value!r} is not a valid Kubernetes object name")
        return value

    @field_validator("pod_failure_policy")
    @classmethod
    def _pod_failure_policy(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        rules = value.get("rules")
        if set(value) != {"rules"} or not isinstance(rules, list) or not rules:
            raise ValueError("must be {rules: [...]} with at least one rule")
        for index, rule in enumerate(rules):
            if not isinstance(rule, dict) or rule.get("action") not in {
                "FailJob",
                "Ignore",
                "Count",
                "FailIndex",
            }:
                raise ValueError(
                    f"rules[{index}].action must be one of FailJob, Ignore, Count, FailIndex"
                )
            if ("onExitCodes" in rule) == ("onPodConditions" in rule):
                raise ValueError(
                    f"rules[{index}] needs exactly one of onExitCodes, onPodConditions"
                )
        return value

    @model_validator(mode="after")
    def _gpus_agree(self) -> JobTemplate:
        for section in ("requests", "limits"):
            declared = getattr(self.resources, section).get(GPU_RESOURCE)
            if declared is not None and str(declared) != str(self.gpus_per_node):
                raise ValueError(
                    f"resources.{section}.{GPU_RESOURCE} is {declared} but gpusPerNode is "
                    f"{self.gpus_per_node}; set gpusPerNode alone"
                )
        return self

    def cpu_per_node(self) -> float:
        """Cores requested per node (the limit when no request is set), for CPU accounting."""
        raw = self.resources.requests.get("cpu", self.resources.limits.get("cpu"))
        return parse_cpu(raw) if raw is not None else 0.0


def parse_cpu(quantity: str | int | float) -> float:
    """A CPU quantity in cores: ``"500m"`` is 0.5, ``"2"`` is 2."""
    text = str(quantity)
    if text.endswith("m"):
        return float(text[:-1]) / 1000.0
    return float(text)


def parse_template(data: Any, *, source: str = "job template") -> JobTemplate:
    """Validate a decoded template; errors name ``source`` and every key at fault."""
    if not isinstance(data, dict):
        raise JobTemplateError(f"{source}: must be a mapping of keys to values")
    try:
        return JobTemplate.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            key = ".".join(str(part) for part in error["loc"]) or "(top level)"
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = "unknown key"
                if len(error["loc"]) == 1:
                    message += f" (allowed: {', '.join(sorted(_allowed_keys()))})"
            problems.append(f"{key}: {message}")
        raise JobTemplateError(f"{source}: " + "; ".join(problems)) from None


def load_template(path: Path) -> JobTemplate:
    """Read and validate the template file (YAML or JSON)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise JobTemplateError(
            f"job template {path} does not exist; set RATCHET_KUBERNETES_JOB_TEMPLATE to a "
            "YAML or JSON file"
        ) from None
    except OSError as exc:
        raise JobTemplateError(f"cannot read job template {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise JobTemplateError(f"job template {path} is not valid YAML/JSON: {exc}") from None
    return parse_template(data, source=f"job template {path}")


def _allowed_keys() -> list[str]:
    return [field.alias or name for name, field in JobTemplate.model_fields.items()]
