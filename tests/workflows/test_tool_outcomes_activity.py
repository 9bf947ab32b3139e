"""Tools the trace never called, end to end at the activity level: a replay loop's job asks
its MCP endpoint what nobody recorded, the worker records the answer in the loop's store
and sets aside the task whose every episode needed a tool nobody could answer, and the next
snapshot ships the answer (its rollouts replay it: the server is not asked again) and leaves
the set-aside task out of its train split.

Real Temporal dev server, real Postgres, a real job process through the local executor, a
real MCP server (the SDK's, over stdio, started by the job from the deployment's settings).
The job's policy is a script (a model would choose the same calls only by chance): it runs
the replay environment as the train and eval jobs do, and writes ``metrics.json`` with the
same function they call.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select
from temporalio.client import Client

from services.artifacts import uri_to_path
from services.curation.snapshot import snapshot
from services.db.models import Dataset, Loop, Task, ToolResponse
from services.db.session import SessionFactory
from services.environments.base import TaskSpec, read_task_file
from services.environments.replay import ReplayEnvironment
from services.environments.replay.endpoints import from_job_env
from services.environments.replay.records import canonical_arguments
from services.environments.replay.sandbox import TOOL_ANSWERS_FILE
from services.loop.job_documents import endpoint_env
from services.settings import ToolEndpoint
from tests.services.environments.mcp_support import (
    ENDPOINT,
    airport_trace,
    calls_made,
    stdio_command,
)
from tests.services.environments.replay_traces import hermes
from tests.workflows.test_jobs_activity import World, run_job, worker

pytestmark = pytest.mark.slow

# The job: two episodes per task. Task "gate-1" asks the gate's walking time (nobody recorded
# it; the allow-listed MCP tool answers); task "gate-2" asks to rebook, a tool off the
# endpoint's allow-list, in both of its episodes. TAMPER rewrites the answers file after.
JOB = """
import json, os, pathlib
from services.environments.base import read_task_file
from services.environments.replay.endpoints import from_job_env
from services.training.jobspec import environment_outputs, write_json

out = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"])
tasks = read_task_file(pathlib.Path(os.environ["RATCHET_DATASET"]))
env = from_job_env()

def call(name, arguments):
    return "<tool_call>\\n" + json.dumps({"name": name, "arguments": arguments}) + "\\n</tool_call>"

for task in tasks:
    asks_gate = "gate-1" in task.prompt
    completion = call("gate_walk_minutes", {"gate": "D4"}) if asks_gate else call(
        "rebook", {"flight": "LX318"}
    )
    for _ in range(2):
        episode = env.chat_start(task, max_turns=3)
        env.chat_step(task, episode, completion)
        env.chat_step(task, episode, "LX318: gate D4, an 11 minute walk.")
        env.chat_verify(task, episode)
metrics = environment_outputs(env, out)
if TAMPER:
    path = out / "tool_answers.jsonl"
    path.write_text(path.read_text().replace("11 minute", "12 minute"))
write_json(out / "metrics.json", metrics)
"""


class ReplayWorld(World):
    """A replay loop whose curation policy names the deployment's MCP endpoint ``desk``
    (its allow-list: the lookups, never ``rebook``), with the two tasks of the airport desk
    in its train split and a first snapshot of them."""

    def __init__(self, session_factory: SessionFactory, tmp_path: Path) -> None:
        super().__init__(session_factory, tmp_path)
        self.calls = tmp_path / "server-calls.jsonl"
        self.settings = self.settings.model_copy(
            update={
                "tool_endpoints": {
                    ENDPOINT: ToolEndpoint(
                        kind="mcp",
                        command=stdio_command(self.calls),
                        tools=["gate_walk_minutes", "flight_status"],
                    )
                }
            }
        )
        with session_factory.begin() as session:
            loop = session.scalars(select(Loop).where(Loop.name == self.loop)).one()
            loop.environment = "replay"
            loop.curation_policy = {"tool_endpoint": ENDPOINT}
            env = ReplayEnvironment()
            self.tasks: dict[str, int] = {}
            for external_id in ("gate-1", "gate-2"):
                spec = env.task_from_trace(airport_trace(external_id))
                assert isinstance(spec, TaskSpec)
                task = Task(
                    loop_id=loop.id,
                    content_hash=spec.task_id,
                    environment="replay",
                    spec=spec.to_dict(),
                    cluster_id=f"cluster-{external_id}",
                    split="train",
                )
                session.add(task)
                session.flush()
                self.tasks[external_id] = task.id
        self.dataset = snapshot(self.sessions, self.artifacts, loop_name=self.loop, cycle=1)

    def script(self, *, tamper: bool = False) -> str:
        return f"TAMPER = {tamper!r}\n" + JOB


@pytest.fixture
def world(session_factory: SessionFactory, tmp_path: Path) -> ReplayWorld:
    return ReplayWorld(session_factory, tmp_path)


async def test_a_live_answer_is_stored_a_hopeless_task_set_aside_and_the_next_snapshot_shows_both(
    temporal_client: Client, task_queue: str, world: ReplayWorld
) -> None:
    run_id = f"{world.loop}-c1-train"
    activities = world.activities(world.script())
    async with worker(temporal_client, task_queue, activities):
        result = await run_job(
            temporal_client,
            task_queue,
            world.job_input(run_id, dataset_id=world.dataset.dataset_id),
        )
    assert result.status == "succeeded" and result.error is None, result.error

    # The job asked the server once (a second identical call came from its own answers) and
    # never asked it to rebook.
    assert calls_made(world.calls) == [{"tool": "gate_walk_minutes", "arguments": {"gate": "D4"}}]
    metrics = json.loads((world.output_dir(run_id) / "metrics.json").read_text())
    assert metrics["tool_answers"]["file"] == TOOL_ANSWERS_FILE
    assert metrics["tool_answers"]["count"] == 1
    assert metrics["tool_endpoints"][ENDPOINT]["refused"] == 2
    assert list(metrics["unanswerable_calls"].values()) == [
        {"calls": 2, "episodes": 2, "episodes_unanswered": 2}
    ]

    with world.sessions() as session:
        stored = session.scalars(select(ToolResponse).where(ToolResponse.tool != "<answer>")).all()
        live = [row for row in stored if row.tool == "gate_walk_minutes"]
        assert [(r.arguments, r.result, r.trace_id) for r in live] == [
            (canonical_arguments({"gate": "D4"}), "D4: an 11 minute walk", None)
        ]
        gate_1, gate_2 = (session.get(Task, world.tasks[k]) for k in ("gate-1", "gate-2"))
        assert gate_1 is not None and gate_2 is not None
        assert gate_1.set_aside_reason is None
        assert gate_2.set_aside_reason == "unanswerable_calls"
        assert gate_2.set_aside_detail is not None and "every one of its 2 episode(s)" in (
            gate_2.set_aside_detail
        )

    # The next snapshot: a new dataset (the store grew), without the set-aside task, whose
    # store file holds the live answer.
    following = snapshot(world.sessions, world.artifacts, loop_name=world.loop, cycle=2)
    assert following.dataset_id != world.dataset.dataset_id
    with world.sessions() as session:
        dataset = session.get(Dataset, following.dataset_id)
        assert dataset is not None
        train_file = uri_to_path(dataset.train_uri)
    tasks = read_task_file(train_file)
    assert [task.prompt.count("gate-1") for task in tasks] == [1]

    # Its rollouts replay the answer: the server is not asked again.
    env = from_job_env(endpoint_env({"tool_endpoint": ENDPOINT}, world.settings))
    try:
        episode = env.chat_start(tasks[0], max_turns=3)
        env.chat_step(tasks[0], episode, hermes("gate_walk_minutes", {"gate": "D4"}))
        assert episode.messages[-1].content == "D4: an 11 minute walk"
    finally:
        env.close()
    assert len(calls_made(world.calls)) == 1


async def test_a_tampered_answers_file_stores_nothing_and_says_why(
    temporal_client: Client, task_queue: str, world: ReplayWorld
) -> None:
    run_id = f"{world.loop}-c1-train"
    activities = world.activities(world.script(tamper=True))
    async with worker(temporal_client, task_queue, activities):
        result = await run_job(
            temporal_client,
            task_queue,
            world.job_input(run_id, dataset_id=world.dataset.dataset_id),
        )
    assert result.status == "succeeded"
    assert result.error is not None and "tool answers rejected, none stored" in result.error
    assert "sha256" in result.error
    with world.sessions() as session:
        tools = session.scalars(select(ToolResponse.tool)).all()
        assert "gate_walk_minutes" not in tools
        # The unanswerable count is the job's metrics, which the run keeps: it still counts.
        gate_2 = session.get(Task, world.tasks["gate-2"])
        assert gate_2 is not None and gate_2.set_aside_reason == "unanswerable_calls"
