"""The drift signal: the served model's rolling failure rate, from ingested trace outcomes.

The served model version is the one on the loop's most recent trace. Its failure rate is
taken over its last ``drift_window`` traces that report an outcome, with the same failure
test as curation's selection; the loop has **drifted** when that rate reaches
``drift_failure_rate`` and at least ``drift_min_traces`` traces (curation policy) were seen,
so three unlucky traces of a fresh version do not start a cycle. The drift keys are read
through the loop's :class:`~services.loop.policies.TriggerPolicy`, the class that
validated them. The loop consumes the
result as a trigger; the rate is exported as ``ratchet_loop_live_failure_rate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from services.curation.policy import CurationPolicy
from services.db.models import Loop
from services.db.queries import traces as q
from services.loop.policies import TriggerPolicy, describe_errors


class DriftPolicyError(ValueError):
    """``loops.trigger_policy`` (where the drift keys live) is not a valid trigger policy."""


def drift_policy(raw: Mapping[str, Any] | None) -> TriggerPolicy:
    """The loop's trigger policy, whose ``drift_*`` keys this module reads."""
    try:
        return TriggerPolicy.model_validate(raw or {})
    except ValidationError as exc:
        raise DriftPolicyError(describe_errors("trigger_policy", exc)) from None


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
    drift = drift_policy(loop.trigger_policy)
    curation = CurationPolicy.from_json(loop.curation_policy)
    version = q.latest_model_version(session=session, loop_id=loop.id)
    if version is None:
        return DriftReading(None, 0, 0, 0.0, drift.drift_failure_rate, drift.drift_window, False)
    traces, failures = q.failure_window(
        session=session,
        loop_id=loop.id,
        model_version=version,
        window=drift.drift_window,
        failure_score_threshold=curation.failure_score_threshold,
    )
    rate = failures / traces if traces else 0.0
    drifted = (
        drift.drift_enabled
        and traces >= min(curation.drift_min_traces, drift.drift_window)
        and rate >= drift.drift_failure_rate
    )
    return DriftReading(
        version, traces, failures, rate, drift.drift_failure_rate, drift.drift_window, drifted
    )
