"""Wilson score intervals against published values, and bad inputs.

Reference values: Newcombe (1998), "Two-sided confidence intervals for the single
proportion", Statistics in Medicine 17, Table II, method 3 (score interval, no continuity
correction), given there to four decimals.
"""

from __future__ import annotations

import pytest

from services.dashboard.stats import wilson_interval


@pytest.mark.parametrize(
    ("passed", "n", "expected"),
    [
        (81, 263, (0.2553, 0.3662)),
        (15, 148, (0.0624, 0.1605)),
        (0, 20, (0.0, 0.1611)),
        (1, 29, (0.0061, 0.1718)),
    ],
)
def test_wilson_interval_matches_published_values(
    passed: int, n: int, expected: tuple[float, float]
) -> None:
    low, high = wilson_interval(passed, n)
    assert low == pytest.approx(expected[0], abs=5e-5)
    assert high == pytest.approx(expected[1], abs=5e-5)


def test_no_trials_means_nothing_is_known() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_a_higher_confidence_widens_the_interval() -> None:
    low95, high95 = wilson_interval(30, 60)
    low99, high99 = wilson_interval(30, 60, confidence=0.99)
    assert low99 < low95 < 0.5 < high95 < high99


@pytest.mark.parametrize(
    ("passed", "n", "confidence", "message"),
    [
        (11, 10, 0.95, "passed <= n"),
        (-1, 10, 0.95, "passed <= n"),
        (1, -1, 0.95, "passed <= n"),
        (1, 10, 1.0, "confidence"),
        (1, 10, 0.0, "confidence"),
    ],
)
def test_bad_inputs_are_refused(passed: int, n: int, confidence: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wilson_interval(passed, n, confidence=confidence)
