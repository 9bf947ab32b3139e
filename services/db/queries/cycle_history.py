"""The loop's cycles as one table: each cycle with both evaluations (eval and held-out
sets), its dataset, the gate's decision and what followed, its three numbers and its cost.
Never commits.

The dashboard's cycles table and charts and the demo's report read the same rows
(:func:`loop_cycles`, one query for all of them), so a cycle's figures cannot differ
between the two.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import Select, and_, func, select
from sqlalchemy.orm import Session, aliased

from services.dashboard.timeline import current_stage
from services.db.models import Cycle, Dataset, Evaluation, Promotion, Run
from services.db.queries.points import cycle_cost_usd
from services.evaluation.figures import gain_from_detail
from services.evaluation.stats import wilson_interval
from services.loop.estimate import PHASES


def _rate(passed: int, n: int) -> float | None:
    return passed / n if n else None


@dataclass(frozen=True)
class EvalSummary:
    """A checkpoint's result on a cycle's eval set, with its Wilson interval."""

    checkpoint_id: str
    n: int
    passed: int
    # As the evaluation stored them: pass@1 estimated from each task's samples, and its
    # interval at the gate's confidence (the demo's report prints these).
    pass_at_1: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None

    @property
    def pass_rate(self) -> float | None:
        return _rate(self.passed, self.n)

    @property
    def stored_estimate(self) -> tuple[float, float, float] | None:
        """(pass@1, low, high) as stored, or None for a row without them."""
        if self.pass_at_1 is None or self.ci_low is None or self.ci_high is None:
            return None
        return self.pass_at_1, self.ci_low, self.ci_high

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.passed, self.n)


@dataclass(frozen=True)
class CycleNumber:
    """One of a cycle's numbers, in pass-rate points, with its interval when known."""

    key: str  # "heldout" | "gate" | "live"
    label: str
    points: float
    ci_low: float | None
    ci_high: float | None
    counted: str | None = None  # what it counted: "40 tasks", "50 → 60 traces"


@dataclass(frozen=True)
class PhaseRow:
    """One phase of a cycle: what the estimate expected it to cost, what it cost, how long."""

    phase: str
    estimate_usd: float | None
    cost_usd: float | None
    seconds: float | None


def _float_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class CycleRow:
    """One cycle as the cycles table and the per-cycle charts show it."""

    number: int
    trigger: str
    stage: str
    outcome: str | None
    outcome_detail: str | None
    started_at: dt.datetime
    ended_at: dt.datetime | None
    stage_timings: dict[str, Any]
    workflow_id: str | None
    champion_checkpoint_id: str | None
    candidate_checkpoint_id: str | None
    dataset_id: int | None
    train_count: int | None
    eval_count: int | None
    champion: EvalSummary | None
    candidate: EvalSummary | None
    decision: str | None
    promotion_status: str | None
    promotion_reason: str | None
    accounted_cost_usd: Decimal
    runs_cost_usd: Decimal
    compute_seconds: float
    points_gained: float | None
    gate_points: float | None = None
    live_points: float | None = None
    points_detail: dict[str, Any] | None = None
    heldout_champion: EvalSummary | None = None
    heldout_candidate: EvalSummary | None = None
    deployed_at: dt.datetime | None = None
    canary_ended_at: dt.datetime | None = None
    rolled_back_at: dt.datetime | None = None
    # The estimate made before training (None: the cycle never got that far, or ran before
    # estimates) and where the money went, by phase (services.loop.estimate).
    estimate_usd: Decimal | None = None
    estimate: dict[str, Any] | None = None
    cost_by_phase: dict[str, Any] | None = None

    @property
    def phase_costs(self) -> list[PhaseRow]:
        """Each phase's estimated and actual dollars (and actual seconds), in phase order."""
        actual = self.cost_by_phase or {}
        planned = (self.estimate or {}).get("phases") or {}
        rows = []
        for name in PHASES:
            got, est = actual.get(name), planned.get(name)
            if not isinstance(got, dict) and not isinstance(est, dict):
                continue
            got, est = got if isinstance(got, dict) else {}, est if isinstance(est, dict) else {}
            rows.append(
                PhaseRow(
                    name,
                    _float_or_none(est.get("cost_usd")),
                    _float_or_none(got.get("cost_usd")),
                    _float_or_none(got.get("seconds")),
                )
            )
        return rows

    delivery: dict[str, Any] | None = None  # the promotion's statistics.delivery
    # A bootstrap's report (``trigger_detail.bootstrap``: traces seen, successes used and
    # left out by reason, the base model; services.curation.bootstrap), None for other cycles.
    bootstrap: dict[str, Any] | None = None

    @property
    def delivery_notes(self) -> list[DeliveryNote]:
        """Proof of delivery of each deploy the promotion made (candidate, restore,
        rollback): verified, not verified and why, or the mismatch that failed it."""
        notes = []
        delivery = self.delivery or {}
        order = {purpose: i for i, purpose in enumerate(("candidate", "restore", "rollback"))}
        for purpose in sorted(delivery, key=lambda p: (order.get(p, len(order)), p)):
            proof = delivery[purpose]
            if isinstance(proof, dict) and isinstance(proof.get("note"), str):
                notes.append(DeliveryNote(purpose, proof.get("verified") is True, proof["note"]))
        return notes

    @property
    def canary_seconds(self) -> float:
        """How long the candidate served under watch: deploy to the canary's end (or the
        rollback); 0 when it was never deployed."""
        ended = self.canary_ended_at or self.rolled_back_at
        if self.deployed_at is None or ended is None:
            return 0.0
        return (ended - self.deployed_at).total_seconds()

    @property
    def numbers(self) -> list[CycleNumber]:
        """The cycle's three numbers (DESIGN §8), each on its own set, with intervals."""
        detail = self.points_detail or {}
        out = []
        for key, label, value in (
            ("heldout", "held-out", self.points_gained),
            ("gate", "gate", self.gate_points),
            ("live", "live", self.live_points),
        ):
            if value is None:
                continue
            found = detail.get(key)
            interval: dict[str, Any] = found if isinstance(found, dict) else {}
            low, high = interval.get("ci_low_points"), interval.get("ci_high_points")
            figure = gain_from_detail(interval, live=key == "live")
            out.append(
                CycleNumber(
                    key,
                    label,
                    float(value),
                    float(low) if isinstance(low, int | float) else None,
                    float(high) if isinstance(high, int | float) else None,
                    figure.counted() if figure is not None and figure.n else None,
                )
            )
        return out

    @property
    def is_open(self) -> bool:
        return self.ended_at is None

    @property
    def current_stage(self) -> str:
        """The stage the cycle is in (or ended in), read like the timeline reads it."""
        return current_stage(self.stage, self.stage_timings)

    @property
    def cost_usd(self) -> Decimal:
        """The accounted cost once the cycle is accounted, the cost of its runs until then."""
        return cycle_cost_usd(self.accounted_cost_usd, self.runs_cost_usd)

    @property
    def duration_seconds(self) -> float | None:
        if self.ended_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds()


def _evaluation_join(evaluation: Any, checkpoint: Any, task_set: str) -> Any:
    return and_(
        evaluation.cycle_id == Cycle.id,
        evaluation.checkpoint_id == checkpoint,
        evaluation.task_set == task_set,
    )


def _evaluation_columns(evaluation: Any, prefix: str) -> list[Any]:
    return [
        getattr(evaluation, column).label(f"{prefix}_{column}")
        for column in ("n", "passed", "pass_rate", "ci_low", "ci_high")
    ]


def _eval_summary(row: Any, prefix: str, checkpoint_id: str | None) -> EvalSummary | None:
    n = getattr(row, f"{prefix}_n")
    if not checkpoint_id or n is None:
        return None
    return EvalSummary(
        checkpoint_id,
        n,
        getattr(row, f"{prefix}_passed"),
        pass_at_1=getattr(row, f"{prefix}_pass_rate"),
        ci_low=getattr(row, f"{prefix}_ci_low"),
        ci_high=getattr(row, f"{prefix}_ci_high"),
    )


def _cycles_select(loop_id: int) -> Select[*tuple[Any, ...]]:
    champion = aliased(Evaluation)
    candidate = aliased(Evaluation)
    heldout_champion = aliased(Evaluation)
    heldout_candidate = aliased(Evaluation)
    runs_cost = (
        select(Run.cycle_id, func.sum(Run.cost_usd).label("cost"))
        .where(Run.loop_id == loop_id)
        .group_by(Run.cycle_id)
        .subquery()
    )
    return (
        select(
            Cycle,
            *_evaluation_columns(champion, "champion"),
            *_evaluation_columns(candidate, "candidate"),
            *_evaluation_columns(heldout_champion, "heldout_champion"),
            *_evaluation_columns(heldout_candidate, "heldout_candidate"),
            Dataset.train_count,
            Dataset.eval_count,
            Promotion.decision,
            Promotion.status.label("promotion_status"),
            Promotion.reason.label("promotion_reason"),
            Promotion.deployed_at,
            Promotion.canary_ended_at,
            Promotion.rolled_back_at,
            Promotion.statistics.label("promotion_statistics"),
            func.coalesce(runs_cost.c.cost, 0).label("runs_cost"),
        )
        .outerjoin(champion, _evaluation_join(champion, Cycle.champion_checkpoint_id, "eval"))
        .outerjoin(candidate, _evaluation_join(candidate, Cycle.candidate_checkpoint_id, "eval"))
        .outerjoin(
            heldout_champion,
            _evaluation_join(heldout_champion, Cycle.champion_checkpoint_id, "heldout"),
        )
        .outerjoin(
            heldout_candidate,
            _evaluation_join(heldout_candidate, Cycle.candidate_checkpoint_id, "heldout"),
        )
        .outerjoin(Dataset, Dataset.id == Cycle.dataset_id)
        .outerjoin(Promotion, Promotion.cycle_id == Cycle.id)
        .outerjoin(runs_cost, runs_cost.c.cycle_id == Cycle.id)
        .where(Cycle.loop_id == loop_id)
    )


@dataclass(frozen=True)
class DeliveryNote:
    """One deploy's proof of delivery as the loop page shows it."""

    purpose: str
    verified: bool
    note: str


def _delivery(statistics: Any) -> dict[str, Any] | None:
    found = statistics.get("delivery") if isinstance(statistics, dict) else None
    return found if isinstance(found, dict) else None


def loop_cycles(*, session: Session, loop_id: int, limit: int = 50) -> list[CycleRow]:
    """The loop's latest cycles, newest first, with both evaluations and the gate's decision."""
    statement = _cycles_select(loop_id).order_by(Cycle.number.desc()).limit(limit)
    rows: list[CycleRow] = []
    for row in session.execute(statement):
        cycle: Cycle = row.Cycle
        champion_id, candidate_id = cycle.champion_checkpoint_id, cycle.candidate_checkpoint_id
        rows.append(
            CycleRow(
                number=cycle.number,
                trigger=cycle.trigger,
                stage=cycle.stage,
                outcome=cycle.outcome,
                outcome_detail=cycle.outcome_detail,
                started_at=cycle.started_at,
                ended_at=cycle.ended_at,
                stage_timings=dict(cycle.stage_timings or {}),
                workflow_id=cycle.workflow_id,
                champion_checkpoint_id=cycle.champion_checkpoint_id,
                candidate_checkpoint_id=cycle.candidate_checkpoint_id,
                dataset_id=cycle.dataset_id,
                train_count=row.train_count,
                eval_count=row.eval_count,
                champion=_eval_summary(row, "champion", champion_id),
                candidate=_eval_summary(row, "candidate", candidate_id),
                decision=row.decision,
                promotion_status=row.promotion_status,
                promotion_reason=row.promotion_reason,
                accounted_cost_usd=Decimal(cycle.cost_usd or 0),
                runs_cost_usd=Decimal(row.runs_cost or 0),
                compute_seconds=float(cycle.compute_seconds or 0),
                points_gained=cycle.points_gained,
                gate_points=cycle.gate_points,
                live_points=cycle.live_points,
                points_detail=dict(cycle.points_detail or {}),
                heldout_champion=_eval_summary(row, "heldout_champion", champion_id),
                heldout_candidate=_eval_summary(row, "heldout_candidate", candidate_id),
                deployed_at=row.deployed_at,
                canary_ended_at=row.canary_ended_at,
                rolled_back_at=row.rolled_back_at,
                estimate_usd=cycle.estimate_usd,
                estimate=dict(cycle.estimate or {}),
                cost_by_phase=dict(cycle.cost_by_phase or {}),
                delivery=_delivery(row.promotion_statistics),
                bootstrap=_bootstrap(cycle.trigger_detail),
            )
        )
    return rows


def _bootstrap(trigger_detail: Any) -> dict[str, Any] | None:
    found = trigger_detail.get("bootstrap") if isinstance(trigger_detail, dict) else None
    return found if isinstance(found, dict) else None


@dataclass(frozen=True)
class RunSpan:
    """When one of a cycle's jobs ran (unset ends: it has not started or not ended)."""

    kind: str
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    # A train job's sentence when a round's successes were rare (services.training.rft).
    rare_successes: str | None = None

    @property
    def seconds(self) -> float:
        if self.started_at is None or self.ended_at is None:
            return 0.0
        return (self.ended_at - self.started_at).total_seconds()


def cycle_run_spans(*, session: Session, loop_id: int) -> dict[int, list[RunSpan]]:
    """Cycle number → when its jobs ran, in the order they were submitted; one query."""
    statement = (
        select(
            Cycle.number,
            Run.kind,
            Run.started_at,
            Run.ended_at,
            Run.metrics["rare_successes"].as_string(),
        )
        .join(Cycle, Cycle.id == Run.cycle_id)
        .where(Run.loop_id == loop_id)
        .order_by(Cycle.number, Run.submitted_at, Run.id)
    )
    spans: dict[int, list[RunSpan]] = {}
    for number, kind, started_at, ended_at, rare in session.execute(statement):
        spans.setdefault(number, []).append(RunSpan(kind, started_at, ended_at, rare))
    return spans
