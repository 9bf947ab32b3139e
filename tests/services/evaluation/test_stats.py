"""Exact values of the evaluation statistics."""

from __future__ import annotations

import math

import pytest

from services.evaluation.stats import (
    compare_paired,
    mcnemar_exact,
    mcnemar_exact_one_sided,
    paired_bootstrap,
    proportion_interval,
    wilson_interval,
)


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [
        # Published 95% Wilson score intervals (e.g. Newcombe 1998, Table I; Agresti & Coull 1998).
        (0, 10, 0.0, 0.2775),
        (5, 10, 0.2366, 0.7634),
        (8, 10, 0.4902, 0.9433),
        (10, 10, 0.7225, 1.0),
        (81, 263, 0.2553, 0.3662),
    ],
)
def test_wilson_matches_published_values(k: int, n: int, low: float, high: float) -> None:
    got_low, got_high = wilson_interval(k, n, 0.95)
    assert got_low == pytest.approx(low, abs=5e-5)
    assert got_high == pytest.approx(high, abs=5e-5)


def test_wilson_is_exactly_0_or_1_at_the_ends() -> None:
    """At 0 % and 100 % the bounds are 0 and 1 exactly, not float residue (JSON shows it)."""
    assert wilson_interval(0, 20)[0] == 0.0 and wilson_interval(20, 20)[1] == 1.0
    assert proportion_interval(0.0, 7)[0] == 0.0 and proportion_interval(7.0, 7)[1] == 1.0


def test_wilson_closed_form_at_99_percent() -> None:
    z = 2.5758293035489004
    p, n = 0.3, 50
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert wilson_interval(15, 50, 0.99) == pytest.approx((centre - half, centre + half), abs=1e-12)


def test_a_higher_confidence_widens_the_wilson_interval() -> None:
    low95, high95 = wilson_interval(30, 60)
    low99, high99 = wilson_interval(30, 60, confidence=0.99)
    assert low99 < low95 < 0.5 < high95 < high99


@pytest.mark.parametrize(
    ("k", "n", "confidence", "message"),
    [
        (11, 10, 0.95, "k <= n"),
        (-1, 10, 0.95, "k <= n"),
        (1, -1, 0.95, "k <= n"),
        (1, 10, 1.0, "confidence"),
        (1, 10, 0.0, "confidence"),
    ],
)
def test_wilson_refuses_each_bad_input(k: int, n: int, confidence: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wilson_interval(k, n, confidence=confidence)


def test_wilson_rejects_bad_inputs() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="k <= n"):
        wilson_interval(5, 3)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 3, 1.5)


@pytest.mark.parametrize(
    ("b", "c", "expected"),
    [
        # 2 * P(X <= min(b, c)), X ~ Binomial(b + c, 1/2), computed by hand:
        (2, 8, 2 * (1 + 10 + 45) / 2**10),  # 0.109375
        (0, 5, 2 * 1 / 2**5),  # 0.0625
        (1, 9, 2 * (1 + 10) / 2**10),  # 0.021484375
        (3, 3, 1.0),  # doubling the middle exceeds 1: capped
        (0, 0, 1.0),
        (0, 1, 1.0),
    ],
)
def test_mcnemar_exact_hand_computed(b: int, c: int, expected: float) -> None:
    assert mcnemar_exact(b, c) == pytest.approx(expected, abs=1e-15)
    assert mcnemar_exact(c, b) == pytest.approx(expected, abs=1e-15)


def test_mcnemar_one_sided() -> None:
    # P(X >= 8), X ~ Binomial(10, 1/2) = (45 + 10 + 1) / 1024
    assert mcnemar_exact_one_sided(2, 8) == pytest.approx(56 / 1024, abs=1e-15)
    # the candidate winning fewer discordant tasks is no evidence of improvement
    assert mcnemar_exact_one_sided(8, 2) == pytest.approx(1 - (1 + 10) / 1024, abs=1e-15)
    assert mcnemar_exact_one_sided(3, 0) == 1.0


def test_paired_bootstrap_is_deterministic_and_brackets_delta() -> None:
    champion = [True] * 60 + [False] * 40
    candidate = [True] * 50 + [False] * 10 + [True] * 30 + [False] * 10
    first = paired_bootstrap(champion, candidate, n_resamples=500, seed=3)
    assert first == paired_bootstrap(champion, candidate, n_resamples=500, seed=3)
    delta, low, high = first
    assert delta == pytest.approx(0.2)
    assert low < delta < high


def test_paired_bootstrap_degenerate_when_identical() -> None:
    same = [True, False, True, True]
    assert paired_bootstrap(same, same, n_resamples=50) == (0.0, 0.0, 0.0)


def test_compare_paired_counts_and_tests() -> None:
    champion = [True, True, False, False, True, False, False, False, False, False, False, True]
    candidate = [True, False, True, True, True, True, True, True, True, True, False, True]
    result = compare_paired(champion, candidate, confidence=0.95, seed=1, n_resamples=400)
    assert (result.n, result.both_passed, result.neither_passed) == (12, 3, 1)
    assert (result.only_champion, result.only_candidate) == (1, 7)
    assert result.champion_passed == 4 and result.candidate_passed == 10
    assert result.delta == pytest.approx(0.5) and result.delta_points == pytest.approx(50.0)
    assert result.p_value == pytest.approx(2 * (1 + 8) / 2**8)
    assert result.p_value_improvement == pytest.approx((1 + 8) / 2**8)
    assert result.ci_low <= 0.5 <= result.ci_high
    assert result.to_dict()["only_candidate"] == 7


def test_compare_paired_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="equal-length"):
        compare_paired([True], [True, False])
    with pytest.raises(ValueError, match="at least one"):
        compare_paired([], [])
