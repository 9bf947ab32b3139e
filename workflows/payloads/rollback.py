"""Payloads of an operator rollback: plan, deploy, record."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.loop.policies import (
    ServingTarget,
)
from workflows.payload import policy_payload


@dataclass
class RollbackInput:
    loop: str
    reason: str


@dataclass
class RollbackResult:
    rolled_back: bool
    reason: str
    checkpoint_id: str | None = None


@policy_payload()
@dataclass
class RollbackPlan:
    """What an operator rollback undoes: the last held promotion and the champion before it
    (``promotion_id`` None: nothing to roll back, ``reason`` says why)."""

    promotion_id: int | None
    reason: str = ""
    checkpoint_id: str | None = None
    checkpoint_uri: str | None = None
    serving_target: ServingTarget = field(default_factory=ServingTarget)


@dataclass
class FinishRollbackInput:
    """How the rollback's deploy ended: ``error`` None when the previous champion serves."""

    loop: str
    reason: str
    promotion_id: int
    checkpoint_id: str
    error: str | None = None
