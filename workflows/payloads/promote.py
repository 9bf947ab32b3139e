"""Payloads of PromoteWorkflow and its activities: the deploy, the canary's live stats,
the promotion's status."""

from __future__ import annotations

from dataclasses import dataclass

from services.loop.policies import (
    ServingTarget,
)
from services.loop.states import PromotionStatus
from workflows.payload import policy_payload


@policy_payload()
@dataclass
class PromoteInput:
    loop: str
    cycle: int
    promotion_id: int
    candidate_checkpoint_id: str
    candidate_uri: str
    previous_checkpoint_id: str | None
    previous_uri: str | None
    serving_target: ServingTarget
    canary_seconds: float
    canary_check_interval_s: float
    canary_min_traces: int
    canary_max_drop_points: float


@dataclass
class PromoteResult:
    status: PromotionStatus  # HELD, ROLLED_BACK or FAILED
    reason: str
    live_before: float | None = None
    live_after: float | None = None
    # The canary's two samples as counted (the previous champion's traces up to the deploy,
    # the candidate's since): the live delta and its interval are computed from them.
    live_baseline: LiveStats | None = None
    live_canary: LiveStats | None = None


@policy_payload()
@dataclass
class DeployInput:
    loop: str
    serving_target: ServingTarget
    checkpoint_id: str
    checkpoint_uri: str
    # Set by PromoteWorkflow: the cycle whose candidate this is ("candidate"), or whose
    # champion is restored ("restore"). The activity refuses a checkpoint that would let the
    # serving model slip back (not the cycle's own candidate, or older than the champion).
    cycle: int | None = None
    purpose: str = "candidate"


@dataclass
class DeployResult:
    served_version: str
    deployed_at: str
    # Proof of delivery: "verified: ..." or why not ("not verified: no probe set").
    delivery: str = ""


@dataclass
class LiveStatsInput:
    loop: str
    model_version: str | None
    since: str | None = None
    until: str | None = None
    limit: int = 1000


@dataclass
class LiveStats:
    n: int
    successes: int
    success_rate: float | None
    ci_low: float | None = None
    ci_high: float | None = None
    # Traces of the window not counted: their response ids are not signed for their version.
    unattested: int = 0


@dataclass
class PromotionStatusInput:
    loop: str
    promotion_id: int
    status: PromotionStatus
    reason: str | None = None
    set_champion: str | None = None
    timestamp_field: str | None = None
