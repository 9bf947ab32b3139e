"""A loop's policies, parsed from the JSON columns of ``loops`` with defaults and checks.

The same models validate the admin API's input (unknown keys are refused, so a typo in a
policy never silently becomes a default) and give the workflow its parsed configuration.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ModelWrapValidatorHandler,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, InitErrorDetails, PydanticCustomError

from services.serving.kinds import (
    TARGET_KINDS,
    TargetKind,
    endpoint_problem,
    kind_names,
    target_kind,
)
from services.training.config import (
    HyperparameterError,
    algorithm_chain,
    parse_chain,
    parse_hyperparameters,
)

if TYPE_CHECKING:
    from services.settings import ServingEndpoint

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
    idle_check_interval_s: float = Field(
        default=600,
        gt=0,
        le=86_400,
        description="the longest wait between checks that find nothing new (a loop with no "
        "traffic backs off to it; a trace's arrival wakes it at once)",
    )
    drift_enabled: bool = True
    drift_failure_rate: float = Field(default=0.5, gt=0, le=1)
    drift_window: int = Field(default=200, ge=10)


class GatePolicy(_Policy):
    """When a candidate is promoted, and how the canary judges it live."""

    mode: Literal["auto", "manual"] = "auto"
    confidence: float = Field(default=0.95, ge=0.5, lt=1)
    min_improvement_points: float = Field(default=0.0, ge=0)
    regression_tolerance_points: float = Field(
        default=2.0,
        ge=0,
        description="a larger drop on the regression suite refuses where it is significant "
        "at `confidence` (a suite too small to show it is named in the decision, not refused)",
    )
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
    (``RATCHET_LOCAL_JOB_COMMANDS_ENABLED``, see services.executors.local_env.check_loop_jobs).
    """

    image: Text | None = Field(default=None, description="container image of the job")
    command: list[Text] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="entry point; `train|eval --spec <path>` is appended",
    )


# A job's bounds, checked when a loop is saved; they cap what a cycle spends between its
# budget checks (the estimate before training, the close after):
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
    _refuse(title, "job_bounds", [((field,), value, reason) for field, value, reason in problems])


def _refuse(title: str, kind: str, problems: list[tuple[tuple[str, ...], object, str]]) -> None:
    """Raise the validation error of ``problems`` (location, value, reason each), if any."""
    if problems:
        raise ValidationError.from_exception_data(
            title,
            [
                InitErrorDetails(
                    type=PydanticCustomError(kind, "{reason}", {"reason": reason}),
                    loc=location,
                    input=value,
                )
                for location, value, reason in problems
            ],
        )


# A checkpoint id of the content-addressed store (the sha256 its manifest names).
CHECKPOINT_ID_PATTERN = re.compile(r"^[0-9a-f]{64}$")
CheckpointId = Annotated[str, StringConstraints(pattern=CHECKPOINT_ID_PATTERN.pattern)]


class BootstrapPolicy(_Policy):
    """How a loop with no champion gets its first one from its own successful traces
    (``ratchet loop bootstrap``; docs/loops.md, "A first champion by bootstrap"): an SFT-LoRA
    adapter over the profile's ``base_checkpoint``, trained on the conversations of the train
    split's successful traces and judged against the base model on the held-out set by the
    gate."""

    auto: bool = Field(
        default=False,
        description="bootstrap automatically when the loop has no champion and at least "
        "`min_successes` successful train-split traces (needs `base_checkpoint`, family hf)",
    )
    min_successes: int = Field(
        default=16,
        ge=1,
        le=100_000,
        description="fewest successful train-split traces an automatic bootstrap waits for",
    )
    max_demonstrations: int = Field(
        default=2000,
        ge=1,
        le=100_000,
        description="the newest successful train-split traces a bootstrap trains on, at most",
    )
    hyperparameters: dict[Text, Scalar] = Field(
        default_factory=dict,
        description="the SFT-LoRA job's hyper-parameters (the hf sft trainer's keys: steps, "
        "lr, lora_r, ...); its defaults otherwise",
    )


def _check_bootstrap(title: str, profile: TrainingProfile) -> None:
    """A bootstrap that could never run is refused when the loop is saved, the error naming
    the key (``training_profile.bootstrap.hyperparameters.lr``)."""
    bootstrap = profile.bootstrap
    problems: list[tuple[tuple[str, ...], object, str]] = []
    try:
        parse_hyperparameters("hf", "sft", bootstrap.hyperparameters)
    except HyperparameterError as exc:
        location = ("bootstrap", "hyperparameters", *((exc.key,) if exc.key else ()))
        problems.append((location, bootstrap.hyperparameters.get(exc.key or ""), exc.message))
    if bootstrap.hyperparameters.get("lora") is False:
        problems.append(
            (
                ("bootstrap", "hyperparameters", "lora"),
                False,
                "bootstrap trains a LoRA adapter over the base model; lora cannot be false",
            )
        )
    if bootstrap.hyperparameters.get("recovery_fraction"):
        problems.append(
            (
                ("bootstrap", "hyperparameters", "recovery_fraction"),
                bootstrap.hyperparameters["recovery_fraction"],
                "bootstrap trains on recorded conversations, which have no synthetic slips",
            )
        )
    if bootstrap.auto and profile.base_checkpoint is None:
        problems.append(
            (
                ("bootstrap", "auto"),
                True,
                "an automatic bootstrap needs `base_checkpoint` (the checkpoint id `ratchet "
                "models import` prints) to train its adapter over",
            )
        )
    if bootstrap.auto and profile.family != "hf":
        problems.append(
            (("bootstrap", "auto"), True, "bootstrap trains an hf LoRA adapter: set family hf")
        )
    _refuse(title, "bootstrap", problems)


class TrainingProfile(_Policy):
    """What a training job gets: algorithm, hyper-parameters, accelerators, limits."""

    algorithm: Text | Annotated[list[Text], Field(max_length=16)] = Field(
        default="grpo",
        description="grpo, sft, rft or dpo, or a chain run in order (['rft', 'grpo']), each "
        "stage from the previous stage's weights; a chain's key 'rft.steps' is one stage's",
    )
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
    base_checkpoint: CheckpointId | None = Field(
        default=None,
        description="the loop's base model: a checkpoint id of the store (`ratchet models "
        "import` prints it); what bootstrap trains its adapter over and judges it against",
    )
    bootstrap: BootstrapPolicy = Field(
        default_factory=BootstrapPolicy,
        description="a first champion from the loop's successful traces (docs/loops.md)",
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
        _check_bootstrap(cls.__name__, profile)
        try:
            algorithm_chain(profile.algorithm)
        except HyperparameterError as exc:
            error = PydanticCustomError("algorithm", "{reason}", {"reason": exc.message})
            raise ValidationError.from_exception_data(
                cls.__name__,
                [InitErrorDetails(type=error, loc=("algorithm",), input=profile.algorithm)],
            ) from None
        try:
            parse_chain(profile.family, profile.algorithm, profile.hyperparameters)
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

    def bootstrap_profile(self) -> TrainingProfile:
        """The profile a bootstrap's train job runs: this one with SFT and the bootstrap's
        hyper-parameters (copied, not validated: both were checked when the loop was saved)."""
        return self.model_copy(
            update={"algorithm": "sft", "hyperparameters": dict(self.bootstrap.hyperparameters)}
        )


# A serving endpoint's name, as listed in RATCHET_SERVING_ENDPOINTS.
EndpointName = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
]

# What a serving target held before serving endpoints became deployment settings, with the
# value the old model wrote for each when it was not given. A loop no longer sets any of them:
# a URL, a Deployment or an environment variable a loop may name is a URL the worker sends
# its key to and a Deployment it patches (its own, say). Stored loops and recorded workflow
# histories still carry them.
RETIRED_SERVING_KEYS: dict[str, object] = {
    "url": None,
    "version_url": None,
    "artifacts_dir": None,
    "namespace": None,
    "deployment": None,
    "container": None,
    "env_var": "RATCHET_MODEL_PATH",
    "rollout_timeout_s": 600,
}
_ENDPOINTS_HINT = (
    "list the model server in RATCHET_SERVING_ENDPOINTS on the api and the worker (the "
    "chart's serving.endpoints) and set `endpoint` to its name"
)


def _known_kind(name: str) -> str:
    if target_kind(name) is None:
        raise ValueError(f"unknown serving target kind {name!r}; expected one of {kind_names()}")
    return name


ServingKind = Annotated[str, AfterValidator(_known_kind)]


class ServingTarget(_Policy):
    """Where the champion serves: the local model server, or one of the deployment's serving
    endpoints (an OpenAI-compatible server with vLLM's adapter endpoints, or a Kubernetes
    Deployment of them), picked by name (see docs/executors.md).

    The loop says which endpoint and under which name its agents call the model; where the
    endpoint is, its key and the Deployment a deploy patches are the deployment's settings
    (``services.settings.ServingEndpoint``). Whether ``endpoint`` names a configured one is
    checked where the settings are known: by the api when a loop is saved
    (:func:`serving_endpoint_problem`) and by the worker when it deploys.
    """

    kind: ServingKind = Field(
        default="local",
        description="a serving target kind (services.serving.kinds registers them)",
    )
    endpoint: EndpointName | None = Field(
        default=None,
        description="openai and kubernetes: the name of a serving endpoint the deployment "
        "lists (RATCHET_SERVING_ENDPOINTS)",
    )
    model: Text | None = Field(
        default=None, description="the served name the loop's agents call (the alias)"
    )
    upstream: EndpointName | None = Field(
        default=None,
        description="the capture gateway: an OpenAI-compatible upstream the deployment lists "
        "(RATCHET_GATEWAY_UPSTREAMS, with the key Ratchet holds for it) that the gateway "
        "forwards to while the loop has no champion (then serving moves to the champion)",
    )
    upstream_model: Text | None = Field(
        default=None, description="the model the gateway asks `upstream` for"
    )
    verify_timeout_s: float = Field(default=60, gt=0, le=3600)
    value_per_success_usd: float | None = Field(
        default=None,
        gt=0,
        description="what one successful served episode is worth, in dollars: the serving "
        "ledger's break-even (the tokens a champion must serve before its live success gain "
        "repays its training cost); unset, no break-even is shown",
    )
    retired_keys: tuple[str, ...] = Field(
        default=(),
        description="set only on a loop saved before serving endpoints: the keys it named "
        "that no longer apply; such a target cannot deploy until it names an endpoint",
    )

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """Published as a union discriminated by ``kind``: one ``oneOf`` branch per registered
        kind with what that kind needs, built whenever a schema is generated, so a kind
        registered later appears. The runtime model stays this one class (its checks are
        :meth:`_kind_problem`'s, and a recorded target's retired keys keep parsing)."""
        json_schema = handler(core_schema)
        schema = handler.resolve_ref_schema(json_schema)
        schema["properties"]["kind"]["enum"] = list(TARGET_KINDS)
        default = cls.model_fields["kind"].default
        schema["oneOf"] = [_kind_branch(kind, default) for kind in TARGET_KINDS.values()]
        schema["discriminator"] = {"propertyName": "kind"}
        return json_schema

    @model_validator(mode="wrap")
    @classmethod
    def _retire_keys(
        cls, data: Any, handler: ModelWrapValidatorHandler[Self], info: ValidationInfo
    ) -> Self:
        """A new or changed loop naming a retired key (or ``retired_keys``) is refused, the
        error naming the key; a stored or recorded one keeps parsing, with the keys it
        named in ``retired_keys`` (so its deploy can say what to configure)."""
        if not isinstance(data, Mapping):
            return handler(data)
        recorded = info.context == RECORDED
        named = [key for key in RETIRED_SERVING_KEYS if key in data]
        if recorded:
            given = {
                key
                for key in named
                if data[key] is not None and data[key] != RETIRED_SERVING_KEYS[key]
            }
            kept = {k: v for k, v in data.items() if k not in RETIRED_SERVING_KEYS}
            if given:
                kept["retired_keys"] = tuple(sorted(given | set(data.get("retired_keys") or ())))
            return handler(kept)
        errors = [
            _field_error(
                key, data[key], f"a loop no longer names a model server's {key}: {_ENDPOINTS_HINT}"
            )
            for key in named
        ]
        if data.get("retired_keys"):
            errors.append(
                _field_error(
                    "retired_keys",
                    data["retired_keys"],
                    "is set only on loops saved before serving endpoints",
                )
            )
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        target = handler(data)
        problem = target._kind_problem()
        if problem is not None:
            field, message = problem
            raise ValidationError.from_exception_data(
                cls.__name__, [_field_error(field, getattr(target, field), message)]
            )
        return target

    def _kind_problem(self) -> tuple[str, str] | None:
        """The field a new or changed target lacks (or must not set) for its kind, and why;
        a recorded target is a fact and is not asked."""
        kind = target_kind(self.kind)
        assert kind is not None  # the field's validator checked it
        if kind.needs_endpoint and not self.endpoint:
            return "endpoint", f"an {self.kind} serving target needs `endpoint`: {_ENDPOINTS_HINT}"
        if not kind.needs_endpoint and self.endpoint:
            return "endpoint", (
                f"a {self.kind} serving target takes no `endpoint` (the local one is the "
                "built-in model server at RATCHET_SERVE_HOST:RATCHET_SERVE_PORT)"
            )
        if kind.needs_model and not self.model:
            return "model", f"an {self.kind} serving target needs `model` (the loop's served name)"
        if (self.upstream is None) != (self.upstream_model is None):
            missing = "upstream_model" if self.upstream is not None else "upstream"
            return (
                missing,
                "`upstream` and `upstream_model` are set together (the gateway's upstream)",
            )
        return None


def _kind_branch(kind: TargetKind, default_kind: str) -> dict[str, Any]:
    """One kind's branch of the published serving target: ``kind`` fixed to its name and
    required (but for the default kind, which a target may leave out: exactly one branch
    matches either way), and the fields a new target of that kind must set."""
    required = [] if kind.name == default_kind else ["kind"]
    required += [
        field
        for field, needed in (("endpoint", kind.needs_endpoint), ("model", kind.needs_model))
        if needed
    ]
    branch: dict[str, Any] = {"title": kind.name, "properties": {"kind": {"const": kind.name}}}
    if kind.description:
        branch["description"] = kind.description
    if required:
        branch["required"] = required
    return branch


def _field_error(field: str, value: object, message: str) -> InitErrorDetails:
    error = PydanticCustomError("serving_target", "{reason}", {"reason": message})
    return InitErrorDetails(type=error, loc=(field,), input=value)


def serving_endpoint_problem(
    target: ServingTarget, endpoints: Mapping[str, ServingEndpoint]
) -> str:
    """Why ``target`` cannot deploy with these configured endpoints (by name), or "".

    The api asks this when a loop is saved and the worker when it deploys, so the answer
    (and its wording) is the same on both sides."""
    if target.retired_keys:
        return (
            f"this loop's serving target names {', '.join(target.retired_keys)}, which a loop "
            f"no longer sets: {_ENDPOINTS_HINT} (`ratchet loop apply`)"
        )
    registered = target_kind(target.kind)
    if registered is None or not registered.needs_endpoint:
        return ""
    if target.endpoint is None:
        return f"an {target.kind} serving target needs `endpoint`: {_ENDPOINTS_HINT}"
    configured = ", ".join(sorted(endpoints)) or "none"
    endpoint = endpoints.get(target.endpoint)
    if endpoint is None:
        return (
            f"no serving endpoint is named {target.endpoint!r} in RATCHET_SERVING_ENDPOINTS "
            f"(configured: {configured})"
        )
    problem = endpoint_problem(target.endpoint, endpoint)
    if problem:
        return problem
    if endpoint.kind != target.kind:
        return (
            f"serving endpoint {target.endpoint!r} is of kind {endpoint.kind}, not "
            f"{target.kind}; set `kind: {endpoint.kind}` or name another (configured: "
            f"{configured})"
        )
    return ""


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
        # A stored serving target is read as recorded: one saved before serving endpoints
        # still loads (its deploy says what to configure) instead of stopping the loop.
        ServingTarget.model_validate(serving or {}, context=RECORDED),
    )
