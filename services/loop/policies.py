"""A loop's policies, parsed from the JSON columns of ``loops`` with defaults and checks.

The same models validate the admin API's input (unknown keys are refused, so a typo in a
policy never silently becomes a default) and give the workflow its parsed configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from services.training.config import HyperparameterError, parse_hyperparameters

# Strings Postgres can store in jsonb (no NUL) and a person can read.
Text = Annotated[str, StringConstraints(min_length=1, max_length=2048, pattern=r"^[^\x00]*$")]
Scalar = bool | int | float | Text


# Validation context of a payload already recorded in a workflow history: it is a fact, the
# trainer's check ran when its loop was saved, and a stricter check of a later release must
# not make a running workflow's history unreadable.
RECORDED = {"recorded": True}


class _Policy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TriggerPolicy(_Policy):
    """When a cycle starts."""

    min_new_tasks: int = Field(
        default=32, ge=1, description="curated train tasks not yet trained on"
    )
    max_interval_s: float = Field(
        default=86_400, gt=0, description="at most this long between cycles"
    )
    check_interval_s: float = Field(
        default=30, gt=0, le=86_400, description="how often to curate and check"
    )
    drift_enabled: bool = True
    drift_failure_rate: float = Field(default=0.5, gt=0, le=1)
    drift_window: int = Field(default=200, ge=10)


class GatePolicy(_Policy):
    """When a candidate is promoted, and how the canary judges it live."""

    mode: Literal["auto", "manual"] = "auto"
    confidence: float = Field(default=0.95, ge=0.5, lt=1)
    min_improvement_points: float = Field(default=0.0, ge=0)
    regression_tolerance_points: float = Field(default=2.0, ge=0)
    canary_seconds: float = Field(default=300, ge=0)
    canary_check_interval_s: float = Field(default=10, gt=0)
    canary_min_traces: int = Field(default=30, ge=1)
    canary_max_drop_points: float = Field(default=10, ge=0)
    eval_samples: int = Field(
        default=4, ge=1, le=64, description="samples per task; pass@1 is estimated from them"
    )
    eval_temperature: float = Field(
        default=0.7, ge=0, le=2, description="sampling temperature of the eval rollouts"
    )
    min_discordant_pairs: int = Field(
        default=5,
        ge=0,
        le=10_000,
        description="eval tasks on which the two models must differ before a win counts",
    )

    @model_validator(mode="after")
    def _check_sampling(self) -> GatePolicy:
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError(
                "eval_samples > 1 needs eval_temperature > 0: greedy samples are all the same"
            )
        return self


class JobOverride(_Policy):
    """This loop's own job image and command, in place of the deployment's job template.

    ``command`` is the entry point; the executor appends ``train|eval --spec <path>`` to it,
    as it does to the template's. ``image`` applies where jobs run in containers (the
    kubernetes executor); the local executor ignores it (with a warning) and runs ``command``
    on the worker's machine only where the deployment enables it
    (``RATCHET_LOCAL_JOB_COMMANDS_ENABLED``, see services.executors.local.check_loop_jobs).
    """

    image: Text | None = Field(default=None, description="container image of the job")
    command: list[Text] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="entry point; `train|eval --spec <path>` is appended",
    )


# A job's bounds, checked when a loop is saved (the budget is checked only after spending):
# the longest a training job may run, and the most accelerators one job may hold in all
# (nodes x accelerators per node; e.g. 256 nodes of 8).
MAX_JOB_TIMEOUT_S = 7 * 86_400
MAX_JOB_ACCELERATORS = 2048


def _check_job_bounds(title: str, profile: TrainingProfile) -> None:
    """The profile's job limits (not for a recorded payload: see ``RECORDED``)."""
    problems: list[tuple[str, object, str]] = []
    if profile.timeout_s > MAX_JOB_TIMEOUT_S:
        problems.append(
            (
                "timeout_s",
                profile.timeout_s,
                f"must be at most {MAX_JOB_TIMEOUT_S} seconds (7 days), got {profile.timeout_s}",
            )
        )
    # Only training runs on several nodes; an eval job is one node (eval_accelerators).
    total = profile.nodes * profile.accelerators
    if total > MAX_JOB_ACCELERATORS:
        problems.append(
            (
                "accelerators",
                profile.accelerators,
                f"nodes x accelerators is {profile.nodes} x {profile.accelerators} = {total}; "
                f"one training job may hold at most {MAX_JOB_ACCELERATORS} accelerators",
            )
        )
    if problems:
        raise ValidationError.from_exception_data(
            title,
            [
                InitErrorDetails(
                    type=PydanticCustomError("job_bounds", "{reason}", {"reason": reason}),
                    loc=(field,),
                    input=value,
                )
                for field, value, reason in problems
            ],
        )


class TrainingProfile(_Policy):
    """What a training job gets: algorithm, hyper-parameters, accelerators, limits."""

    algorithm: Literal["grpo", "sft"] = "grpo"
    family: Literal["tiny", "hf"] = Field(
        default="tiny", description="model family of the champion: the trainer that runs"
    )
    hyperparameters: dict[Text, Scalar] = Field(
        default_factory=dict,
        description="the trainer's hyper-parameters (scalars), checked against the trainer of "
        "`family` and `algorithm`: unknown keys and out-of-range values are refused",
    )
    accelerators: int = Field(default=0, ge=0, le=1024, description="accelerators per node")
    nodes: int = Field(default=1, ge=1, le=512, description="multi-node data parallel (torchrun)")
    eval_accelerators: int = Field(default=0, ge=0, le=1024)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    timeout_s: float = Field(
        default=6 * 3600, gt=0, description=f"at most {MAX_JOB_TIMEOUT_S} s (7 days)"
    )
    seed: int = 0
    train_job: JobOverride | None = Field(
        default=None, description="bring your own trainer: its image and command"
    )
    eval_job: JobOverride | None = Field(
        default=None, description="the evaluator's image and command (default: Ratchet's)"
    )

    @model_validator(mode="wrap")
    @classmethod
    def _check_hyperparameters(
        cls, data: Any, handler: ModelWrapValidatorHandler[Self], info: ValidationInfo
    ) -> Self:
        """The trainer's own check (torch-free), so a loop is refused when it is created or
        changed rather than at its first train job after curation. The error's location names
        the key: ``training_profile.hyperparameters.lr``."""
        profile = handler(data)
        if info.context == RECORDED:
            return profile
        _check_job_bounds(cls.__name__, profile)
        try:
            parse_hyperparameters(profile.family, profile.algorithm, profile.hyperparameters)
        except HyperparameterError as exc:
            location: tuple[str, ...] = ("hyperparameters",)
            value: object = profile.hyperparameters
            if exc.key is not None:
                location += (exc.key,)
                value = profile.hyperparameters.get(exc.key)
            error = PydanticCustomError("hyperparameter", "{reason}", {"reason": exc.message})
            raise ValidationError.from_exception_data(
                cls.__name__, [InitErrorDetails(type=error, loc=location, input=value)]
            ) from None
        return profile


class ServingTarget(_Policy):
    """Where the champion serves: the local model server, any OpenAI-compatible server with
    vLLM's adapter endpoints, or a Kubernetes Deployment (see docs/executors.md)."""

    kind: Literal["local", "openai", "kubernetes", "none"] = "local"
    url: Text | None = None
    model: Text | None = Field(
        default=None, description="the served name the loop's agents call (the alias)"
    )
    artifacts_dir: Text | None = Field(
        default=None, description="where the model server sees Ratchet's artifact store"
    )
    verify_timeout_s: float = Field(default=60, gt=0, le=3600)
    namespace: Text | None = None
    deployment: Text | None = None
    container: Text | None = None
    env_var: Text = "RATCHET_MODEL_PATH"
    version_url: Text | None = Field(
        default=None, description="deprecated: the old /v1/model URL; use `url`"
    )
    rollout_timeout_s: float = Field(default=600, gt=0)

    @model_validator(mode="after")
    def _check_kind_fields(self) -> ServingTarget:
        if self.kind == "kubernetes" and not self.deployment:
            raise ValueError("a kubernetes serving target needs `deployment`")
        if self.kind == "openai" and not self.url:
            raise ValueError("an openai serving target needs `url` (the server's base URL)")
        if self.kind == "openai" and not self.model:
            raise ValueError("an openai serving target needs `model` (the loop's served name)")
        if self.kind == "kubernetes" and not (self.url or self.version_url):
            raise ValueError(
                "a kubernetes serving target needs `url` (the model servers' OpenAI base URL, "
                "e.g. http://agent-model.serving:8000): a deploy is verified by asking them"
            )
        return self


def describe_errors(policy: str, exc: ValidationError) -> str:
    """One line per bad field, each named by its path (``gate_policy.confidence: ...``)."""
    return "; ".join(
        f"{'.'.join([policy, *(str(part) for part in error['loc'])])}: {error['msg']}"
        for error in exc.errors()
    )


def parse_policies(
    trigger: Mapping[str, object] | None,
    gate: Mapping[str, object] | None,
    training: Mapping[str, object] | None,
    serving: Mapping[str, object] | None,
) -> tuple[TriggerPolicy, GatePolicy, TrainingProfile, ServingTarget]:
    """Parse the four JSON columns (raises pydantic's ValidationError naming each field)."""
    return (
        TriggerPolicy.model_validate(trigger or {}),
        GatePolicy.model_validate(gate or {}),
        TrainingProfile.model_validate(training or {}),
        ServingTarget.model_validate(serving or {}),
    )
