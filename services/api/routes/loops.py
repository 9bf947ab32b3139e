"""Admin API for loops and their ingest credentials (behind the admin token).

Creation returns the webhook signing secret and the ingest token once; rotation issues a new
one while the old one keeps working for a grace period.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session

from services.api.deps import AdminDep, SessionDep, StateDep
from services.api.errors import ApiError, field_errors_from_validation
from services.api.loop_control import start_loop_workflow
from services.api.schemas.loops import (
    ConfigChangePublic,
    CredentialPublic,
    CycleFiguresPublic,
    GainPublic,
    LoopConfigChange,
    LoopConfigVersionPublic,
    LoopCreate,
    LoopCreateCheck,
    LoopCreated,
    LoopDetail,
    LoopPatch,
    LoopPublic,
    NextCyclePublic,
    RotateRequest,
    RotateResult,
)
from services.api.schemas.traces import CurationCountPublic
from services.api.state import AppState
from services.db.models import Loop
from services.db.queries.credentials import active_credentials
from services.db.queries.cycle_history import CycleRow, loop_cycles
from services.db.queries.errors import NotFound
from services.db.queries.loops import (
    LoopFields,
    LoopNameTaken,
    config_document,
    config_versions,
    list_loops,
    require_loop,
    serving_targets_of_other_loops,
    trace_stats,
    update_loop_config,
)
from services.db.queries.traces import curation_counts
from services.evaluation.figures import gain_from_detail
from services.ingest.provisioning import ProvisionedLoop, provision_loop, rotate_credential
from services.loop.config import POLICY_KEYS, Change, diff, merge_patch
from services.loop.next_cycle import database_clock, read_next_cycle
from services.loop.policies import (
    GatePolicy,
    ServingTarget,
    TrainingProfile,
    TriggerPolicy,
    serving_endpoint_problem,
)
from services.serving.names import loop_serving_the_same_name, name_taken_message
from services.settings import Settings
from workflows.ids import loop_workflow_id

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/loops", tags=["loops"], dependencies=[AdminDep])
# The latest cycles `GET /v1/loops/{loop}` (and `ratchet loop show`) gives the numbers of.
SHOWN_CYCLES = 5


def _public_fields(loop: Loop, settings: Settings) -> dict[str, object]:
    base = settings.api_base_url.rstrip("/")
    return {
        "name": loop.name,
        "environment": loop.environment,
        "executor": loop.executor,
        "status": loop.status,
        "status_reason": loop.status_reason,
        "training_profile": loop.training_profile,
        "serving_target": loop.serving_target,
        "gate_policy": loop.gate_policy,
        "trigger_policy": loop.trigger_policy,
        "curation_policy": loop.curation_policy,
        "budget_usd": float(loop.budget_usd) if loop.budget_usd is not None else None,
        "champion_checkpoint_id": loop.champion_checkpoint_id,
        "created_at": loop.created_at,
        "updated_at": loop.updated_at,
        "webhook_url": f"{base}/v1/loops/{loop.name}/traces",
        "otlp_traces_url": f"{base}/otlp/v1/traces",
    }


def loop_or_404(session: Session, name: str, *, for_update: bool = False) -> Loop:
    """The loop called ``name``, or the API's one 404 for a missing loop (every route's)."""
    try:
        return require_loop(session=session, name=name, for_update=for_update)
    except NotFound:
        raise ApiError(404, "loop_not_found", f"there is no loop named {name[:64]!r}") from None


def _given(policy: BaseModel) -> dict[str, Any]:
    """Only the keys the caller set: defaults stay the code's, so they can improve."""
    return policy.model_dump(mode="json", exclude_unset=True)


def _check_environment(name: str) -> None:
    from services.environments import environment_names

    known = environment_names()
    if name not in known:
        # The field's message carries the value and the list too: clients that print the
        # fields (the CLI does) must still say what was refused and which environments exist.
        listed = ", ".join(sorted(known))
        refused = f"{name!r} is not installed; known: {listed}"
        raise ApiError(
            422,
            "unknown_environment",
            f"environment {refused}",
            fields=[{"path": "environment", "message": refused}],
        )


def _check_curation_policy(policy: dict[str, Any], settings: Settings) -> None:
    errors = _curation_policy_errors(policy, settings)
    if errors:
        raise ApiError(422, "invalid_curation_policy", errors[0]["message"], fields=errors)


def _curation_policy_errors(policy: dict[str, Any], settings: Settings) -> list[dict[str, str]]:
    """The policy parses, and the judge and live tool endpoints it names are ones this
    deployment lists (a loop names an endpoint; it never brings a URL of its own)."""
    from services.curation.policy import CurationPolicy, CurationPolicyError

    try:
        parsed = CurationPolicy.from_json(policy)
    except CurationPolicyError as exc:
        return [{"path": "curation_policy", "message": str(exc)}]
    errors = []
    for key, name, known, variable in (
        ("judge_endpoint", parsed.judge_endpoint, settings.judge_endpoints, "JUDGE"),
        ("tool_endpoint", parsed.tool_endpoint, settings.tool_endpoints, "TOOL"),
    ):
        if name is not None and name not in known:
            listed = ", ".join(sorted(known)) or "none"
            message = (
                f"{name!r} is not an endpoint of this deployment "
                f"(RATCHET_{variable}_ENDPOINTS lists: {listed})"
            )
            errors.append({"path": f"curation_policy.{key}", "message": message})
    return errors


def _serving_endpoint_errors(target: ServingTarget, settings: Settings) -> list[dict[str, str]]:
    """A serving target must name one of this deployment's serving endpoints, of its kind."""
    problem = serving_endpoint_problem(target, settings.serving_endpoints)
    errors = [{"path": "serving_target.endpoint", "message": problem}] if problem else []
    if target.upstream is not None and target.upstream not in settings.gateway_upstreams:
        listed = ", ".join(sorted(settings.gateway_upstreams)) or "none"
        message = (
            f"{target.upstream!r} is not an upstream of this deployment "
            f"(RATCHET_GATEWAY_UPSTREAMS lists: {listed})"
        )
        errors.append({"path": "serving_target.upstream", "message": message})
    return errors


def _check_served_name(session: Session, loop: str, serving_target: dict[str, Any]) -> None:
    """409 when another loop already serves under this loop's model name on its server
    (services.serving.names)."""
    others = serving_targets_of_other_loops(session=session, except_name=loop)
    other = loop_serving_the_same_name(serving_target, others)
    if other is not None:
        raise ApiError(
            409,
            "served_name_taken",
            name_taken_message(serving_target, other),
            fields=[{"path": "serving_target.model", "message": f"loop {other!r} serves it"}],
        )


def _check_loop_jobs(
    executor: str, training_profile: dict[str, Any], settings: Settings
) -> list[str]:
    """Refuse (422 naming the field and the setting) a loop's own job command the local
    executor may not run; return what it will ignore (a job image) as warnings."""
    from services.executors.local_env import check_loop_jobs

    errors, warnings = check_loop_jobs(
        executor, training_profile, commands_enabled=settings.local_job_commands_enabled
    )
    if errors:
        raise ApiError(
            422,
            "local_job_command_disabled",
            "the local executor does not run a loop's own job command in this deployment",
            fields=[{"path": path, "message": message} for path, message in errors],
        )
    return warnings


def _checked_creation(body: LoopCreate, settings: Settings) -> tuple[LoopFields, list[str]]:
    """Every check a new loop passes (422 naming the field), and what its executor will
    ignore; a creation and its dry run make the same ones."""
    _check_environment(body.environment)
    _check_curation_policy(body.curation_policy, settings)
    endpoint_errors = _serving_endpoint_errors(body.serving_target, settings)
    if endpoint_errors:
        raise ApiError(
            422, "unknown_serving_endpoint", endpoint_errors[0]["message"], fields=endpoint_errors
        )
    warnings = _check_loop_jobs(
        body.executor or settings.executor,
        body.training_profile.model_dump(mode="json"),
        settings,
    )
    fields = LoopFields(
        name=body.name,
        environment=body.environment,
        executor=body.executor or settings.executor,
        training_profile=_given(body.training_profile),
        serving_target=_given(body.serving_target),
        gate_policy=_given(body.gate_policy),
        trigger_policy=_given(body.trigger_policy),
        curation_policy=body.curation_policy,
        budget_usd=body.budget_usd,
        changed_by=body.changed_by or "admin-api",
    )
    return fields, warnings


def _name_taken(name: str) -> ApiError:
    return ApiError(409, "loop_exists", f"a loop named {name!r} already exists")


def _refuse_a_taken_name(state: AppState, name: str) -> None:
    with state.session_factory() as session:
        try:
            require_loop(session=session, name=name)
        except NotFound:
            return
    raise _name_taken(name)


@router.post(
    "",
    status_code=201,
    summary="Create a loop, its ingest credentials and workflow",
    responses={200: {"description": "dry_run: the loop passed every check; nothing created"}},
)
async def create_loop(
    body: LoopCreate,
    state: StateDep,
    response: Response,
    dry_run: bool = Query(default=False, description="make every check, create nothing"),
) -> LoopCreated | LoopCreateCheck:
    fields, warnings = _checked_creation(body, state.settings)
    if dry_run:
        await asyncio.to_thread(_refuse_a_taken_name, state, body.name)
        response.status_code = 200
        return LoopCreateCheck(
            name=body.name,
            environment=fields.environment,
            executor=fields.executor,
            warnings=warnings,
        )

    def provision() -> tuple[dict[str, object], ProvisionedLoop]:
        # Its own transaction: the workflow starts only once the loop is committed.
        with state.session_factory.begin() as session:
            created = provision_loop(session, fields=fields, box=state.secret_box)
            # After the name's own check (a loop of that name: 409 loop_exists); a refusal
            # here rolls the new loop back.
            _check_served_name(session, body.name, fields.serving_target or {})
            return _public_fields(created.loop, state.settings), created

    try:
        public, created = await asyncio.to_thread(provision)
    except LoopNameTaken:
        raise _name_taken(body.name) from None
    if state.ingest is not None:
        state.ingest.credentials.invalidate(body.name)  # its webhook works at once in this process
    started = True
    try:
        client = await state.temporal.get()
        await start_loop_workflow(client, state.settings, body.name)
    except Exception as exc:
        started = False
        logger.warning("loop %s created, but its workflow did not start: %s", body.name, exc)
    return LoopCreated(
        **public,
        signing_secret=created.signing_secret,
        ingest_token=created.ingest_token,
        gateway_key=created.gateway_key,
        gateway_url=f"{state.settings.gateway_base_url}/v1",
        workflow_id=loop_workflow_id(body.name),
        workflow_started=started,
        warnings=warnings,
    )


@router.get("", summary="List loops")
def list_all(session: SessionDep, state: StateDep) -> list[LoopPublic]:
    return [
        LoopPublic(**_public_fields(loop, state.settings)) for loop in list_loops(session=session)
    ]


@router.get("/{loop}", summary="Show a loop, its traffic and its active credentials")
def show(loop: str, session: SessionDep, state: StateDep) -> LoopDetail:
    row = loop_or_404(session, loop)
    stats = trace_stats(session=session, loop_id=row.id)
    credentials = active_credentials(session=session, loop_id=row.id, now=dt.datetime.now(dt.UTC))
    return LoopDetail(
        **_public_fields(row, state.settings),
        trace_count=stats.count,
        last_trace_at=stats.last_received_at,
        credentials=[
            CredentialPublic(kind=c.kind, created_at=c.created_at, expires_at=c.expires_at)
            for c in credentials
        ],
        config_version=_current_version(session, row),
        curation=[
            CurationCountPublic(
                outcome=c.outcome,
                reason=c.reason,
                count=c.count,
                example_external_id=c.example_external_id,
            )
            for c in curation_counts(session=session, loop_id=row.id)
        ],
        next_cycle=NextCyclePublic.of(
            read_next_cycle(session=session, loop=row),
            database_clock(session=session, loop=row),
            now=dt.datetime.now(dt.UTC),
        ),
        cycles=[
            _cycle_figures(cycle)
            for cycle in loop_cycles(session=session, loop_id=row.id, limit=SHOWN_CYCLES)
        ],
    )


def _cycle_figures(cycle: CycleRow) -> CycleFiguresPublic:
    detail = cycle.points_detail or {}

    def gain(key: str) -> GainPublic | None:
        found = detail.get(key)
        figure = gain_from_detail(found if isinstance(found, dict) else None, live=key == "live")
        return GainPublic(**figure.to_json()) if figure is not None else None

    return CycleFiguresPublic(
        number=cycle.number,
        outcome=cycle.outcome,
        decision=cycle.decision,
        points_gained=cycle.points_gained,
        heldout=gain("heldout"),
        gate=gain("gate"),
        live=gain("live"),
    )


@router.post(
    "/{loop}/secrets/rotate",
    summary="Rotate the signing secret (or ingest token, or gateway key); the old one works for "
    "a grace period (0 revokes it at once)",
)
def rotate(
    loop: str,
    session: SessionDep,
    state: StateDep,
    body: RotateRequest | None = None,
) -> RotateResult:
    body = body or RotateRequest()
    row = loop_or_404(session, loop)
    rotated = rotate_credential(
        session,
        loop=row,
        kind=body.kind,
        grace=dt.timedelta(seconds=body.grace_seconds),
        box=state.secret_box,
    )
    if state.ingest is not None:
        state.ingest.credentials.invalidate(row.name)
    return RotateResult(
        loop=row.name,
        kind=rotated.kind,
        secret=rotated.value,
        previous_expires_at=rotated.previous_expires_at,
    )


# The typed policies (the curation policy has its own parser); unknown keys are refused.
_POLICY_MODELS: dict[str, type[BaseModel]] = {
    "training_profile": TrainingProfile,
    "gate_policy": GatePolicy,
    "trigger_policy": TriggerPolicy,
    "serving_target": ServingTarget,
}


def _patched_config(current: dict[str, Any], body: LoopPatch, settings: Settings) -> dict[str, Any]:
    """The loop's configuration after ``body``, validated as a whole; 422 naming each field."""
    given = body.model_fields_set
    config = dict(current)
    errors: list[dict[str, str]] = []
    if "environment" in given and body.environment != current["environment"]:
        errors.append(
            {
                "path": "environment",
                "message": f"a loop's environment cannot change (it is "
                f"{current['environment']!r}: its tasks belong to it); create a new loop",
            }
        )
    if "executor" in given:
        if body.executor is None:
            errors.append({"path": "executor", "message": "must be local or kubernetes"})
        else:
            config["executor"] = body.executor
    if "budget_usd" in given:
        config["budget_usd"] = float(body.budget_usd) if body.budget_usd is not None else None
    for key in POLICY_KEYS:
        if key not in given:
            continue
        patch = getattr(body, key)
        config[key] = merge_patch(current.get(key) or {}, patch) if patch is not None else {}
        policy_errors = (
            _curation_policy_errors(config[key], settings)
            if key == "curation_policy"
            else _policy_errors(key, config[key])
        )
        if key == "serving_target" and not policy_errors:
            target = ServingTarget.model_validate(config[key])
            policy_errors = _serving_endpoint_errors(target, settings)
        errors.extend(policy_errors)
    if errors:
        raise ApiError(422, "invalid_loop_config", "the change is not a valid loop", fields=errors)
    return config


def _policy_errors(key: str, policy: dict[str, Any]) -> list[dict[str, str]]:
    try:
        _POLICY_MODELS[key].model_validate(policy)
    except ValidationError as exc:
        return [
            {
                "path": key if field["path"] == "(root)" else f"{key}.{field['path']}",
                "message": str(field["message"]),
            }
            for field in field_errors_from_validation(list(exc.errors()))
        ]
    return []


def _current_version(session: Session, loop: Loop) -> int:
    latest = config_versions(session=session, loop_id=loop.id, limit=1)
    return latest[0].version if latest else 0


def _change_public(changes: list[Change]) -> list[ConfigChangePublic]:
    return [ConfigChangePublic(path=c.path, before=c.before, after=c.after) for c in changes]


@router.patch(
    "/{loop}",
    summary="Change a loop's policies, executor or budget (versioned; from the next cycle on)",
)
def patch_loop(
    loop: str,
    body: LoopPatch,
    state: StateDep,
    dry_run: bool = Query(default=False, description="validate and show the diff, change nothing"),
) -> LoopConfigChange:
    with state.session_factory() as session:
        row = loop_or_404(session, loop, for_update=True)
        current = config_document(row)
        config = _patched_config(current, body, state.settings)
        if "serving_target" in body.model_fields_set:
            _check_served_name(session, loop, config.get("serving_target") or {})
        warnings = _check_loop_jobs(
            config["executor"], config.get("training_profile") or {}, state.settings
        )
        if dry_run:
            changes = diff(current, config)
            session.rollback()
            return LoopConfigChange(
                loop=loop,
                dry_run=True,
                changed=bool(changes),
                version=_current_version(session, row),
                changes=_change_public(changes),
                config=config,
                warnings=warnings,
            )
        update = update_loop_config(
            session=session,
            loop=row,
            config=config,
            changed_by=body.changed_by or "admin-api",
            reason=body.reason,
        )
        result = LoopConfigChange(
            loop=loop,
            dry_run=False,
            changed=update.version is not None,
            version=(
                update.version.version
                if update.version is not None
                else _current_version(session, row)
            ),
            changes=_change_public(update.changes),
            config=config_document(row),
            warnings=warnings,
        )
        session.commit()
    if result.changed:
        logger.info(
            "loop %s: configuration version %s by %s (%s)",
            loop,
            result.version,
            body.changed_by or "admin-api",
            ", ".join(c.path for c in result.changes),
        )
        if state.waker is not None:  # an idle loop reads the change now, not after its backoff
            state.waker.wake(loop)
    return result


@router.get("/{loop}/config/versions", summary="The loop's configuration history, newest first")
def list_config_versions(
    loop: str,
    session: SessionDep,
    limit: int = Query(default=50, ge=1, le=500),
) -> list[LoopConfigVersionPublic]:
    row = loop_or_404(session, loop)
    return [
        LoopConfigVersionPublic(
            version=v.version,
            config=dict(v.config),
            changes=[ConfigChangePublic(**c) for c in v.changes or []],
            changed_by=v.changed_by,
            reason=v.reason,
            created_at=v.created_at,
        )
        for v in config_versions(session=session, loop_id=row.id, limit=limit)
    ]
