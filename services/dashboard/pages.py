"""What each page shows: the queries it runs and the charts it draws, as a template context.

Routes stay thin: they find the loop, call one function here and render the result.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from markupsafe import Markup
from sqlalchemy.orm import Session

from services.artifacts import ArtifactStore
from services.dashboard import charts
from services.dashboard.lineage import serving_lineage
from services.dashboard.links import CHILD_WORKFLOW_STAGES, RUN_KIND_STAGE, TemporalLinks
from services.dashboard.logs_tail import read_logs_tail
from services.dashboard.queries import (
    PROMPT_PREVIEW_CHARS,
    LiveSeries,
    LoopEvent,
    failure_clusters,
    judge_agreement,
    live_success_series,
    loop_events,
    recent_runs,
    run_detail,
)
from services.dashboard.render import pct, usd, when
from services.dashboard.timeline import Step, StepState, cycle_steps
from services.db.models import Loop, Task
from services.db.queries.cycle_history import CycleRow, loop_cycles
from services.db.queries.cycles import run_record
from services.db.queries.demonstrations import task_demonstrations
from services.db.queries.live import live_counts
from services.db.queries.loop_overview import loops_overview
from services.db.queries.loops import config_versions
from services.db.queries.points import CyclePoints, intelligence_per_dollar
from services.db.queries.serving_ledger import ChampionFigures, loop_champion_figures
from services.db.queries.spend import loop_spend
from services.db.queries.traces import curation_counts
from services.environments.replay.scoring import AGREEMENT_MAX_EPISODES, AGREEMENT_SHARE
from services.gateway.queries import recent_sessions, session_counts
from services.loop.estimate import run_phase_costs
from services.loop.next_cycle import database_clock, read_next_cycle
from services.loop.states import LoopLifecycle


def _percent(value: float) -> str:
    return f"{value * 100:.0f}%"


PERCENT_AXIS = charts.Axis(ticks=(0, 0.25, 0.5, 0.75, 1.0), format=_percent, low=0, high=1)


@dataclass(frozen=True)
class Action:
    """A loop action button: the admin API path segment and what the button says."""

    path: str
    label: str
    confirm: str | None = None


def loop_actions(loop: Loop, *, has_open_cycle: bool) -> list[Action]:
    """The actions that make sense in the loop's state (the API has the last word)."""
    actions: list[Action] = []
    if loop.status == LoopLifecycle.ACTIVE:
        actions.append(Action("pause", "Pause"))
    elif loop.status == LoopLifecycle.PAUSED:
        actions.append(Action("resume", "Resume"))
    if loop.status != LoopLifecycle.ARCHIVED:
        actions.append(Action("run-now", "Run a cycle now"))
    if has_open_cycle:
        actions.append(Action("approve", "Approve candidate"))
        actions.append(Action("reject", "Reject candidate", "Reject this cycle's candidate?"))
    if loop.champion_checkpoint_id is not None:
        actions.append(
            Action("rollback", "Roll back", "Roll the serving model back to the previous one?")
        )
    return actions


# Charts ---------------------------------------------------------------------------------------


def _epoch(value: dt.datetime) -> float:
    return value.timestamp()


# Tick label formats, shortest first; a time-of-day format only when every tick is on one
# date, a month-day one only within one year.
_TIME_FORMATS = (
    ("%H:%M", "date"),
    ("%H:%M:%S", "date"),
    ("%m-%d", "year"),
    ("%m-%d %H:%M", "year"),
    ("%Y-%m-%d", None),
    ("%Y-%m-%d %H:%M", None),
    ("%Y-%m-%d %H:%M:%S", None),
)


def time_tick_labels(ticks: Sequence[dt.datetime]) -> list[str]:
    """The shortest labels that tell every tick apart: a two-day chart labelled only with
    times of day read "10:00, 22:00, 10:00, 22:00, 10:00"."""
    same_date = len({t.date() for t in ticks}) == 1
    same_year = len({t.year for t in ticks}) == 1
    labels: list[str] = []
    for fmt, needs in _TIME_FORMATS:
        if (needs == "date" and not same_date) or (needs == "year" and not same_year):
            continue
        labels = [t.strftime(fmt) for t in ticks]
        if len(set(labels)) == len(labels):
            return labels
    return labels


def _time_axis(start: dt.datetime, end: dt.datetime) -> charts.Axis:
    span = (end - start).total_seconds()
    ticks = [_epoch(start) + span * i / 4 for i in range(5)] if span > 0 else [_epoch(start)]
    labels = time_tick_labels([dt.datetime.fromtimestamp(t, tz=dt.UTC) for t in ticks])
    return charts.Axis(
        ticks=ticks,
        format=str,
        low=_epoch(start),
        high=_epoch(end),
        tick_labels=labels,
    )


def live_chart(series: LiveSeries, events: Sequence[LoopEvent]) -> Markup:
    """The live success rate per bucket, with promotion, rollback and drift markers."""
    half = series.width / 2
    points = []
    for bucket in series.buckets:
        low, high = bucket.interval
        points.append(
            charts.Point(
                x=_epoch(bucket.start + half),
                y=bucket.rate,
                label=(
                    f"{when(bucket.start)}: {bucket.passed}/{bucket.n} succeeded "
                    f"({pct(bucket.rate)}, 95% CI [{pct(low)}, {pct(high)}])"
                ),
            )
        )
    end = max(series.end, series.buckets[-1].start + series.width)
    markers = [charts.Marker(_epoch(e.at), e.kind, f"{when(e.at)}: {e.label}") for e in events]
    return charts.line_chart(
        [charts.Series("live success rate", "live", points)],
        x_axis=_time_axis(series.start, end),
        y_axis=PERCENT_AXIS,
        markers=markers,
        title="Live success rate over time",
    )


def _cycle_axis(numbers: Sequence[int]) -> charts.Axis:
    low, high = min(numbers), max(numbers)
    ticks: Sequence[float] = (
        list(range(low, high + 1)) if high - low <= 20 else charts.nice_ticks(low, high)
    )
    return charts.Axis(
        ticks=ticks, format=lambda value: f"c{value:.0f}", low=low - 0.6, high=high + 0.6
    )


def evaluation_chart(cycles: Sequence[CycleRow]) -> Markup | None:
    """Champion and candidate pass rate per cycle, each with its Wilson interval."""
    rows = [c for c in sorted(cycles, key=lambda c: c.number) if c.champion or c.candidate]
    if not rows:
        return None
    series = []
    for role, css, offset in (("champion", "champion", -0.12), ("candidate", "candidate", 0.12)):
        points = []
        for cycle in rows:
            summary = cycle.champion if role == "champion" else cycle.candidate
            if summary is None or summary.pass_rate is None:
                continue
            low, high = summary.interval
            points.append(
                charts.Point(
                    x=cycle.number + offset,
                    y=summary.pass_rate,
                    low=low,
                    high=high,
                    label=(
                        f"cycle {cycle.number} {role}: {summary.passed}/{summary.n} "
                        f"({pct(summary.pass_rate)}, 95% Wilson [{pct(low)}, {pct(high)}])"
                    ),
                )
            )
        series.append(charts.Series(role, css, points))
    return charts.line_chart(
        series,
        x_axis=_cycle_axis([c.number for c in rows]),
        y_axis=PERCENT_AXIS,
        title="Champion vs candidate pass rate per cycle",
    )


def cost_chart(cycles: Sequence[CycleRow]) -> Markup | None:
    """Dollars spent per cycle (so far, for the open one)."""
    rows = sorted(cycles, key=lambda c: c.number)
    if not rows:
        return None
    top = max(float(c.cost_usd) for c in rows)
    ticks = charts.nice_ticks(0, top if top > 0 else 1)
    bars = [
        charts.Bar(
            label=f"c{c.number}",
            value=float(c.cost_usd),
            title=f"cycle {c.number}: {usd(c.cost_usd)}" + (" so far" if c.is_open else ""),
        )
        for c in rows
    ]
    axis = charts.Axis(ticks=ticks, format=lambda v: f"${v:,.2f}", low=0, high=ticks[-1])
    return charts.bar_chart(bars, y_axis=axis, title="Cost per cycle (USD)")


def points_per_dollar_chart(rows: Sequence[CyclePoints]) -> Markup | None:
    """Intelligence per dollar per accounted cycle and cumulative (services.db.queries.points)."""
    measured = [r for r in rows if r.cumulative_points_per_dollar is not None]
    if not measured:
        return None
    values = [r.cumulative_points_per_dollar for r in measured]
    values += [r.points_per_dollar for r in measured]
    found = [v for v in values if v is not None]
    ticks = charts.nice_ticks(min(0.0, *found), max(0.0, *found) or 1.0)
    per_cycle = [
        charts.Point(r.cycle, ratio, f"cycle {r.cycle}: {ratio:.2f} points/$")
        for r in measured
        if (ratio := r.points_per_dollar) is not None
    ]
    cumulative = [
        charts.Point(r.cycle, ratio, f"after cycle {r.cycle}: {ratio:.2f} points/$")
        for r in measured
        if (ratio := r.cumulative_points_per_dollar) is not None
    ]
    return charts.line_chart(
        [
            charts.Series("per cycle", "per-cycle", per_cycle, connect=False),
            charts.Series("cumulative", "cumulative", cumulative),
        ],
        x_axis=_cycle_axis([r.cycle for r in measured]),
        y_axis=charts.Axis(ticks=ticks, format=lambda v: f"{v:g}", low=ticks[0], high=ticks[-1]),
        title="Pass-rate points gained per dollar",
    )


def serving_cost_chart(champions: Sequence[ChampionFigures]) -> Markup | None:
    """$ per million tokens served by each champion, at the start of its tenure, over the
    loop's life (tenures that served no token yet are left out)."""
    priced = [c for c in champions if c.usd_per_mtok is not None]
    if not priced:
        return None
    values = [c.usd_per_mtok for c in priced if c.usd_per_mtok is not None]
    ticks = charts.nice_ticks(0.0, max(values) or 1.0)
    points = [
        charts.Point(
            _epoch(c.started_at),
            c.usd_per_mtok,
            f"{c.checkpoint_id[:12]}: {usd(c.usd_per_mtok)}/Mtok over {c.tokens_served:,} tokens",
        )
        for c in priced
        if c.usd_per_mtok is not None
    ]
    end = max(priced[-1].ended_at or priced[-1].started_at, priced[-1].started_at)
    return charts.line_chart(
        [charts.Series("$/Mtok served", "live", points)],
        x_axis=_time_axis(priced[0].started_at, end),
        y_axis=charts.Axis(
            ticks=ticks, format=lambda v: f"${v:,.2f}", low=ticks[0], high=ticks[-1]
        ),
        title="Serving cost per million tokens, per champion (USD)",
    )


# Pages ----------------------------------------------------------------------------------------


def overview_context(session: Session) -> dict[str, Any]:
    return {"loops": loops_overview(session=session)}


def cycle_links(links: TemporalLinks, loop: str, cycle: CycleRow) -> list[tuple[str, str]]:
    """(stage, URL) for each child workflow the cycle has reached."""
    if links.ui_url is None:
        return []
    reached = {
        s.stage
        for s in _steps(cycle)
        if s.state in (StepState.DONE, StepState.CURRENT, StepState.FAILED)
    }
    result = []
    for stage in CHILD_WORKFLOW_STAGES:
        url = links.cycle_stage(loop, cycle.number, stage)
        if stage in reached and url is not None:
            result.append((stage, url))
    return result


def _steps(cycle: CycleRow) -> list[Step]:
    return cycle_steps(
        stage=cycle.stage,
        stage_timings=cycle.stage_timings,
        is_open=cycle.is_open,
        outcome=cycle.outcome,
    )


def loop_context(
    session: Session, *, loop: Loop, links: TemporalLinks, cached_token_weight: float = 0.1
) -> dict[str, Any]:
    """Everything the loop page shows; ``cached_token_weight`` prices cached prompt tokens
    (``RATCHET_SERVING_CACHED_TOKEN_WEIGHT``)."""
    cycles = loop_cycles(session=session, loop_id=loop.id)
    current = cycles[0] if cycles else None
    live = live_success_series(session=session, loop_id=loop.id)
    events = loop_events(session=session, loop_id=loop.id, since=live.start) if live else []
    ppd = intelligence_per_dollar(session=session, loop_id=loop.id).cycles
    recent = live_counts(session=session, loop=loop)
    champions = loop_champion_figures(
        session=session, loop=loop, cached_token_weight=cached_token_weight
    )
    next_cycle = read_next_cycle(session=session, loop=loop)
    return {
        "ratchet_loop": loop,
        "next_cycle_waits_for": next_cycle.waits_for(),
        "pending_curation": next_cycle.curation_note(
            database_clock(session=session, loop=loop), now=dt.datetime.now(dt.UTC)
        ),
        "spend": loop_spend(session=session, loop_id=loop.id).cost_usd,
        "current": current,
        "steps": _steps(current) if current else [],
        "cycles": cycles,
        "cycle_links": {c.number: cycle_links(links, loop.name, c) for c in cycles},
        "evaluation_chart": evaluation_chart(cycles),
        "judge_agreement": judge_agreement(session=session, loop_id=loop.id),
        "agreement_share": AGREEMENT_SHARE,
        "agreement_max": AGREEMENT_MAX_EPISODES,
        "live": live,
        "live_passed": recent.successes,
        "live_n": recent.n,
        "live_rate": recent.rate,
        "live_interval": recent.interval if recent.n else None,
        "live_chart": live_chart(live, events) if live else None,
        "events": events,
        "clusters": failure_clusters(session=session, loop_id=loop.id),
        "preview_chars": PROMPT_PREVIEW_CHARS,
        "curation": curation_counts(session=session, loop_id=loop.id),
        "sessions": recent_sessions(session=session, loop_id=loop.id),
        "session_counts": session_counts(session=session, loop_id=loop.id),
        "lineage": serving_lineage(session=session, loop_id=loop.id),
        "cost_chart": cost_chart(cycles),
        "ppd": ppd,
        "ppd_chart": points_per_dollar_chart(ppd),
        "champions": champions,
        "serving_chart": serving_cost_chart(champions),
        "runs": recent_runs(session=session, loop_id=loop.id),
        "actions": loop_actions(loop, has_open_cycle=bool(current and current.is_open)),
        "loop_url": links.loop(loop.name),
        "loop_search_url": links.loop_search(loop.name),
        "config_versions": config_versions(session=session, loop_id=loop.id, limit=20),
    }


def run_context(
    session: Session,
    *,
    loop: Loop,
    run_id: str,
    links: TemporalLinks,
    log_roots: Sequence[Path],
) -> dict[str, Any] | None:
    """Everything the run page shows, or ``None`` when the loop has no such run."""
    detail = run_detail(session=session, loop_id=loop.id, run_id=run_id)
    if detail is None:
        return None
    run = detail.run
    stage = RUN_KIND_STAGE.get(run.kind)
    workflow_links: list[tuple[str, str]] = []
    if (url := links.loop(loop.name)) is not None:
        workflow_links.append((f"loop/{loop.name}", url))
    if detail.cycle_number is not None and stage is not None:
        stage_url = links.cycle_stage(loop.name, detail.cycle_number, stage)
        if stage_url is not None:
            workflow_links.append((f"cycle {detail.cycle_number} {stage}", stage_url))
    duration = (
        (run.ended_at - run.started_at).total_seconds()
        if run.started_at is not None and run.ended_at is not None
        else None
    )
    return {
        "ratchet_loop": loop,
        "run": run,
        "detail": detail,
        "duration": duration,
        "logs": read_logs_tail(
            run.logs_uri,
            allowed_roots=log_roots,
            within=ArtifactStore(Path()).run_dir(loop.name, run.id),
        ),
        "workflow_links": workflow_links,
        # Where the run's money went, once it ended (services.loop.estimate).
        "phase_costs": run_phase_costs(run_record(run)) if run.ended_at is not None else {},
        # How far another engine's rollouts were from the trainer (remote rollouts only).
        "sampler_mismatch": sampler_mismatch_rows(run.metrics),
    }


MISMATCH_ROWS_SHOWN = 100  # the last steps of a long run; the job's metrics keep them all


@dataclass(frozen=True)
class MismatchRow:
    """One batch another engine sampled for a run (metrics.json's ``sampler_mismatch``,
    services.training.mismatch): where, over how many tokens, the mean K3 estimate of
    KL(sampler ‖ trainer), the largest ratio, the share capped (GRPO's), what served it."""

    where: str
    tokens: int
    k3: float
    max_ratio: float
    truncated_fraction: float | None
    served: str


def sampler_mismatch_rows(metrics: Mapping[str, Any] | None) -> list[MismatchRow]:
    """The run's mismatch rows that read as the job writes them, the last
    :data:`MISMATCH_ROWS_SHOWN` (job output: a row of another shape is left out)."""
    raw = (metrics or {}).get("sampler_mismatch")
    rows = []
    for item in raw if isinstance(raw, list) else []:
        row = _mismatch_row(item)
        if row is not None:
            rows.append(row)
    return rows[-MISMATCH_ROWS_SHOWN:]


def _mismatch_row(item: object) -> MismatchRow | None:
    if not isinstance(item, dict):
        return None
    numbers = [item.get(key) for key in ("tokens", "k3", "max_ratio")]
    if not all(isinstance(n, int | float) and not isinstance(n, bool) for n in numbers):
        return None
    truncated = item.get("truncated_fraction")
    return MismatchRow(
        where=str(item.get("where", "")),
        tokens=int(item["tokens"]),
        k3=float(item["k3"]),
        max_ratio=float(item["max_ratio"]),
        truncated_fraction=float(truncated) if isinstance(truncated, int | float) else None,
        served=str(item.get("served", "")),
    )


def task_context(session: Session, *, loop: Loop, task_ref: str) -> dict[str, Any] | None:
    """Everything the task page shows: the task, and its stored successes and failures
    (services.curation.demonstrations), or ``None`` when the loop has no such task.

    Neither the prompt nor an episode's text is in it: the dashboard is open to whoever
    reaches it, and they are the loop's data, which the admin API guards (``/v1/tasks``).
    The page's script fills them in from that API in a tab holding the admin token."""
    if not task_ref.isdigit() or len(task_ref) > 18:
        return None
    task = session.get(Task, int(task_ref))
    if task is None or task.loop_id != loop.id:
        return None
    episodes = task_demonstrations(session=session, loop_id=loop.id, task_id=task.id)
    return {
        "ratchet_loop": loop,
        "task": task,
        "successes": [e for e in episodes if e.passed],
        "failures": [e for e in episodes if not e.passed],
    }
