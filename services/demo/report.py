"""The demo's report: a row per cycle, the live success rate over time, the three numbers.

Every figure is read back from Postgres after the run, through the read models the
dashboard and the api use too (services.db.queries): the cycles through
:func:`loop_cycles` (one query for all cycles, with both evaluations, the held-out set and
the gate's decision), the jobs' run times through :func:`cycle_run_spans`, points per
dollar through :func:`intelligence_per_dollar`, the promotions through
:func:`loop_promotions` and live success through the canary's :func:`live_counts`.
Nothing the demo saw while it ran is trusted over what was stored.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from services.db.models import Loop
from services.db.queries import cycle_history
from services.db.queries.cycle_history import EvalSummary, RunSpan, cycle_run_spans, loop_cycles
from services.db.queries.live import live_counts
from services.db.queries.points import IntelligencePerDollar, intelligence_per_dollar
from services.db.queries.promotions import PromotionRow, loop_promotions
from services.db.queries.serving_ledger import serving_totals
from services.evaluation.figures import (
    Gain,
    Rate,
    gain_from_detail,
    imprecise_note,
    live_gain,
    rate,
)
from services.loop.ledger import usd_per_mtok
from services.modelserver.attestation import TraceAttestation

# Far more cycles than a demo runs: the report and the watcher read them all.
ALL_CYCLES = 10_000
# (seconds since the traffic started, success rate, traces, tool API version)
LiveSample = tuple[float, float | None, int, str]


@dataclass
class CycleRow:
    number: int
    trigger: str
    train_tasks: int
    eval_tasks: int
    train_s: float
    champion_pass: tuple[float, float, float] | None
    candidate_pass: tuple[float, float, float] | None
    decision: str
    outcome: str
    reason: str
    cost_usd: float
    points: float  # held-out points gained (0 unless the candidate serves now)
    points_per_dollar: float | None
    wall_s: float
    job_s: float
    waiting_s: float  # the canary window: reported, not counted as overhead
    gate_points: float | None = None
    live_points: float | None = None
    heldout_champion_pass: tuple[float, float, float] | None = None
    heldout_candidate_pass: tuple[float, float, float] | None = None
    # The estimate made before training (None: refused or failed before it, or none made)
    # and the actual cost by phase ($), services.loop.estimate.
    estimate_usd: float | None = None
    cost_by_phase: dict[str, float] = field(default_factory=dict)
    # The estimate's range ($) and what its rates rested on (measured, calibrated, defaults).
    estimate_range: tuple[float, float] | None = None
    estimate_basis: str = ""
    # The three numbers as measured, each with its interval and counts
    # (services.evaluation.figures); ``points`` above is the held-out figure only while the
    # candidate serves.
    heldout: Gain | None = None
    gate: Gain | None = None
    live_delta: Gain | None = None
    # The train job's sentence when its successes were rare (services.training.rft).
    rare_successes: str | None = None


@dataclass
class DemoReport:
    cycles: list[CycleRow]
    live: list[LiveSample]
    promotions: int
    live_success_before: float | None
    live_success_after: float | None
    demo_wall_s: float
    orchestration_overhead_frac: float | None
    drift_at_s: float | None
    traces_posted: int
    state_dir: str
    heldout_points_gained: float = 0.0
    gate_points: float | None = None
    live_points_gained: float | None = None
    usd_per_heldout_point: float | None = None
    canary_window_s: float = 0.0
    champion_note: str = ""
    tokens_served: int = 0  # the serving ledger's, every champion together
    serving_usd_per_mtok: float | None = None
    # Over the ended cycles: their estimates and actual costs (the cycles that were
    # estimated), the actual cost by phase, and the mean cycle wall time.
    estimate_usd: float | None = None
    actual_usd: float = 0.0
    cost_by_phase: dict[str, float] = field(default_factory=dict)
    cycle_wall_s: float | None = None
    # Live success on the drifted API before and after, with counts and Wilson intervals
    # (``Rate.to_json``); the held-out gain of the one cycle that bought the points (None
    # when no cycle or several did: each cycle's row has its own); what a reader must know
    # about the figures' precision.
    live_before: Rate | None = None
    live_after: Rate | None = None
    heldout_gain: Gain | None = None
    live_change: Gain | None = None  # after minus before, Newcombe's interval
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def demo_cycles(*, session: Session, loop_id: int) -> list[cycle_history.CycleRow]:
    """The loop's cycles, oldest first, as the dashboard's cycles table reads them."""
    return list(reversed(loop_cycles(session=session, loop_id=loop_id, limit=ALL_CYCLES)))


def build_report(
    session: Session,
    *,
    loop: Loop,
    live: list[LiveSample],
    drift_at: float | None,
    drift_wall: dt.datetime | None,
    traces_posted: int,
    state_dir: str,
    attested: TraceAttestation | None = None,
) -> DemoReport:
    """The report of the loop's ended cycles, from what Postgres holds; live success counts
    only the traces ``attested`` vouches for, as the canary does (an episode the model
    server answered with two versions, across a deploy, counts for neither)."""
    spans = cycle_run_spans(session=session, loop_id=loop.id)
    bought = intelligence_per_dollar(session=session, loop_id=loop.id)
    rows = [
        cycle_row(cycle, spans.get(cycle.number, []), bought)
        for cycle in demo_cycles(session=session, loop_id=loop.id)
        if not cycle.is_open
    ]
    # DESIGN's definition: cycle wall time minus job time (the canary window is part of the
    # overhead, and reported on its own as ``canary_window_s``).
    overheads = [max(0.0, row.wall_s - row.job_s) / row.wall_s for row in rows if row.wall_s > 0]
    promotions = loop_promotions(session=session, loop_id=loop.id, held_by_cycles=True)
    measured = live_before_after(session, loop, promotions, drift_wall, attested=attested)
    gate = [row.gate_points for row in rows if row.gate_points is not None]
    live_points = [row.live_points for row in rows if row.live_points is not None]
    estimated = [row.estimate_usd for row in rows if row.estimate_usd is not None]
    phases: dict[str, float] = {}
    for row in rows:
        for phase, dollars in row.cost_by_phase.items():
            phases[phase] = round(phases.get(phase, 0.0) + dollars, 6)
    heldout_gain = headline_gain(rows)
    return DemoReport(
        cycles=rows,
        live=live,
        promotions=len(promotions),
        live_success_before=measured.before,
        live_success_after=measured.after,
        live_before=measured.before_figure,
        live_after=measured.after_figure,
        live_change=measured.delta,
        heldout_gain=heldout_gain,
        notes=precision_notes(rows, heldout_gain),
        demo_wall_s=0.0,
        orchestration_overhead_frac=max(overheads) if overheads else None,
        drift_at_s=drift_at,
        traces_posted=traces_posted,
        state_dir=state_dir,
        heldout_points_gained=bought.points,
        gate_points=sum(gate) if gate else None,
        live_points_gained=sum(live_points) if live_points else None,
        usd_per_heldout_point=bought.usd_per_point,
        canary_window_s=sum(row.waiting_s for row in rows),
        **_serving_figures(session, loop),
        estimate_usd=round(sum(estimated), 6) if estimated else None,
        actual_usd=round(bought.cost_usd, 6),
        cost_by_phase=phases,
        cycle_wall_s=round(sum(row.wall_s for row in rows) / len(rows), 1) if rows else None,
    )


def headline_gain(rows: list[CycleRow]) -> Gain | None:
    """The held-out gain behind the report's points: the measured figure of the one cycle
    whose candidate kept serving; None when none or several did (the points are then a sum,
    and each cycle's row carries its own interval)."""
    kept = [row.heldout for row in rows if row.points and row.heldout is not None]
    return kept[0] if len(kept) == 1 else None


def precision_notes(rows: list[CycleRow], headline: Gain | None) -> list[str]:
    """What the report says about its figures' precision: a held-out interval wider than
    ±15 points (its set is too small to tell such a gain from noise), and a training whose
    successes were rare (what it learned rests on a handful of episodes)."""
    measured = [gain for gain in [headline, *(row.heldout for row in rows)] if gain is not None]
    widest = max(measured, key=lambda gain: gain.half_width_points, default=None)
    note = imprecise_note("held-out", widest)
    rare = [
        f"cycle {row.number}'s training: {row.rare_successes}" for row in rows if row.rare_successes
    ]
    return ([note] if note is not None else []) + rare


def _estimate_range(estimate: Mapping[str, Any] | None) -> tuple[float, float] | None:
    low, high = (estimate or {}).get("low_usd"), (estimate or {}).get("high_usd")
    if isinstance(low, int | float) and isinstance(high, int | float) and high > 0:
        return float(low), float(high)
    return None


def _gain(detail: Mapping[str, Any] | None, key: str) -> Gain | None:
    found = (detail or {}).get(key)
    return gain_from_detail(found if isinstance(found, Mapping) else None, live=key == "live")


def _serving_figures(session: Session, loop: Loop) -> dict[str, Any]:
    """Tokens served over the loop's life and their blended $/Mtok (services.loop.ledger)."""
    served = serving_totals(session=session, loop=loop)
    return {
        "tokens_served": served.tokens,
        "serving_usd_per_mtok": usd_per_mtok(served.cost_usd, served.tokens),
    }


def _estimate(summary: EvalSummary | None) -> tuple[float, float, float] | None:
    return summary.stored_estimate if summary is not None else None


def cycle_row(
    cycle: cycle_history.CycleRow, spans: list[RunSpan], bought: IntelligencePerDollar
) -> CycleRow:
    """One ended cycle as the report prints it; its cost, points and points per dollar as
    ``bought`` (the loop's intelligence per dollar) counts them."""
    train = next((span for span in spans if span.kind == "train"), None)
    accounted = bought.of_cycle(cycle.number)
    cost = accounted.cost_usd if accounted is not None else float(cycle.cost_usd)
    points = accounted.points if accounted is not None else float(cycle.points_gained or 0)
    detail = cycle.outcome_detail
    return CycleRow(
        number=cycle.number,
        trigger=cycle.trigger,
        train_tasks=cycle.train_count or 0,
        eval_tasks=cycle.eval_count or 0,
        train_s=train.seconds if train is not None else 0.0,
        champion_pass=_estimate(cycle.champion),
        candidate_pass=_estimate(cycle.candidate),
        decision=cycle.decision or "-",
        outcome=cycle.outcome or "-",
        reason=detail.splitlines()[0][:300] if detail else "",
        cost_usd=cost,
        points=points,
        points_per_dollar=accounted.points_per_dollar if accounted is not None else None,
        wall_s=cycle.duration_seconds or 0.0,
        job_s=job_seconds(spans),
        waiting_s=cycle.canary_seconds,
        gate_points=cycle.gate_points,
        live_points=cycle.live_points,
        heldout_champion_pass=_estimate(cycle.heldout_champion),
        heldout_candidate_pass=_estimate(cycle.heldout_candidate),
        estimate_usd=float(cycle.estimate_usd) if cycle.estimate_usd is not None else None,
        cost_by_phase={p.phase: p.cost_usd for p in cycle.phase_costs if p.cost_usd is not None},
        estimate_range=_estimate_range(cycle.estimate),
        estimate_basis=str((cycle.estimate or {}).get("basis") or ""),
        heldout=_gain(cycle.points_detail, "heldout"),
        gate=_gain(cycle.points_detail, "gate"),
        live_delta=_gain(cycle.points_detail, "live"),
        rare_successes=train.rare_successes if train is not None else None,
    )


def job_seconds(spans: list[RunSpan]) -> float:
    """Wall time covered by at least one job (parallel eval jobs count once)."""
    intervals = sorted(
        (span.started_at.timestamp(), span.ended_at.timestamp())
        for span in spans
        if span.started_at is not None and span.ended_at is not None
    )
    total, current_start, current_end = 0.0, None, None
    for start, end in intervals:
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None and current_start is not None:
        total += current_end - current_start
    return total


@dataclass(frozen=True)
class LiveBeforeAfter:
    """Live success on the drifted API before and after the promotions, from Postgres:
    (successes, traces) on each side."""

    before_counts: tuple[int, int]
    after_counts: tuple[int, int]

    @property
    def before(self) -> float | None:
        ok, n = self.before_counts
        return ok / n if n else None

    @property
    def after(self) -> float | None:
        ok, n = self.after_counts
        return ok / n if n else None

    @property
    def before_figure(self) -> Rate | None:
        ok, n = self.before_counts
        return rate(ok, n) if n else None

    @property
    def after_figure(self) -> Rate | None:
        ok, n = self.after_counts
        return rate(ok, n) if n else None

    @property
    def delta(self) -> Gain | None:
        return live_gain(self.before_counts, self.after_counts)


def live_before_after(
    session: Session,
    loop: Loop,
    promotions: list[PromotionRow],
    drift_wall: dt.datetime | None,
    *,
    attested: TraceAttestation | None = None,
) -> LiveBeforeAfter:
    """The canary's query (:func:`live_counts`, with its ``attested`` when the server signs
    its answers) over the traces in Postgres.

    Before: traces of a version that was later replaced, from the drift until its
    replacement was deployed. After: traces of every promoted version since it was deployed.
    """
    counts = partial(  # every trace
        live_counts, session=session, loop=loop, limit=1_000_000, attested=attested
    )
    before_n = before_ok = after_n = after_ok = 0
    for promotion in promotions:
        if promotion.deployed_at is None:
            continue
        old = counts(
            model_version=promotion.previous_checkpoint_id,
            since=drift_wall,
            until=promotion.deployed_at,
        )
        new = counts(
            model_version=promotion.candidate_checkpoint_id, since=promotion.deployed_at, until=None
        )
        if drift_wall is not None:
            before_n, before_ok = before_n + old.n, before_ok + old.successes
        after_n, after_ok = after_n + new.n, after_ok + new.successes
    return LiveBeforeAfter((before_ok, before_n), (after_ok, after_n))


def percent(rate: float | None) -> str:
    return "  n/a" if rate is None else f"{rate * 100:4.0f}%"


def format_report(report: DemoReport) -> str:
    lines = ["", "Cycles", ""]
    header = (
        f"{'#':>2}  {'trigger':<13} {'tasks':>9}  {'train':>6}  {'champion':>17}  "
        f"{'candidate':>17}  {'decision':<8} {'outcome':<11} {'cost':>8}  {'est.':>8}  "
        f"{'held-out':>8}  "
        f"{'gate':>6}  {'live':>6}  {'pts/$':>8}"
    )
    lines += [header, "-" * len(header)]
    for row in report.cycles:
        lines.append(
            f"{row.number:>2}  {row.trigger:<13} {row.train_tasks:>4}/{row.eval_tasks:<4}  "
            f"{row.train_s:>5.0f}s  {_interval(row.champion_pass):>17}  "
            f"{_interval(row.candidate_pass):>17}  {row.decision:<8} {row.outcome:<11} "
            f"${row.cost_usd:>7.4f}  {_usd(row.estimate_usd):>8}  "
            f"{row.points:>+8.1f}  {_signed(row.gate_points):>6}  "
            f"{_signed(row.live_points):>6}  "
            f"{(f'{row.points_per_dollar:,.0f}' if row.points_per_dollar else '-'):>8}"
        )
        if row.heldout_champion_pass or row.heldout_candidate_pass:
            lines.append(
                f"    held-out pass@1: champion {_interval(row.heldout_champion_pass)}, "
                f"candidate {_interval(row.heldout_candidate_pass)}"
            )
        measured = _measured(row)
        if measured:
            lines.append(f"    measured: {measured}")
        if row.estimate_range is not None:
            low, high = row.estimate_range
            lines.append(
                f"    estimate {_usd(row.estimate_usd)} (${low:.4f} to ${high:.4f}): "
                f"{row.estimate_basis or 'basis not recorded'}"
            )
        if row.cost_by_phase:
            lines.append(f"    cost by phase: {_phases(row.cost_by_phase)}")
        if row.reason:
            lines.append(f"    {row.reason}")
    lines += [
        "",
        "champion, eval and candidate columns: pass@1 on the eval set (new failures); held-out:",
        "points gained on the frozen held-out set (the $ per point); gate: the eval-set delta",
        "the gate decided on; live: the canary's delta on traces in Postgres; est.: the",
        "cost estimated before training, from the loop's per-phase rates (measured, or its",
        "calibration pass's; the range and basis under the row). Every",
        "interval is 95% (pass rates: Wilson; gains on the same tasks: paired bootstrap;",
        "live deltas: Newcombe), beside what it counted.",
    ]
    if report.champion_note:
        lines += [f"NOTE: {report.champion_note}"]
    lines += [f"NOTE: {note}" for note in report.notes]
    lines += ["", "Live success rate (20 s window, traces in Postgres)", ""]
    for at, share, n, version in report.live:
        bar = "#" * round((share or 0) * 40)
        counted = rate(round((share or 0) * n), n).text() if n else "n/a (0)"
        lines.append(f"  t={at:5.0f}s {version}  {counted:>20}  {bar}")
    lines += [
        "",
        f"promotions: {report.promotions}   traces posted: {report.traces_posted}   "
        f"wall: {report.demo_wall_s:.0f}s",
        f"live success after drift: {_rate(report.live_before)} -> {_rate(report.live_after)}"
        f"{'   ' + report.live_change.text() if report.live_change else ''}",
        f"held-out points gained: {_headline(report)}",
        f"$ per held-out point: {_usd(report.usd_per_heldout_point)}   canary windows: "
        f"{report.canary_window_s:.0f}s",
        f"tokens served: {report.tokens_served:,}   $/Mtok served: "
        f"{_usd(report.serving_usd_per_mtok)}",
        f"estimate: {_usd(report.estimate_usd)}   actual: {_usd(report.actual_usd)}   "
        f"mean cycle wall: {report.cycle_wall_s or 0:.0f}s   "
        f"by phase: {_phases(report.cost_by_phase) or '-'}",
    ]
    return "\n".join(lines)


def _measured(row: CycleRow) -> str:
    """The cycle's three numbers as measured, each with its interval and counts."""
    named = (("held-out", row.heldout), ("gate", row.gate), ("live", row.live_delta))
    return " · ".join(f"{name} {gain.text()}" for name, gain in named if gain is not None)


def _rate(figure: Rate | None) -> str:
    return "n/a" if figure is None else figure.text()


def _headline(report: DemoReport) -> str:
    """The held-out points with the interval of the cycle that bought them; a sum of
    several cycles says where the intervals are."""
    if report.heldout_gain is not None:
        return report.heldout_gain.text()
    gained = sum(1 for row in report.cycles if row.points)
    if gained > 1:
        return f"{report.heldout_points_gained:+.1f} (the sum of {gained} cycles: intervals above)"
    return f"{report.heldout_points_gained:+.1f}"


def _phases(dollars: dict[str, float]) -> str:
    return " · ".join(f"{phase} ${value:.4f}" for phase, value in dollars.items())


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def _usd(value: float | None) -> str:
    return "n/a" if value is None else f"${value:.4f}"


def _interval(value: tuple[float, float, float] | None) -> str:
    if value is None:
        return "-"
    rate, low, high = value
    return f"{rate * 100:.0f}% [{low * 100:.0f},{high * 100:.0f}]"
