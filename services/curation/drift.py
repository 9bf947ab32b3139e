"""The drift signal: the served model's rolling failure rate, from ingested trace outcomes.

The served model version is the one on the loop's most recent trace. Its failure rate is
taken over its last ``drift_window`` traces that report an outcome, with the same failure
test as curation's selection; the loop has **drifted** when that rate reaches
``drift_failure_rate`` and at least ``drift_min_traces`` traces (curation policy) were seen,
so three unlucky traces of a fresh version do not start a cycle. The loop consumes the
result as a trigger; the rate is exported as ``ratchet_loop_live_failure_rate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from services.curation.policy import CurationPolicy
from services.db.models import Loop
from services.db.queries import traces as q

DEFAULT_FAILURE_RATE = 0.5
DEFAULT_WINDOW = 200


class DriftPolicyError(ValueError):
    """``loops.trigger_policy`` has a drift key curation cannot use."""


@dataclass(frozen=True)
class DriftPolicy:
    """The drift keys of ``loops.trigger_policy`` (the loop's other keys are not read here)."""

    enabled: bool = True
    failure_rate: float = DEFAULT_FAILURE_RATE
    window: int = DEFAULT_WINDOW

    @classmethod
    def from_trigger_policy(cls, raw: Mapping[str, Any] | None) -> DriftPolicy:
        raw = raw or {}
        enabled = raw.get("drift_enabled", True)
        rate = raw.get("drift_failure_rate", DEFAULT_FAILURE_RATE)
        window = raw.get("drift_window", DEFAULT_WINDOW)
        if not isinstance(enabled, bool):
            raise DriftPolicyError(
                f"trigger_policy.drift_enabled must be true or false, got {enabled!r}"
            )
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= 1:
            raise DriftPolicyError(
                f"trigger_policy.drift_failure_rate must be a number in (0, 1], got {rate!r}"
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise DriftPolicyError(
                f"trigger_policy.drift_window must be a positive integer, got {window!r}"
            )
        return cls(enabled=enabled, failure_rate=float(rate), window=window)


@dataclass(frozen=True)
class DriftReading:
    """The failure rate of the served version and whether it crossed the threshold."""

    model_version: str | None
    traces: int
    failures: int
    failure_rate: float
    threshold: float
    window: int
    drifted: bool


def read_drift(session: Session, *, loop: Loop) -> DriftReading:
    """Compute the drift signal of ``loop`` from its traces (see the module docstring)."""
    drift = DriftPolicy.from_trigger_policy(loop.trigger_policy)
    curation = CurationPolicy.from_json(loop.curation_policy)
    version = q.latest_model_version(session=session, loop_id=loop.id)
    if version is None:
        return DriftReading(None, 0, 0, 0.0, drift.failure_rate, drift.window, False)
    traces, failures = q.failure_window(
        session=session,
        loop_id=loop.id,
        model_version=version,
        window=drift.window,
        failure_score_threshold=curation.failure_score_threshold,
    )
    rate = failures / traces if traces else 0.0
    drifted = (
        drift.enabled
        and traces >= min(curation.drift_min_traces, drift.window)
        and rate >= drift.failure_rate
    )
    return DriftReading(version, traces, failures, rate, drift.failure_rate, drift.window, drifted)
