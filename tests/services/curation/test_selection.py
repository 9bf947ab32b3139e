"""Selection: failures, a stable success sample, and screening of bodies no adapter should see."""

from __future__ import annotations

from typing import Any

import pytest

from services.curation.selection import (
    Outcome,
    classify,
    failure_signature,
    sampled,
    screen_trace,
)
from tests.services.curation.support import trace_body


@pytest.mark.parametrize(
    ("outcome", "verdict"),
    [
        (Outcome(False, None, None), "failure"),
        (Outcome(None, 0.2, None), "failure"),
        (Outcome(True, None, "tool_error"), "failure"),
        (Outcome(True, 0.1, None), "failure"),
        (Outcome(True, None, None), "success"),
        (Outcome(None, 0.9, None), "success"),
        (Outcome(None, None, None), "unknown"),
    ],
)
def test_classify(outcome: Outcome, verdict: str) -> None:
    assert classify(outcome, failure_score_threshold=0.5) == verdict


def test_low_scores_are_not_failures_without_a_threshold() -> None:
    assert classify(Outcome(None, 0.1, None), failure_score_threshold=None) == "success"


def test_success_sample_is_stable_and_near_its_rate() -> None:
    picks = [sampled(1, f"t{i}", 0.1) for i in range(5000)]
    assert picks == [sampled(1, f"t{i}", 0.1) for i in range(5000)]
    assert 0.08 < sum(picks) / len(picks) < 0.12
    assert not sampled(1, "x", 0.0) and sampled(1, "x", 1.0)


def _body(**changes: Any) -> dict[str, Any]:
    body = trace_body("t1", "where is my order?")
    body.update(changes)
    return body


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("not an object", "malformed_trace"),
        (_body(schema="other/v9"), "unsupported_schema"),
        (_body(messages=[]), "missing_messages"),
        (_body(messages="hello"), "missing_messages"),
        (_body(messages=[{"role": "wizard", "content": "x"}]), "malformed_trace"),
        (_body(messages=[{"role": "user", "content": 5}]), "malformed_trace"),
        (
            _body(messages=[{"role": "assistant", "tool_calls": {"name": "x"}}]),
            "unknown_tool_format",
        ),
        (
            _body(messages=[{"role": "assistant", "tool_calls": [{"fn": "x"}]}]),
            "unknown_tool_format",
        ),
        (_body(tools="search"), "unknown_tool_format"),
        (_body(tools=[{"description": "no name"}]), "unknown_tool_format"),
        (
            _body(messages=[{"role": "user", "content": "\x01\x02\x03binary\x04\x05"}]),
            "binary_payload",
        ),
    ],
)
def test_screen_refuses_bad_bodies(body: Any, reason: str) -> None:
    rejection = screen_trace(body, size_bytes=100, max_trace_bytes=10_000)
    assert rejection is not None and rejection.reason == reason


def test_screen_refuses_huge_and_deep_bodies() -> None:
    huge = screen_trace(_body(), size_bytes=20_000, max_trace_bytes=10_000)
    assert huge is not None and huge.reason == "too_large"
    assert "max_trace_bytes is 10000" in huge.message
    deep: Any = "x"
    for _ in range(40):
        deep = {"d": deep}
    nested = screen_trace(_body(metadata=deep), size_bytes=100, max_trace_bytes=10_000)
    assert nested is not None and "nested deeper" in nested.message


def test_screen_accepts_a_normal_trace() -> None:
    assert screen_trace(_body(), size_bytes=100, max_trace_bytes=10_000) is None


def test_failure_signature_names_error_and_tools() -> None:
    assert failure_signature(_body(), "wrong_answer") == "wrong_answer|search"
    assert failure_signature({"messages": []}, None) == "failed|"
