"""``POST /v1/loops/{loop}/bootstrap``: a first champion from the loop's own successful traces.

The route answers at once with what the bootstrap will learn from (the traces it saw, the
successes it uses, the ones it leaves out and why) or why it cannot run, and, unless it is a
dry run, signals the loop's workflow, which runs the bootstrap as a cycle
(workflows/bootstrap.py; docs/loops.md, "A first champion by bootstrap").
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from services.api.deps import AdminDep, StateDep, get_temporal
from services.api.errors import ApiError
from services.api.loop_control import signal_loop
from services.api.routes.loops import loop_or_404
from services.artifacts import ArtifactStore
from services.curation.bootstrap import BootstrapRefused, BootstrapSelection, select_demonstrations
from services.db.models import Loop
from services.db.queries.cycles import current_open_cycle
from services.db.queries.tasks import heldout_count
from services.loop.bootstrap import BootstrapProblem, check_request, resolve_base
from services.loop.policies import RECORDED, TrainingProfile
from services.loop.states import LoopLifecycle
from workflows.ids import loop_workflow_id
from workflows.loop import LoopWorkflow
from workflows.payloads.loop import BootstrapSignal

router = APIRouter(prefix="/v1/loops", tags=["loop actions"], dependencies=[AdminDep])


class BootstrapIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="the base model: a checkpoint id of the store, or a model directory (path "
        "or file:// URI) the api installs; default: training_profile.base_checkpoint",
    )
    force: bool = Field(
        default=False, description="bootstrap a loop that has a champion (it may replace it)"
    )
    dry_run: bool = Field(default=False, description="say what it would learn from; start nothing")
    by: str = Field(default="operator", min_length=1, max_length=128)
    reason: str | None = Field(default=None, max_length=2000)


class BootstrapReportOut(BaseModel):
    """Every trace the bootstrap looked at (services.curation.bootstrap.BootstrapReport)."""

    traces: int = Field(description="traces seen (the newest first)")
    successes: int
    failures: int = Field(description="failures seen: never trained on")
    no_outcome: int
    used: int = Field(description="successful train-split traces it trains on")
    left_out: dict[str, int] = Field(description="successes left out, by reason")
    truncated: bool = Field(description="older traces exist than the ones scanned")


class BootstrapOut(BaseModel):
    loop: str
    status: str = Field(description="signalled, or dry_run")
    workflow_id: str
    base_checkpoint_id: str
    heldout_tasks: int = Field(description="the frozen held-out set the gate judges it on")
    report: BootstrapReportOut
    summary: str
    note: str | None = Field(
        default=None, description="when the cycle will start, if not at the next trigger check"
    )


@router.post(
    "/{loop}/bootstrap",
    response_model=BootstrapOut,
    summary="Bootstrap a first champion from the loop's successful traces",
    description=(
        "Trains an SFT-LoRA adapter over the base model on the conversations of the loop's "
        "successful train-split traces, evaluates it and the base model on the frozen held-out "
        "set, and proposes it through the gate with the base model as the baseline. Answers "
        "with the traces it saw, used and left out (and why); 409 when the loop has a champion "
        "(unless `force`), no held-out task or no successful train-split trace; 422 when it "
        "is not a replay loop of the hf family or the base model is refused."
    ),
)
async def bootstrap(loop: str, body: BootstrapIn, state: StateDep) -> BootstrapOut:
    with state.session_factory() as session:
        row = loop_or_404(session, loop)
        out, base = await _plan(session, row, body, ArtifactStore(state.settings.artifacts_dir))
        if body.dry_run:
            session.rollback()  # a dry run records nothing (not even the base model's row)
            return out
        session.commit()  # the base model's row, before the workflow can look for it
    # Temporal is needed only to signal: a dry run and every refusal answer without it.
    client = await get_temporal(state)
    signal = BootstrapSignal(
        by=body.by, reason=body.reason or "", force=body.force, base_checkpoint_id=base
    )
    await signal_loop(client, state.settings, loop, LoopWorkflow.bootstrap, signal)
    return out


async def _plan(
    session: Session, row: Loop, body: BootstrapIn, store: ArtifactStore
) -> tuple[BootstrapOut, str]:
    """What the bootstrap would learn from and its base model's id, or the ApiError that
    says why it cannot run."""
    profile = TrainingProfile.model_validate(row.training_profile or {}, context=RECORDED)
    try:
        check_request(row, profile, force=body.force)
        base = await asyncio.to_thread(
            resolve_base, session, store, loop=row, profile=profile, ref=body.base
        )
        selection = await asyncio.to_thread(
            _selection, session, row, profile.bootstrap.max_demonstrations
        )
    except BootstrapProblem as problem:
        fields = [{"path": problem.field, "message": problem.message}] if problem.field else None
        raise ApiError(problem.status, problem.code, problem.message, fields=fields) from None
    heldout = heldout_count(session=session, loop_id=row.id)
    _refuse_without_data(row, selection, heldout)
    out = BootstrapOut(
        loop=row.name,
        status="dry_run" if body.dry_run else "signalled",
        workflow_id=loop_workflow_id(row.name),
        base_checkpoint_id=base.checkpoint_id,
        heldout_tasks=heldout,
        report=BootstrapReportOut.model_validate(selection.report.to_json()),
        summary=selection.report.summary(),
        note=_note(session, row),
    )
    return out, base.checkpoint_id


def _selection(session: Session, loop: Loop, limit: int) -> BootstrapSelection:
    try:
        return select_demonstrations(session, loop=loop, limit=limit)
    except BootstrapRefused as exc:  # check_request refuses these first; the words agree
        raise BootstrapProblem("bootstrap_unsupported", str(exc), field="environment") from None


def _refuse_without_data(loop: Loop, selection: BootstrapSelection, heldout: int) -> None:
    """409 when the gate would have nothing to judge on, or the adapter nothing to learn."""
    if selection.report.used == 0:
        raise ApiError(
            409,
            "no_demonstrations",
            f"loop {loop.name!r} has no successful train-split traces to learn from: "
            f"{selection.report.summary()}",
        )
    if heldout == 0:
        raise ApiError(
            409,
            "no_heldout",
            f"loop {loop.name!r} has no held-out tasks yet: the gate judges a bootstrap on the "
            "frozen held-out set, which curation draws from all traffic "
            "(curation_policy.heldout_fraction); post more traces",
        )


def _note(session: Session, loop: Loop) -> str | None:
    """When the bootstrap's cycle starts, where that is not the loop's next trigger check."""
    if loop.status == LoopLifecycle.PAUSED:
        return "the loop is paused: the bootstrap starts when it is resumed (`ratchet loop resume`)"
    cycle = current_open_cycle(session=session, loop=loop)
    if cycle is not None:
        return f"cycle {cycle.number} is open (stage {cycle.stage}): the bootstrap starts after it"
    return None
