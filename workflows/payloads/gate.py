"""Payloads of the gate's activities."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.loop.states import Decision


@dataclass
class GateInput:
    loop: str
    cycle: int
    champion_checkpoint_id: str
    candidate_checkpoint_id: str
    confidence: float
    min_improvement_points: float
    regression_tolerance_points: float
    min_discordant_pairs: int = 0


@dataclass
class GateResult:
    decision: Decision  # PROMOTE or REJECT
    reason: str
    statistics: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecordDecisionInput:
    loop: str
    cycle: int
    decision: Decision
    reason: str
    statistics: dict[str, Any]
    candidate_checkpoint_id: str | None
    previous_checkpoint_id: str | None
    decided_by: str = "gate"


@dataclass
class RecordDecisionResult:
    promotion_id: int
    decision: Decision
