"""Feedback that arrives while a curation batch holds its trace (issue 43, item 3).

Two sessions on a real Postgres: a batch that has locked the trace and linked it to its
task but not committed yet, and feedback on the same trace. On main the feedback deleted
the links it could see (none: the batch's were not committed), waited for the row, then
reset the verdict over the batch's committed link; the next pass linked the trace again,
hit ``task_sources``' primary key, and so did every retry, oldest first, for good.
"""

from __future__ import annotations

import threading

from sqlalchemy import select, text

from services.curation.pipeline import curate_batch
from services.curation.policy import CurationPolicy
from services.db.models import Loop, Task, TaskSource, Trace, TraceFeedback
from services.db.queries.traces import add_feedback
from services.db.session import SessionFactory
from tests.services.curation.support import (
    QaAdapter,
    add_traces,
    curate_all,
    make_loop,
    trace_body,
)
from tests.support import assert_eventually


def give_feedback(session_factory: SessionFactory, loop_id: int, trace_id: int) -> None:
    with session_factory.begin() as session:
        add_feedback(
            session=session,
            loop_id=loop_id,
            trace_id=trace_id,
            score=0.0,
            label="wrong",
            correction="42",
            comment=None,
            content_hash="f" * 64,
        )


def waiting_on_a_lock(session_factory: SessionFactory) -> int:
    with session_factory() as session:
        return int(
            session.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        )


def test_feedback_during_a_batch_never_stalls_curation(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory)
    [trace_id] = add_traces(session_factory, loop_id, [trace_body("t1", "What is 6 x 7?")])
    feedback = threading.Thread(target=give_feedback, args=(session_factory, loop_id, trace_id))

    with session_factory.begin() as batch:  # the batch holds the trace until it commits
        loop = batch.get(Loop, loop_id)
        assert loop is not None
        report = curate_batch(
            batch, loop=loop, policy=CurationPolicy(), adapter=QaAdapter(), limit=10
        )
        assert report.tasks_created == 1
        feedback.start()

        def feedback_waits() -> None:
            assert waiting_on_a_lock(session_factory) == 1

        assert_eventually(feedback_waits)
    feedback.join(timeout=30)
    assert not feedback.is_alive()

    curate_all(session_factory, loop_id)  # on main: a primary-key violation, every time

    with session_factory() as session:
        trace = session.get_one(Trace, trace_id)
        assert trace.curated_at is not None and trace.curation_outcome == "duplicate"
        links = session.scalars(select(TaskSource).where(TaskSource.trace_id == trace_id)).all()
        assert len(links) == 1
        task = session.get_one(Task, links[0].task_id)
        assert task.weight == 1  # the trace counts once, however often it was linked
        assert session.scalars(select(TraceFeedback)).one().trace_id == trace_id


def test_a_link_left_behind_by_an_older_version_is_dropped_when_the_trace_is_curated(
    session_factory: SessionFactory,
) -> None:
    """A database that stalled before the fix: the trace is uncurated but still linked."""
    loop_id = make_loop(session_factory)
    [trace_id] = add_traces(session_factory, loop_id, [trace_body("t1", "What is 6 x 7?")])
    curate_all(session_factory, loop_id)
    with session_factory.begin() as session:  # what the race left: verdict reset, link kept
        session.execute(
            text("UPDATE traces SET curated_at = NULL, curation_outcome = NULL WHERE id = :id"),
            {"id": trace_id},
        )

    curate_all(session_factory, loop_id)

    with session_factory() as session:
        assert session.get_one(Trace, trace_id).curated_at is not None
        [link] = session.scalars(select(TaskSource).where(TaskSource.trace_id == trace_id)).all()
        assert session.get_one(Task, link.task_id).weight == 1
