"""A training profile's job limits are bounded when the loop is saved (the budget is only
checked after spending): timeout_s at most 7 days, nodes x accelerators at most
MAX_JOB_ACCELERATORS; each refusal names its field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.loop.policies import (
    MAX_JOB_ACCELERATORS,
    MAX_JOB_TIMEOUT_S,
    RECORDED,
    TrainingProfile,
)


def _refusal(data: dict[str, object]) -> tuple[tuple[str | int, ...], str]:
    with pytest.raises(ValidationError) as refused:
        TrainingProfile.model_validate(data)
    (error,) = refused.value.errors()
    return error["loc"], error["msg"]


def test_timeout_is_at_most_seven_days() -> None:
    assert MAX_JOB_TIMEOUT_S == 7 * 86_400
    assert TrainingProfile.model_validate({"timeout_s": MAX_JOB_TIMEOUT_S}).timeout_s == 604_800
    location, message = _refusal({"timeout_s": MAX_JOB_TIMEOUT_S + 1})
    assert location == ("timeout_s",)
    assert "7 days" in message and "604800" in message


def test_nodes_times_accelerators_is_bounded() -> None:
    fits = TrainingProfile.model_validate({"nodes": 64, "accelerators": 8})
    assert fits.nodes * fits.accelerators == 512 <= MAX_JOB_ACCELERATORS
    location, message = _refusal({"nodes": 512, "accelerators": 1024})
    assert location == ("accelerators",)
    assert "nodes x accelerators" in message and str(MAX_JOB_ACCELERATORS) in message
    location, _ = _refusal({"eval_accelerators": MAX_JOB_ACCELERATORS + 1})
    assert location == ("eval_accelerators",)


def test_a_recorded_profile_is_read_as_it_was() -> None:
    """A running workflow's history holds the profile it started with: a bound added later
    must not make it unreadable."""
    old = TrainingProfile.model_validate(
        {"timeout_s": 30 * 86_400, "nodes": 512, "accelerators": 1024}, context=RECORDED
    )
    assert old.timeout_s == 30 * 86_400


def test_both_refusals_are_reported_with_their_paths() -> None:
    """The admin API's 422 carries the same paths (see describe_errors and the routes)."""
    from services.loop.policies import describe_errors

    with pytest.raises(ValidationError) as refused:
        TrainingProfile.model_validate({"timeout_s": 10**9, "nodes": 100, "accelerators": 100})
    text = describe_errors("training_profile", refused.value)
    assert "training_profile.timeout_s: must be at most 604800 seconds" in text
    assert "training_profile.accelerators: nodes x accelerators is 100 x 100 = 10000" in text
