"""What a loop's next cycle waits for (services.loop.next_cycle): the words, and the counts
read from Postgres."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest

from services.db.models import Loop, Task
from services.db.session import SessionFactory
from services.loop.next_cycle import (
    NextCycle,
    WorkflowClock,
    WorkflowState,
    database_clock,
    read_next_cycle,
    run_now_note,
    run_now_refusal,
)

NOW = dt.datetime(2026, 12, 6, 12, 0, 0, tzinfo=dt.UTC)
FRESH = NextCycle(
    loop="myloop",
    paused=False,
    has_champion=False,
    new_train_tasks=3,
    min_new_tasks=16,
    eval_tasks=0,
    pending_traces=2,
    check_interval_s=30,
)
READY = replace(FRESH, has_champion=True, new_train_tasks=16, eval_tasks=4, pending_traces=0)
NO_CHAMPION = (
    "no champion: run `ratchet loop bootstrap myloop` (a first one from the loop's successful "
    "traces) or import one: `ratchet models smollm2 --import --loop myloop`, "
    "`ratchet models import DIR --loop myloop`"
)


def test_a_new_loop_waits_for_tasks_an_eval_task_and_a_champion() -> None:
    assert FRESH.waits_for() == [
        "3 of 16 new train tasks (trigger_policy.min_new_tasks)",
        "no eval tasks yet (a cycle's snapshot needs one; curation holds out a share of the "
        "failure clusters for eval: curation_policy.eval_fraction)",
        NO_CHAMPION,
    ]
    assert FRESH.summary() == "; ".join(FRESH.waits_for())


def test_a_ready_loop_waits_for_nothing_and_a_paused_one_says_how_to_resume() -> None:
    assert READY.waits_for() == []
    assert READY.summary() == "nothing: the next trigger check starts a cycle"
    assert replace(READY, paused=True).waits_for() == [
        "the loop is paused: `ratchet loop resume myloop`"
    ]


@pytest.mark.parametrize(
    ("clock", "note"),
    [
        (
            WorkflowClock(WorkflowState.WAITING, next_check_at=NOW + dt.timedelta(seconds=42)),
            "2 traces wait for curation: next curation at 12:00:42 UTC (in 42 s; every 30 s "
            "while the loop waits)",
        ),
        (
            WorkflowClock(),
            "2 traces wait for curation: curated at the loop's next trigger check (every 30 s "
            "while the loop waits)",
        ),
        (
            WorkflowClock(WorkflowState.NOT_RUNNING),
            "2 traces wait for curation: the loop's workflow is not running "
            "(`ratchet loop start myloop`)",
        ),
        (
            WorkflowClock(WorkflowState.PAUSED),
            "2 traces wait for curation: curation runs again when the loop resumes",
        ),
        (
            WorkflowClock(WorkflowState.IN_CYCLE, cycle=3),
            "2 traces wait for curation: curated at the first trigger check after cycle 3 ends",
        ),
    ],
)
def test_pending_traces_say_when_curation_runs(clock: WorkflowClock, note: str) -> None:
    assert FRESH.curation_note(clock, now=NOW) == note


def test_nothing_pending_needs_no_note_and_one_trace_is_singular() -> None:
    clock = WorkflowClock(WorkflowState.WAITING, next_check_at=NOW)
    assert READY.curation_note(clock, now=NOW) is None
    one = replace(FRESH, pending_traces=1).curation_note(WorkflowClock(), now=NOW)
    assert one is not None and one.startswith("1 trace waits for curation: ")


def test_run_now_is_refused_without_a_champion_and_warned_without_an_eval_task() -> None:
    assert run_now_refusal(FRESH) == f"loop 'myloop' cannot run a cycle: {NO_CHAMPION}"
    assert run_now_refusal(READY) is None
    assert run_now_note(READY) is None
    assert run_now_note(replace(READY, eval_tasks=0)) == "no eval tasks yet: the cycle ends no_data"
    assert run_now_note(replace(READY, eval_tasks=0, pending_traces=5)) == (
        "no eval tasks yet: the cycle ends no_data unless curating the 5 pending traces adds one"
    )


def _task(loop_id: int, n: int, split: str, *, pinned: bool = False) -> Task:
    return Task(
        loop_id=loop_id,
        content_hash=f"{n:064x}",
        environment="replay",
        spec={},
        cluster_id=f"c{n}",
        split=split,
        pinned=pinned,
    )


def test_the_counts_come_from_postgres(session_factory: SessionFactory) -> None:
    with session_factory.begin() as session:
        loop = Loop(name="counted", environment="replay", trigger_policy={"min_new_tasks": 16})
        session.add(loop)
        session.flush()
        fresh = read_next_cycle(session=session, loop=loop)
        assert (fresh.new_train_tasks, fresh.eval_tasks, fresh.pending_traces) == (0, 0, 0)
        assert (fresh.min_new_tasks, fresh.check_interval_s, fresh.has_champion) == (16, 30, False)
        session.add_all(
            [
                _task(loop.id, 1, "train"),
                _task(loop.id, 2, "train"),
                _task(loop.id, 3, "train", pinned=True),  # a regression task, never trained on
                _task(loop.id, 4, "eval"),
                _task(loop.id, 5, "eval", pinned=True),
                _task(loop.id, 6, "heldout"),
            ]
        )
        session.flush()
        counted = read_next_cycle(session=session, loop=loop)
        assert (counted.new_train_tasks, counted.eval_tasks) == (2, 1)
        assert database_clock(session=session, loop=loop) == WorkflowClock()
        loop.status = "paused"
        assert read_next_cycle(session=session, loop=loop).paused
        assert database_clock(session=session, loop=loop).state == WorkflowState.PAUSED
