"""The drift signal: rolling failure rate of the served model version."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from sqlalchemy import update

from services.curation.drift import DriftPolicyError, drift_policy, read_drift
from services.db.models import Loop, Trace
from services.db.session import SessionFactory
from tests.services.curation.support import add_traces, make_loop, trace_body


def outcomes(prefix: str, version: str, failures: int, successes: int) -> list[dict[str, Any]]:
    bad = [trace_body(f"{prefix}-f{i}", "q", model_version=version) for i in range(failures)]
    good = [
        trace_body(f"{prefix}-s{i}", "q", model_version=version, success=True, error_kind=None)
        for i in range(successes)
    ]
    return bad + good


def reading(session_factory: SessionFactory, loop_id: int) -> Any:
    with session_factory() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        return read_drift(session, loop=loop)


def test_failure_rate_of_the_latest_version_over_its_window(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(
        session_factory,
        trigger_policy={"drift_failure_rate": 0.5, "drift_window": 20},
        curation_policy={"drift_min_traces": 10},
    )
    add_traces(session_factory, loop_id, outcomes("old", "v1", failures=2, successes=18))
    result = reading(session_factory, loop_id)
    assert (result.model_version, result.traces, result.failures) == ("v1", 20, 2)
    assert result.failure_rate == pytest.approx(0.1) and not result.drifted

    add_traces(session_factory, loop_id, outcomes("new", "v2", failures=4, successes=2))
    early = reading(session_factory, loop_id)
    assert (early.model_version, early.traces) == ("v2", 6)
    assert early.failure_rate > 0.5 and not early.drifted  # fewer than drift_min_traces

    add_traces(session_factory, loop_id, outcomes("more", "v2", failures=8, successes=2))
    late = reading(session_factory, loop_id)
    assert (late.traces, late.failures, late.threshold, late.window) == (16, 12, 0.5, 20)
    assert late.drifted


def test_window_keeps_only_the_most_recent_traces(session_factory: SessionFactory) -> None:
    loop_id = make_loop(
        session_factory,
        trigger_policy={"drift_window": 10, "drift_failure_rate": 0.3},
        curation_policy={"drift_min_traces": 5},
    )
    add_traces(session_factory, loop_id, outcomes("a", "v1", failures=10, successes=0))
    add_traces(session_factory, loop_id, outcomes("b", "v1", failures=0, successes=10))
    with session_factory.begin() as session:  # make arrival order explicit
        session.execute(
            update(Trace)
            .where(Trace.external_id.like("a-%"))
            .values(received_at=Trace.received_at - dt.timedelta(minutes=5))
        )
    result = reading(session_factory, loop_id)
    assert (result.traces, result.failures, result.drifted) == (10, 0, False)


def test_disabled_or_empty_loops_never_drift(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory, trigger_policy={"drift_enabled": False})
    assert reading(session_factory, loop_id).model_version is None
    add_traces(session_factory, loop_id, outcomes("x", "v1", failures=50, successes=0))
    result = reading(session_factory, loop_id)
    assert result.failure_rate == 1.0 and not result.drifted


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"drift_failure_rate": 0}, "trigger_policy.drift_failure_rate: Input should be greater"),
        ({"drift_failure_rate": "x"}, "trigger_policy.drift_failure_rate: Input should be a"),
        ({"drift_window": 0}, "trigger_policy.drift_window: Input should be greater than or"),
        ({"drift_enabled": "maybe"}, "trigger_policy.drift_enabled: Input should be a valid bool"),
        ({"drift_windoww": 20}, "trigger_policy.drift_windoww: Extra inputs are not permitted"),
    ],
)
def test_bad_drift_keys_are_clear_errors(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(DriftPolicyError) as info:
        drift_policy(raw)
    assert message in str(info.value)


def test_the_drift_keys_are_the_trigger_policys() -> None:
    from services.loop.policies import TriggerPolicy

    assert drift_policy({"min_new_tasks": 5}) == TriggerPolicy(min_new_tasks=5)
    assert drift_policy(None) == TriggerPolicy()
