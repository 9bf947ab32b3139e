"""Curation of a replay loop on a real Postgres: a library-loans agent's traces become tasks
scored by the most trusted reward each allows (reference, feedback, a successful trace of
the same conversation, the loop's judge), the rest are rejected with the reason, and the
loop's tool-response store is fed and shipped with each dataset."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sqlalchemy import select, text

from services.artifacts import ArtifactStore, uri_to_path
from services.curation.snapshot import snapshot
from services.db.models import Task, ToolResponse
from services.db.session import SessionFactory
from services.environments import get_environment, read_task_file
from services.environments.replay import ReplayEnvironment
from tests.services.curation.support import add_traces, curate_all, make_loop, traces_by_id
from tests.services.environments.replay_traces import (
    USER,
    call,
    failing_trace,
    result,
)


def _curate(session_factory: SessionFactory, loop_id: int) -> None:
    curate_all(session_factory, loop_id, adapter=get_environment("replay"))


def _add_feedback(session_factory: SessionFactory, loop_id: int, trace_id: int, **fb: Any) -> None:
    values = {"score": None, "label": None, "correction": None, "comment": None, **fb}
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
    with session_factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO trace_feedback (loop_id, trace_id, score, label, correction, "
                "comment, content_hash) VALUES (:loop, :trace, :score, :label, :correction, "
                ":comment, :hash)"
            ),
            {"loop": loop_id, "trace": trace_id, "hash": digest, **values},
        )


def _tasks(session_factory: SessionFactory, loop_id: int) -> list[Task]:
    with session_factory() as session:
        return list(session.scalars(select(Task).where(Task.loop_id == loop_id).order_by(Task.id)))


def _question(n: int) -> str:
    return f"{USER} Ticket {n}: patron asks about copy {n * 7919 % 1000} of branch {n}."


def _trace(n: int, **overrides: Any) -> dict[str, Any]:
    trace = failing_trace(f"loan-{n}", **overrides)
    trace["messages"][1] = {"role": "user", "content": _question(n)}
    return trace


def test_replay_traces_become_tasks_by_their_most_trusted_reward(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory, "desk", environment="replay")
    bodies = [
        _trace(1),  # the trace's own reference
        _trace(2, reference_answer=None, metadata={}),  # feedback correction (below)
        _trace(3, reference_answer=None, metadata={}),  # nothing: rejected
        # A success and, later, a failure of the same conversation: the success's answer.
        _trace(4, reference_answer=None, metadata={}, outcome={"success": True}),
        # A reference with nothing the facts rule (the default) could check.
        _trace(5, reference_answer="It is blocked, sorry.", metadata={}),
    ]
    bodies[3]["messages"][-1] = {"role": "assistant", "content": "Hold B-77 placed for P-204."}
    ids = add_traces(session_factory, loop_id, bodies)
    _add_feedback(session_factory, loop_id, ids[1], score=0.0, correction="P-204 has 3 overdue")
    _curate(session_factory, loop_id)
    later = _trace(4, reference_answer=None, metadata={})
    later["external_id"] = "loan-4-again"
    later["messages"][-1] = {"role": "assistant", "content": "It is placed."}
    (later_id,) = add_traces(session_factory, loop_id, [later])
    _curate(session_factory, loop_id)

    rows = traces_by_id(session_factory, [*ids, later_id])
    assert rows[ids[0]].curation_outcome == "task"
    assert rows[ids[1]].curation_outcome == "task"
    assert rows[ids[2]].curation_outcome == "rejected"
    assert (rows[ids[2]].curation_detail or "").startswith("no_reward_source: nothing can score")
    assert rows[ids[3]].curation_outcome == "skipped"  # a success outside the sample
    assert rows[ids[4]].curation_outcome == "rejected"
    assert (rows[ids[4]].curation_detail or "").startswith(
        "no_checkable_facts: the reference answer holds no checkable fact"
    )
    assert "set reference_match" in (rows[ids[4]].curation_detail or "")
    assert rows[later_id].curation_outcome == "task"
    by_source = {
        t.spec["metadata"]["source"]["external_id"]: (
            t.spec["verifier"]["params"]["reward"]["source"],
            t.spec["reference_answer"],
            t.spec["verifier"]["params"]["reward"]["match"],
        )
        for t in _tasks(session_factory, loop_id)
    }
    assert by_source == {
        "loan-1": ("trace", r".*\boverdue\b.*", {"rule": "regex"}),
        "loan-2": (
            "feedback_correction",
            "P-204 has 3 overdue",
            {
                "rule": "facts",
                "facts": [
                    {"kind": "code", "value": "P204", "text": "P-204"},
                    {"kind": "number", "value": "3", "text": "3"},
                ],
            },
        ),
        "loan-4-again": (
            "success_trace",
            "Hold B-77 placed for P-204.",
            {
                "rule": "facts",
                "facts": [
                    {"kind": "code", "value": "B77", "text": "B-77"},
                    {"kind": "code", "value": "P204", "text": "P-204"},
                ],
            },
        ),
    }


def test_feedback_turns_a_claimed_success_into_a_failure(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory, "desk", environment="replay")
    claimed = _trace(5, reference_answer=None, metadata={}, outcome={"success": True})
    (trace_id,) = add_traces(session_factory, loop_id, [claimed])
    correction = "It is blocked by 3 overdue loans"
    _add_feedback(session_factory, loop_id, trace_id, label="wrong", correction=correction)
    _curate(session_factory, loop_id)
    assert traces_by_id(session_factory, [trace_id])[trace_id].curation_outcome == "task"
    (task,) = _tasks(session_factory, loop_id)
    assert task.origin == "failure" and task.spec["reference_answer"] == correction


def test_a_judge_loop_marks_judge_only_tasks(session_factory: SessionFactory) -> None:
    policy = {"judge_endpoint": "grader", "judge_rubric": "Holds for overdue patrons fail."}
    loop_id = make_loop(session_factory, "desk", environment="replay", curation_policy=policy)
    traces = [
        _trace(6, reference_answer=None, metadata={}),  # nothing but the judge
        _trace(7, reference_answer="It is blocked, sorry.", metadata={}),  # no fact to check
        _trace(8, reference_answer="Blocked: P-204 has 3 overdue loans.", metadata={}),
    ]
    add_traces(session_factory, loop_id, traces)
    _curate(session_factory, loop_id)
    tasks = {
        t.spec["metadata"]["source"]["external_id"]: t for t in _tasks(session_factory, loop_id)
    }
    alone, guided, facts = tasks["loan-6"], tasks["loan-7"], tasks["loan-8"]
    assert alone.spec["metadata"]["verifier_kind"] == "judge"
    assert alone.spec["verifier"]["params"]["reward"]["rubric"] == policy["judge_rubric"]
    # The reference-guided judge decides where the reference has no fact, and sees it.
    assert guided.spec["metadata"]["verifier_kind"] == "judge"
    assert guided.spec["reference_answer"] == "It is blocked, sorry."
    # Where the facts rule can check, it decides; the judge rides along for the comparison.
    assert facts.spec["metadata"]["verifier_kind"] == "reference"
    reward = facts.spec["verifier"]["params"]["reward"]
    assert reward["match"]["rule"] == "facts" and reward["judge"]["endpoint"] == "grader"


def test_the_store_is_fed_by_every_trace_and_shipped_with_the_dataset(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    loop_id = make_loop(
        session_factory,
        "desk",
        environment="replay",
        curation_policy={"eval_fraction": 0.0, "heldout_fraction": 0.0},
    )
    # A success that looked up the patron's loans; its calls answer the failures' tasks.
    success = _trace(7, outcome={"success": True})
    success["messages"][2:] = [
        call("c9", "patron_loans", {"patron_id": "P-204", "limit": 10.0}),
        result("c9", "patron_loans", '{"open": 2, "overdue": 3}'),
        {"role": "assistant", "content": "Blocked: 3 overdue loans."},
    ]
    add_traces(session_factory, loop_id, [_trace(8), success])
    _curate(session_factory, loop_id)
    with session_factory() as session:
        stored = {
            (row.tool, row.arguments)
            for row in session.scalars(select(ToolResponse).where(ToolResponse.loop_id == loop_id))
        }
    assert ("patron_loans", '{"limit":10,"patron_id":"P-204"}') in stored
    assert ("place_hold", '{"book_id":"B-77","patron_id":"P-204"}') in stored

    dataset = snapshot(session_factory, ArtifactStore(tmp_path / "artifacts"), loop_name="desk")
    directory = uri_to_path(dataset.train_uri).parent
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["tool_store"]["count"] == 3 and manifest["tool_store"]["version"] > 0
    (task,) = read_task_file(uri_to_path(dataset.train_uri))
    assert task.metadata["ratchet"]["tool_store"] == str(directory / "tool_responses.jsonl")
    env = ReplayEnvironment()
    # Recorded in the other trace, with the limit written as an integer this time.
    assert env.tool_result(task, "patron_loans", {"patron_id": "P-204", "limit": 10}) == (
        '{"open": 2, "overdue": 3}'
    )
    assert env.tool_result(task, "patron_loans", {"patron_id": "P-1"}).startswith(
        "error: no recorded result for tool patron_loans"
    )
