"""The loop's status query says when its next trigger check (which curates first) is due,
so ``ratchet loop status`` can tell when pending traces will be curated."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from temporalio.client import Client

from services.loop.policies import TriggerPolicy
from tests.support import assert_eventually_async
from tests.workflows.test_loop import BASE_CONFIG, World, make_worker, start_loop
from workflows.loop import LoopWorkflow
from workflows.payloads.loop import PauseSignal


async def test_a_waiting_loop_reports_its_next_check(
    temporal_client: Client, task_queue: str
) -> None:
    config = replace(
        BASE_CONFIG,
        trigger_policy=TriggerPolicy(min_new_tasks=8, check_interval_s=600, drift_enabled=False),
    )
    world = World(new_tasks=0, config=config)
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, max_cycles=1)

        async def waiting() -> None:
            status = await handle.query(LoopWorkflow.status)
            assert status.waiting_for == "trigger"
            assert status.next_check_at is not None

        await assert_eventually_async(waiting, timeout=30)
        status = await handle.query(LoopWorkflow.status)
        assert status.next_check_at is not None
        due = dt.datetime.fromisoformat(status.next_check_at)
        assert due.tzinfo is not None
        ahead = (due - dt.datetime.now(dt.UTC)).total_seconds()
        assert 0 < ahead <= 600

        await handle.signal(LoopWorkflow.pause, PauseSignal(reason="maintenance"))

        async def paused() -> None:
            status = await handle.query(LoopWorkflow.status)
            assert status.stage == "paused"
            assert status.next_check_at is None  # no check is due while paused

        await assert_eventually_async(paused, timeout=30)
        await handle.terminate()
