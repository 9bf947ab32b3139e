"""CurateWorkflow and the curation activities on the real Temporal dev server and Postgres.

Includes the restart test: a worker process is killed (SIGKILL) while a batch is about to
commit; the batch is retried by another worker after the heartbeat timeout and every trace is
curated exactly once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from services.artifacts import ArtifactStore
from services.db.models import Loop, Task, TaskSource, Trace
from services.db.session import SessionFactory
from services.metrics import REGISTRY
from tests.services.curation.support import add_traces, make_loop, qa_resolver, trace_body
from tests.support import assert_eventually
from workflows.activities.curation import CurationActivities
from workflows.curate import CurateWorkflow
from workflows.payloads.curation import (
    CurateBatchInput,
    CurateInput,
    DriftInput,
    PendingWorkInput,
    SnapshotInput,
)

REPO = Path(__file__).resolve().parents[2]


def activities(session_factory: SessionFactory, tmp_path: Path) -> CurationActivities:
    return CurationActivities(
        session_factory, ArtifactStore(tmp_path / "artifacts"), adapters=qa_resolver
    )


def batch_worker(
    client: Client, task_queue: str, acts: CurationActivities, *workflows: type
) -> Worker:
    """A worker that runs curation batches (and, when given, the workflows that ask for them)."""
    return Worker(
        client,
        task_queue=task_queue,
        workflows=list(workflows),
        activities=[acts.curate_batch],
        activity_executor=concurrent.futures.ThreadPoolExecutor(2),
    )


def seed(session_factory: SessionFactory, n: int, name: str = "support") -> list[int]:
    loop_id = make_loop(session_factory, name=name, curation_policy={"success_sample_rate": 0.0})
    bodies = [
        trace_body(
            f"t{i}",
            f"question {i % (n // 2 or 1)} about order {i % (n // 2 or 1)}",
            answer=str(i % (n // 2 or 1)),
        )
        for i in range(n)
    ]
    return add_traces(session_factory, loop_id, bodies)


def curation_counts(session_factory: SessionFactory) -> tuple[int, int, dict[int, int]]:
    with session_factory() as session:
        uncurated = session.scalar(select(func.count()).where(Trace.curated_at.is_(None))) or 0
        tasks = session.scalar(select(func.count()).select_from(Task)) or 0
        rows = session.execute(
            select(TaskSource.trace_id, func.count()).group_by(TaskSource.trace_id)
        ).all()
        per_trace = {int(row[0]): int(row[1]) for row in rows}
    return uncurated, tasks, per_trace


async def test_workflow_curates_every_batch_and_replays(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory, tmp_path: Path
) -> None:
    ids = seed(session_factory, 45)
    acts = activities(session_factory, tmp_path)
    async with batch_worker(temporal_client, task_queue, acts, CurateWorkflow):
        handle = await temporal_client.start_workflow(
            CurateWorkflow.run,
            CurateInput(loop="support", batch_size=10),
            id=f"loop/support/curate/{task_queue}",
            task_queue=task_queue,
        )
        result = await handle.result()
    assert (result.traces_seen, result.tasks_created, result.duplicates) == (45, 22, 23)
    assert result.new_train_tasks <= result.tasks_created
    uncurated, tasks, per_trace = curation_counts(session_factory)
    assert (uncurated, tasks) == (0, 22)
    assert sorted(per_trace) == sorted(ids) and set(per_trace.values()) == {1}
    history = await handle.fetch_history()
    await Replayer(workflows=[CurateWorkflow]).replay_workflow(history)


async def test_max_batches_bounds_a_run(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory, tmp_path: Path
) -> None:
    seed(session_factory, 30)
    acts = activities(session_factory, tmp_path)
    async with batch_worker(temporal_client, task_queue, acts, CurateWorkflow):
        result = await temporal_client.execute_workflow(
            CurateWorkflow.run,
            CurateInput(loop="support", batch_size=5, max_batches=2),
            id=f"curate-bounded/{task_queue}",
            task_queue=task_queue,
        )
    assert result.traces_seen == 10
    assert curation_counts(session_factory)[0] == 20


def test_activities_fail_fast_on_configuration_errors(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    acts = activities(session_factory, tmp_path)
    env = ActivityEnvironment()
    make_loop(session_factory, name="bad-policy", curation_policy={"typo": 1})
    make_loop(session_factory, name="bad-env", environment="nowhere")
    cases: list[tuple[Callable[..., Any], Any, str]] = [
        (acts.curate_batch, CurateBatchInput("missing"), "NotFound"),
        (acts.curate_batch, CurateBatchInput("bad-policy"), "InvalidPolicy"),
        (acts.curate_batch, CurateBatchInput("bad-env"), "UnknownEnvironment"),
        (acts.curate_batch, CurateBatchInput("bad-env", batch_size=0), "InvalidInput"),
        (acts.snapshot_dataset, SnapshotInput("missing", 1), "SnapshotFailed"),
        (acts.check_drift, DriftInput("missing"), "NotFound"),
        (acts.pending_work, PendingWorkInput("missing"), "NotFound"),
    ]
    for function, argument, kind in cases:
        with pytest.raises(ApplicationError) as info:
            env.run(function, argument)
        assert info.value.type == kind and info.value.non_retryable, info.value


def test_activities_report_counts_metrics_and_datasets(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    acts = activities(session_factory, tmp_path)
    env = ActivityEnvironment()
    loop_id = make_loop(
        session_factory,
        name="metered",
        trigger_policy={"drift_failure_rate": 0.5},
        curation_policy={"drift_min_traces": 3},
    )
    add_traces(
        session_factory,
        loop_id,
        [trace_body(f"m{i}", f"metered question {i}", answer=str(i)) for i in range(6)]
        + [trace_body("m-bad", "no answer", answer=None)],
    )

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"loop": "metered", **labels}) or 0.0

    before = sample("ratchet_curation_rejected_total", reason="no_answer")
    assert env.run(acts.pending_work, PendingWorkInput("metered")).uncurated_traces == 7
    batch = env.run(acts.curate_batch, CurateBatchInput("metered", batch_size=100))
    assert (batch.traces_seen, batch.tasks_created, batch.rejected, batch.more) == (7, 6, 1, False)
    assert sample("ratchet_curation_rejected_total", reason="no_answer") == before + 1
    assert sample("ratchet_curation_traces_total", outcome="task") >= 6
    pending = env.run(acts.pending_work, PendingWorkInput("metered"))
    assert (pending.new_train_tasks, pending.uncurated_traces) == (batch.new_train_tasks, 0)
    dataset = env.run(acts.snapshot_dataset, SnapshotInput("metered", 1))
    assert dataset.train_count == batch.new_train_tasks
    assert env.run(acts.snapshot_dataset, SnapshotInput("metered", 2)) == dataset
    assert env.run(acts.pending_work, PendingWorkInput("metered")).new_train_tasks == 0
    drift = env.run(acts.check_drift, DriftInput("metered"))
    assert (drift.model_version, drift.failure_rate, drift.drifted) == ("m1", 1.0, True)
    assert sample("ratchet_loop_live_failure_rate") == 1.0


WORKER_SCRIPT = textwrap.dedent(
    """
    import asyncio, concurrent.futures, sys, time
    from pathlib import Path
    from sqlalchemy import event
    from temporalio.client import Client
    from temporalio.worker import Worker
    from services.artifacts import ArtifactStore
    from services.db.session import create_db_engine, make_session_factory
    from tests.services.curation.support import qa_resolver
    from workflows.activities.curation import CurationActivities

    async def main(address, database_url, task_queue, marker, artifacts):
        sessions = make_session_factory(create_db_engine(database_url, pool_size=2))

        @event.listens_for(sessions, "before_commit")
        def stall(session):
            # The batch's tasks are written but not committed: announce it, hang till killed.
            Path(marker).write_text("about to commit")
            time.sleep(3600)

        acts = CurationActivities(sessions, ArtifactStore(Path(artifacts)), adapters=qa_resolver)
        client = await Client.connect(address)
        async with Worker(
            client,
            task_queue=task_queue,
            activities=[acts.curate_batch],
            activity_executor=concurrent.futures.ThreadPoolExecutor(2),
        ):
            await asyncio.Event().wait()

    asyncio.run(main(*sys.argv[1:]))
    """
)


async def test_worker_killed_mid_batch_curates_each_trace_exactly_once(
    temporal_env: WorkflowEnvironment,
    task_queue: str,
    database_url: str,
    session_factory: SessionFactory,
    tmp_path: Path,
) -> None:
    client = temporal_env.client
    ids = seed(session_factory, 30)
    marker = tmp_path / "stalled"
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    log = (tmp_path / "worker.log").open("w")
    doomed = subprocess.Popen(
        [
            sys.executable,
            str(script),
            client.service_client.config.target_host,
            database_url,
            task_queue,
            str(marker),
            str(tmp_path / "artifacts"),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        async with Worker(client, task_queue=task_queue, workflows=[CurateWorkflow]):
            handle = await client.start_workflow(
                CurateWorkflow.run,
                CurateInput(loop="support", batch_size=12),
                id=f"loop/support/curate/restart-{task_queue}",
                task_queue=task_queue,
            )
            await asyncio.to_thread(
                assert_eventually,
                lambda: _check(marker.exists(), (tmp_path / "worker.log").read_text()),
                timeout=60,
                interval=0.1,
            )
            assert curation_counts(session_factory)[0] == 30  # nothing committed yet
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(timeout=10)
            acts = activities(session_factory, tmp_path)
            async with batch_worker(client, task_queue, acts):
                result = await asyncio.wait_for(handle.result(), timeout=60)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait()
        log.close()
    assert (result.traces_seen, result.tasks_created, result.duplicates) == (30, 15, 15)
    uncurated, tasks, per_trace = curation_counts(session_factory)
    assert (uncurated, tasks) == (0, 15)
    assert sorted(per_trace) == sorted(ids) and set(per_trace.values()) == {1}
    with session_factory() as session:
        weights = session.scalar(select(func.sum(Task.weight))) or 0
        loop = session.scalars(select(Loop)).one()
    assert (weights, loop.name) == (30, "support")
    history = await handle.fetch_history()
    retried = [
        e.activity_task_started_event_attributes.attempt
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    ]
    assert max(retried) >= 2  # the killed worker's attempt timed out and was retried


def _check(condition: bool, log: str) -> None:
    assert condition, f"the worker never reached the commit; its log:\n{log}"


def test_batches_on_a_process_pool_match_one_process_and_time_their_phases(
    make_database: Callable[[], str], tmp_path: Path
) -> None:
    from services.curation.workers import PreparePool
    from services.db.session import create_db_engine, make_session_factory
    from tests.services.curation.test_equivalence import outcome

    digests = []
    for processes in (1, 2):
        engine = create_db_engine(make_database(), pool_size=2)
        sessions = make_session_factory(engine)
        seed(sessions, 400)
        with PreparePool(processes) as pool:
            acts = CurationActivities(
                sessions, ArtifactStore(tmp_path / f"a{processes}"), adapters=qa_resolver, pool=pool
            )
            env = ActivityEnvironment()
            while env.run(acts.curate_batch, CurateBatchInput("support", batch_size=150)).more:
                pass
        digests.append(outcome(sessions))
        engine.dispose()
    assert digests[0] == digests[1]
    for phase in ("lock", "prepare", "lookup", "dedup", "write"):
        seconds = REGISTRY.get_sample_value(
            "ratchet_curation_phase_seconds_total", {"loop": "support", "phase": phase}
        )
        assert seconds is not None and seconds > 0, phase
