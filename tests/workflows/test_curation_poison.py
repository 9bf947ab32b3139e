"""A trace that fails its curation batch never stops the queue behind it (issue 43, item 3).

The poison is real: a Postgres trigger refuses the task link of one trace, as a constraint
would refuse a row, so the batch's transaction fails. On main every retry of the batch took
the same oldest traces and failed the same way, for good. The activity runs on a real
Postgres through Temporal's activity environment.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from temporalio.testing import ActivityEnvironment

from services.artifacts import ArtifactStore
from services.db.models import Trace
from services.db.queries.traces import TraceFilter, list_traces
from services.db.session import SessionFactory
from tests.services.curation.support import add_traces, make_loop, qa_resolver, trace_body
from workflows.activities.curation import MAX_CURATION_ATTEMPTS, CurationActivities
from workflows.payloads.curation import CurateBatchInput, CurateBatchResult


def poison(session_factory: SessionFactory, condition: str) -> None:
    """Make Postgres refuse the task link of the traces ``condition`` (on NEW) names."""
    with session_factory.begin() as session:
        session.execute(
            text(
                "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF {condition} THEN RAISE EXCEPTION 'poison trace %', NEW.trace_id; END IF; "
                "RETURN NEW; END $$"
            )
        )
        session.execute(
            text(
                "CREATE TRIGGER poison BEFORE INSERT ON task_sources FOR EACH ROW "
                "EXECUTE FUNCTION poison()"
            )
        )


def curate(activities: CurationActivities, loop: str) -> CurateBatchResult:
    result: CurateBatchResult = ActivityEnvironment().run(
        activities.curate_batch, CurateBatchInput(loop=loop, batch_size=10)
    )
    return result


QUESTIONS = {
    "bad": "Why does my invoice show a late fee?",
    "g1": "How do I reset the router to factory settings?",
    "g2": "Which plan includes priority phone support?",
    "g3": "Can I move my appointment to next Thursday morning?",
    "g4": "Where is the nearest store that repairs bicycles?",
    "a": "What colour is the emergency exit sign?",
    "b": "How many vacation days carry over to next year?",
    "c": "Is the parking garage open on public holidays?",
}


def questions(*names: str) -> list[dict[str, object]]:
    return [trace_body(name, QUESTIONS[name]) for name in names]


def trace(session_factory: SessionFactory, trace_id: int) -> Trace:
    with session_factory() as session:
        row = session.get_one(Trace, trace_id)
        session.expunge(row)
        return row


def test_a_poison_trace_is_set_aside_and_the_queue_moves_on(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    loop_id = make_loop(session_factory)
    bad, *good = add_traces(session_factory, loop_id, questions("bad", "g1", "g2", "g3"))
    poison(session_factory, f"NEW.trace_id = {bad}")
    activities = CurationActivities(session_factory, ArtifactStore(tmp_path), adapters=qa_resolver)

    first = curate(activities, "support")

    assert first.tasks_created == 3  # the traces behind the bad one are curated
    assert all(trace(session_factory, i).curated_at is not None for i in good)
    waiting = trace(session_factory, bad)
    assert waiting.curated_at is None and waiting.curation_attempts == 1
    assert (waiting.curation_detail or "").startswith(
        f"curation_failed: attempt 1 of {MAX_CURATION_ATTEMPTS}: RaiseException: poison trace"
    )

    for _ in range(MAX_CURATION_ATTEMPTS - 1):
        last = curate(activities, "support")
    assert last.rejected == 1
    set_aside = trace(session_factory, bad)
    assert set_aside.curated_at is not None and set_aside.curation_outcome == "rejected"
    assert (set_aside.curation_detail or "").startswith(
        f"curation_failed: set aside after {MAX_CURATION_ATTEMPTS} attempts: RaiseException"
    )
    with session_factory() as session:  # the listing shows it, by its reason
        listed = list_traces(
            session=session,
            loop_id=loop_id,
            filters=TraceFilter(curation="rejected", reason="curation_failed"),
            after=None,
            limit=10,
        )
    assert [row.id for row in listed] == [bad]

    [later] = add_traces(session_factory, loop_id, questions("g4"))
    assert curate(activities, "support").tasks_created == 1
    assert trace(session_factory, later).curation_outcome == "task"


def test_a_batch_that_fails_for_every_trace_is_not_blamed_on_them(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """The code or the database is at fault: the activity fails (a fixed deploy resumes the
    queue), and no trace is counted against."""
    loop_id = make_loop(session_factory)
    ids = add_traces(session_factory, loop_id, questions("a", "b", "c"))
    poison(session_factory, "true")
    activities = CurationActivities(session_factory, ArtifactStore(tmp_path), adapters=qa_resolver)

    with pytest.raises((DBAPIError, psycopg.Error), match="poison trace"):
        curate(activities, "support")

    for trace_id in ids:
        row = trace(session_factory, trace_id)
        assert row.curated_at is None and row.curation_attempts == 0
