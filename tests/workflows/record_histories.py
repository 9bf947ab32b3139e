"""Record workflow histories for the replay gate: ``python -m tests.workflows.record_histories``.

Runs the loop's scenarios against a fresh Temporal dev server (with the typed activity fakes
of test_loop.py) and writes each workflow's history — the loop and its child workflows —
under tests/workflows/histories/. Re-record only for a deliberate, versioned change; the
committed files are what running workflows in production look like, so a new scenario is
recorded on its own (``python -m tests.workflows.record_histories probed``) and the older
files stay as the older code wrote them.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowHistory
from temporalio.testing import WorkflowEnvironment

from services.curation.policy import CurationPolicy
from services.local.binaries import temporal_cli_path
from services.loop.policies import TrainingProfile
from tests.workflows.test_loop import (
    BASE_CONFIG,
    LiveStats,
    World,
    make_worker,
    start_loop,
    with_gate,
)
from workflows.ids import cycle_workflow_id
from workflows.ledger import ServingLedgerWorkflow
from workflows.payloads.ledger import ServingLedgerInput, ServingLedgerResult
from workflows.payloads.retention import (
    MaintainPartitionsInput,
    MaintainPartitionsResult,
    PurgeTraceBodiesInput,
    PurgeTraceBodiesResult,
    RetentionInput,
)
from workflows.retention import RetentionWorkflow
from workflows.search_attributes import SEARCH_ATTRIBUTES

HISTORIES = Path(__file__).parent / "histories"


async def _record(client: Client, scenario: str, world: World) -> None:
    task_queue = f"record-{uuid.uuid4().hex[:8]}"
    name = f"rec-{scenario}"
    async with make_worker(client, task_queue, world):
        handle = await start_loop(client, task_queue, name, max_cycles=1)
        await handle.result()
    ids = [f"loop/{name}"] + [
        # Not curate: the loop scenarios run a fake of it (its real history is curate-batches).
        cycle_workflow_id(name, 1, stage)
        for stage in ("probe", "train", "evaluate", "promote")
    ]
    for workflow_id in ids:
        try:
            history = await client.get_workflow_handle(workflow_id).fetch_history()
        except Exception:
            continue
        stage = workflow_id.rsplit("/", 1)[-1] if "/cycle/" in workflow_id else "loop"
        _write(HISTORIES / f"{stage}-{scenario}.json", history)


async def _record_curate(client: Client) -> None:
    """A real CurateWorkflow run: real activities on an embedded Postgres."""
    import tempfile

    import pgserver

    from services.artifacts import ArtifactStore
    from services.db.migrate import upgrade
    from services.db.session import create_db_engine, make_session_factory
    from tests.services.curation.support import add_traces, make_loop, qa_resolver, trace_body
    from workflows.activities.curation import CurationActivities
    from workflows.curate import CurateWorkflow
    from workflows.payloads.curation import CurateInput

    work = Path(tempfile.mkdtemp(prefix="ratchet-record-"))
    server = pgserver.get_server(work / "pg", cleanup_mode="delete")
    try:
        url = server.get_uri("postgres")
        upgrade(url)
        engine = create_db_engine(url, pool_size=2)
        sessions = make_session_factory(engine)
        loop_id = make_loop(sessions, name="rec-curate", curation_policy={"success_sample_rate": 0})
        add_traces(
            sessions,
            loop_id,
            [
                trace_body(f"t{i}", f"question {i} about order {i}", answer=str(i))
                for i in range(12)
            ],
        )
        activities = CurationActivities(sessions, ArtifactStore(work / "art"), adapters=qa_resolver)
        await _record_workflow(
            client,
            CurateWorkflow,
            CurateInput("rec-curate", batch_size=5),
            workflow_id="loop/rec-curate/cycle/1/curate",
            activities=[activities.curate_batch],
            history="curate-batches.json",
        )
        engine.dispose()
    finally:
        server.cleanup()


async def _record_operator_rollback(client: Client, scenario: str = "operator-rollback") -> None:
    """Two operator rollbacks (LoopWorkflow's rollback-deploy patch): the first one's deploy
    fails every attempt and is recorded, the second serves the previous champion; then a
    cycle runs, as the loop carries on."""
    from tests.support import assert_eventually_async
    from workflows.loop import LoopWorkflow
    from workflows.payloads.loop import RollbackSignal, RunNowSignal

    world = World(new_tasks=0, rollback_deploy_fails=True)
    task_queue = f"record-{uuid.uuid4().hex[:8]}"
    name = f"rec-{scenario}"
    async with make_worker(client, task_queue, world):
        handle = await start_loop(client, task_queue, name, max_cycles=1)
        await handle.signal(LoopWorkflow.rollback, RollbackSignal(reason="bad answers"))

        async def failed() -> None:
            assert world.rollback_failures

        await assert_eventually_async(failed, timeout=60)
        world.rollback_deploy_fails = False
        await handle.signal(LoopWorkflow.rollback, RollbackSignal(reason="still bad"))

        async def rolled_back() -> None:
            assert world.rollbacks == ["still bad"]

        await assert_eventually_async(rolled_back, timeout=60)
        world.new_tasks = 12
        await handle.signal(LoopWorkflow.run_now, RunNowSignal())
        await handle.result()
    _write(HISTORIES / f"loop-{scenario}.json", await handle.fetch_history())


async def _record_idle(client: Client, scenario: str = "idle-woken") -> None:
    """An idle loop (LoopWorkflow's idle-backoff patch): quiet checks that back off, then a
    wake signal as traces arrive, their curation, and the cycle they trigger."""
    from services.loop.policies import TriggerPolicy
    from tests.support import assert_eventually_async
    from tests.workflows.test_loop_idle import IdleWorld, timer_waits
    from workflows.loop import LoopWorkflow
    from workflows.payloads.loop import WakeSignal

    trigger = TriggerPolicy(
        min_new_tasks=8, check_interval_s=0.2, idle_check_interval_s=0.8, drift_enabled=False
    )
    world = IdleWorld(config=replace(BASE_CONFIG, trigger_policy=trigger))
    task_queue = f"record-{uuid.uuid4().hex[:8]}"
    name = f"rec-{scenario}"
    async with make_worker(client, task_queue, world):
        handle = await start_loop(client, task_queue, name, max_cycles=1)

        async def backed_off() -> None:
            assert len(await timer_waits(handle)) >= 4

        await assert_eventually_async(backed_off, timeout=60)
        world.uncurated, world.new_tasks = 12, 12
        await handle.signal(LoopWorkflow.wake, WakeSignal())
        await handle.result()
    _write(HISTORIES / f"loop-{scenario}.json", await handle.fetch_history())


async def _record_bootstrap(client: Client, scenario: str) -> None:
    """A bootstrap cycle (LoopWorkflow's bootstrap-cycle patch) on a loop with no champion:
    SFT over the base model, the base model and the adapter on the held-out set, the
    bootstrap gate, the promotion; the loop and its children. ``bootstrap``: an operator's
    signal starts it; ``bootstrap-auto``: the training profile's bootstrap.auto, once the
    readiness check says enough successes are there (the loop's history only)."""
    from tests.workflows.test_bootstrap_cycle import BOOTSTRAP_PROFILE, NO_CHAMPION, BootstrapWorld
    from workflows.loop import LoopWorkflow
    from workflows.payloads.loop import BootstrapSignal

    auto = scenario == "bootstrap-auto"
    world = BootstrapWorld()
    if auto:
        policy = BOOTSTRAP_PROFILE.bootstrap.model_copy(update={"auto": True})
        profile = BOOTSTRAP_PROFILE.model_copy(update={"bootstrap": policy})
        world = BootstrapWorld(config=replace(NO_CHAMPION, training_profile=profile))
    task_queue = f"record-{uuid.uuid4().hex[:8]}"
    name = f"rec-{scenario}"
    async with make_worker(client, task_queue, world):
        handle = await start_loop(client, task_queue, name, max_cycles=1)
        if not auto:
            await handle.signal(LoopWorkflow.bootstrap, BootstrapSignal(by="ops", reason="first"))
        await handle.result()
    stages = () if auto else ("train", "evaluate", "promote")
    for workflow_id in [f"loop/{name}"] + [cycle_workflow_id(name, 1, s) for s in stages]:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        stage = workflow_id.rsplit("/", 1)[-1] if "/cycle/" in workflow_id else "loop"
        _write(HISTORIES / f"{stage}-{scenario}.json", history)


@activity.defn(name="purge_trace_bodies")
def _fake_purge(input: PurgeTraceBodiesInput) -> PurgeTraceBodiesResult:
    return PurgeTraceBodiesResult(purged=3, cutoff=input.now)


@activity.defn(name="maintain_partitions")
def _fake_maintain(input: MaintainPartitionsInput) -> MaintainPartitionsResult:
    return MaintainPartitionsResult(made=["trace_bodies_p20261210"], retired=[])


async def _record_retention(client: Client, name: str) -> None:
    """A RetentionWorkflow run with typed fakes of its activities (the real ones are tested
    in test_retention.py against Postgres). ``retention`` was recorded before partitions
    (one activity); ``retention-partitions`` makes partitions first."""
    await _record_workflow(
        client,
        RetentionWorkflow,
        RetentionInput(retention_days=30),
        workflow_id="retention/purge",
        activities=[_fake_maintain, _fake_purge],
        history="retention-purged.json" if name == "retention" else f"{name}.json",
    )


@activity.defn(name="sample_serving_ledgers")
def _fake_sample(input: ServingLedgerInput) -> ServingLedgerResult:
    return ServingLedgerResult(sampled=2, unreadable=1)


async def _record_serving_ledger(client: Client) -> None:
    """A ServingLedgerWorkflow run with a typed fake of its activity (the real one is
    tested in test_serving_ledger.py against Postgres)."""
    await _record_workflow(
        client,
        ServingLedgerWorkflow,
        ServingLedgerInput(),
        workflow_id="serving-ledger/sample",
        activities=[_fake_sample],
        history="serving-ledger-sampled.json",
    )


async def _record_workflow(
    client: Client,
    workflow: Any,
    arg: Any,
    *,
    workflow_id: str,
    activities: list[Callable[..., Any]],
    history: str,
) -> None:
    """Run one workflow on a worker of its own and write its history to ``history``."""
    import concurrent.futures

    from temporalio.worker import Worker

    task_queue = f"record-{uuid.uuid4().hex[:8]}"
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        async with Worker(
            client,
            task_queue=task_queue,
            workflows=[workflow],
            activities=activities,
            activity_executor=executor,
        ):
            handle = await client.start_workflow(
                workflow.run, arg, id=workflow_id, task_queue=task_queue
            )
            await handle.result()
    _write(HISTORIES / history, await handle.fetch_history())


def _write(path: Path, history: WorkflowHistory) -> None:
    path.write_text(history.to_json())
    print(f"wrote {path}")


SCENARIOS: dict[str, World | None] = {
    "curate": None,  # a real CurateWorkflow run, see _record_curate
    "retention": None,  # see _record_retention
    "retention-partitions": None,
    "serving-ledger": None,  # see _record_serving_ledger
    "operator-rollback": None,  # see _record_operator_rollback
    # The same, recorded with the serving target typed in the rollback plan and deploy
    # payloads (workflows/payload.py).
    "operator-rollback-typed": None,
    "bootstrap": None,  # see _record_bootstrap
    "bootstrap-auto": None,
    "idle-woken": None,  # see _record_idle
    "promoted": World(new_tasks=12),
    "rejected": World(new_tasks=12, gate_decision="reject"),
    "rolled-back": World(
        new_tasks=12,
        candidate_live=LiveStats(40, 4, 0.1, 0.04, 0.23),
        baseline_live=LiveStats(40, 32, 0.8, 0.65, 0.9),
    ),
    # A cycle with the difficulty probe (ProbeWorkflow; LoopWorkflow's probe patch).
    "probed": World(
        new_tasks=12,
        config=replace(BASE_CONFIG, curation_policy=CurationPolicy(difficulty_filter=True)),
    ),
    # Honest points (LoopWorkflow's honest-points patch): the held-out set evaluated with
    # sampled evals, points from it, the deploy naming its cycle, the cycle number from Postgres.
    "honest": World(
        new_tasks=12,
        heldout_count=40,
        config=with_gate(BASE_CONFIG, eval_samples=4, eval_temperature=0.7, min_discordant_pairs=5),
    ),
    # LoopConfig with nested typed policies (plus the flat keys older workers read), with the
    # gate's sampling and the curation policy's probe read from them.
    "typed-config": World(
        new_tasks=12,
        heldout_count=40,
        config=replace(
            with_gate(BASE_CONFIG, eval_samples=4, eval_temperature=0.7, min_discordant_pairs=5),
            curation_policy=CurationPolicy(difficulty_filter=True, probe_attempts=4),
        ),
    ),
    # Every stage through the loop's child helper (LoopWorkflow's curate-stage-helper
    # patch), recorded with the probe and honest points on so one history has every marker.
    "curated": World(
        new_tasks=12,
        heldout_count=40,
        config=replace(
            with_gate(BASE_CONFIG, eval_samples=4, eval_temperature=0.7, min_discordant_pairs=5),
            curation_policy=CurationPolicy(difficulty_filter=True),
            last_cycle_number=0,
        ),
    ),
    # The estimate stage (LoopWorkflow's cycle-estimate patch) with the job deadline in every
    # run_job input: a cycle that fits the budget, and one refused over it.
    "estimated": World(
        new_tasks=12,
        heldout_count=40,
        estimate_usd=0.5,
        budget_left_usd=1.0,
        config=with_gate(BASE_CONFIG, eval_samples=4, eval_temperature=0.7, min_discordant_pairs=5),
    ),
    "over-budget": World(new_tasks=12, estimate_usd=5.0, budget_left_usd=1.0),
    # The policies typed in every stage's payload (workflows/payload.py): the training
    # profile in the probe, estimate, train and evaluate inputs, the serving target in the
    # promote and deploy inputs; with the probe, the held-out set and the estimate on.
    "typed-payloads": World(
        new_tasks=12,
        heldout_count=40,
        estimate_usd=0.5,
        budget_left_usd=1.0,
        config=replace(
            with_gate(BASE_CONFIG, eval_samples=4, eval_temperature=0.7, min_discordant_pairs=5),
            curation_policy=CurationPolicy(difficulty_filter=True),
            training_profile=TrainingProfile(timeout_s=3600, seed=3),
            last_cycle_number=0,
        ),
    ),
}


async def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {sorted(SCENARIOS)}")
    HISTORIES.mkdir(exist_ok=True)
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_cli_path()),
        search_attributes=SEARCH_ATTRIBUTES,
        ui=False,
    )
    try:
        for name in names or list(SCENARIOS):
            world = SCENARIOS[name]
            if name in ("retention", "retention-partitions"):
                await _record_retention(env.client, name)
            elif name == "serving-ledger":
                await _record_serving_ledger(env.client)
            elif name in ("operator-rollback", "operator-rollback-typed"):
                await _record_operator_rollback(env.client, name)
            elif name in ("bootstrap", "bootstrap-auto"):
                await _record_bootstrap(env.client, name)
            elif name == "idle-woken":
                await _record_idle(env.client, name)
            elif world is None:
                await _record_curate(env.client)
            else:
                await _record(env.client, name, world)
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
