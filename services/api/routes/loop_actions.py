"""Operator actions on a loop: start, pause, resume, run now, approve/reject, rollback, status.

Actions are signals to the loop's workflow (``loop/<name>``), sent with signal-with-start so
an action on a loop whose workflow is not running starts it rather than failing. Pause and
resume are also written to ``loops.status`` so the dashboard and a restarted workflow agree.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from services.api.deps import (
    AdminDep,
    SessionDep,
    SettingsDep,
    StateDep,
    TemporalDep,
    get_temporal,
)
from services.api.errors import ApiError
from services.api.loop_control import signal_loop, start_loop_workflow
from services.api.routes.loops import loop_or_404
from services.api.schemas.loops import NextCyclePublic
from services.api.state import AppState
from services.artifacts import ArtifactStore, uri_to_path
from services.checkpoints import install_checkpoint, record_checkpoint
from services.db.models import Loop
from services.db.queries.cycles import current_open_cycle, last_rollback_record
from services.loop.next_cycle import (
    WorkflowClock,
    WorkflowState,
    read_next_cycle,
    run_now_note,
    run_now_refusal,
)
from services.loop.promotions import operator_promotion
from services.loop.states import CycleStage, Decision, LoopLifecycle, PromotionStatus
from services.training.checkpoint_manifest import CheckpointError
from workflows.ids import loop_workflow_id
from workflows.loop import LoopWorkflow
from workflows.payloads.loop import (
    ApprovalSignal,
    LoopStatus,
    PauseSignal,
    ResumeSignal,
    RollbackSignal,
    RunNowSignal,
)

router = APIRouter(prefix="/v1/loops", tags=["loop actions"], dependencies=[AdminDep])


class ActionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=2000)
    by: str = Field(default="operator", max_length=128)
    cycle: int = Field(default=0, ge=0, description="for approve/reject: the cycle (0: current)")


class ActionOut(BaseModel):
    loop: str
    action: str
    workflow_id: str
    status: str
    note: str | None = Field(
        default=None, description="run-now: what the cycle will likely lack (no eval task)"
    )


class RollbackOut(BaseModel):
    """The loop's latest operator rollback: ``rolled_back``, or ``failed`` with the reason
    (the champion then stays what it was, and the loop keeps running)."""

    status: str
    reason: str
    checkpoint_id: str | None
    decided_at: dt.datetime


class LoopStatusOut(BaseModel):
    loop: str
    db_status: str
    status_reason: str | None
    workflow_id: str
    workflow_status: str | None
    stage: str | None = None
    cycle: int | None = None
    paused: bool | None = None
    waiting_for: str | None = None
    last_outcome: str | None = None
    cycles_done: int | None = None
    last_rollback: RollbackOut | None = None
    next_cycle: NextCyclePublic | None = Field(
        default=None, description="What the loop's next cycle waits for"
    )


# Each action's signal handler, by reference (a renamed handler breaks here, at import, not
# as a signal the workflow never handles), and the payload it takes.
_SIGNALS: dict[str, tuple[Callable[..., None], type]] = {
    "pause": (LoopWorkflow.pause, PauseSignal),
    "resume": (LoopWorkflow.resume, ResumeSignal),
    "run-now": (LoopWorkflow.run_now, RunNowSignal),
    "rollback": (LoopWorkflow.rollback, RollbackSignal),
}


class ChampionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(
        min_length=1, max_length=4096, description="checkpoint directory: a path or file:// URI"
    )
    reason: str = Field(default="registered by operator", max_length=2000)


class ChampionOut(BaseModel):
    loop: str
    checkpoint_id: str
    uri: str
    promotion_id: int


@router.post(
    "/{loop}/champion",
    response_model=ChampionOut,
    summary="Register a checkpoint directory as the loop's champion (e.g. the first one)",
    description=(
        "Verifies every file's sha256 against the manifest, copies the checkpoint into the "
        "content-addressed store, records it and makes it the champion. The serving target "
        "must already serve it (for example `ratchet serve --checkpoint DIR`)."
    ),
)
async def register_champion(
    loop: str, body: ChampionIn, session: SessionDep, settings: SettingsDep
) -> ChampionOut:
    row = loop_or_404(session, loop)
    _refuse_while_a_cycle_is_open(session, row)
    try:
        source = uri_to_path(body.checkpoint)
    except ValueError as exc:
        raise ApiError(
            422, "invalid_checkpoint", str(exc), fields=_field("checkpoint", str(exc))
        ) from exc
    if not source.is_dir():
        message = f"{source} is not a directory readable by the api"
        raise ApiError(422, "invalid_checkpoint", message, fields=_field("checkpoint", message))
    try:
        installed = await asyncio.to_thread(
            install_checkpoint, source, ArtifactStore(settings.artifacts_dir)
        )
    except CheckpointError as exc:
        message = f"checkpoint rejected: {exc}"
        raise ApiError(
            422, "invalid_checkpoint", message, fields=_field("checkpoint", message)
        ) from exc
    # Serialized with a cycle's start on the loop's row (start_cycle locks it too), and
    # checked again under the lock: the install above may have taken minutes.
    row = loop_or_404(session, loop, for_update=True)
    _refuse_while_a_cycle_is_open(session, row)
    checkpoint = record_checkpoint(
        session=session, installed=installed, loop_id=row.id, parent_id=None, run_id=None
    )
    previous = row.champion_checkpoint_id
    row.champion_checkpoint_id = checkpoint.id
    promotion = operator_promotion(
        row,
        decision=Decision.PROMOTE,
        status=PromotionStatus.HELD,
        reason=body.reason,
        candidate_checkpoint_id=checkpoint.id,
        previous_checkpoint_id=previous,
        now=dt.datetime.now(dt.UTC),
    )
    session.add(promotion)
    session.flush()
    return ChampionOut(
        loop=loop, checkpoint_id=checkpoint.id, uri=checkpoint.uri, promotion_id=promotion.id
    )


def _refuse_while_a_cycle_is_open(session: Any, loop: Loop) -> None:
    """A cycle trains from, evaluates against and may restore the champion it started with;
    a champion registered meanwhile would be compared with the wrong model or overwritten."""
    cycle = current_open_cycle(session=session, loop=loop)
    if cycle is not None:
        raise ApiError(
            409,
            "cycle_open",
            f"loop {loop.name!r} has cycle {cycle.number} open (stage {cycle.stage}); register "
            "a champion once it has ended (pause the loop first so no new cycle starts: "
            "`ratchet loop pause`, then `ratchet loop status` until no cycle runs)",
        )


def _field(path: str, message: str) -> list[dict[str, Any]]:
    """The field at fault with the real reason, which `ratchet loop set-champion` prints."""
    return [{"path": path, "message": message}]


@router.post("/{loop}/start", response_model=ActionOut, summary="Start the loop's workflow")
async def start(
    loop: str, session: SessionDep, settings: SettingsDep, client: TemporalDep
) -> ActionOut:
    loop_or_404(session, loop)
    workflow_id = await start_loop_workflow(client, settings, loop)
    return ActionOut(loop=loop, action="start", workflow_id=workflow_id, status="running")


async def _act(
    loop: str, action: str, session: Any, state: AppState, body: ActionIn | None
) -> ActionOut:
    """Check, record and signal one action. Temporal is reached last, so a missing loop or
    a run-now that cannot train is answered as such even while Temporal is down."""
    row = loop_or_404(session, loop)
    body = body or ActionIn()
    handler: Callable[..., None]
    if action in ("approve", "reject"):
        handler = LoopWorkflow.approve if action == "approve" else LoopWorkflow.reject
        arg: Any = ApprovalSignal(cycle=body.cycle, by=body.by, reason=body.reason or "")
    else:
        handler, signal_type = _SIGNALS[action]
        arg = signal_type(reason=body.reason) if body.reason else signal_type()
    note = _check_run_now(session, row) if action == "run-now" else None
    if action == "pause":
        row.status, row.status_reason = LoopLifecycle.PAUSED, body.reason or "paused by operator"
    elif action == "resume":
        row.status, row.status_reason = LoopLifecycle.ACTIVE, None
    session.flush()
    client = await get_temporal(state)
    await signal_loop(client, state.settings, loop, handler, arg)
    return ActionOut(
        loop=loop,
        action=action,
        workflow_id=loop_workflow_id(loop),
        status="signalled",
        note=note,
    )


def _check_run_now(session: Any, loop: Loop) -> str | None:
    """Refuse a run-now that cannot train (no champion: 409 saying how to get one); else
    what its cycle will likely lack, for the answer's ``note``."""
    next_cycle = read_next_cycle(session=session, loop=loop)
    refusal = run_now_refusal(next_cycle)
    if refusal is not None:
        raise ApiError(409, "no_champion", refusal)
    return run_now_note(next_cycle)


def _action_route(action: str, summary: str) -> None:
    """One explicit route per action, so no catch-all can shadow other loop routes."""

    async def endpoint(
        loop: str, session: SessionDep, state: StateDep, body: ActionIn | None = None
    ) -> ActionOut:
        return await _act(loop, action, session, state, body)

    endpoint.__name__ = f"loop_{action.replace('-', '_')}"
    router.add_api_route(
        f"/{{loop}}/{action}",
        endpoint,
        methods=["POST"],
        response_model=ActionOut,
        summary=summary,
    )


for _action, _summary in (
    ("pause", "Pause the loop (no new cycle starts; a running one finishes its stage)"),
    ("resume", "Resume a paused loop"),
    ("run-now", "Start a cycle now, without waiting for a trigger"),
    ("approve", "Approve the candidate waiting at a manual gate"),
    ("reject", "Reject the candidate waiting at a manual gate"),
    ("rollback", "Roll back to the champion before the last promotion"),
):
    _action_route(_action, _summary)


@router.get("/{loop}/status", response_model=LoopStatusOut, summary="The loop's live status")
async def status(loop: str, session: SessionDep, client: TemporalDep) -> LoopStatusOut:
    row = loop_or_404(session, loop)
    workflow_id = loop_workflow_id(loop)
    rollback = last_rollback_record(session=session, loop=row)
    out = LoopStatusOut(
        loop=loop,
        db_status=row.status,
        status_reason=row.status_reason,
        workflow_id=workflow_id,
        workflow_status=None,
        last_rollback=(
            RollbackOut(
                status=rollback.status,
                reason=rollback.reason,
                checkpoint_id=rollback.candidate_checkpoint_id,
                decided_at=rollback.decided_at,
            )
            if rollback is not None
            else None
        ),
    )
    next_cycle = read_next_cycle(session=session, loop=row)
    clock = WorkflowClock(WorkflowState.NOT_RUNNING)
    handle = client.get_workflow_handle(workflow_id)
    try:
        description = await handle.describe()
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        description = None
    if description is not None:
        out.workflow_status = description.status.name if description.status else None
    if description is not None and description.status == WorkflowExecutionStatus.RUNNING:
        live = await handle.query(LoopWorkflow.status)
        out.stage, out.cycle, out.paused = live.stage, live.cycle, live.paused
        out.waiting_for, out.last_outcome = live.waiting_for, live.last_outcome
        out.cycles_done = live.cycles_done
        clock = workflow_clock(live)
    out.next_cycle = NextCyclePublic.of(next_cycle, clock, now=dt.datetime.now(dt.UTC))
    return out


def workflow_clock(live: LoopStatus) -> WorkflowClock:
    """The running workflow's status query as :class:`WorkflowClock`: paused, waiting for
    a trigger (with its next check, from a worker that reports it), or in a cycle."""
    if live.paused or live.stage == CycleStage.PAUSED:
        return WorkflowClock(WorkflowState.PAUSED)
    if live.stage in (CycleStage.WAITING, CycleStage.STARTING):
        due = live.next_check_at
        return WorkflowClock(
            WorkflowState.WAITING, next_check_at=dt.datetime.fromisoformat(due) if due else None
        )
    return WorkflowClock(WorkflowState.IN_CYCLE, cycle=live.cycle)
