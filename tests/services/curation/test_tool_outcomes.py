"""The worker's side of a replay job's sandbox, in Postgres: listed live answers join the
loop's tool-response store only when the listing vouches for them and the loop's terms allow
them; a task whose every episode hit an unanswerable call is set aside, shown with its reason
and left out of the next train split until an operator restores it; what a job cannot be
trusted on records nothing and says why on the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from services.curation.tool_outcomes import ToolOutcomes, record_job_tool_outcomes
from services.db.models import Dataset, DatasetTask, Loop, Run, Task, ToolResponse
from services.db.queries import task_set_aside
from services.db.queries import tasks as task_queries
from services.db.session import SessionFactory
from services.environments.base import TaskSpec
from services.environments.replay import ReplayEnvironment
from services.environments.replay.records import RecordedCall, canonical_arguments, schema_hash
from services.environments.replay.sandbox import write_tool_answers
from services.settings import ToolEndpoint
from tests.services.curation.support import make_loop
from tests.services.environments.mcp_support import ENDPOINT, TOOLS, airport_trace

ENDPOINTS = {ENDPOINT: ToolEndpoint(kind="mcp", command=["desk"], tools=["gate_walk_minutes"])}
GATE_TOOL = next(tool for tool in TOOLS if tool["name"] == "gate_walk_minutes")


class Seeded:
    """A replay loop naming the ``desk`` endpoint, two train tasks, a dataset of them and a
    succeeded train run of that dataset."""

    def __init__(self, session_factory: SessionFactory) -> None:
        self.sessions = session_factory
        self.loop_id = make_loop(session_factory, "desk", environment="replay")
        env = ReplayEnvironment()
        specs = [env.task_from_trace(airport_trace(f"gate-{n}")) for n in (1, 2)]
        assert all(isinstance(spec, TaskSpec) for spec in specs)
        self.job_ids = [spec.task_id for spec in specs if isinstance(spec, TaskSpec)]
        with session_factory.begin() as session:
            loop = session.get(Loop, self.loop_id)
            assert loop is not None
            loop.curation_policy = {"tool_endpoint": ENDPOINT}
            rows = [
                Task(
                    loop_id=self.loop_id,
                    content_hash=spec.task_id,
                    environment="replay",
                    spec=spec.to_dict(),
                    cluster_id=f"c{n}",
                    split="train",
                )
                for n, spec in enumerate(specs)
                if isinstance(spec, TaskSpec)
            ]
            session.add_all(rows)
            session.flush()
            dataset = Dataset(
                loop_id=self.loop_id,
                content_hash="d" * 64,
                train_count=2,
                eval_count=0,
                train_uri="file:///train.jsonl",
                eval_uri="file:///eval.jsonl",
            )
            session.add(dataset)
            session.flush()
            for row in rows:
                session.add(DatasetTask(dataset_id=dataset.id, task_id=row.id, split="train"))
            session.add(
                Run(
                    id="desk-c1-train",
                    loop_id=self.loop_id,
                    kind="train",
                    executor="local",
                    spec={},
                    status="succeeded",
                    dataset_id=dataset.id,
                )
            )
            self.task_rows = [row.id for row in rows]

    def record(self, output_dir: Path, metrics: dict[str, Any]) -> tuple[ToolOutcomes, str | None]:
        with self.sessions.begin() as session:
            run = session.get(Run, "desk-c1-train")
            assert run is not None
            outcomes = record_job_tool_outcomes(
                session, run=run, output_dir=output_dir, metrics=metrics, tool_endpoints=ENDPOINTS
            )
            return outcomes, run.error

    def stored(self) -> list[tuple[str, str, str]]:
        with self.sessions() as session:
            rows = session.execute(
                select(ToolResponse.tool, ToolResponse.arguments, ToolResponse.result).where(
                    ToolResponse.loop_id == self.loop_id
                )
            ).all()
            return [(r[0], r[1], r[2]) for r in rows]


@pytest.fixture
def seeded(session_factory: SessionFactory) -> Seeded:
    return Seeded(session_factory)


def answer(tool: dict[str, Any] = GATE_TOOL, gate: str = "D4") -> RecordedCall:
    return RecordedCall(
        str(tool["name"]), schema_hash(tool), canonical_arguments({"gate": gate}), f"{gate}: 11"
    )


def test_listed_answers_join_the_loops_store(seeded: Seeded, tmp_path: Path) -> None:
    listing = write_tool_answers(tmp_path, [answer()])
    outcomes, error = seeded.record(tmp_path, {"tool_answers": listing})
    assert outcomes == ToolOutcomes(answers_stored=1) and error is None
    assert seeded.stored() == [("gate_walk_minutes", '{"gate":"D4"}', "D4: 11")]
    # Recording the same run again (a retried activity) adds nothing.
    assert seeded.record(tmp_path, {"tool_answers": listing})[0].answers_stored == 1
    assert len(seeded.stored()) == 1


@pytest.mark.parametrize(
    ("calls", "metrics_edit", "reason"),
    [
        ([answer()], {"file": "other.jsonl"}, "must list the file 'tool_answers.jsonl'"),
        ([answer()], {"count": 2}, "holds 1 answers, its listing says 2"),
        ([answer()], {"sha256": "0" * 64}, "does not match the sha256"),
        ([answer()], {"bytes": -1}, "bytes must be a non-negative integer"),
        (
            [RecordedCall("rebook", schema_hash(GATE_TOOL), "{}", "rebooked")],
            {},
            "that the loop's endpoint does not allow-list",
        ),
        (
            [answer({**GATE_TOOL, "parameters": {"type": "object"}})],
            {},
            "which no task of the run has",
        ),
    ],
)
def test_answers_the_job_cannot_vouch_for_store_nothing_and_say_why(
    seeded: Seeded,
    tmp_path: Path,
    calls: list[RecordedCall],
    metrics_edit: dict[str, Any],
    reason: str,
) -> None:
    listing = {**write_tool_answers(tmp_path, calls), **metrics_edit}
    outcomes, error = seeded.record(tmp_path, {"tool_answers": listing})
    assert outcomes.answers_stored == 0 and seeded.stored() == []
    assert error is not None and error.startswith("tool answers rejected, none stored")
    assert reason in error


def test_answers_of_a_loop_naming_no_endpoint_are_refused(seeded: Seeded, tmp_path: Path) -> None:
    with seeded.sessions.begin() as session:
        loop = session.get(Loop, seeded.loop_id)
        assert loop is not None
        loop.curation_policy = {}
    _, error = seeded.record(tmp_path, {"tool_answers": write_tool_answers(tmp_path, [answer()])})
    assert error is not None and "names no tool endpoint" in error
    assert seeded.stored() == []


def test_a_task_whose_every_episode_hit_an_unanswerable_call_is_set_aside(
    seeded: Seeded, tmp_path: Path
) -> None:
    hopeless, partial = seeded.job_ids
    report = {
        hopeless: {"calls": 3, "episodes": 2, "episodes_unanswered": 2},
        partial: {"calls": 1, "episodes": 2, "episodes_unanswered": 1},
        "f" * 64: {"calls": 2, "episodes": 2, "episodes_unanswered": 2},  # not the run's
    }
    outcomes, error = seeded.record(tmp_path, {"unanswerable_calls": report})
    assert error is None and outcomes.set_aside == (seeded.task_rows[0],)
    with seeded.sessions() as session:
        rows = {row.id: row for row in session.scalars(select(Task))}
        aside = rows[seeded.task_rows[0]]
        assert aside.set_aside_reason == "unanswerable_calls"
        assert aside.set_aside_at is not None
        assert aside.set_aside_detail == (
            "every one of its 2 episode(s) in run desk-c1-train needed a tool result nobody "
            "could give (3 call(s): no recorded result, no live endpoint or a tool off its "
            "allow-list, or the endpoint failed)"
        )
        assert rows[seeded.task_rows[1]].set_aside_reason is None
        train = task_queries.split_members(session=session, loop_id=seeded.loop_id, split="train")
        assert [m.task_id for m in train] == [seeded.task_rows[1]]
    # An operator brings it back (its tool allow-listed since, say).
    with seeded.sessions.begin() as session:
        restored = task_set_aside.restore_tasks(
            session=session, loop_id=seeded.loop_id, task_ids=seeded.task_rows
        )
        assert restored == [seeded.task_rows[0]]
        train = task_queries.split_members(session=session, loop_id=seeded.loop_id, split="train")
        assert len(train) == 2


def test_one_episode_is_too_few_to_set_a_task_aside(seeded: Seeded, tmp_path: Path) -> None:
    report = {seeded.job_ids[0]: {"calls": 1, "episodes": 1, "episodes_unanswered": 1}}
    outcomes, error = seeded.record(tmp_path, {"unanswerable_calls": report})
    assert outcomes.set_aside == () and error is None


@pytest.mark.parametrize(
    ("report", "reason"),
    [
        ([1, 2], "must be an object of task id -> counts"),
        ({"t" * 65: {}}, "the key must be a task id"),
        ({"t": 3}, "must be an object of counts"),
        ({"t": {"calls": 1, "episodes": 1}}, "episodes_unanswered must be a non-negative"),
        ({"t": {"calls": 1, "episodes": 1, "episodes_unanswered": 2}}, "cannot all hold"),
        ({"t": {"calls": 0, "episodes": 1, "episodes_unanswered": 1}}, "cannot all hold"),
        ({"t": {"calls": True, "episodes": 1, "episodes_unanswered": 1}}, "calls must be"),
    ],
)
def test_a_malformed_unanswerable_report_sets_nothing_aside(
    seeded: Seeded, tmp_path: Path, report: Any, reason: str
) -> None:
    outcomes, error = seeded.record(tmp_path, {"unanswerable_calls": report})
    assert outcomes.set_aside == ()
    assert error is not None and error.startswith("unanswerable_calls rejected")
    assert reason in error
