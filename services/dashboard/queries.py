"""The reads only the dashboard pages make: the live success chart and its events, the
failure clusters, the runs table and a run's page.

The questions the demo and the api ask too (the overview, the cycles, spend, intelligence
per dollar, live outcomes, promotions) have their read models in services.db.queries.
Every function takes the session keyword-only and never commits (the route owns a
read-only transaction). Each returns small frozen dataclasses shaped for a page, so
templates never touch the ORM or trigger lazy loads.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal

from sqlalchemy import and_, func, select, text
from sqlalchemy.orm import Session, aliased

from services.db.models import Checkpoint, Cycle, Evaluation, Run, Task, TaskSource, Trace
from services.db.queries.promotions import loop_promotions
from services.evaluation.stats import wilson_interval
from services.loop.states import PromotionStatus

# Bucket widths of the live success chart, smallest first: the first that keeps the chart
# under ``max_buckets`` points is used.
_BUCKET_WIDTHS = tuple(
    dt.timedelta(minutes=m)
    for m in (1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440, 2880, 10080)
)
_BUCKET_ORIGIN = dt.datetime(2000, 1, 3, tzinfo=dt.UTC)  # a Monday, so weeks line up

# Characters of a task prompt shown as an example of its cluster (by the page's script, in a
# tab holding the admin token: the page itself carries no prompt).
PROMPT_PREVIEW_CHARS = 600


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
    *,
    session: Session,
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


def loop_events(*, session: Session, loop_id: int, since: dt.datetime) -> list[LoopEvent]:
    """Promotions (when deployed), rollbacks and drift-triggered cycles since ``since``."""
    events: list[LoopEvent] = []
    for promotion in loop_promotions(session=session, loop_id=loop_id):
        number = promotion.cycle_number
        cycle = f"cycle {number}" if number is not None else "operator"
        if promotion.promoted:
            at = promotion.deployed_at or promotion.decided_at
            events.append(LoopEvent(at, "promote", f"{cycle}: promoted"))
        if promotion.rolled_back:
            at = promotion.rolled_back_at or promotion.decided_at
            what = (
                "rollback failed" if promotion.status == PromotionStatus.FAILED else "rolled back"
            )
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
    """A task of a cluster: where it sits and what it calls. Its (redacted) prompt is the
    loop's data, which the admin API guards: the page's script shows it to a tab holding
    the admin token (``/v1/tasks/{id}``), the page itself never carries it."""

    task_id: int
    split: str
    origin: str
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
    tools = [
        str(tool.get("name"))
        for tool in spec.get("tools") or []
        if isinstance(tool, dict) and tool.get("name")
    ]
    return ClusterExample(
        task_id=task.id,
        split=task.split,
        origin=task.origin,
        tools=tools,
        source_traces=source_traces,
        created_at=task.created_at,
    )


def failure_clusters(
    *, session: Session, loop_id: int, limit: int = 12, examples: int = 3
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


def recent_runs(*, session: Session, loop_id: int, limit: int = 25) -> list[RunRow]:
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


def run_detail(*, session: Session, loop_id: int, run_id: str) -> RunDetail | None:
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


# Judge agreement ------------------------------------------------------------------------------


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass(frozen=True)
class JudgeAgreementRow:
    """How often a judge agreed with the rule in one eval job (its ``judge_agreement``
    metrics, services.environments.replay.scoring): the episodes both scored, split by
    verdict."""

    run_id: str
    cycle_number: int | None
    checkpoint_id: str | None
    judge: str
    both_pass: int
    both_fail: int
    rule_only: int
    judge_only: int
    unparseable: int
    errors: int

    @property
    def episodes(self) -> int:
        return self.both_pass + self.both_fail + self.rule_only + self.judge_only

    @property
    def agreed(self) -> int:
        return self.both_pass + self.both_fail

    @property
    def share(self) -> float | None:
        return self.agreed / self.episodes if self.episodes else None

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.agreed, self.episodes)


def judge_agreement(*, session: Session, loop_id: int, limit: int = 20) -> list[JudgeAgreementRow]:
    """The loop's latest eval jobs that compared a judge with the rule, newest first, one
    row per judge (reads only the ``judge_agreement`` element of each job's metrics)."""
    agreement = Run.metrics["judge_agreement"]
    statement = (
        select(Run.id, Cycle.number, Run.base_checkpoint_id, agreement)
        .outerjoin(Cycle, Cycle.id == Run.cycle_id)
        .where(Run.loop_id == loop_id, Run.kind == "eval", agreement.isnot(None))
        .order_by(Run.submitted_at.desc(), Run.id)
        .limit(limit)
    )
    rows: list[JudgeAgreementRow] = []
    for run_id, number, checkpoint_id, found in session.execute(statement):
        for judge, counts in sorted(found.items()) if isinstance(found, dict) else ():
            counts = counts if isinstance(counts, dict) else {}
            rows.append(
                JudgeAgreementRow(
                    run_id=run_id,
                    cycle_number=number,
                    checkpoint_id=checkpoint_id,
                    judge=str(judge),
                    **{
                        key: _count(counts.get(key))
                        for key in (
                            "both_pass",
                            "both_fail",
                            "rule_only",
                            "judge_only",
                            "unparseable",
                            "errors",
                        )
                    },
                )
            )
    return rows
