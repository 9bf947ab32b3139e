"""What an idle LoopWorkflow does while it waits for a trigger (workflows/trigger.py, the
``idle-backoff`` patch): a check curates only when a trace waits, quiet checks back off up
to the trigger policy's ``idle_check_interval_s``, and a ``wake`` signal (traces arrived)
ends a backoff at once. On the real Temporal dev server with the typed fakes of test_loop.py;
the waits are read from the history's timers, not timed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowHandle

from services.loop.policies import TriggerPolicy
from tests.support import assert_eventually_async
from tests.workflows.test_loop import BASE_CONFIG, World, make_worker, start_loop
from workflows.loop import LoopWorkflow
from workflows.payloads.curation import (
    CurateBatchInput,
    CurateBatchResult,
    PendingWorkInput,
    PendingWorkResult,
)
from workflows.payloads.loop import LoopConfig, LoopResult, LoopState, WakeSignal
from workflows.trigger import next_check_s


def trigger_config(**trigger: Any) -> LoopConfig:
    policy = TriggerPolicy(min_new_tasks=8, max_interval_s=3600, drift_enabled=False, **trigger)
    return replace(BASE_CONFIG, trigger_policy=policy)


@dataclass
class IdleWorld(World):
    """The loop's fakes with uncurated traces that curation consumes, and call counts."""

    uncurated: int = 0
    curate_calls: int = 0
    pending_calls: int = 0

    @activity.defn(name="curate_batch")
    def curate_batch(self, input: CurateBatchInput) -> CurateBatchResult:
        self.curate_calls += 1
        seen, self.uncurated = self.uncurated, 0
        return CurateBatchResult(traces_seen=seen, tasks_created=seen, more=False)

    @activity.defn(name="pending_work")
    def pending_work(self, input: PendingWorkInput) -> PendingWorkResult:
        self.pending_calls += 1
        return PendingWorkResult(new_train_tasks=self.new_tasks, uncurated_traces=self.uncurated)


async def timer_waits(handle: WorkflowHandle[Any, LoopResult]) -> list[float]:
    """The seconds of every timer the loop started, in order (its waits between checks)."""
    history = await handle.fetch_history()
    return [
        event.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
        for event in history.events
        if event.HasField("timer_started_event_attributes")
    ]


async def scheduled_activities(handle: WorkflowHandle[Any, LoopResult]) -> list[str]:
    history = await handle.fetch_history()
    return [
        event.activity_task_scheduled_event_attributes.activity_type.name
        for event in history.events
        if event.HasField("activity_task_scheduled_event_attributes")
    ]


def test_the_wait_doubles_up_to_the_idle_ceiling_and_never_past_the_max_interval() -> None:
    config = trigger_config(check_interval_s=30, idle_check_interval_s=600)
    waits = [next_check_s(config, idle, None) for idle in range(7)]
    assert waits == [30, 60, 120, 240, 480, 600, 600]
    # Tasks wait for the maximum interval, due in 100 s: the loop looks again by then...
    assert next_check_s(config, 5, 100.0) == 100
    # ...but never more often than every check_interval_s.
    assert next_check_s(config, 5, 0.0) == 30
    # A ceiling below check_interval_s means no backoff at all.
    flat = trigger_config(check_interval_s=30, idle_check_interval_s=10)
    assert [next_check_s(flat, idle, None) for idle in range(3)] == [30, 30, 30]
    # A long idle streak neither overflows nor passes the ceiling.
    assert next_check_s(config, 10_000, None) == 600


async def test_an_idle_loop_backs_off_and_never_curates(
    temporal_client: Client, task_queue: str
) -> None:
    world = IdleWorld(config=trigger_config(check_interval_s=0.2, idle_check_interval_s=1.6))
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue)

        async def backed_off() -> None:
            assert len(await timer_waits(handle)) >= 5

        await assert_eventually_async(backed_off, timeout=60)
        await handle.terminate()
    assert (await timer_waits(handle))[:5] == [0.4, 0.8, 1.6, 1.6, 1.6]
    assert world.curate_calls == 0  # nothing waited to be curated
    # An idle check is two activities: the loop's configuration and what is pending.
    kinds = set(await scheduled_activities(handle))
    assert kinds == {"load_loop_config", "pending_work"}


async def test_a_wake_signal_ends_the_backoff_and_traffic_resets_it(
    temporal_client: Client, task_queue: str
) -> None:
    # After the first quiet check the loop waits a minute; the test never waits that long.
    world = IdleWorld(config=trigger_config(check_interval_s=30, idle_check_interval_s=3600))
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue)

        async def waiting() -> None:
            assert await timer_waits(handle) == [60]
            status = await handle.query(LoopWorkflow.status)
            assert status.waiting_for == "trigger"

        await assert_eventually_async(waiting, timeout=30)
        assert world.curate_calls == 0
        world.uncurated = 5
        await handle.signal(LoopWorkflow.wake, WakeSignal())

        async def curated() -> None:
            assert world.curate_calls == 1
            # The check that curated was not quiet: the next wait is check_interval_s again.
            assert await timer_waits(handle) == [60, 30]

        await assert_eventually_async(curated, timeout=30)
        await handle.terminate()


async def test_waiting_tasks_are_checked_again_when_the_max_interval_is_due(
    temporal_client: Client, task_queue: str
) -> None:
    # A cycle ended 3590 s ago: the maximum interval (3600 s) is due in about 10 s, so the
    # backed-off wait is cut to it although quiet checks would wait far longer.
    world = IdleWorld(
        config=trigger_config(check_interval_s=2, idle_check_interval_s=3600), new_tasks=3
    )
    ended = datetime.fromtimestamp(datetime.now(UTC).timestamp() - 3590, UTC)
    name = f"bot-{uuid.uuid4().hex[:8]}"
    state = LoopState(idle_checks=10, last_cycle_ended_at=ended.isoformat(), cycle_number=1)
    async with make_worker(temporal_client, task_queue, world):
        handle = await start_loop(temporal_client, task_queue, name, state=state)

        async def waiting() -> None:
            assert len(await timer_waits(handle)) == 1

        await assert_eventually_async(waiting, timeout=30)
        await handle.terminate()
    (wait,) = await timer_waits(handle)
    assert 2 <= wait <= 10
