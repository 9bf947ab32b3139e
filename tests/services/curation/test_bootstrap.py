"""Bootstrap's demonstrations on a real Postgres: only successful traces whose conversation
is on the train side of the split line become demonstrations; failures, and successes of
eval, held-out or regression tasks and clusters never do; every trace seen is counted."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from services.curation.bootstrap import BootstrapRefused, select_demonstrations
from services.db.models import Loop, Task
from services.db.session import SessionFactory
from services.environments import read_task_file
from services.environments.replay import ReplayEnvironment
from tests.services.curation.bootstrap_traces import (
    ANSWER,
    curate,
    failure,
    post,
    replay_loop,
    success,
)
from tests.services.curation.support import make_loop

TICKETS = range(12)


def _select(session_factory: SessionFactory, loop_id: int, limit: int = 100):  # type: ignore[no-untyped-def]
    with session_factory() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        return select_demonstrations(session, loop=loop, limit=limit)


def _splits_by_ticket(session_factory: SessionFactory, loop_id: int) -> dict[int, str]:
    """The split curation gave each ticket's failure task (its cluster's split)."""
    with session_factory() as session:
        tasks = session.scalars(select(Task).where(Task.loop_id == loop_id)).all()
        return {
            int(t.spec["metadata"]["source"]["external_id"].removeprefix("fail-")): t.split
            for t in tasks
        }


def test_only_successes_of_train_clusters_become_demonstrations(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    loop_id = replay_loop(session_factory)
    post(session_factory, loop_id, [failure(n) for n in TICKETS])
    curate(session_factory, loop_id)
    splits = _splits_by_ticket(session_factory, loop_id)
    assert set(splits.values()) == {"train", "eval", "heldout"}, splits
    ids = post(session_factory, loop_id, [success(n) for n in TICKETS])
    curate(session_factory, loop_id)  # successes outside the sample: no task, no cluster yet
    waiting = post(session_factory, loop_id, [success(99, external_id="ok-uncurated")])

    selection = _select(session_factory, loop_id)

    trained = {n for n, split in splits.items() if split == "train"}
    source = {ids[n]: n for n in TICKETS}
    used = {source[t.metadata["ratchet"]["source_traces"][0]] for t in selection.tasks}
    assert used == trained
    report = selection.report
    assert report.traces == 2 * len(TICKETS) + 1
    assert report.failures == len(TICKETS)
    assert report.successes == len(TICKETS) + 1
    assert report.used == len(trained)
    assert report.left_out == {
        "eval_cluster": sum(1 for s in splits.values() if s == "eval"),
        "heldout_cluster": sum(1 for s in splits.values() if s == "heldout"),
        "not_curated": len(waiting),
    }
    assert "failures (never used)" in report.summary()

    path = tmp_path / "bootstrap.jsonl"
    assert selection.write(path) == len(trained)
    env = ReplayEnvironment()
    for task in read_task_file(path):
        assert task.metadata["ratchet"]["split"] == "train"
        pairs = env.chat_demonstration(task)
        # Three agent turns: the search and the loans calls (their recorded results
        # replayed as the tool messages that follow), then the answer.
        assert len(pairs) == 3 and pairs[-1][1] == ANSWER
        assert '"search_catalog"' in pairs[0][1] and '"patron_loans"' in pairs[1][1]
        tool_message = pairs[-1][0][-1]
        assert tool_message.role == "tool" and "overdue" in (tool_message.content or "")


def test_sampled_successes_are_regression_or_held_out_tasks_and_never_used(
    session_factory: SessionFactory,
) -> None:
    loop_id = replay_loop(session_factory, success_sample_rate=1.0)
    post(session_factory, loop_id, [failure(n) for n in TICKETS])
    curate(session_factory, loop_id)
    post(session_factory, loop_id, [success(n) for n in TICKETS])
    curate(session_factory, loop_id)

    selection = _select(session_factory, loop_id)

    assert selection.tasks == []
    left = selection.report.left_out
    assert set(left) <= {"regression_task", "heldout_task"}
    assert sum(left.values()) == len(TICKETS) and left["regression_task"] > 0
    assert "0 successes used" in selection.report.summary()


def test_a_success_that_cannot_replay_is_left_out_with_its_reason(
    session_factory: SessionFactory,
) -> None:
    loop_id = replay_loop(session_factory, eval_fraction=0.0, heldout_fraction=0.0)
    unanswered = success(1)
    del unanswered["messages"][5]  # the loans call's result
    no_answer = success(2)
    no_answer["messages"] = no_answer["messages"][:6]  # ends on the tool's result
    no_answer["reference_answer"] = ANSWER  # so curation can still score its task
    post(session_factory, loop_id, [unanswered, no_answer, success(3)])
    curate(session_factory, loop_id)

    selection = _select(session_factory, loop_id)

    assert selection.report.used == 1
    assert selection.report.left_out == {"unanswered_tool_call": 1, "no_final_answer": 1}


def test_the_newest_successes_are_used_up_to_the_limit(session_factory: SessionFactory) -> None:
    loop_id = replay_loop(session_factory, eval_fraction=0.0, heldout_fraction=0.0)
    ids = post(session_factory, loop_id, [success(n) for n in range(5)])
    curate(session_factory, loop_id)

    selection = _select(session_factory, loop_id, limit=2)

    assert [t.metadata["ratchet"]["source_traces"][0] for t in selection.tasks] == ids[:-3:-1]
    assert selection.report.left_out == {"over_limit": 3}


def test_a_loop_of_another_environment_is_refused(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory, "calc", environment="toolcalc")
    with pytest.raises(BootstrapRefused, match="replay environment"):
        _select(session_factory, loop_id)
