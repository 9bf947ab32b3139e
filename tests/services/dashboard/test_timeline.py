"""The stage timeline of a cycle, from whatever the cycle row holds."""

from __future__ import annotations

import datetime as dt

import pytest

from services.dashboard.timeline import (
    STAGES,
    StageTiming,
    Step,
    current_stage,
    cycle_steps,
    parse_stage_timings,
)

T0 = dt.datetime(2026, 11, 1, 12, 0, tzinfo=dt.UTC)


def _at(minutes: float) -> str:
    return (T0 + dt.timedelta(minutes=minutes)).isoformat()


def _states(steps: list[Step]) -> dict[str, str]:
    return {step.stage: step.state for step in steps}


def test_timings_accept_objects_and_plain_seconds() -> None:
    timings = parse_stage_timings(
        {
            "curate": {"started_at": _at(0), "ended_at": _at(3)},
            "snapshot": 12.5,
            "train": {"started_at": _at(5), "duration_s": 60},
            "evaluate": {"started_at": "2026-11-01T13:00:00"},
        }
    )
    assert timings["curate"] == StageTiming(T0, T0 + dt.timedelta(minutes=3), 180.0)
    assert timings["snapshot"] == StageTiming(seconds=12.5)
    assert timings["train"].seconds == 60
    # A naive timestamp is read as UTC.
    assert timings["evaluate"].started_at == dt.datetime(2026, 11, 1, 13, tzinfo=dt.UTC)


def test_timings_of_unknown_shape_are_ignored() -> None:
    timings = parse_stage_timings(
        {"curate": "soon", "train": -4, "gate": True, "promote": {"started_at": "not a date"}}
    )
    assert set(timings) == {"promote"}
    assert timings["promote"] == StageTiming()
    assert parse_stage_timings(None) == {}


def test_an_open_cycle_in_train() -> None:
    steps = cycle_steps(
        stage="train",
        stage_timings={"curate": {"started_at": _at(0), "ended_at": _at(3)}},
        is_open=True,
        outcome=None,
    )
    assert [s.stage for s in steps] == list(STAGES)
    states = _states(steps)
    # snapshot was not timed, but the cycle cannot be in train without having passed it.
    assert states["curate"] == states["snapshot"] == "done"
    assert states["train"] == "current"
    assert {states[s] for s in STAGES[3:]} == {"pending"}
    assert steps[0].seconds == 180


def test_a_rejected_cycle_skips_the_stages_it_never_reached() -> None:
    timings = {
        stage: {"started_at": _at(i), "ended_at": _at(i + 1)}
        for i, stage in enumerate(("curate", "snapshot", "train", "evaluate", "gate", "account"))
    }
    states = _states(
        cycle_steps(stage="account", stage_timings=timings, is_open=False, outcome="rejected")
    )
    assert states["gate"] == "done"
    assert states["promote"] == states["canary"] == "skipped"
    assert states["account"] == "done"


def test_a_failed_cycle_marks_the_stage_it_failed_in() -> None:
    states = _states(cycle_steps(stage="train", stage_timings={}, is_open=False, outcome="failed"))
    assert states["curate"] == "done"
    assert states["train"] == "failed"
    assert states["evaluate"] == "skipped"


def test_an_unknown_stage_is_shown_where_it_ran() -> None:
    timings = {
        "curate": {"started_at": _at(0), "ended_at": _at(1)},
        "gate": {"started_at": _at(10), "ended_at": _at(11)},
    }
    steps = cycle_steps(
        stage="awaiting_approval", stage_timings=timings, is_open=True, outcome=None
    )
    order = [s.stage for s in steps]
    assert order.index("awaiting_approval") == order.index("gate") + 1
    states = _states(steps)
    assert states["awaiting_approval"] == "current"
    assert states["promote"] == "pending"


def test_a_terminal_stage_name_is_not_a_step() -> None:
    steps = cycle_steps(
        stage="done",
        stage_timings={"curate": 5.0, "train": 50.0},
        is_open=False,
        outcome="no_data",
    )
    assert "done" not in [s.stage for s in steps]
    assert _states(steps)["train"] == "done"
    assert _states(steps)["evaluate"] == "skipped"


def test_promotion_stages_without_timings_follow_the_outcome() -> None:
    promoted = _states(
        cycle_steps(stage="account", stage_timings={}, is_open=False, outcome="promoted")
    )
    rejected = _states(
        cycle_steps(stage="account", stage_timings={}, is_open=False, outcome="rejected")
    )
    assert promoted["promote"] == promoted["canary"] == "done"
    assert rejected["promote"] == rejected["canary"] == "skipped"
    assert rejected["gate"] == "done"


# What the loop writes (services.db.queries.cycles): a cycle starts as stage "curate" with
# curate's start; set_stage(stage) records that a stage *finished* (started at the previous
# end, ``_last_end`` kept as a bookkeeping key); close_cycle sets stage "done".
def _loop_timings(*finished: str) -> dict[str, object]:
    timings: dict[str, object] = {"curate": {"started_at": _at(0)}}
    for minute, stage in enumerate(finished, start=1):
        timings[stage] = {"started_at": _at(minute - 1), "ended_at": _at(minute)}
        timings["_last_end"] = _at(minute)
    return timings


def test_a_recorded_stage_that_has_ended_means_the_next_one_runs() -> None:
    curating = _states(
        cycle_steps(stage="curate", stage_timings=_loop_timings(), is_open=True, outcome=None)
    )
    assert curating["curate"] == "current" and curating["snapshot"] == "pending"
    training = _states(
        cycle_steps(
            stage="snapshot", stage_timings=_loop_timings("snapshot"), is_open=True, outcome=None
        )
    )
    assert training["curate"] == training["snapshot"] == "done"
    assert training["train"] == "current"
    assert training["evaluate"] == "pending"
    assert "_last_end" not in training


@pytest.mark.parametrize(
    ("outcome", "done", "skipped"),
    [
        ("promoted", STAGES, ()),
        ("rolled_back", STAGES, ()),
        (
            "rejected",
            ("curate", "snapshot", "train", "evaluate", "gate", "account"),
            ("promote", "canary"),
        ),
        (
            "no_data",
            ("curate", "snapshot", "account"),
            ("train", "evaluate", "gate", "promote", "canary"),
        ),
    ],
)
def test_a_closed_cycle_is_read_from_its_outcome(
    outcome: str, done: tuple[str, ...], skipped: tuple[str, ...]
) -> None:
    finished = ("snapshot",) if outcome == "no_data" else ("snapshot", "train")
    states = _states(
        cycle_steps(
            stage="done", stage_timings=_loop_timings(*finished), is_open=False, outcome=outcome
        )
    )
    assert {s for s, state in states.items() if state == "done"} == set(done)
    assert {s for s, state in states.items() if state == "skipped"} == set(skipped)


def test_a_cycle_that_failed_in_training_shows_where() -> None:
    states = _states(
        cycle_steps(
            stage="done", stage_timings=_loop_timings("snapshot"), is_open=False, outcome="failed"
        )
    )
    assert states["snapshot"] == "done"
    assert states["train"] == "failed"
    assert states["evaluate"] == states["promote"] == "skipped"


def test_current_stage_reads_both_ways_of_recording() -> None:
    assert current_stage("snapshot", _loop_timings("snapshot")) == "train"
    assert current_stage("train", {"train": {"started_at": _at(0)}}) == "train"
    assert current_stage("curate", None) == "curate"
    assert current_stage("awaiting_approval", _loop_timings("snapshot", "train")) == (
        "awaiting_approval"
    )
