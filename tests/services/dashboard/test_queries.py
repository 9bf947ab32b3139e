"""The dashboard's reads, against the realistic loop history in a real Postgres."""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Callable
from decimal import Decimal

import pytest
from sqlalchemy import distinct, func, select

from services.dashboard.lineage import serving_lineage
from services.dashboard.queries import (
    bucket_width,
    failure_clusters,
    live_success_series,
    loop_events,
    recent_runs,
    run_detail,
)
from services.db.models import Cycle, Loop, Task, TaskSource, Trace
from services.db.queries.cycle_history import loop_cycles
from services.db.queries.live import live_counts
from services.db.queries.loop_overview import loops_overview
from services.db.queries.loops import require_loop
from services.db.queries.points import intelligence_per_dollar
from services.db.queries.spend import loop_spend
from tests.services.dashboard.conftest import SeededDatabase
from tests.services.dashboard.seed import VERIFIED_NOTE, XSS_SIGNATURE, _success_rate


def _loop_id(db: SeededDatabase, name: str) -> int:
    with db.session_factory() as session:
        loop = require_loop(session=session, name=name)
        return loop.id


def test_overview_summarises_every_loop(seeded_database: SeededDatabase) -> None:
    story = seeded_database.story
    with seeded_database.session_factory() as session:
        quiet, busy = loops_overview(session=session)
    assert (quiet.name, busy.name) == (story.quiet_loop, story.loop)

    assert busy.stage == "train"
    assert busy.champion_id == story.champion_checkpoint
    assert busy.last_cycle_number == 3
    assert busy.last_cycle_outcome is None
    assert busy.spend_usd == Decimal("3.80")
    assert busy.budget_usd == Decimal("25")
    # The live rate is taken over the 200 latest outcomes (traces 88..287 of the story).
    expected = sum(1 for i in range(88, 288) if (i * 7) % 20 < _success_rate(i / 4) * 20)
    assert (busy.live_passed, busy.live_n) == (expected, 200)
    low, high = busy.live_interval
    assert low < busy.live_rate < high  # type: ignore[operator]
    with seeded_database.session_factory() as session:
        loop = require_loop(session=session, name=story.loop)
        recent = live_counts(session=session, loop=loop)
        assert (recent.successes, recent.n) == (expected, 200)
        assert live_counts(session=session, loop=loop, limit=4).n == 4

    assert quiet.stage == "idle"
    assert quiet.champion_id is None
    assert (quiet.live_n, quiet.live_rate) == (0, None)
    assert quiet.last_cycle_number is None
    assert quiet.spend_usd == 0


def test_a_paused_loop_shows_paused_whatever_its_cycle(seeded_database: SeededDatabase) -> None:
    with seeded_database.session_factory() as session:
        loop = require_loop(session=session, name=seeded_database.story.loop)
        loop.status = "paused"
        session.flush()
        summary = next(s for s in loops_overview(session=session) if s.name == loop.name)
        session.rollback()
    assert summary.stage == "paused"


def test_the_stage_shown_is_the_one_running(seeded_database: SeededDatabase) -> None:
    """The loop records a stage when it ends: "snapshot" (ended) means training runs."""
    with seeded_database.session_factory() as session:
        loop = require_loop(session=session, name=seeded_database.story.loop)
        cycle = session.scalars(
            select(Cycle).where(Cycle.loop_id == loop.id, Cycle.ended_at.is_(None))
        ).one()
        cycle.stage = "snapshot"
        cycle.stage_timings = {
            "curate": {"started_at": "2026-11-01T10:00:00+00:00"},
            "snapshot": {
                "started_at": "2026-11-01T10:05:00+00:00",
                "ended_at": "2026-11-01T10:06:00+00:00",
            },
            "_last_end": "2026-11-01T10:06:00+00:00",
        }
        session.flush()
        summary = next(s for s in loops_overview(session=session) if s.name == loop.name)
        (row, *_) = loop_cycles(session=session, loop_id=loop.id)
        session.rollback()
    assert summary.stage == "train"
    assert row.current_stage == "train"


def test_cycles_carry_both_evaluations_and_the_gate(seeded_database: SeededDatabase) -> None:
    loop_id = _loop_id(seeded_database, seeded_database.story.loop)
    with seeded_database.session_factory() as session:
        c3, c2, c1 = loop_cycles(session=session, loop_id=loop_id)
    assert [c.number for c in (c1, c2, c3)] == [1, 2, 3]

    assert c2.trigger == "drift"
    assert c2.champion is not None and (c2.champion.passed, c2.champion.n) == (3, 12)
    assert c2.candidate is not None and (c2.candidate.passed, c2.candidate.n) == (10, 12)
    assert c2.candidate.checkpoint_id == seeded_database.story.champion_checkpoint
    assert (c2.decision, c2.promotion_status) == ("promote", "held")
    assert (c2.train_count, c2.eval_count) == (20, 12)
    assert c2.cost_usd == Decimal("2.10")  # accounted
    assert c2.duration_seconds == pytest.approx(12.1 * 3600)

    assert (c1.outcome, c1.promotion_status) == ("rolled_back", "rolled_back")
    assert c1.candidate is not None and (c1.candidate.passed, c1.candidate.n) == (6, 10)

    # Each deploy's proof of delivery, as the deploy activity kept it on the promotion.
    assert [(d.purpose, d.verified) for d in c1.delivery_notes] == [
        ("candidate", True),
        ("rollback", False),
    ]
    assert [d.note for d in c2.delivery_notes] == [VERIFIED_NOTE]

    assert c3.is_open and c3.stage == "train"
    assert c3.champion is None and c3.candidate is None and c3.decision is None
    assert c3.delivery_notes == []
    assert c3.cost_usd == Decimal("0.30")  # not accounted yet: what its runs cost so far


def test_live_series_buckets_every_outcome(seeded_database: SeededDatabase) -> None:
    story = seeded_database.story
    loop_id = _loop_id(seeded_database, story.loop)
    with seeded_database.session_factory() as session:
        series = live_success_series(session=session, loop_id=loop_id)
        total_passed = session.scalar(
            select(func.count()).where(Trace.loop_id == loop_id, Trace.success.is_(True))
        )
    assert series is not None
    assert series.width == dt.timedelta(hours=2)  # 72 hours in at most 60 buckets
    assert sum(b.n for b in series.buckets) == story.trace_count
    assert sum(b.passed for b in series.buckets) == total_passed
    starts = [b.start for b in series.buckets]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert all(later - earlier >= series.width for earlier, later in itertools.pairwise(starts))
    # The drift is visible: the healthy first day beats the drifted hours.
    first_day = [b.rate for b in series.buckets if b.start < story.start + dt.timedelta(hours=22)]
    drifted = [
        b.rate
        for b in series.buckets
        if story.start + dt.timedelta(hours=26) <= b.start < story.start + dt.timedelta(hours=30)
    ]
    assert min(first_day) > max(drifted)


def test_live_series_window_ends_at_the_latest_outcome(seeded_database: SeededDatabase) -> None:
    loop_id = _loop_id(seeded_database, seeded_database.story.loop)
    with seeded_database.session_factory() as session:
        series = live_success_series(session=session, loop_id=loop_id, window=dt.timedelta(hours=6))
    assert series is not None
    assert series.end - series.start <= dt.timedelta(hours=6, minutes=15)
    assert sum(b.n for b in series.buckets) == 6 * 4 + 1  # one trace every 15 minutes


@pytest.mark.parametrize(
    "query",
    [live_success_series, serving_lineage],
    ids=["no outcomes, no series", "no champion, no lineage"],
)
def test_a_quiet_loop_has_nothing_to_draw(
    seeded_database: SeededDatabase, query: Callable[..., object]
) -> None:
    loop_id = _loop_id(seeded_database, seeded_database.story.quiet_loop)
    with seeded_database.session_factory() as session:
        assert query(session=session, loop_id=loop_id) is None


def test_events_mark_promotions_rollbacks_and_drift(seeded_database: SeededDatabase) -> None:
    story = seeded_database.story
    loop_id = _loop_id(seeded_database, story.loop)
    with seeded_database.session_factory() as session:
        events = loop_events(session=session, loop_id=loop_id, since=story.start)
        later = loop_events(
            session=session, loop_id=loop_id, since=story.start + dt.timedelta(hours=40)
        )
    assert [(e.kind, e.at - story.start) for e in events] == [
        ("promote", dt.timedelta(hours=30)),
        ("rollback", dt.timedelta(hours=32)),
        ("drift", dt.timedelta(hours=34)),
        ("promote", dt.timedelta(hours=44)),
    ]
    assert "cycle 1" in events[1].label
    assert [e.kind for e in later] == ["promote"]


def test_failure_clusters_group_tasks_with_newest_examples(
    seeded_database: SeededDatabase,
) -> None:
    loop_id = _loop_id(seeded_database, seeded_database.story.loop)
    with seeded_database.session_factory() as session:
        clusters = failure_clusters(session=session, loop_id=loop_id, examples=3)
        sources = dict(
            session.execute(
                select(Task.cluster_id, func.count(distinct(TaskSource.trace_id)))
                .join(TaskSource, TaskSource.task_id == Task.id)
                .where(Task.loop_id == loop_id)
                .group_by(Task.cluster_id)
            ).all()
        )
        top_one = failure_clusters(session=session, loop_id=loop_id, limit=1, examples=1)
    assert [(c.cluster_id, c.tasks, c.train, c.eval) for c in clusters] == [
        ("c-lookup-renamed", 16, 10, 6),
        ("c-date-format", 10, 6, 4),
        ("c-calc-args", 6, 4, 2),
    ]
    assert {c.cluster_id: c.source_traces for c in clusters} == sources
    date = clusters[1]
    assert date.signature == XSS_SIGNATURE
    assert len(date.examples) == 3
    ids = [e.task_id for e in date.examples]
    assert ids == sorted(ids, reverse=True)  # newest first
    assert all(e.tools == ["lookup_v2", "fmt"] for e in date.examples)
    # No prompt: the page carries none (the admin API shows it to a tab with the token).
    assert not any(hasattr(e, "prompt") for e in date.examples)
    assert [(c.cluster_id, len(c.examples)) for c in top_one] == [("c-lookup-renamed", 1)]


def test_lineage_of_the_serving_model(seeded_database: SeededDatabase) -> None:
    story = seeded_database.story
    loop_id = _loop_id(seeded_database, story.loop)
    with seeded_database.session_factory() as session:
        lineage = serving_lineage(session=session, loop_id=loop_id)
    assert lineage is not None
    assert lineage.checkpoint_id == story.champion_checkpoint
    assert lineage.ancestry == [story.champion_checkpoint, story.base_checkpoint]
    assert lineage.parents == [story.base_checkpoint]
    assert (lineage.run_id, lineage.run_status) == (story.cycle2_train_run, "succeeded")
    assert lineage.dataset_id == story.cycle2_dataset_id
    assert (lineage.train_count, lineage.eval_count) == (20, 12)
    assert (lineage.task_count, lineage.cluster_count) == (story.cycle2_task_count, 3)
    assert lineage.trace_count == story.cycle2_trace_count
    assert lineage.failed_trace_count == lineage.trace_count  # tasks come from failures
    assert lineage.first_received_at is not None and lineage.last_received_at is not None
    assert lineage.first_received_at >= story.start + dt.timedelta(hours=24)
    assert (lineage.cycle_number, lineage.decision, lineage.promotion_status) == (
        2,
        "promote",
        "held",
    )


def test_lineage_of_a_base_checkpoint_has_no_run(seeded_database: SeededDatabase) -> None:
    story = seeded_database.story
    with seeded_database.session_factory() as session:
        loop = session.scalars(select(Loop).where(Loop.name == story.loop)).one()
        loop.champion_checkpoint_id = story.base_checkpoint
        session.flush()
        lineage = serving_lineage(session=session, loop_id=loop.id)
        session.rollback()
    assert lineage is not None
    assert lineage.ancestry == [story.base_checkpoint]
    assert lineage.run_id is None and lineage.dataset_id is None
    assert (lineage.task_count, lineage.trace_count) == (0, 0)
    assert lineage.promotion_id is None


def test_runs_and_what_they_produced(seeded_database: SeededDatabase) -> None:
    story = seeded_database.story
    loop_id = _loop_id(seeded_database, story.loop)
    quiet_id = _loop_id(seeded_database, story.quiet_loop)
    with seeded_database.session_factory() as session:
        runs = recent_runs(session=session, loop_id=loop_id)
        train = run_detail(session=session, loop_id=loop_id, run_id=story.cycle2_train_run)
        evaluation = run_detail(session=session, loop_id=loop_id, run_id=f"{story.loop}-c2-eval")
        elsewhere = run_detail(session=session, loop_id=quiet_id, run_id=story.cycle2_train_run)
        spend = loop_spend(session=session, loop_id=loop_id)
    assert [r.id for r in runs][:2] == [story.cycle3_train_run, f"{story.loop}-c2-eval"]
    assert len(runs) == 5 and runs[0].cycle_number == 3 and runs[0].status == "running"
    assert train is not None and train.cycle_number == 2
    assert [c.id for c in train.checkpoints] == [story.champion_checkpoint]
    assert train.evaluations == []
    assert evaluation is not None
    assert sorted(e.passed for e in evaluation.evaluations) == [3, 10]
    assert elsewhere is None  # a run is only found under its own loop
    assert spend.cost_usd == sum(r.cost_usd for r in runs)


def test_points_per_dollar_count_every_accounted_cycle(seeded_database: SeededDatabase) -> None:
    loop_id = _loop_id(seeded_database, seeded_database.story.loop)
    with seeded_database.session_factory() as session:
        rows = intelligence_per_dollar(session=session, loop_id=loop_id).cycles
    assert [r.cycle for r in rows] == [1, 2]  # cycle 3 is still open
    assert rows[0].points_per_dollar == 0.0
    assert rows[1].points_per_dollar == pytest.approx(58.3 / 2.10)
    assert rows[1].cumulative_points_per_dollar == pytest.approx(58.3 / 3.50)


@pytest.mark.parametrize(
    ("span", "max_buckets", "width"),
    [
        (dt.timedelta(minutes=30), 60, dt.timedelta(minutes=1)),
        (dt.timedelta(hours=3), 60, dt.timedelta(minutes=5)),
        (dt.timedelta(hours=72), 60, dt.timedelta(hours=2)),
        (dt.timedelta(days=7), 60, dt.timedelta(hours=3)),
        (dt.timedelta(days=3650), 60, dt.timedelta(days=7)),
    ],
)
def test_bucket_width(span: dt.timedelta, max_buckets: int, width: dt.timedelta) -> None:
    assert bucket_width(span, max_buckets=max_buckets) == width


def test_bucket_width_needs_a_bucket() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        bucket_width(dt.timedelta(hours=1), max_buckets=0)
