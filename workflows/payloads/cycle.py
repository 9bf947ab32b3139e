"""Payloads of a cycle's bookkeeping activities: starting it, marking its stage, closing it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.loop.states import CycleOutcome, CycleStage
from workflows.payloads.promote import LiveStats


@dataclass
class StartCycleInput:
    loop: str
    # The cycle (``cycle`` in workflow code; the field keeps the name histories store).
    number: int
    trigger: str
    trigger_detail: dict[str, Any]
    workflow_id: str


@dataclass
class StartCycleResult:
    cycle_id: int
    champion_checkpoint_id: str | None
    champion_uri: str | None


@dataclass
class StageInput:
    loop: str
    cycle: int
    stage: CycleStage
    dataset_id: int | None = None
    candidate_checkpoint_id: str | None = None


@dataclass
class CloseCycleInput:
    loop: str
    cycle: int
    outcome: CycleOutcome
    detail: str
    points_gained: float | None = None
    candidate_checkpoint_id: str | None = None
    # ``points_gained`` is held-out points (the headline). The gate's points on the eval
    # set (new failures) and the canary's two live samples, from which the activity records
    # the live delta; every interval is computed there.
    gate_points: float | None = None
    live_baseline: LiveStats | None = None
    live_canary: LiveStats | None = None


@dataclass
class CloseCycleResult:
    cost_usd: float
    compute_seconds: float
    cumulative_cost_usd: float
    cumulative_points: float
    points_per_dollar: float | None
    budget_exhausted: bool
