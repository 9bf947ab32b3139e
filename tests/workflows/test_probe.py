"""The difficulty probe on a real Postgres and the real Temporal dev server.

The activities (export, pass rates, record) run against Postgres. The loop-level tests run
LoopWorkflow with the real curation, job and loop activities: traces are curated into train
tasks, the probe job runs through the local executor — a small program honouring the job
contract that "solves" a task always, never or half the time by its prompt — and the
snapshot keeps only the task with a mixed pass rate. Every split is train (no eval tasks),
so each cycle ends ``no_data`` right after its snapshot: no trainer needed.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

from services.artifacts import ArtifactStore, path_to_uri, uri_to_path
from services.db.models import Checkpoint, Cycle, Dataset, DatasetTask, Loop, Run, Task
from services.db.queries import tasks as q
from services.db.session import SessionFactory
from services.environments.base import read_task_file
from services.evaluation.job import _options
from services.executors.local import LocalExecutor
from services.settings import Settings
from services.training.jobspec import job_environment, load_spec
from tests.services.curation.support import add_traces, make_loop, qa_resolver, trace_body
from workflows.activities.curation import CurationActivities
from workflows.activities.jobs import JobActivities
from workflows.activities.stages import StageActivities
from workflows.curate import CurateWorkflow
from workflows.loop import LoopWorkflow
from workflows.payloads.curation import CurateBatchInput
from workflows.payloads.loop import LoopInput
from workflows.payloads.probe import (
    ExportProbeTasksInput,
    ProbeInput,
    ProbePassRatesInput,
    RecordProbesInput,
)
from workflows.probe import ProbeWorkflow, probe_job_spec

QUESTIONS = {
    "always": "always solved: which warehouse ships the blue parcel today",
    "never": "never solved: why was the customs label on invoice 77 rejected",
    "mixed": "sometimes solved: how do I reset the billing password of my premium plan",
}

# A probe job honouring the job contract: per task, `samples` rollouts of which all, none or
# half pass, by the word the prompt starts with.
PROBE_JOB = """
import json, os, pathlib, sys
spec = json.loads(pathlib.Path(os.environ["RATCHET_JOB_SPEC"]).read_text())
out = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"])
out.mkdir(parents=True, exist_ok=True)
if sys.argv[1] != "eval" or spec["kind"] != "eval":
    print("a probe is an eval job", file=sys.stderr)
    sys.exit(2)
samples = spec["samples"]
rows = []
for line in pathlib.Path(os.environ["RATCHET_DATASET"]).read_text().splitlines():
    task = json.loads(line)
    prompt = task["prompt"]
    passes = samples if "always" in prompt else 0 if "never" in prompt else samples // 2
    rows.append({"task_id": TASK_ID, "passed": passes * 2 > samples, "reward": passes / samples,
                 "samples": samples, "sample_passes": passes})
(out / "results.jsonl").write_text("".join(json.dumps(row) + "\\n" for row in rows))
(out / "metrics.json").write_text(json.dumps({"n": len(rows)}))
"""
GOOD_JOB = PROBE_JOB.replace("TASK_ID", 'task["task_id"]')
FAILING_JOB = 'import sys\nprint("CUDA out of memory", file=sys.stderr)\nsys.exit(1)\n'
CONFIG_ERROR_JOB = 'import sys\nprint("unknown environment", file=sys.stderr)\nsys.exit(2)\n'
WRONG_TASKS_JOB = PROBE_JOB.replace("TASK_ID", '"f" * 64')


def curated_loop(
    session_factory: SessionFactory, tmp_path: Path, *, difficulty_filter: bool = True
) -> str:
    """A loop whose three failures become train tasks, with a registered champion."""
    name = f"probe-{uuid.uuid4().hex[:8]}"
    loop_id = make_loop(
        session_factory,
        name=name,
        curation_policy={
            "success_sample_rate": 0.0,
            "eval_fraction": 0.0,
            "heldout_fraction": 0.0,
            "difficulty_filter": difficulty_filter,
            "probe_attempts": 4,
        },
        trigger_policy={"min_new_tasks": 1, "check_interval_s": 0.2, "drift_enabled": False},
    )
    add_traces(
        session_factory,
        loop_id,
        [trace_body(key, text, answer=key) for key, text in QUESTIONS.items()],
    )
    champion = tmp_path / f"champion-{name}"
    champion.mkdir()
    with session_factory.begin() as session:
        checkpoint_id = uuid.uuid4().hex
        session.add(
            Checkpoint(
                id=checkpoint_id,
                loop_id=loop_id,
                uri=path_to_uri(champion),
                format="safetensors",
                size_bytes=0,
                sha256="0" * 64,
                manifest={},
            )
        )
        session.flush()
        loop = session.get(Loop, loop_id)
        assert loop is not None
        loop.champion_checkpoint_id = checkpoint_id
    return name


def curate(acts: CurationActivities, name: str) -> None:
    ActivityEnvironment().run(acts.curate_batch, CurateBatchInput(name))


def task_by_question(session_factory: SessionFactory, name: str) -> dict[str, Task]:
    with session_factory() as session:
        tasks = session.scalars(select(Task).join(Loop).where(Loop.name == name)).all()
        session.expunge_all()
    return {key: t for t in tasks for key, text in QUESTIONS.items() if text in t.spec["prompt"]}


def curated_tasks(
    session_factory: SessionFactory, acts: CurationActivities, tmp_path: Path
) -> tuple[str, dict[str, Task]]:
    """A :func:`curated_loop`, curated: its name and its train tasks by question."""
    name = curated_loop(session_factory, tmp_path)
    curate(acts, name)
    return name, task_by_question(session_factory, name)


def record_pass_rate(session_factory: SessionFactory, task: Task, rate: float) -> None:
    with session_factory.begin() as session:
        q.record_probe_results(session=session, loop_id=task.loop_id, pass_rates={task.id: rate})


def application_error(exc: pytest.ExceptionInfo[ApplicationError]) -> tuple[str | None, bool]:
    return exc.value.type, exc.value.non_retryable


# Activities ---------------------------------------------------------------------------------


@pytest.fixture
def acts(session_factory: SessionFactory, tmp_path: Path) -> CurationActivities:
    return CurationActivities(
        session_factory, ArtifactStore(tmp_path / "artifacts"), adapters=qa_resolver
    )


def test_export_writes_the_unprobed_train_tasks_once(
    session_factory: SessionFactory, acts: CurationActivities, tmp_path: Path
) -> None:
    name, tasks = curated_tasks(session_factory, acts, tmp_path)
    record_pass_rate(session_factory, tasks["always"], 1.0)
    env = ActivityEnvironment()
    run_id = f"{name}-c1-probe"
    first = env.run(acts.export_probe_tasks, ExportProbeTasksInput(name, run_id))
    assert first.count == 2
    assert sorted(first.task_ids) == sorted([tasks["never"].id, tasks["mixed"].id])
    assert first.task_uri is not None
    path = uri_to_path(first.task_uri)
    assert path == tmp_path / "artifacts" / "loops" / name / "runs" / run_id / "probe-tasks.jsonl"
    lines = read_task_file(path)  # the ratchet.task/v1 format the eval job reads
    assert sorted(t.metadata["ratchet"]["task_id"] for t in lines) == sorted(first.task_ids)
    assert {t.metadata["ratchet"]["split"] for t in lines} == {"train"}
    assert {t.task_id for t in lines} == {tasks[k].spec["task_id"] for k in ("never", "mixed")}
    written = path.read_bytes()

    # A retry returns the file the first attempt wrote, even after the tasks changed.
    record_pass_rate(session_factory, tasks["never"], 0.0)
    again = env.run(acts.export_probe_tasks, ExportProbeTasksInput(name, run_id))
    assert (again.task_uri, again.task_ids) == (first.task_uri, first.task_ids)
    assert path.read_bytes() == written

    # Another run exports what is unprobed now, capped by max_tasks.
    other = env.run(acts.export_probe_tasks, ExportProbeTasksInput(name, f"{name}-c2-probe", 1))
    assert other.task_ids == [tasks["mixed"].id]
    record_pass_rate(session_factory, tasks["mixed"], 0.5)
    none = env.run(acts.export_probe_tasks, ExportProbeTasksInput(name, f"{name}-c3-probe"))
    assert (none.task_uri, none.count, none.task_ids) == (None, 0, [])
    assert not (path.parent.parent / f"{name}-c3-probe").exists()

    with pytest.raises(ApplicationError, match="does not exist") as raised:
        env.run(acts.export_probe_tasks, ExportProbeTasksInput("nope", "nope-c1-probe"))
    assert application_error(raised) == ("ProbeFailed", True)


def test_probe_results_become_pass_rates_of_the_exported_tasks(
    session_factory: SessionFactory, acts: CurationActivities, tmp_path: Path
) -> None:
    name, tasks = curated_tasks(session_factory, acts, tmp_path)
    env = ActivityEnvironment()
    exported = env.run(acts.export_probe_tasks, ExportProbeTasksInput(name, f"{name}-c1-probe"))
    output = tmp_path / "output"
    output.mkdir()
    passes = {"always": 8, "never": 0, "mixed": 3}
    rows = [
        {"task_id": tasks[k].spec["task_id"], "passed": n > 4, "samples": 8, "sample_passes": n}
        for k, n in passes.items()
    ]
    (output / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = env.run(
        acts.probe_pass_rates,
        ProbePassRatesInput(name, path_to_uri(output), exported.task_ids),
    )
    assert result.pass_rates == {
        tasks["always"].id: 1.0,
        tasks["never"].id: 0.0,
        tasks["mixed"].id: 0.375,
    }
    assert (result.kept, result.too_easy, result.too_hard) == (1, 1, 1)

    # Results naming a task that was not given are not this probe's: refused.
    given = [tasks["never"].id, tasks["mixed"].id]
    with pytest.raises(ApplicationError, match="not probed") as raised:
        env.run(acts.probe_pass_rates, ProbePassRatesInput(name, path_to_uri(output), given))
    assert application_error(raised) == ("BadProbeOutput", True)
    (output / "results.jsonl").write_text('{"task_id": "abc", "passed": true}\n')
    with pytest.raises(ApplicationError, match="no sample counts") as raised:
        env.run(acts.probe_pass_rates, ProbePassRatesInput(name, path_to_uri(output), given))
    assert application_error(raised) == ("BadProbeOutput", True)
    missing = path_to_uri(tmp_path / "no-output")
    with pytest.raises(ApplicationError, match="cannot read") as raised:
        env.run(acts.probe_pass_rates, ProbePassRatesInput(name, missing, given))
    assert application_error(raised) == ("BadProbeOutput", True)


def test_record_probes_sets_absolute_values(
    session_factory: SessionFactory, acts: CurationActivities, tmp_path: Path
) -> None:
    name = curated_loop(session_factory, tmp_path)
    other = curated_loop(session_factory, tmp_path)
    curate(acts, name)
    curate(acts, other)
    tasks = task_by_question(session_factory, name)
    env = ActivityEnvironment()
    rates = {tasks["always"].id: 1.0, tasks["mixed"].id: 0.25}
    assert env.run(acts.record_probes, RecordProbesInput(name, rates)).updated == 2
    assert env.run(acts.record_probes, RecordProbesInput(name, rates)).updated == 2  # a retry
    after = task_by_question(session_factory, name)
    assert {k: t.probe_pass_rate for k, t in after.items()} == {
        "always": 1.0,
        "never": None,
        "mixed": 0.25,
    }
    # Another loop's tasks are out of reach.
    foreign = task_by_question(session_factory, other)["never"].id
    assert env.run(acts.record_probes, RecordProbesInput(name, {foreign: 0.5})).updated == 0
    assert task_by_question(session_factory, other)["never"].probe_pass_rate is None

    with pytest.raises(ApplicationError, match="outside") as raised:
        env.run(acts.record_probes, RecordProbesInput(name, {tasks["never"].id: 1.5}))
    assert application_error(raised) == ("InvalidInput", True)
    with pytest.raises(ApplicationError, match="does not exist") as raised:
        env.run(acts.record_probes, RecordProbesInput("nope", rates))
    assert application_error(raised) == ("NotFound", True)


def test_the_probe_spec_is_a_valid_eval_job_spec(tmp_path: Path) -> None:
    """The real eval job's parser accepts the probe's spec: K samples at temperature 1."""
    input = ProbeInput("bot", 3, "toolcalc", "ckpt", "file:///ckpt", attempts=6)
    spec = probe_job_spec(input, "file:///runs/tasks.jsonl", "bot-c3-probe")
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    loaded = load_spec(
        str(path), job_environment({"RATCHET_OUTPUT_DIR": str(tmp_path)}), kind="eval"
    )
    assert _options(loaded) == {"temperature": 1.0, "samples": 6}
    assert (loaded.checkpoint, loaded.dataset) == (Path("/ckpt"), Path("/runs/tasks.jsonl"))
    assert loaded.seed == 3


# The loop -----------------------------------------------------------------------------------


def loop_worker(
    client: Client,
    task_queue: str,
    session_factory: SessionFactory,
    tmp_path: Path,
    job: str,
) -> Worker:
    artifacts = ArtifactStore(tmp_path / "artifacts")
    curation = CurationActivities(session_factory, artifacts, adapters=qa_resolver)
    jobs = JobActivities(
        session_factory=session_factory,
        executors={
            "local": LocalExecutor(
                command=[sys.executable, "-c", textwrap.dedent(job)],
                poll_interval_s=0.05,
                cancel_grace_s=5,
            )
        },
        artifacts=artifacts,
        # A dollar per CPU-second, so even a tiny job has a visible cost.
        settings=Settings(state_dir=tmp_path / "state", cpu_hour_price_usd=3600.0),
    )
    loop = StageActivities.build(session_factory, lambda target, checkpoint_id, uri: checkpoint_id)
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[LoopWorkflow, CurateWorkflow, ProbeWorkflow],
        activities=[
            *curation.activities(),
            jobs.run_job,
            loop.cycle.load_loop_config,
            loop.cycle.start_cycle,
            loop.cycle.set_cycle_stage,
            loop.cycle.close_cycle,
        ],
        activity_executor=concurrent.futures.ThreadPoolExecutor(8),
    )


async def run_one_cycle(
    client: Client,
    task_queue: str,
    session_factory: SessionFactory,
    tmp_path: Path,
    job: str,
    name: str,
) -> None:
    async with loop_worker(client, task_queue, session_factory, tmp_path, job):
        result = await client.execute_workflow(
            LoopWorkflow.run,
            LoopInput(loop=name, max_cycles=1),
            id=f"loop/{name}",
            task_queue=task_queue,
        )
    assert (result.cycles_done, result.last_outcome) == (1, "no_data")


def cycle_records(
    session_factory: SessionFactory, name: str
) -> tuple[Cycle, list[Run], Dataset, set[int]]:
    with session_factory() as session:
        loop = session.scalars(select(Loop).where(Loop.name == name)).one()
        cycle = session.scalars(select(Cycle).where(Cycle.loop_id == loop.id)).one()
        runs = list(session.scalars(select(Run).where(Run.loop_id == loop.id)).all())
        dataset = session.scalars(select(Dataset).where(Dataset.loop_id == loop.id)).one()
        train = set(
            session.scalars(
                select(DatasetTask.task_id).where(
                    DatasetTask.dataset_id == dataset.id, DatasetTask.split == "train"
                )
            ).all()
        )
        session.expunge_all()
    return cycle, runs, dataset, train


async def test_the_loop_probes_and_the_snapshot_keeps_only_mixed_tasks(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory, tmp_path: Path
) -> None:
    name = curated_loop(session_factory, tmp_path)
    await run_one_cycle(temporal_client, task_queue, session_factory, tmp_path, GOOD_JOB, name)
    tasks = task_by_question(session_factory, name)
    assert {k: t.probe_pass_rate for k, t in tasks.items()} == {
        "always": 1.0,
        "never": 0.0,
        "mixed": 0.5,
    }
    cycle, runs, dataset, train = cycle_records(session_factory, name)
    assert train == {tasks["mixed"].id}
    assert dataset.stats["difficulty"] == {"kept": 1, "too_easy": 1, "too_hard": 1, "unprobed": 0}
    # Evaluations map results to tasks with the same lookup, scoped to their dataset.
    job_task_ids = [t.spec["task_id"] for t in tasks.values()]
    with session_factory() as session:
        in_dataset = q.row_ids_by_job_task_id(
            session=session,
            loop_id=dataset.loop_id,
            job_task_ids=job_task_ids,
            dataset_id=dataset.id,
        )
    assert in_dataset == {tasks["mixed"].spec["task_id"]: tasks["mixed"].id}

    (run,) = runs
    assert (run.id, run.kind, run.status, run.cycle_id) == (
        f"{name}-c1-probe",
        "probe",
        "succeeded",
        cycle.id,
    )
    assert run.spec["kind"] == "eval"
    assert run.spec["samples"] == 4  # the loop's probe_attempts
    assert run.spec["hyperparameters"] == {"temperature": 1.0}
    assert run.base_checkpoint_id is not None
    # The probe's cost is the cycle's.
    assert run.cost_usd > 0 and cycle.cost_usd == run.cost_usd
    assert cycle.compute_seconds == pytest.approx(run.compute_seconds)
    assert "probe" in cycle.stage_timings and cycle.outcome == "no_data"

    probe = await temporal_client.get_workflow_handle(f"loop/{name}/cycle/1/probe").result()
    assert (probe["status"], probe["probed"], probe["recorded"]) == ("succeeded", 3, 3)
    assert (probe["kept"], probe["too_easy"], probe["too_hard"]) == (1, 1, 1)


async def test_without_the_filter_no_probe_job_runs(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory, tmp_path: Path
) -> None:
    name = curated_loop(session_factory, tmp_path, difficulty_filter=False)
    await run_one_cycle(temporal_client, task_queue, session_factory, tmp_path, GOOD_JOB, name)
    cycle, runs, dataset, train = cycle_records(session_factory, name)
    assert runs == []
    assert len(train) == 3
    assert dataset.stats["difficulty"] == {"kept": 3, "too_easy": 0, "too_hard": 0, "unprobed": 0}
    assert "probe" not in cycle.stage_timings
    assert all(t.probe_pass_rate is None for t in task_by_question(session_factory, name).values())


@pytest.mark.parametrize(
    ("job", "run_status"),
    [
        (FAILING_JOB, "failed"),  # the job fails: a result
        (CONFIG_ERROR_JOB, "failed"),  # a config exit code: run_job fails, so does the probe
        (WRONG_TASKS_JOB, "succeeded"),  # results of other tasks: refused, the probe fails
    ],
    ids=["job-failed", "config-error", "bad-results"],
)
async def test_a_failed_probe_lets_the_cycle_go_on_unfiltered(
    temporal_client: Client,
    task_queue: str,
    session_factory: SessionFactory,
    tmp_path: Path,
    job: str,
    run_status: str,
) -> None:
    name = curated_loop(session_factory, tmp_path)
    await run_one_cycle(temporal_client, task_queue, session_factory, tmp_path, job, name)
    cycle, runs, dataset, train = cycle_records(session_factory, name)
    (run,) = runs
    assert (run.kind, run.status) == ("probe", run_status)
    if run_status == "failed":
        assert run.error
    assert cycle.outcome == "no_data"  # it got to the snapshot, not "failed"
    assert cycle.cost_usd == run.cost_usd  # the failed probe still cost the cycle
    assert len(train) == 3
    assert dataset.stats["difficulty"] == {"kept": 3, "too_easy": 0, "too_hard": 0, "unprobed": 3}
    assert all(t.probe_pass_rate is None for t in task_by_question(session_factory, name).values())
