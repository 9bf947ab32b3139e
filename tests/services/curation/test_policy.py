"""The curation policy parses Loop.curation_policy with defaults and clear errors."""

from __future__ import annotations

from typing import Any

import pytest

from services.curation.policy import CurationPolicy, CurationPolicyError, CustomPattern


def test_empty_policy_gives_documented_defaults() -> None:
    policy = CurationPolicy.from_json({})
    assert policy == CurationPolicy()
    assert CurationPolicy.from_json(None) == policy
    assert policy.success_sample_rate == 0.05
    assert policy.near_duplicate_threshold == 0.9
    assert policy.cluster_threshold == 0.8
    assert policy.eval_fraction == 0.2
    assert policy.heldout_fraction == 0.1
    # The probe costs a job per cycle, so the difficulty filter is opt-in.
    assert policy.difficulty_filter is False
    assert policy.probe_attempts == 8


def test_round_trip_through_json() -> None:
    raw = {
        "success_sample_rate": 0.5,
        "redact_patterns": [{"name": "order_id", "pattern": r"ORD-\d{6}"}],
        "near_duplicate_threshold": 0.95,
        "cluster_threshold": 0.7,
        "heldout_max_tasks": 10,
        "failure_score_threshold": None,
    }
    policy = CurationPolicy.from_json(raw)
    assert policy.redact_patterns == (CustomPattern("order_id", r"ORD-\d{6}"),)
    assert policy.failure_score_threshold is None
    assert CurationPolicy.from_json(policy.to_json()) == policy


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"sucess_sample_rate": 0.1}, "unknown curation_policy key(s) 'sucess_sample_rate'"),
        ({"success_sample_rate": 1.5}, "success_sample_rate must be between 0.0 and 1.0"),
        ({"success_sample_rate": "high"}, "success_sample_rate must be a number"),
        ({"success_sample_rate": True}, "success_sample_rate must be a number"),
        ({"near_duplicate_threshold": 0.3}, "near_duplicate_threshold must be between 0.5"),
        ({"cluster_threshold": 0.95}, "cluster_threshold (0.95) must not exceed"),
        ({"eval_fraction": 0.6, "heldout_fraction": 0.4}, "must be below 1"),
        ({"heldout_max_tasks": -1}, "heldout_max_tasks must be between 0"),
        ({"heldout_max_tasks": 2.5}, "heldout_max_tasks must be an integer"),
        ({"difficulty_filter": "yes"}, "difficulty_filter must be true or false"),
        ({"max_trace_bytes": 10}, "max_trace_bytes must be between 1024"),
        ({"redact_patterns": "x"}, "redact_patterns must be a list"),
        ({"redact_patterns": [{"name": "x"}]}, "exactly 'name' and 'pattern'"),
        ({"redact_patterns": [{"name": "Bad Name", "pattern": "x"}]}, "name must match"),
        ({"redact_patterns": [{"name": "a", "pattern": "("}]}, "is not a valid regex"),
        ({"redact_patterns": [{"name": "a", "pattern": "x*"}]}, "must not match the empty"),
        (
            {"redact_patterns": [{"name": "a", "pattern": "x"}, {"name": "a", "pattern": "y"}]},
            "is used twice",
        ),
    ],
)
def test_bad_policies_name_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(CurationPolicyError) as info:
        CurationPolicy.from_json(raw)
    assert message in str(info.value)


def test_policy_must_be_an_object() -> None:
    with pytest.raises(CurationPolicyError, match="must be a JSON object"):
        CurationPolicy.from_json([1, 2])  # type: ignore[arg-type]


def test_replay_reward_keys_are_checked_by_name() -> None:
    policy = CurationPolicy.from_json(
        {
            "reference_match": {"rule": "number", "tolerance": 0.5},
            "judge_endpoint": "grader",
            "judge_rubric": "Refuse holds for overdue patrons.",
            "judge_cost_per_1k_tokens": 0.002,
            "tool_endpoint": "library",
        }
    )
    assert policy.replay_settings()["reference_match"] == {
        "rule": "number",
        "tolerance": 0.5,
        "relative": False,
    }
    assert CurationPolicy.from_json(policy.to_json()) == policy
    bad = {
        "reference_match": "fuzzy",
        "judge_endpoint": "https://judge.example.com/v1",
        "tool_endpoint": 3,
        "judge_cost_per_1k_tokens": -1,
    }
    for key, value in bad.items():
        with pytest.raises(CurationPolicyError, match=f"curation_policy.{key}"):
            CurationPolicy.from_json({key: value})
    with pytest.raises(CurationPolicyError, match="judge_rubric is required"):
        CurationPolicy.from_json({"judge_endpoint": "grader"})
