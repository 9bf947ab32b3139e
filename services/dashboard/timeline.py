"""The stage timeline of a cycle, from the row the loop keeps up to date.

A cycle walks curate → snapshot → train → evaluate → gate → promote → canary → account
(DESIGN §1). ``Cycle.stage`` names the stage it is in and ``Cycle.stage_timings`` records, per
stage, when it started and ended; this module turns both into steps a page can draw, and
keeps stages it does not know (a loop may add one) rather than hiding them.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.loop.states import CycleOutcome, CycleStage

STAGES: tuple[str, ...] = (
    "curate",
    "snapshot",
    "train",
    "evaluate",
    "gate",
    "promote",
    "canary",
    "account",
)

# Stages that run only after the gate promotes; a cycle can pass them by.
CONDITIONAL_STAGES = frozenset({"promote", "canary"})
# How far a closed cycle got, by its outcome, for stages it did not time.
OUTCOME_REACHED: dict[str, str] = {
    CycleOutcome.PROMOTED: "canary",
    CycleOutcome.ROLLED_BACK: "canary",
    CycleOutcome.REJECTED: CycleStage.GATE,
    CycleOutcome.NO_DATA: CycleStage.SNAPSHOT,
}

# Stage names a finished cycle may carry in ``Cycle.stage``: they are not steps of the walk.
TERMINAL_STAGES = frozenset({"done", "finished", "ended", "failed", "cancelled"})


class StepState(enum.StrEnum):
    """How a step of the timeline is drawn (the page's ``step-<state>`` class): a stage
    ``done``, the ``current`` one, one still ``pending``, one the cycle passed by
    (``skipped``), or the one a failed cycle ``failed`` in."""

    DONE = "done"
    CURRENT = "current"
    PENDING = "pending"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass(frozen=True)
class StageTiming:
    """When one stage ran, as far as the cycle row says."""

    started_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class Step:
    """One stage on the timeline."""

    stage: str
    state: StepState
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    seconds: float | None


def _parse_time(value: Any) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    if isinstance(value, str) and value:
        try:
            parsed = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)
    return None


def _parse_seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value >= 0 else None


def parse_stage_timings(raw: Mapping[str, Any] | None) -> dict[str, StageTiming]:
    """Read ``Cycle.stage_timings``.

    Each entry may be a number of seconds, or an object with ``started_at`` / ``ended_at``
    (ISO 8601) and optionally ``seconds`` (or ``duration_s``). Entries of any other shape are
    ignored: a dashboard must render whatever the row holds.
    """
    timings: dict[str, StageTiming] = {}
    for stage, value in (raw or {}).items():
        if isinstance(value, Mapping):
            started = _parse_time(value.get("started_at"))
            ended = _parse_time(value.get("ended_at"))
            seconds = _parse_seconds(value.get("seconds", value.get("duration_s")))
            if seconds is None and started is not None and ended is not None:
                seconds = max(0.0, (ended - started).total_seconds())
            timings[str(stage)] = StageTiming(started, ended, seconds)
        elif (seconds := _parse_seconds(value)) is not None:
            timings[str(stage)] = StageTiming(seconds=seconds)
    return timings


def _ordered_stages(current: str, timings: Mapping[str, StageTiming]) -> list[str]:
    """Known stages in their order, with unknown ones placed where they ran.

    An unknown stage goes right after the last stage that started before it; one with no
    start time (the stage the cycle has just entered, say) goes after the last timed stage.
    """
    order = list(STAGES)
    extra = [stage for stage in timings if stage not in STAGES]
    if current not in STAGES and current not in TERMINAL_STAGES and current not in extra:
        extra.append(current)
    far_future = dt.datetime.max.replace(tzinfo=dt.UTC)

    def started(stage: str) -> dt.datetime:
        timing = timings.get(stage)
        return timing.started_at if timing and timing.started_at else far_future

    for stage in sorted(extra, key=started):
        position = 0
        for index, known in enumerate(order):
            if known in timings and started(known) <= started(stage):
                position = index + 1
        order.insert(position, stage)
    return order


def _frontier(stage: str, timings: Mapping[str, StageTiming], order: list[str]) -> int | None:
    """Index of the stage the cycle is in (or was in when it ended).

    ``Cycle.stage`` may name the stage in progress or the one that just finished (a loop may
    record a stage when it ends): a stage with an end time is over, so the cycle is in the
    next one. A terminal stage name (``done``) puts the frontier after the last timed stage.
    """
    if stage in order:
        index = order.index(stage)
        ended = timings.get(stage, StageTiming()).ended_at is not None
        return min(index + 1, len(order) - 1) if ended else index
    timed = [i for i, name in enumerate(order) if name in timings]
    return min(max(timed) + 1, len(order) - 1) if timed else None


def current_stage(stage: str, stage_timings: Mapping[str, Any] | None) -> str:
    """The stage an open cycle is in now, whichever way the loop records ``Cycle.stage``."""
    timings = parse_stage_timings(stage_timings)
    order = _ordered_stages(stage, timings)
    frontier = _frontier(stage, timings, order)
    return order[frontier] if frontier is not None else stage


def _state(
    name: str,
    index: int,
    *,
    frontier: int | None,
    timings: Mapping[str, StageTiming],
    is_open: bool,
    outcome: str | None,
    order: list[str],
) -> StepState:
    if is_open:
        if index == frontier:
            return StepState.CURRENT
        if name in timings:
            return StepState.DONE
        passed = frontier is not None and index < frontier
        if passed and (name not in CONDITIONAL_STAGES or not timings):
            return StepState.DONE
        return StepState.SKIPPED if passed else StepState.PENDING
    if name in timings or name == CycleStage.ACCOUNT:
        return StepState.DONE  # a closed cycle has been accounted
    reached = OUTCOME_REACHED.get(outcome or "")
    if reached is not None and index <= order.index(reached):
        return StepState.DONE
    if outcome == CycleOutcome.FAILED and index == frontier:
        return StepState.FAILED
    if frontier is not None and index < frontier and name not in CONDITIONAL_STAGES:
        return StepState.DONE
    return StepState.SKIPPED


def cycle_steps(
    *,
    stage: str,
    stage_timings: Mapping[str, Any] | None,
    is_open: bool,
    outcome: str | None,
) -> list[Step]:
    """The steps of a cycle: done, current, pending, skipped (never ran) or failed.

    A stage with a timing entry ran. Untimed stages are inferred: an open cycle has passed
    every stage before the one it is in (the promotion stages only if it records no
    timings at all, since a rejected cycle skips them), and a closed cycle's outcome says
    how far it got (``rejected`` passed the gate, ``promoted`` the canary, ``no_data`` only
    the snapshot; ``failed`` failed where it stopped).
    """
    timings = parse_stage_timings(stage_timings)
    order = _ordered_stages(stage, timings)
    frontier = _frontier(stage, timings, order)
    steps: list[Step] = []
    for index, name in enumerate(order):
        timing = timings.get(name, StageTiming())
        state = _state(
            name,
            index,
            frontier=frontier,
            timings=timings,
            is_open=is_open,
            outcome=outcome,
            order=order,
        )
        steps.append(Step(name, state, timing.started_at, timing.ended_at, timing.seconds))
    return steps
