"""The loop's writes and reads of its cycles, evaluations and promotions. Never commit."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from services.db.models import (
    Cycle,
    Evaluation,
    EvaluationResult,
    Loop,
    Promotion,
    Run,
    Task,
)
from services.db.queries.errors import NotFound, existing

# Re-exported for the loop's activities, which read the cycle's neighbours through this
# module: the read models themselves live in live.py and spend.py.
from services.db.queries.live import LiveCounts as LiveCounts
from services.db.queries.live import live_counts as live_counts
from services.db.queries.spend import LoopLedger as LoopLedger
from services.db.queries.spend import loop_ledger as loop_ledger
from services.db.queries.tasks import row_ids_by_job_task_id
from services.evaluation.gate import GateDecision
from services.evaluation.results import mean_pass_at_k, pass_at_1, reported_ks
from services.loop.estimate import RunRecord, cycle_phase_costs
from services.loop.points import CyclePoints
from services.loop.states import CycleOutcome, CycleStage, Decision, PromotionStatus, RunStatus

# Cycles --------------------------------------------------------------------------------------


def current_open_cycle(*, session: Session, loop: Loop) -> Cycle | None:
    """The loop's cycle that has not ended, if any (at most one: see :func:`open_cycle`)."""
    return session.scalars(
        select(Cycle)
        .where(Cycle.loop_id == loop.id, Cycle.ended_at.is_(None))
        .order_by(Cycle.number.desc())
        .limit(1)
    ).one_or_none()


def open_cycle(
    *,
    session: Session,
    loop: Loop,
    number: int,
    trigger: str,
    trigger_detail: dict[str, Any],
    workflow_id: str,
) -> Cycle:
    """The cycle (loop, number), created if new. Any other open cycle is closed as superseded,
    so the one-open-cycle invariant holds even after a crash between stages."""
    existing = _find_cycle(session=session, loop=loop, number=number)
    if existing is not None:
        return existing
    session.execute(
        update(Cycle)
        .where(Cycle.loop_id == loop.id, Cycle.ended_at.is_(None))
        .values(
            ended_at=func.now(),
            outcome=CycleOutcome.FAILED,
            outcome_detail="superseded by a newer cycle",
        )
    )
    cycle = Cycle(
        loop_id=loop.id,
        number=number,
        trigger=trigger,
        trigger_detail=trigger_detail,
        stage=CycleStage.CURATE,
        workflow_id=workflow_id,
        champion_checkpoint_id=loop.champion_checkpoint_id,
        stage_timings={CycleStage.CURATE: {"started_at": _now_iso()}},
    )
    session.add(cycle)
    session.flush()
    return cycle


def last_cycle_number(*, session: Session, loop: Loop) -> int:
    """The loop's highest cycle number (0 before its first cycle), open or closed."""
    number = session.scalar(select(func.max(Cycle.number)).where(Cycle.loop_id == loop.id))
    return int(number or 0)


def _find_cycle(*, session: Session, loop: Loop, number: int) -> Cycle | None:
    return session.scalars(
        select(Cycle).where(Cycle.loop_id == loop.id, Cycle.number == number)
    ).one_or_none()


def get_cycle(*, session: Session, loop: Loop, number: int) -> Cycle:
    cycle = _find_cycle(session=session, loop=loop, number=number)
    return existing(cycle, f"cycle {number} of loop {loop.name!r}")


def set_stage(
    *,
    session: Session,
    cycle: Cycle,
    stage: str,
    dataset_id: int | None = None,
    candidate_checkpoint_id: str | None = None,
) -> None:
    """Record that ``stage`` starts now; the stage before it ends now (timings per stage)."""
    timings = {name: dict(value) for name, value in (cycle.stage_timings or {}).items()}
    now = _now_iso()
    if cycle.stage != stage:
        previous = timings.setdefault(cycle.stage, {"started_at": now})
        previous.setdefault("ended_at", now)
    timings.setdefault(stage, {"started_at": now})
    cycle.stage_timings = timings
    cycle.stage = stage
    if dataset_id is not None:
        cycle.dataset_id = dataset_id
    if candidate_checkpoint_id is not None:
        cycle.candidate_checkpoint_id = candidate_checkpoint_id


@dataclass(frozen=True)
class CycleCost:
    compute_seconds: float
    cost_usd: Decimal


def cycle_cost(*, session: Session, cycle: Cycle) -> CycleCost:
    row = session.execute(
        select(
            func.coalesce(func.sum(Run.compute_seconds), 0.0),
            func.coalesce(func.sum(Run.cost_usd), Decimal(0)),
        ).where(Run.cycle_id == cycle.id)
    ).one()
    return CycleCost(float(row[0]), Decimal(row[1]))


def close_cycle(
    *,
    session: Session,
    cycle: Cycle,
    outcome: str,
    detail: str,
    points_gained: float | None,
    candidate_checkpoint_id: str | None,
    gate_points: float | None,
    points: CyclePoints,
) -> Cycle:
    """Close the cycle with its outcome, its three numbers and the cost of its runs, in
    all and by phase (``services.loop.estimate``).

    Idempotent: every value is set absolutely. ``points_gained`` is held-out points (what
    the ledger divides by dollars); ``gate_points`` the eval-set delta the gate decided on;
    ``points`` the canary's live delta and every number's intervals and counts.
    """
    cost = cycle_cost(session=session, cycle=cycle)
    if cycle.ended_at is None:
        cycle.ended_at = dt.datetime.now(dt.UTC)
    cycle.outcome = outcome
    cycle.outcome_detail = detail
    if cycle.stage != CycleStage.DONE:
        timings = {name: dict(value) for name, value in (cycle.stage_timings or {}).items()}
        timings.setdefault(cycle.stage, {"started_at": _now_iso()}).setdefault(
            "ended_at", _now_iso()
        )
        cycle.stage_timings = timings
    cycle.stage = CycleStage.DONE
    cycle.compute_seconds = cost.compute_seconds
    cycle.cost_usd = cost.cost_usd
    cycle.cost_by_phase = cycle_phase_costs(run_records(session=session, cycle_ids=[cycle.id]))
    cycle.points_gained = points_gained
    cycle.gate_points = gate_points
    cycle.live_points = points.live_points
    cycle.points_detail = dict(points.detail)
    if candidate_checkpoint_id is not None:
        cycle.candidate_checkpoint_id = candidate_checkpoint_id
    return cycle


def run_records(
    *, session: Session, cycle_ids: Iterable[int], succeeded_only: bool = False
) -> list[RunRecord]:
    """The runs of these cycles as the phase split and the rates read them."""
    ids = list(cycle_ids)
    if not ids:
        return []
    statement = select(Run).where(Run.cycle_id.in_(ids)).order_by(Run.submitted_at, Run.id)
    if succeeded_only:
        statement = statement.where(Run.status == RunStatus.SUCCEEDED)
    return [run_record(run) for run in session.scalars(statement)]


def run_record(run: Run) -> RunRecord:
    """A run row as the phase split reads it."""
    wall_s = (
        (run.ended_at - run.started_at).total_seconds()
        if run.started_at is not None and run.ended_at is not None
        else 0.0
    )
    return RunRecord(
        kind=run.kind,
        metrics=dict(run.metrics or {}),
        wall_s=wall_s,
        compute_s=float(run.compute_seconds or 0.0),
        cost_usd=float(run.cost_usd or 0),
    )


def accounted_cycle_ids(*, session: Session, loop: Loop, before: int, limit: int) -> list[int]:
    """The ids of the loop's last ``limit`` closed cycles numbered below ``before``, whose
    runs measure the rates of the next estimate."""
    return list(
        session.scalars(
            select(Cycle.id)
            .where(Cycle.loop_id == loop.id, Cycle.number < before, Cycle.ended_at.is_not(None))
            .order_by(Cycle.number.desc())
            .limit(limit)
        )
    )


def record_estimate(
    *, session: Session, cycle: Cycle, estimate_usd: float, estimate: dict[str, Any]
) -> Cycle:
    """Store the cycle's estimate once: a cycle keeps the first estimate made for it (so a
    retried estimate activity, or a restarted worker, answers as the first attempt did)."""
    if cycle.estimate_usd is None:
        cycle.estimate_usd = Decimal(str(estimate_usd))
        cycle.estimate = dict(estimate)
    return cycle


# Evaluations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvaluationRecord:
    """One evaluation job's outcome as the gate stores it: which checkpoint on which task
    set, the dataset and run it came from, its per-task result rows and the interval of
    its pass@1."""

    checkpoint_id: str
    task_set: str
    dataset_id: int
    run_id: str
    results: Sequence[dict[str, Any]]
    ci: tuple[float, float]


def record_evaluation(
    *, session: Session, loop: Loop, cycle: Cycle, record: EvaluationRecord
) -> Evaluation:
    """Store an evaluation with its per-task rows; a second call returns the first one."""
    existing = session.scalars(
        select(Evaluation).where(
            Evaluation.cycle_id == cycle.id,
            Evaluation.checkpoint_id == record.checkpoint_id,
            Evaluation.task_set == record.task_set,
        )
    ).one_or_none()
    if existing is not None:
        return existing
    rows = list(record.results)
    job_task_ids = {str(row["task_id"]) for row in rows}
    row_ids = row_ids_by_job_task_id(
        session=session, loop_id=loop.id, job_task_ids=job_task_ids, dataset_id=record.dataset_id
    )
    missing = job_task_ids - set(row_ids)
    if missing:
        raise NotFound(
            f"evaluation results name {len(missing)} task(s) unknown to loop {loop.name!r}, "
            f"e.g. {sorted(missing)[0]}"
        )
    passed = sum(1 for row in rows if row.get("passed"))
    # pass@1 estimated from each task's samples; ``passed`` counts tasks passed by majority.
    pass_rate = sum(pass_at_1(row) for row in rows) / len(rows) if rows else 0.0
    evaluation = Evaluation(
        loop_id=loop.id,
        cycle_id=cycle.id,
        checkpoint_id=record.checkpoint_id,
        dataset_id=record.dataset_id,
        run_id=record.run_id,
        task_set=record.task_set,
        n=len(rows),
        passed=passed,
        pass_rate=pass_rate,
        ci_low=record.ci[0],
        ci_high=record.ci[1],
    )
    session.add(evaluation)
    session.flush()
    session.execute(
        insert(EvaluationResult),
        [
            {
                "evaluation_id": evaluation.id,
                "task_id": row_ids[str(row["task_id"])],
                "passed": bool(row.get("passed")),
                "reward": float(row.get("reward", 0.0)),
                "details": _storable(
                    {
                        key: value
                        for key, value in row.items()
                        if key not in {"task_id", "passed", "reward"}
                    }
                ),
            }
            for row in rows
        ],
    )
    return evaluation


def _storable(value: Any) -> Any:
    """A results row's details as Postgres's jsonb stores them: a model's answer is text it
    sampled, and jsonb refuses NUL (``\\u0000``), so a NUL becomes U+FFFD."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_storable(key): _storable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_storable(item) for item in value]
    return value


def paired_results(
    *, session: Session, cycle: Cycle, champion_id: str, candidate_id: str, task_set: str
) -> tuple[list[float], list[float]]:
    """Per-task pass@1 of both checkpoints on the tasks both were evaluated on (task order)."""
    champion = _results_by_task(session, cycle, champion_id, task_set)
    candidate = _results_by_task(session, cycle, candidate_id, task_set)
    shared = sorted(set(champion) & set(candidate))
    return [champion[t] for t in shared], [candidate[t] for t in shared]


def evaluated_task_specs(
    *, session: Session, cycle: Cycle, checkpoint_id: str, task_set: str
) -> list[dict[str, Any]]:
    """The ``ratchet.task/v1`` specs of the tasks ``checkpoint_id`` was evaluated on."""
    return list(
        session.scalars(
            select(Task.spec)
            .join(EvaluationResult, EvaluationResult.task_id == Task.id)
            .join(Evaluation, Evaluation.id == EvaluationResult.evaluation_id)
            .where(
                Evaluation.cycle_id == cycle.id,
                Evaluation.checkpoint_id == checkpoint_id,
                Evaluation.task_set == task_set,
            )
            .distinct()
        )
    )


def pass_at_k_of(
    *, session: Session, cycle: Cycle, checkpoint_id: str, task_set: str
) -> dict[str, float]:
    """The checkpoint's pass@k on a task set of the cycle, k = 1, 2, 4, ..., its samples per
    task (unbiased estimator, :func:`services.evaluation.results.pass_at_k`); {} if it was
    not evaluated there."""
    rows = [
        {**(details or {}), "passed": passed}
        for _, passed, details in _result_rows(session, cycle, checkpoint_id, task_set)
    ]
    if not rows:
        return {}
    samples = min(int(row.get("samples") or 1) for row in rows)
    values = {k: mean_pass_at_k(rows, k) for k in reported_ks(samples)}
    return {str(k): round(v, 6) for k, v in values.items() if v is not None}


def _results_by_task(
    session: Session, cycle: Cycle, checkpoint_id: str, task_set: str
) -> dict[int, float]:
    return {
        task_id: pass_at_1({**(details or {}), "passed": passed})
        for task_id, passed, details in _result_rows(session, cycle, checkpoint_id, task_set)
    }


def _result_rows(
    session: Session, cycle: Cycle, checkpoint_id: str, task_set: str
) -> list[tuple[int, bool, dict[str, Any] | None]]:
    rows = session.execute(
        select(EvaluationResult.task_id, EvaluationResult.passed, EvaluationResult.details)
        .join(Evaluation, Evaluation.id == EvaluationResult.evaluation_id)
        .where(
            Evaluation.cycle_id == cycle.id,
            Evaluation.checkpoint_id == checkpoint_id,
            Evaluation.task_set == task_set,
        )
    ).all()
    return [(task_id, passed, details) for task_id, passed, details in rows]


# Promotions ---------------------------------------------------------------------------------


def record_decision(
    *,
    session: Session,
    loop: Loop,
    cycle: Cycle,
    verdict: GateDecision,
    candidate_checkpoint_id: str | None,
    previous_checkpoint_id: str | None,
    decided_by: str,
) -> Promotion:
    """At most one decision per cycle: a second call returns the first decision unchanged.

    ``verdict`` is the decision with its reason and statistics, the gate's or a person's
    (``decided_by``)."""
    session.execute(
        insert(Promotion)
        .values(
            loop_id=loop.id,
            cycle_id=cycle.id,
            decision=verdict.decision,
            status=PromotionStatus.DECIDED
            if verdict.decision == Decision.PROMOTE
            else PromotionStatus.REJECTED,
            reason=verdict.reason,
            statistics=verdict.statistics,
            candidate_checkpoint_id=candidate_checkpoint_id,
            previous_checkpoint_id=previous_checkpoint_id,
            serving_target=loop.serving_target,
            decided_by=decided_by,
        )
        .on_conflict_do_nothing(index_elements=[Promotion.cycle_id])
    )
    return session.scalars(select(Promotion).where(Promotion.cycle_id == cycle.id)).one()


def cycle_promotion(*, session: Session, cycle: Cycle) -> Promotion | None:
    """The cycle's decision (at most one), if the gate got that far."""
    return session.scalars(select(Promotion).where(Promotion.cycle_id == cycle.id)).one_or_none()


def evaluation_runs_of(
    *, session: Session, loop: Loop, checkpoint_id: str
) -> list[tuple[str | None, dict[str, Any]]]:
    """(output URI, metrics) of the loop's succeeded eval runs of a checkpoint, held-out set
    first, newest first: where its probe set (proof of delivery) is looked up."""
    heldout_first = case((Evaluation.task_set == "heldout", 0), else_=1)
    rows = session.execute(
        select(Run.output_uri, Run.metrics)
        .join(Evaluation, Evaluation.run_id == Run.id)
        .where(
            Evaluation.loop_id == loop.id,
            Evaluation.checkpoint_id == checkpoint_id,
            Run.status == RunStatus.SUCCEEDED,
        )
        .order_by(heldout_first, Evaluation.created_at.desc(), Evaluation.id.desc())
    )
    return [(uri, dict(metrics or {})) for uri, metrics in rows]


def record_delivery(
    *, session: Session, promotion: Promotion, purpose: str, proof: dict[str, Any]
) -> None:
    """Keep a deploy's proof of delivery on its promotion (``statistics.delivery.<purpose>``):
    an absolute value, so a retried deploy writes the same."""
    statistics = dict(promotion.statistics or {})
    delivery = dict(statistics.get("delivery") or {})
    delivery[purpose] = proof
    statistics["delivery"] = delivery
    promotion.statistics = statistics


PROMOTION_TIMESTAMPS = {"deployed_at", "canary_ended_at", "rolled_back_at"}


def update_promotion(
    *,
    session: Session,
    promotion_id: int,
    status: str,
    reason: str | None,
    set_champion: str | None,
    timestamp_field: str | None,
) -> Promotion:
    promotion = existing(
        session.get(Promotion, promotion_id, with_for_update=True), f"promotion {promotion_id}"
    )
    promotion.status = status
    if reason:
        promotion.reason = f"{promotion.reason}\n{reason}" if promotion.reason else reason
    if timestamp_field is not None:
        if timestamp_field not in PROMOTION_TIMESTAMPS:
            raise ValueError(f"unknown promotion timestamp {timestamp_field!r}")
        if getattr(promotion, timestamp_field) is None:
            setattr(promotion, timestamp_field, dt.datetime.now(dt.UTC))
    if set_champion is not None:
        loop = session.get(Loop, promotion.loop_id, with_for_update=True)
        assert loop is not None
        loop.champion_checkpoint_id = set_champion
    return promotion


def get_promotion(*, session: Session, promotion_id: int) -> Promotion:
    return existing(session.get(Promotion, promotion_id), f"promotion {promotion_id}")


def has_rollback_record(*, session: Session, loop: Loop, status: str, reason: str) -> bool:
    """Whether an operator rollback with this outcome was recorded (a retry records once)."""
    return (
        session.scalars(
            select(Promotion.id).where(
                Promotion.loop_id == loop.id,
                Promotion.decision == Decision.ROLLBACK,
                Promotion.status == status,
                Promotion.reason == reason,
            )
        ).first()
        is not None
    )


def last_rollback_record(*, session: Session, loop: Loop) -> Promotion | None:
    """The loop's latest operator rollback, rolled back or failed."""
    return session.scalars(
        select(Promotion)
        .where(Promotion.loop_id == loop.id, Promotion.decision == Decision.ROLLBACK)
        .order_by(Promotion.decided_at.desc(), Promotion.id.desc())
        .limit(1)
    ).one_or_none()


def last_held_promotion(*, session: Session, loop: Loop) -> Promotion | None:
    return session.scalars(
        select(Promotion)
        .where(Promotion.loop_id == loop.id, Promotion.status == PromotionStatus.HELD)
        .order_by(Promotion.decided_at.desc(), Promotion.id.desc())
        .limit(1)
    ).one_or_none()


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat()
