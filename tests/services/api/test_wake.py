"""Waking an idle loop on traffic (services.api.wake): the first accepted trace after a quiet
spell signals the loop's workflow once; steady traffic sends nothing more."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from temporalio.testing import WorkflowEnvironment

from services.api.wake import LoopWaker
from services.settings import Settings
from tests.services.api.support import ADMIN, ADMIN_TOKEN, body_of, make_trace, signed_headers
from tests.support import assert_eventually_async


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_the_first_trace_after_a_quiet_spell_wakes_the_loop_once() -> None:
    clock, sent = Clock(), []

    async def send(loop: str) -> None:
        sent.append(loop)

    waker = LoopWaker(send, quiet_s=60, clock=clock)
    waker.traces_arrived("a")
    waker.traces_arrived("b")
    clock.now += 59  # steady traffic: no second signal
    waker.traces_arrived("a")
    clock.now += 59  # still within 60 s of a's last trace
    waker.traces_arrived("a")
    clock.now += 61  # a went quiet: its next trace wakes it
    waker.traces_arrived("a")
    await asyncio.sleep(0.01)
    await waker.close()
    assert sent == ["a", "b", "a"]
    assert waker.sent == 3


async def test_a_failed_signal_is_dropped_and_traffic_goes_on() -> None:
    clock, attempts = Clock(), []

    async def send(loop: str) -> None:
        attempts.append(loop)
        raise RuntimeError("Temporal is down")

    waker = LoopWaker(send, quiet_s=60, clock=clock)
    waker.traces_arrived("a")
    await asyncio.sleep(0.01)
    clock.now += 120
    waker.traces_arrived("a")  # never raises: ingest does not depend on Temporal
    await asyncio.sleep(0.01)
    await waker.close()
    assert attempts == ["a", "a"]
    assert waker.sent == 0


@pytest.fixture
def settings(database_url: str, temporal_env: WorkflowEnvironment, tmp_path: Path) -> Settings:
    address = temporal_env.client.service_client.config.target_host
    return Settings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        temporal_address=address,
        # No worker polls this queue: the loop's workflow only records the signals it gets.
        temporal_task_queue=f"wake-{tmp_path.name}",
        state_dir=tmp_path / "state",
    )


def _post(client: TestClient, loop: dict[str, Any], count: int) -> None:
    body = body_of({"traces": [make_trace() for _ in range(count)]})
    response = client.post(
        f"/v1/loops/{loop['name']}/traces",
        content=body,
        headers=signed_headers(loop["signing_secret"], body),
    )
    assert response.status_code == 200, response.text
    assert response.json()["accepted"] == count


async def test_posted_traces_signal_wake_to_the_loops_workflow(
    client: TestClient, loop: dict[str, Any], temporal_env: WorkflowEnvironment
) -> None:
    assert loop["workflow_started"]
    handle = temporal_env.client.get_workflow_handle(loop["workflow_id"])
    _post(client, loop, 2)
    _post(client, loop, 3)  # the same quiet spell: no second signal

    async def woken() -> None:
        history = await handle.fetch_history()
        signals = [
            event.workflow_execution_signaled_event_attributes.signal_name
            for event in history.events
            if event.HasField("workflow_execution_signaled_event_attributes")
        ]
        assert signals == ["wake"]

    await assert_eventually_async(woken, timeout=30)
    await handle.terminate()


async def signals_of(temporal_env: WorkflowEnvironment, workflow_id: str) -> list[str]:
    history = await temporal_env.client.get_workflow_handle(workflow_id).fetch_history()
    return [
        event.workflow_execution_signaled_event_attributes.signal_name
        for event in history.events
        if event.HasField("workflow_execution_signaled_event_attributes")
    ]


async def test_a_configuration_change_wakes_the_loop_and_a_dry_run_does_not(
    client: TestClient, loop: dict[str, Any], temporal_env: WorkflowEnvironment
) -> None:
    patch = {"trigger_policy": {"min_new_tasks": 4}}
    dry = client.patch(f"/v1/loops/{loop['name']}?dry_run=true", json=patch, headers=ADMIN)
    assert dry.status_code == 200 and dry.json()["changed"]
    changed = client.patch(f"/v1/loops/{loop['name']}", json=patch, headers=ADMIN)
    assert changed.status_code == 200 and changed.json()["changed"]

    async def woken() -> None:
        assert await signals_of(temporal_env, loop["workflow_id"]) == ["wake"]

    await assert_eventually_async(woken, timeout=30)
    same = client.patch(f"/v1/loops/{loop['name']}", json=patch, headers=ADMIN)
    assert same.status_code == 200 and not same.json()["changed"]  # nothing new: no signal
    await temporal_env.client.get_workflow_handle(loop["workflow_id"]).terminate()
    assert await signals_of(temporal_env, loop["workflow_id"]) == ["wake"]
