"""Watching the demo's loop: drift the tool API on time, sample live success, stop when done.

Every five seconds: drift the API once ``drift_at`` has passed, sample the live success
rate of the last 20 s from the traces in Postgres (the canary's query), print one line,
and stop once ``cycles`` cycles have ended (plus 30 s on the new model after a promotion,
so its live rate shows) or the timeout passes.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field

from services.db.models import Loop
from services.db.queries.live import live_counts
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.demo.options import LOOP_NAME, DemoOptions, Printer
from services.demo.report import LiveSample, demo_cycles, percent
from services.demo.traffic import TrafficSimulator
from services.loop.states import CycleOutcome, CycleStage

TICK_S = 5.0
LIVE_WINDOW_S = 20.0
# How long to keep watching the promoted model before the report.
AFTER_PROMOTION_S = 30.0


@dataclass
class Watched:
    """What the watcher saw: the live samples and when the drift happened."""

    live: list[LiveSample] = field(default_factory=list)
    drift_at: float | None = None  # seconds of traffic
    drift_wall: dt.datetime | None = None


def watch(
    options: DemoOptions,
    sessions: SessionFactory,
    traffic: TrafficSimulator,
    api_version: list[str],
    out: Printer,
) -> Watched:
    """Run until the demo is done; ``api_version[0]`` is what the traffic's agent calls."""
    watched = Watched()
    deadline = time.monotonic() + options.timeout_s
    held_at: float | None = None
    while time.monotonic() < deadline:
        time.sleep(TICK_S)
        now = traffic.elapsed()
        if watched.drift_at is None and now >= options.drift_at:
            api_version[0] = options.drift_to
            watched.drift_at = now
            watched.drift_wall = dt.datetime.now(dt.UTC)
            out(f"[demo] t={now:.0f}s the tool API drifted: {options.drift_to} is live")
        rate, n = recent_live_success(sessions, seconds=LIVE_WINDOW_S)
        watched.live.append((round(now, 1), rate, n, api_version[0]))
        with sessions() as session:
            cycles = demo_cycles(
                session=session, loop_id=require_loop(session=session, name=LOOP_NAME).id
            )
        done = [cycle for cycle in cycles if not cycle.is_open]
        stage = cycles[-1].stage if cycles and cycles[-1].is_open else CycleStage.WAITING
        out(
            f"[demo] t={now:4.0f}s api={api_version[0]} live success (20s) "
            f"{percent(rate)} on {n:3d}  stage={stage:<18} cycles done={len(done)}"
        )
        if len(done) >= options.cycles:
            if not any(cycle.outcome == CycleOutcome.PROMOTED for cycle in done):
                break
            if held_at is None:
                held_at = now
            if now - held_at >= AFTER_PROMOTION_S:
                break
    return watched


def recent_live_success(sessions: SessionFactory, *, seconds: float) -> tuple[float | None, int]:
    """Success rate of the loop's traces received in the last ``seconds``, from Postgres."""
    with sessions() as session:
        loop: Loop = require_loop(session=session, name=LOOP_NAME)
        counts = live_counts(
            session=session,
            loop=loop,
            model_version=None,
            since=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds),
            until=None,
            limit=100_000,
        )
    return (counts.successes / counts.n if counts.n else None), counts.n
