"""The reads behind the dashboard pages.

Every function takes the session keyword-only and never commits (the route owns a
read-only transaction). Each returns small frozen dataclasses shaped for a page, so
templates never touch the ORM or trigger lazy loads.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import Select, and_, func, select, text
from sqlalchemy.orm import Session, aliased

from services.dashboard.timeline import current_stage
from services.db.models import (
    Checkpoint,
    Cycle,
    Dataset,
    Evaluation,
    Promotion,
    Run,
    Task,
    TaskSource,
    Trace,
)
from services.evaluation.stats import wilson_interval
from services.loop.estimate import PHASES

# The live success rate of the overview is taken over this many most recent outcomes.
LIVE_WINDOW_TRACES = 200

# Bucket widths of the live success chart, smallest first: the first that keeps the chart
# under ``max_buckets`` points is used.
_BUCKET_WIDTHS = tuple(
    dt.timedelta(minutes=m)
    for m in (1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440, 2880, 10080)
)
_BUCKET_ORIGIN = dt.datetime(2000, 1, 3, tzinfo=dt.UTC)  # a Monday, so weeks line up

# Characters of a task prompt shown as an example of its cluster.
PROMPT_PREVIEW_CHARS = 600


def _rate(passed: int, n: int) -> float | None:
    return passed / n if n else None


@dataclass(frozen=True)
class LoopSummary:
    """One row of the loops overview."""

    name: str
    status: str
    status_reason: str | None
    environment: str
    executor: str
    champion_id: str | None
    champion_created_at: dt.datetime | None
    open_stage: str | None
    open_stage_timings: dict[str, Any] | None
    live_n: int
    live_passed: int
    last_cycle_number: int | None
    last_cycle_stage: str | None
    last_cycle_outcome: str | None
    last_cycle_started_at: dt.datetime | None
    last_cycle_ended_at: dt.datetime | None
    spend_usd: Decimal
    budget_usd: Decimal | None

    @property
    def stage(self) -> str:
        """What the loop is doing: paused, archived, a cycle's stage, or idle."""
        if self.status != "active":
            return self.status
        if self.open_stage is None:
            return "idle"
        return current_stage(self.open_stage, self.open_stage_timings)

    @property
    def live_rate(self) -> float | None:
        return _rate(self.live_passed, self.live_n)

    @property
    def live_interval(self) -> tuple[float, float]:
        return wilson_interval(self.live_passed, self.live_n)


_OVERVIEW_SQL = text(
    """
SELECT l.name, l.status, l.status_reason, l.environment, l.executor, l.budget_usd,
       l.champion_checkpoint_id AS champion_id, ck.created_at AS champion_created_at,
       open_cycle.stage AS open_stage, open_cycle.stage_timings AS open_stage_timings,
       live.n AS live_n, live.passed AS live_passed,
       last.number AS last_cycle_number, last.stage AS last_cycle_stage,
       last.outcome AS last_cycle_outcome, last.started_at AS last_cycle_started_at,
       last.ended_at AS last_cycle_ended_at,
       spend.total AS spend_usd
FROM loops l
LEFT JOIN checkpoints ck ON ck.id = l.champion_checkpoint_id
LEFT JOIN LATERAL (
    SELECT c.stage, c.stage_timings
    FROM cycles c WHERE c.loop_id = l.id AND c.ended_at IS NULL LIMIT 1
) open_cycle ON true
LEFT JOIN LATERAL (
    SELECT c.number, c.stage, c.outcome, c.started_at, c.ended_at
    FROM cycles c WHERE c.loop_id = l.id ORDER BY c.number DESC LIMIT 1
) last ON true
LEFT JOIN LATERAL (
    SELECT count(*) AS n, count(*) FILTER (WHERE recent.success) AS passed
    FROM (
        SELECT t.success FROM traces t
        WHERE t.loop_id = l.id AND t.success IS NOT NULL
        ORDER BY t.received_at DESC
        LIMIT :window
    ) recent
) live ON true
LEFT JOIN LATERAL (
    SELECT coalesce(sum(r.cost_usd), 0) AS total FROM runs r WHERE r.loop_id = l.id
) spend ON true
ORDER BY l.status = 'archived', l.name
"""
)


def loops_overview(session: Session) -> list[LoopSummary]:
    """Every loop with its stage, champion, live success rate, last cycle and spend."""
    rows = session.execute(_OVERVIEW_SQL, {"window": LIVE_WINDOW_TRACES}).mappings()
    return [LoopSummary(**row) for row in rows]


def recent_outcomes(
    session: Session, *, loop_id: int, limit: int = LIVE_WINDOW_TRACES
) -> tuple[int, int]:
    """(succeeded, reported) over the loop's latest ``limit`` reported outcomes: the live
    success rate the overview shows."""
    recent = (
        select(Trace.success)
        .where(Trace.loop_id == loop_id, Trace.success.is_not(None))
        .order_by(Trace.received_at.desc())
        .limit(limit)
        .subquery()
    )
    passed, n = session.execute(
        select(func.count().filter(recent.c.success.is_(True)), func.count()).select_from(recent)
    ).one()
    return int(passed), int(n)


def loop_spend(session: Session, *, loop_id: int) -> Decimal:
    """Dollars spent on the loop's jobs so far (every run, in a cycle or not)."""
    total = session.scalar(
        select(func.coalesce(func.sum(Run.cost_usd), 0)).where(Run.loop_id == loop_id)
    )
    return Decimal(total or 0)


# Cycles ---------------------------------------------------------------------------------------


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
            out.append(
                CycleNumber(
                    key,
                    label,
                    float(value),
                    float(low) if isinstance(low, int | float) else None,
                    float(high) if isinstance(high, int | float) else None,
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
        return self.accounted_cost_usd if self.accounted_cost_usd > 0 else self.runs_cost_usd

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


def loop_cycles(session: Session, *, loop_id: int, limit: int = 50) -> list[CycleRow]:
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
            )
        )
    return rows


@dataclass(frozen=True)
class RunSpan:
    """When one of a cycle's jobs ran (unset ends: it has not started or not ended)."""

    kind: str
    started_at: dt.datetime | None
    ended_at: dt.datetime | None

    @property
    def seconds(self) -> float:
        if self.started_at is None or self.ended_at is None:
            return 0.0
        return (self.ended_at - self.started_at).total_seconds()


def cycle_run_spans(session: Session, *, loop_id: int) -> dict[int, list[RunSpan]]:
    """Cycle number → when its jobs ran, in the order they were submitted; one query."""
    statement = (
        select(Cycle.number, Run.kind, Run.started_at, Run.ended_at)
        .join(Cycle, Cycle.id == Run.cycle_id)
        .where(Run.loop_id == loop_id)
        .order_by(Cycle.number, Run.submitted_at, Run.id)
    )
    spans: dict[int, list[RunSpan]] = {}
    for number, kind, started_at, ended_at in session.execute(statement):
        spans.setdefault(number, []).append(RunSpan(kind, started_at, ended_at))
    return spans


# Live success rate ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveBucket:
    """Outcomes of the traces received in one time bucket."""

    start: dt.datetime
    n: int
    passed: int

    @property
    def rate(self) -> float:
        return self.passed / self.n

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.passed, self.n)


@dataclass(frozen=True)
class LiveSeries:
    """The live success rate over time, bucketed so the chart stays readable."""

    start: dt.datetime
    end: dt.datetime
    width: dt.timedelta
    buckets: list[LiveBucket] = field(default_factory=list)


def bucket_width(span: dt.timedelta, *, max_buckets: int) -> dt.timedelta:
    """The smallest round bucket width that cuts ``span`` into at most ``max_buckets``."""
    if max_buckets < 1:
        raise ValueError("max_buckets must be at least 1")
    for width in _BUCKET_WIDTHS:
        if span / width <= max_buckets:
            return width
    return _BUCKET_WIDTHS[-1]


def live_success_series(
    session: Session,
    *,
    loop_id: int,
    window: dt.timedelta = dt.timedelta(days=7),
    max_buckets: int = 60,
) -> LiveSeries | None:
    """Success rate of reported outcomes per time bucket, over the ``window`` that ends at
    the latest reported outcome; ``None`` when no trace reported one."""
    reported = and_(Trace.loop_id == loop_id, Trace.success.is_not(None))
    end = session.scalar(select(func.max(Trace.received_at)).where(reported))
    if end is None:
        return None
    start = session.scalar(
        select(func.min(Trace.received_at)).where(reported, Trace.received_at >= end - window)
    )
    assert start is not None  # the latest outcome itself is in the window
    width = bucket_width(end - start, max_buckets=max_buckets)
    bucket = func.date_bin(width, Trace.received_at, _BUCKET_ORIGIN).label("bucket")
    statement = (
        select(bucket, func.count(), func.count().filter(Trace.success.is_(True)))
        .where(reported, Trace.received_at >= start)
        .group_by(bucket)
        .order_by(bucket)
    )
    buckets = [LiveBucket(at, int(n), int(ok)) for at, n, ok in session.execute(statement)]
    return LiveSeries(start=buckets[0].start, end=end, width=width, buckets=buckets)


@dataclass(frozen=True)
class LoopEvent:
    """Something that moved the live success rate: a promotion, a rollback, a drift."""

    at: dt.datetime
    kind: str
    label: str


def loop_events(session: Session, *, loop_id: int, since: dt.datetime) -> list[LoopEvent]:
    """Promotions (when deployed), rollbacks and drift-triggered cycles since ``since``."""
    events: list[LoopEvent] = []
    promotions = session.execute(
        select(Promotion, Cycle.number)
        .outerjoin(Cycle, Cycle.id == Promotion.cycle_id)
        .where(Promotion.loop_id == loop_id)
    )
    for promotion, number in promotions:
        cycle = f"cycle {number}" if number is not None else "operator"
        if promotion.decision == "promote" and promotion.status not in ("rejected", "failed"):
            at = promotion.deployed_at or promotion.decided_at
            events.append(LoopEvent(at, "promote", f"{cycle}: promoted"))
        if promotion.decision == "rollback" or promotion.rolled_back_at is not None:
            at = promotion.rolled_back_at or promotion.decided_at
            what = "rollback failed" if promotion.status == "failed" else "rolled back"
            events.append(LoopEvent(at, "rollback", f"{cycle}: {what}: {promotion.reason}"))
    drifts = session.execute(
        select(Cycle.number, Cycle.started_at).where(
            Cycle.loop_id == loop_id, Cycle.trigger == "drift"
        )
    )
    for number, started_at in drifts:
        events.append(LoopEvent(started_at, "drift", f"cycle {number}: drift detected"))
    return sorted((e for e in events if e.at >= since), key=lambda e: e.at)


# Failure clusters -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterExample:
    """A task of a cluster, shown by its (already redacted) prompt, never a raw trace."""

    task_id: int
    split: str
    origin: str
    prompt: str
    truncated: bool
    tools: list[str]
    source_traces: int
    created_at: dt.datetime


@dataclass(frozen=True)
class FailureCluster:
    """Tasks the curator grouped as one failure mode."""

    cluster_id: str
    tasks: int
    train: int
    eval: int
    source_traces: int
    signature: str | None
    latest_at: dt.datetime
    examples: list[ClusterExample]


_CLUSTERS_SQL = text(
    """
SELECT t.cluster_id,
       count(*) AS tasks,
       count(*) FILTER (WHERE t.split = 'train') AS train,
       count(*) FILTER (WHERE t.split = 'eval') AS eval,
       mode() WITHIN GROUP (ORDER BY t.failure_signature) AS signature,
       max(t.created_at) AS latest_at,
       (SELECT count(DISTINCT ts.trace_id) FROM task_sources ts JOIN tasks t2 ON t2.id = ts.task_id
        WHERE t2.loop_id = :loop_id AND t2.cluster_id = t.cluster_id) AS source_traces
FROM tasks t
WHERE t.loop_id = :loop_id
GROUP BY t.cluster_id
ORDER BY count(*) DESC, max(t.created_at) DESC, t.cluster_id
LIMIT :limit
"""
)


def signature_label(signature: str | None) -> str | None:
    """A failure signature as people read it. Curation stores ``"<error kind>|<tool,...>"``
    (services.curation.selection.failure_signature), so an episode that called no tool is
    ``"wrong_answer|"``: shown as ``wrong_answer``, and with tools as
    ``wrong_answer · tools: add, mul``, never with the separator."""
    if signature is None:
        return None
    kind, separator, tools = signature.partition("|")
    if not separator:
        return signature
    names = [name for name in tools.split(",") if name]
    return f"{kind} · tools: {', '.join(names)}" if names else kind


def _example(task: Task, source_traces: int) -> ClusterExample:
    spec = task.spec or {}
    prompt = spec.get("prompt")
    prompt = prompt if isinstance(prompt, str) else ""
    tools = [
        str(tool.get("name"))
        for tool in spec.get("tools") or []
        if isinstance(tool, dict) and tool.get("name")
    ]
    return ClusterExample(
        task_id=task.id,
        split=task.split,
        origin=task.origin,
        prompt=prompt[:PROMPT_PREVIEW_CHARS],
        truncated=len(prompt) > PROMPT_PREVIEW_CHARS,
        tools=tools,
        source_traces=source_traces,
        created_at=task.created_at,
    )


def failure_clusters(
    session: Session, *, loop_id: int, limit: int = 12, examples: int = 3
) -> list[FailureCluster]:
    """The largest clusters of curated tasks, each with its newest example tasks."""
    rows = list(session.execute(_CLUSTERS_SQL, {"loop_id": loop_id, "limit": limit}).mappings())
    if not rows:
        return []
    ranked = (
        select(
            Task,
            func.row_number()
            .over(partition_by=Task.cluster_id, order_by=(Task.created_at.desc(), Task.id.desc()))
            .label("rank"),
        )
        .where(Task.loop_id == loop_id, Task.cluster_id.in_([r["cluster_id"] for r in rows]))
        .subquery()
    )
    task_alias = aliased(Task, ranked)
    source_count = (
        select(func.count())
        .select_from(TaskSource)
        .where(TaskSource.task_id == ranked.c.id)
        .scalar_subquery()
    )
    picked: dict[str, list[ClusterExample]] = {}
    for task, sources in session.execute(
        select(task_alias, source_count).where(ranked.c.rank <= examples).order_by(ranked.c.rank)
    ):
        picked.setdefault(task.cluster_id, []).append(_example(task, int(sources)))
    return [
        FailureCluster(
            cluster_id=row["cluster_id"],
            tasks=int(row["tasks"]),
            train=int(row["train"]),
            eval=int(row["eval"]),
            source_traces=int(row["source_traces"]),
            signature=signature_label(row["signature"]),
            latest_at=row["latest_at"],
            examples=picked.get(row["cluster_id"], []),
        )
        for row in rows
    ]


# Runs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRow:
    """One job in the runs table."""

    id: str
    kind: str
    status: str
    executor: str
    cycle_number: int | None
    submitted_at: dt.datetime
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    compute_seconds: float
    cost_usd: Decimal
    error: str | None


def recent_runs(session: Session, *, loop_id: int, limit: int = 25) -> list[RunRow]:
    """The loop's latest jobs, newest first."""
    statement = (
        select(Run, Cycle.number)
        .outerjoin(Cycle, Cycle.id == Run.cycle_id)
        .where(Run.loop_id == loop_id)
        .order_by(Run.submitted_at.desc(), Run.id)
        .limit(limit)
    )
    return [
        RunRow(
            id=run.id,
            kind=run.kind,
            status=run.status,
            executor=run.executor,
            cycle_number=number,
            submitted_at=run.submitted_at,
            started_at=run.started_at,
            ended_at=run.ended_at,
            compute_seconds=float(run.compute_seconds or 0),
            cost_usd=Decimal(run.cost_usd or 0),
            error=run.error,
        )
        for run, number in session.execute(statement)
    ]


@dataclass(frozen=True)
class RunDetail:
    """A job with what it produced: checkpoints (train) and evaluations (eval)."""

    run: Run
    cycle_number: int | None
    checkpoints: list[Checkpoint]
    evaluations: list[Evaluation]


def run_detail(session: Session, *, loop_id: int, run_id: str) -> RunDetail | None:
    """One run of the loop, or ``None`` (also when the run belongs to another loop)."""
    found = session.execute(
        select(Run, Cycle.number)
        .outerjoin(Cycle, Cycle.id == Run.cycle_id)
        .where(Run.id == run_id, Run.loop_id == loop_id)
    ).one_or_none()
    if found is None:
        return None
    run, number = found
    checkpoints = list(
        session.scalars(
            select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.created_at)
        )
    )
    evaluations = list(
        session.scalars(
            select(Evaluation).where(Evaluation.run_id == run_id).order_by(Evaluation.id)
        )
    )
    return RunDetail(run=run, cycle_number=number, checkpoints=checkpoints, evaluations=evaluations)
