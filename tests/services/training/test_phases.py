"""The phase clock that jobs report their seconds per phase with (metrics.json ``phases``)."""

from __future__ import annotations

import pytest

from services.training.phases import PhaseClock, phase_report


def test_clock_adds_up_each_phase_into_the_given_counters() -> None:
    kept = {"rollout": 1.5}  # a resumed run's counters
    clock = PhaseClock(seconds=kept)
    with clock.phase("rollout"):
        pass
    with clock.phase("update"):
        pass
    assert kept["rollout"] >= 1.5 and "update" in kept
    assert clock.seconds is kept


def test_a_failing_block_is_still_timed_and_an_unknown_phase_is_refused() -> None:
    clock = PhaseClock()
    with pytest.raises(RuntimeError), clock.phase("evaluation"):
        raise RuntimeError("boom")
    assert "evaluation" in clock.seconds
    with pytest.raises(ValueError, match="unknown phase 'warmup'"), clock.phase("warmup"):
        pass


def test_report_sums_clocks_and_counts_compute_over_ranks() -> None:
    report = phase_report(
        PhaseClock(seconds={"sync": 1.0}), {"sync": 0.5, "update": 2.0}, world_size=4
    )
    assert report == {
        "update": {"seconds": 2.0, "compute_s": 8.0},
        "sync": {"seconds": 1.5, "compute_s": 6.0},
    }
