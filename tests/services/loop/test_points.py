"""The cycle's three numbers as the ledger keeps them (services.loop.points), exact values."""

from __future__ import annotations

import pytest

from services.evaluation.stats import newcombe_interval
from services.loop.points import LiveSample, cycle_points

COMPARISON = {
    "delta": 0.25,
    "ci_low": 0.05,
    "ci_high": 0.45,
    "n": 20,
    "champion_rate": 0.5,
    "candidate_rate": 0.75,
}


def test_gate_and_heldout_comparisons_in_points() -> None:
    points = cycle_points({"eval": COMPARISON, "heldout": COMPARISON}, None, None)
    assert points.live_points is None
    assert set(points.detail) == {"gate", "heldout"}
    assert points.detail["gate"] == {
        "points": 25.0,
        "ci_low_points": 5.0,
        "ci_high_points": 45.0,
        "n": 20,
        "champion_rate": 0.5,
        "candidate_rate": 0.75,
    }


def test_live_delta_with_newcombes_interval() -> None:
    points = cycle_points({}, LiveSample(n=10, successes=5), LiveSample(n=20, successes=15))
    assert points.live_points == pytest.approx(25.0)
    low, high = newcombe_interval(5, 10, 15, 20)
    assert points.detail == {
        "live": {
            "points": pytest.approx(25.0),
            "ci_low_points": pytest.approx(100.0 * low),
            "ci_high_points": pytest.approx(100.0 * high),
            "n_before": 10,
            "successes_before": 5,
            "n_after": 20,
            "successes_after": 15,
        }
    }


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (None, LiveSample(5, 5)),
        (LiveSample(5, 5), None),
        (LiveSample(0, 0), LiveSample(5, 5)),
        (LiveSample(5, 5), LiveSample(0, 0)),
    ],
)
def test_no_live_delta_without_traces_on_both_sides(
    before: LiveSample | None, after: LiveSample | None
) -> None:
    assert cycle_points({}, before, after).live_points is None
    assert cycle_points({}, before, after).detail == {}


def test_statistics_without_comparisons_give_no_numbers() -> None:
    # A rejected cycle's statistics may hold other keys, or a malformed comparison.
    assert cycle_points({"eval": "n/a", "pass_at_k": {}}, None, None).detail == {}
