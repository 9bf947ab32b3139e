"""Wire models of the loop admin API, separate from the tables."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from services.api.schemas.traces import CurationCountPublic
from services.ingest.schema import MAX_FREE_DEPTH, depth_exceeded
from services.loop.policies import (
    RECORDED,
    GatePolicy,
    ServingTarget,
    TrainingProfile,
    TriggerPolicy,
)

if TYPE_CHECKING:  # the module reads Postgres; a wire model needs only its fields
    from services.loop.next_cycle import NextCycle, WorkflowClock

LOOP_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$"
LoopName = Annotated[
    str,
    StringConstraints(pattern=LOOP_NAME_PATTERN, max_length=40),
    Field(
        description="Lowercase letters, digits and dashes, 1-40 characters, starting and "
        "ending with a letter or digit (a DNS label)",
        examples=["support-agent"],
    ),
]


def _contains_nul(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _storable(value: dict[str, Any]) -> dict[str, Any]:
    """A JSON object Postgres can store as jsonb: bounded depth, no NUL characters."""
    if depth_exceeded(value):
        raise ValueError(f"nested deeper than {MAX_FREE_DEPTH} levels")
    if _contains_nul(value):
        raise ValueError("strings may not contain NUL (\\u0000) characters")
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_storable)]
Text = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[^\x00]*$")]


Actor = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00]*$")]
Reason = Annotated[str, StringConstraints(min_length=1, max_length=2000, pattern=r"^[^\x00]*$")]


class LoopCreate(BaseModel):
    """A new loop: one served model to improve."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: LoopName
    environment: Text = Field(description="The environment its tasks run in, e.g. toolcalc")
    executor: Literal["local", "kubernetes"] | None = Field(
        default=None, description="Where jobs run; defaults to the server's RATCHET_EXECUTOR"
    )
    training_profile: TrainingProfile = Field(default_factory=TrainingProfile)
    serving_target: ServingTarget = Field(default_factory=ServingTarget)
    gate_policy: GatePolicy = Field(default_factory=GatePolicy)
    trigger_policy: TriggerPolicy = Field(default_factory=TriggerPolicy)
    curation_policy: JsonObject = Field(default_factory=dict)
    budget_usd: Decimal | None = Field(
        default=None, ge=0, lt=Decimal("1e10"), decimal_places=4, description="Spend cap, USD"
    )
    changed_by: Actor | None = Field(
        default=None, description="Who creates it, recorded as version 1 (default: admin-api)"
    )


class CredentialPublic(BaseModel):
    """An active credential, without its value."""

    kind: Literal["signing_secret", "ingest_token", "gateway_key"]
    created_at: dt.datetime
    expires_at: dt.datetime | None


def _as_recorded(policy: type[BaseModel]) -> WrapValidator:
    """Read a stored policy as recorded: what a loop runs with is a fact, so a read (the
    api's from its row, the typed client's from the api) never refuses what a later release
    checks more strictly, nor a serving target saved before serving endpoints. A wrap
    validator that does not hand on: the policy's own checks would run again without the
    recorded context."""

    def parse(value: object, handler: ValidatorFunctionWrapHandler) -> object:
        if isinstance(value, policy):
            return value
        return policy.model_validate(value or {}, context=RECORDED)

    return WrapValidator(parse)


class LoopPublic(BaseModel):
    """A loop as the admin API shows it (no secrets), each policy as the loop runs it: the
    keys its configuration sets, the code's defaults for the rest (``GET
    /v1/loops/{loop}/config/versions`` has the configuration as given)."""

    name: str
    environment: str
    executor: str
    status: str
    status_reason: str | None
    training_profile: Annotated[TrainingProfile, _as_recorded(TrainingProfile)]
    serving_target: Annotated[ServingTarget, _as_recorded(ServingTarget)]
    gate_policy: Annotated[GatePolicy, _as_recorded(GatePolicy)]
    trigger_policy: Annotated[TriggerPolicy, _as_recorded(TriggerPolicy)]
    # Curation's policy is its own stdlib dataclass (services.curation.policy), parsed by
    # CurationPolicy.from_json; shown as stored.
    curation_policy: dict[str, Any]
    budget_usd: float | None
    champion_checkpoint_id: str | None
    created_at: dt.datetime
    updated_at: dt.datetime
    webhook_url: str = Field(description="Where to post signed ratchet.trace/v1 traces")
    otlp_traces_url: str = Field(description="OTLP/HTTP traces endpoint (Bearer ingest token)")


class NextCyclePublic(BaseModel):
    """What the loop's next cycle waits for (services.loop.next_cycle), with the counts."""

    waits_for: list[str] = Field(
        description="What the next cycle lacks, each with what to do; empty: nothing"
    )
    summary: str = Field(description="The same in one line")
    new_train_tasks: int = Field(description="Curated train tasks no dataset holds yet")
    min_new_tasks: int = Field(description="trigger_policy.min_new_tasks")
    eval_tasks: int = Field(description="Eval tasks a snapshot can take (it needs one)")
    has_champion: bool = Field(description="A cycle trains from the champion")
    pending_traces: int = Field(description="Traces not curated yet")
    curation: str | None = Field(
        default=None, description="When the pending traces will be curated (None: none)"
    )
    next_check_at: dt.datetime | None = Field(
        default=None,
        description="When the loop's next trigger check (it curates first) is due, where the "
        "loop's workflow said so",
    )

    @classmethod
    def of(cls, next_cycle: NextCycle, clock: WorkflowClock, *, now: dt.datetime) -> Self:
        return cls(
            waits_for=next_cycle.waits_for(),
            summary=next_cycle.summary(),
            new_train_tasks=next_cycle.new_train_tasks,
            min_new_tasks=next_cycle.min_new_tasks,
            eval_tasks=next_cycle.eval_tasks,
            has_champion=next_cycle.has_champion,
            pending_traces=next_cycle.pending_traces,
            curation=next_cycle.curation_note(clock, now=now),
            next_check_at=clock.next_check_at,
        )


class GainPublic(BaseModel):
    """A difference of two pass rates in points with its 95 % interval and what it counted
    (services.evaluation.figures)."""

    points: float
    ci95_points: list[float]
    n: int = Field(description="tasks (paired_bootstrap), or traces after (newcombe)")
    method: str = Field(description="paired_bootstrap (same tasks) or newcombe (live)")
    n_before: int | None = Field(default=None, description="traces before (newcombe)")


class CycleFiguresPublic(BaseModel):
    """One cycle's three numbers, each with its interval and counts."""

    number: int
    outcome: str | None
    decision: str | None
    points_gained: float | None = Field(description="held-out points the ledger counts")
    heldout: GainPublic | None = Field(description="the held-out comparison as measured")
    gate: GainPublic | None = Field(description="the eval-set comparison the gate decided on")
    live: GainPublic | None = Field(description="the canary's live delta")


class LoopDetail(LoopPublic):
    """One loop with its traffic and active credentials."""

    trace_count: int
    last_trace_at: dt.datetime | None
    credentials: list[CredentialPublic]
    config_version: int = Field(
        default=0, description="The current configuration version (see /config/versions)"
    )
    curation: list[CurationCountPublic] = Field(
        default_factory=list,
        description="Traces by curation outcome and reason, each with an example trace "
        "(see GET /v1/loops/{loop}/traces?curation=...&reason=...)",
    )
    next_cycle: NextCyclePublic | None = Field(
        default=None, description="What the loop's next cycle waits for"
    )
    cycles: list[CycleFiguresPublic] = Field(
        default_factory=list, description="The latest cycles' numbers, newest first"
    )


class LoopCreated(LoopPublic):
    """A created loop with its credentials, shown this once."""

    signing_secret: str = Field(description="Standard Webhooks secret (whsec_...), shown once")
    ingest_token: str = Field(description="Bearer token for the OTLP endpoint, shown once")
    gateway_key: str = Field(
        description="API key an agent gives the capture gateway (its base_url is gateway_url), "
        "shown once"
    )
    gateway_url: str = Field(description="The capture gateway's OpenAI base_url (…/v1)")
    workflow_id: str = Field(description="The loop's Temporal workflow (loop/<name>)")
    workflow_started: bool = Field(
        description="False when Temporal was unreachable; POST /v1/loops/{loop}/start later"
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="What the loop's executor ignores of its configuration (a job image on "
        "the local executor)",
    )


class LoopCreateCheck(BaseModel):
    """``POST /v1/loops?dry_run=true``: the loop passed every check its creation makes;
    nothing was created."""

    name: str
    dry_run: Literal[True] = True
    environment: str
    executor: str = Field(description="The executor it would use (the server's default if unset)")
    warnings: list[str] = Field(
        default_factory=list,
        description="What the loop's executor would ignore of its configuration",
    )


class RotateRequest(BaseModel):
    """Rotate a credential; the old one keeps working for the grace period."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["signing_secret", "ingest_token", "gateway_key"] = "signing_secret"
    grace_seconds: int = Field(default=86400, ge=0, le=30 * 86400)


class RotateResult(BaseModel):
    loop: str
    kind: Literal["signing_secret", "ingest_token", "gateway_key"]
    secret: str = Field(description="The new secret or token, shown once")
    previous_expires_at: dt.datetime | None = Field(
        description="Until when the previous one is still accepted (null if there was none)"
    )


class LoopPatch(BaseModel):
    """A change to a loop's configuration, as a JSON merge patch (RFC 7386) per setting.

    Each policy given is merged into the stored one: keys given replace, keys set to ``null``
    return to their defaults, a policy set to ``null`` returns to all defaults. The result is
    validated as a whole, so a change can never leave a loop with an invalid policy. The
    change applies from the loop's next cycle; a cycle already running keeps its settings.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    environment: Text | None = Field(
        default=None, description="Must equal the loop's environment (it cannot change)"
    )
    executor: Literal["local", "kubernetes"] | None = None
    budget_usd: Decimal | None = Field(
        default=None,
        ge=0,
        lt=Decimal("1e10"),
        decimal_places=4,
        description="Spend cap, USD; null removes the cap",
    )
    training_profile: JsonObject | None = None
    gate_policy: JsonObject | None = None
    trigger_policy: JsonObject | None = None
    curation_policy: JsonObject | None = None
    serving_target: JsonObject | None = None
    changed_by: Actor | None = Field(
        default=None, description="Who makes the change, kept in the loop's history"
    )
    reason: Reason | None = Field(default=None, description="Why, kept in the loop's history")


class ConfigChangePublic(BaseModel):
    """One setting that changed (null on a side: not set there, i.e. the default)."""

    path: str = Field(examples=["gate_policy.confidence"])
    before: Any
    after: Any


class LoopConfigChange(BaseModel):
    """What a configuration change did (or, with ``dry_run``, would do)."""

    loop: str
    dry_run: bool
    changed: bool
    version: int = Field(description="The version now current (the new one when changed)")
    changes: list[ConfigChangePublic]
    config: dict[str, Any] = Field(description="The loop's configuration after the change")
    warnings: list[str] = Field(
        default_factory=list,
        description="What the loop's executor ignores of its configuration (a job image on "
        "the local executor)",
    )


class LoopConfigVersionPublic(BaseModel):
    """One version of a loop's configuration: what, who, when, and what changed."""

    version: int
    config: dict[str, Any]
    changes: list[ConfigChangePublic]
    changed_by: str
    reason: str | None
    created_at: dt.datetime


class LoopToolPublic(BaseModel):
    """One tool of a loop's live endpoint."""

    name: str
    allowed: bool = Field(description="On the deployment's allow-list: the sandbox may ask it")
    listed: bool | None = Field(
        description="The server lists it (null: the endpoint cannot list, e.g. http)"
    )
    read_only_hint: bool | None = Field(
        description="The server's readOnlyHint: shown for the operator, never taken as "
        "permission (only the allow-list is)"
    )
    description: str | None


class LoopToolsPublic(BaseModel):
    """A replay loop's live tool endpoint and its tools, allowed or listed."""

    loop: str
    endpoint: str | None = Field(description="curation_policy.tool_endpoint")
    kind: str | None = Field(description="http or mcp")
    tools: list[LoopToolPublic]
    error: str | None = Field(description="Why the server's listing is missing, if it is")
