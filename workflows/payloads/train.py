"""Payloads of TrainWorkflow."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.loop.policies import (
    TrainingProfile,
)
from services.loop.states import RunStatus
from workflows.payload import policy_payload


@policy_payload()
@dataclass
class TrainInput:
    loop: str
    cycle: int
    dataset_id: int
    train_uri: str
    base_checkpoint_id: str | None
    base_checkpoint_uri: str | None
    environment: str
    profile: TrainingProfile


@dataclass
class TrainResult:
    run_id: str
    status: RunStatus
    checkpoint_id: str | None = None
    checkpoint_uri: str | None = None
    compute_seconds: float = 0.0
    cost_usd: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
