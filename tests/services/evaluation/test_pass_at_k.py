"""pass@k, the unbiased estimator of Chen et al. 2021 (issue 26): what sampling still reaches
beside pass@1, for the probe, the gate and every evaluation's metrics."""

from __future__ import annotations

from math import comb

import pytest

from services.evaluation.results import mean_pass_at_k, pass_at_k, reported_ks


def row(samples: int, passes: int) -> dict[str, object]:
    return {
        "task_id": "t",
        "passed": passes * 2 > samples,
        "samples": samples,
        "sample_passes": passes,
    }


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [(10, 0, 1), (10, 1, 1), (10, 1, 5), (10, 3, 4), (64, 1, 8), (64, 1, 64), (200, 7, 100)],
)
def test_pass_at_k_is_the_unbiased_estimator_on_fixed_counts(n: int, c: int, k: int) -> None:
    exact = 1 - comb(n - c, k) / comb(n, k)
    assert pass_at_k(row(n, c), k) == pytest.approx(exact, abs=1e-12)


def test_edge_cases() -> None:
    assert pass_at_k(row(4, 4), 2) == 1.0
    assert pass_at_k(row(4, 3), 2) == 1.0  # every pair holds a success
    assert pass_at_k(row(4, 0), 4) == 0.0
    assert pass_at_k(row(4, 1), 1) == pytest.approx(0.25)
    assert pass_at_k(row(2, 1), 4) is None  # fewer samples than k: no estimate
    assert pass_at_k({"passed": True}, 1) == 1.0  # no sample counts: its pass/fail
    assert pass_at_k({"passed": True}, 2) is None
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k(row(4, 1), 0)


def test_a_task_sets_pass_at_k_is_the_mean_of_its_tasks() -> None:
    rows = [row(8, 0), row(8, 1), row(8, 8)]
    assert mean_pass_at_k(rows, 1) == pytest.approx((0 + 1 / 8 + 1) / 3)
    assert mean_pass_at_k(rows, 8) == pytest.approx((0 + 1 + 1) / 3)
    assert mean_pass_at_k([*rows, row(2, 1)], 8) is None
    assert mean_pass_at_k([], 1) is None


def test_the_reported_ks() -> None:
    assert reported_ks(1) == [1]
    assert reported_ks(2) == [1, 2]
    assert reported_ks(8) == [1, 2, 4, 8]
    assert reported_ks(12) == [1, 2, 4, 8, 12]
