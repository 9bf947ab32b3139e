"""The difficulty filter keeps tasks the champion sometimes solves."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.curation.difficulty import (
    ProbeCount,
    probe_counts,
    select_by_difficulty,
)


def test_zero_variance_tasks_are_dropped_and_counted() -> None:
    selection = select_by_difficulty(
        {
            1: ProbeCount(0, 8),
            2: ProbeCount(8, 8),
            3: ProbeCount(3, 8),
            4: None,
            5: 0.5,
            6: 1.0,
        }
    )
    assert selection.kept == {3, 4, 5}
    assert selection.too_hard == {1}
    assert selection.too_easy == {2, 6}
    assert selection.unprobed == {4}
    assert selection.counts() == {"kept": 3, "too_easy": 2, "too_hard": 1, "unprobed": 1}


@given(
    st.dictionaries(
        st.integers(),
        st.integers(1, 16).flatmap(lambda k: st.integers(0, k).map(lambda p: ProbeCount(p, k))),
    )
)
def test_kept_iff_pass_rate_strictly_between_zero_and_one(probes: dict[int, ProbeCount]) -> None:
    selection = select_by_difficulty(probes)
    for task_id, probe in probes.items():
        assert (task_id in selection.kept) == (0 < probe.passed < probe.attempts)
    assert sum(selection.counts().values()) == len(probes)


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one attempt"):
        ProbeCount(0, 0)
    with pytest.raises(ValueError, match="passed must be between 0 and 4"):
        ProbeCount(5, 4)
    with pytest.raises(ValueError, match="outside"):
        select_by_difficulty({1: 1.5})


def test_a_probe_counts_pass_rate_is_passes_over_samples() -> None:
    assert ProbeCount(2, 8).pass_rate == 0.25


def test_probe_counts_read_the_eval_jobs_result_rows() -> None:
    rows = [
        {"task_id": "aaa", "passed": True, "samples": 8, "sample_passes": 8},
        {"task_id": "bbb", "passed": False, "samples": 8, "sample_passes": 0},
        {"task_id": "ccc", "passed": False, "samples": 8, "sample_passes": 3, "reward": 0.4},
    ]
    counts = probe_counts(rows)
    assert counts == {"aaa": ProbeCount(8, 8), "bbb": ProbeCount(0, 8), "ccc": ProbeCount(3, 8)}
    assert [count.pass_rate for count in counts.values()] == [1.0, 0.0, 0.375]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"samples": 8, "sample_passes": 1}], "no task_id"),
        ([{"task_id": "a", "passed": True}], "no sample counts"),
        ([{"task_id": "a", "samples": True, "sample_passes": 1}], "no sample counts"),
        ([{"task_id": "a", "samples": 8, "sample_passes": 9}], "passed must be between"),
        ([{"task_id": "a", "samples": 0, "sample_passes": 0}], "at least one attempt"),
        (
            [
                {"task_id": "a", "samples": 8, "sample_passes": 1},
                {"task_id": "a", "samples": 8, "sample_passes": 2},
            ],
            "reported twice",
        ),
    ],
)
def test_probe_counts_refuse_malformed_rows(rows: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        probe_counts(rows)
