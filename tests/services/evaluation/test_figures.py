"""Figures with their counts and 95 % intervals (services.evaluation.figures)."""

from __future__ import annotations

import pytest

from services.evaluation.figures import (
    PRECISION_POINTS,
    Gain,
    gain_from_detail,
    imprecise_note,
    live_gain,
    paired_gain,
    rate,
)
from services.evaluation.stats import compare_paired, newcombe_interval, wilson_interval
from services.loop.points import LiveSample, cycle_points


def test_a_rate_prints_its_count_and_wilson_interval() -> None:
    figure = rate(40, 60)
    low, high = wilson_interval(40, 60)
    assert (figure.low, figure.high) == (low, high)
    assert figure.text() == f"67% [{100 * low:.0f}, {100 * high:.0f}] (40/60)"
    assert figure.to_json() == {
        "rate": 40 / 60,
        "successes": 40.0,
        "n": 60,
        "ci95": [low, high],
        "method": "wilson",
    }
    assert rate(0, 0).text() == "n/a (0)" and rate(0, 0).value is None
    # pass@1 summed over several samples per task: the count keeps its fraction
    assert rate(2.5, 4).text().endswith("(2.5/4)")
    # an evaluation's stored interval wins
    assert (rate(9, 10, interval=(0.5, 0.99)).low, rate(9, 10, interval=(0.5, 0.99)).high) == (
        0.5,
        0.99,
    )


def test_a_paired_gain_is_the_bootstrap_interval_in_points() -> None:
    champion = [0.0] * 20 + [1.0] * 20
    candidate = [1.0] * 15 + [0.0] * 5 + [1.0] * 20
    gain = paired_gain(champion, candidate)
    comparison = compare_paired(champion, candidate, confidence=0.95)
    assert gain == Gain(
        100 * comparison.delta, 100 * comparison.ci_low, 100 * comparison.ci_high, 40
    )
    assert gain.text() == (
        f"+37.5 [{100 * comparison.ci_low:+.1f}, {100 * comparison.ci_high:+.1f}] pts (40 tasks)"
    )
    assert gain.to_json()["ci95_points"] == [gain.low, gain.high]
    # a figure stored before counts were kept shows its interval alone
    assert Gain(5.0, 1.0, 9.0, 0).text() == "+5.0 [+1.0, +9.0] pts"


def test_a_live_gain_is_newcombes_with_the_traces_on_each_side() -> None:
    gain = live_gain((10, 50), (40, 60))
    assert gain is not None
    low, high = newcombe_interval(10, 50, 40, 60)
    assert (gain.low, gain.high) == pytest.approx((100 * low, 100 * high))
    assert gain.counted() == "50 → 60 traces"
    assert gain.to_json()["n_before"] == 50
    assert live_gain((0, 0), (3, 4)) is None


def test_the_cycles_stored_numbers_read_back_as_figures() -> None:
    statistics = {
        "eval": compare_paired([0.0] * 10, [1.0] * 8 + [0.0] * 2).to_dict(),
        "heldout": compare_paired([0.0] * 5 + [1.0] * 5, [1.0] * 10).to_dict(),
    }
    points = cycle_points(statistics, LiveSample(50, 10), LiveSample(60, 40))
    heldout = gain_from_detail(points.detail["heldout"])
    gate = gain_from_detail(points.detail["gate"])
    live = gain_from_detail(points.detail["live"], live=True)
    assert heldout is not None and gate is not None and live is not None
    assert (heldout.points, heldout.n, heldout.method) == (50.0, 10, "paired_bootstrap")
    assert (gate.points, gate.n) == (80.0, 10)
    assert (live.method, live.n_before, live.n) == ("newcombe", 50, 60)
    assert live == live_gain((10, 50), (40, 60))
    assert gain_from_detail(None) is None
    assert gain_from_detail({"points": "x"}) is None


def test_a_wide_interval_is_said_to_be_too_wide() -> None:
    narrow = Gain(20.0, 10.0, 30.0, 120)
    wide = Gain(20.0, -5.0, 45.0, 12)
    assert narrow.precise and imprecise_note("held-out", narrow) is None
    assert not wide.precise
    note = imprecise_note("held-out", wide)
    assert note is not None
    assert note.startswith("the held-out interval is ±25.0 points on 12 tasks")
    assert f"±{PRECISION_POINTS:g}" in note
    assert imprecise_note("held-out", None) is None


def test_the_gates_number_is_shown_at_95_whatever_the_policys_confidence() -> None:
    """The gate decides at its policy's confidence (here 90 %); the figure it leaves for
    every page is the 95 % interval the gate activity adds beside (``ci95_*``)."""
    champion, candidate = [0.0] * 10, [1.0] * 6 + [0.0] * 4
    decided = compare_paired(champion, candidate, confidence=0.9).to_dict()
    shown = paired_gain(champion, candidate)
    statistics = {"eval": {**decided, "ci95_low": shown.low / 100, "ci95_high": shown.high / 100}}
    gate = gain_from_detail(cycle_points(statistics, None, None).detail["gate"])
    assert gate is not None
    assert (gate.low, gate.high) == pytest.approx((shown.low, shown.high))
    assert gate.low <= 100 * decided["ci_low"]  # the 95 % interval is the wider one
