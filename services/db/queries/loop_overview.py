"""The loops overview: every loop with what it is doing, its champion, its live success
rate, its last cycle and its spend, in one query (plus the spend's). Never commits."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from services.dashboard.timeline import current_stage
from services.db.queries.live import LIVE_WINDOW_TRACES
from services.db.queries.spend import spend_by_loop
from services.evaluation.stats import wilson_interval
from services.loop.states import LoopLifecycle


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
    budget_usd: Decimal | None
    spend_usd: Decimal  # services.db.queries.spend

    @property
    def stage(self) -> str:
        """What the loop is doing: paused, archived, a cycle's stage, or idle."""
        if self.status != LoopLifecycle.ACTIVE:
            return self.status
        if self.open_stage is None:
            return "idle"
        return current_stage(self.open_stage, self.open_stage_timings)

    @property
    def live_rate(self) -> float | None:
        return self.live_passed / self.live_n if self.live_n else None

    @property
    def live_interval(self) -> tuple[float, float]:
        return wilson_interval(self.live_passed, self.live_n)


_OVERVIEW_SQL = text(
    """
SELECT l.id AS loop_id, l.name, l.status, l.status_reason, l.environment, l.executor, l.budget_usd,
       l.champion_checkpoint_id AS champion_id, ck.created_at AS champion_created_at,
       open_cycle.stage AS open_stage, open_cycle.stage_timings AS open_stage_timings,
       live.n AS live_n, live.passed AS live_passed,
       last.number AS last_cycle_number, last.stage AS last_cycle_stage,
       last.outcome AS last_cycle_outcome, last.started_at AS last_cycle_started_at,
       last.ended_at AS last_cycle_ended_at
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
ORDER BY l.status = 'archived', l.name
"""
)


def loops_overview(*, session: Session) -> list[LoopSummary]:
    """Every loop with its stage, champion, live success rate, last cycle and spend."""
    spend = spend_by_loop(session=session)
    rows = session.execute(_OVERVIEW_SQL, {"window": LIVE_WINDOW_TRACES}).mappings()
    return [
        LoopSummary(
            **{key: value for key, value in row.items() if key != "loop_id"},
            spend_usd=spend[row["loop_id"]].cost_usd if row["loop_id"] in spend else Decimal(0),
        )
        for row in rows
    ]
