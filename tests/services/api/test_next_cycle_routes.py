"""What the next cycle waits for, through the admin API (real Postgres and Temporal): the
loop's detail and status say it, and run-now refuses a loop with no champion to train."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from temporalio.testing import WorkflowEnvironment

from services.api.routes.loop_actions import workflow_clock
from services.loop.next_cycle import WorkflowClock, WorkflowState
from services.settings import Settings
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig
from tests.services.api.support import ADMIN, ADMIN_TOKEN, create_loop, make_trace, signed_headers
from workflows.payloads.loop import LoopStatus

NO_CHAMPION = (
    "no champion: run `ratchet loop bootstrap waiting` (a first one from the loop's successful "
    "traces) or import one: `ratchet models smollm2 --import --loop waiting`, "
    "`ratchet models import DIR --loop waiting`"
)


@pytest.fixture
def settings(database_url: str, temporal_env: WorkflowEnvironment, tmp_path: Path) -> Settings:
    address = temporal_env.client.service_client.config.target_host
    return Settings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        temporal_address=address,
        temporal_task_queue=f"next-cycle-{tmp_path.name}",
        state_dir=tmp_path / "state",
    )


@pytest.fixture
def waiting(client: TestClient) -> dict[str, Any]:
    """A loop with min_new_tasks 16 and two traces nobody has curated yet."""
    loop = create_loop(client, "waiting", trigger_policy={"min_new_tasks": 16})
    body = json.dumps({"traces": [make_trace("w-1"), make_trace("w-2")]}).encode()
    posted = client.post(
        "/v1/loops/waiting/traces",
        content=body,
        headers=signed_headers(loop["signing_secret"], body),
    )
    assert posted.status_code == 200, posted.text
    return loop


async def _stop_workflow(temporal_env: WorkflowEnvironment, loop: str) -> None:
    """No worker runs in these tests: the status query would wait for one."""
    await temporal_env.client.get_workflow_handle(f"loop/{loop}").terminate()


async def test_the_loop_says_what_its_next_cycle_waits_for(
    client: TestClient, waiting: dict[str, Any], temporal_env: WorkflowEnvironment
) -> None:
    shown = client.get("/v1/loops/waiting", headers=ADMIN)
    assert shown.status_code == 200
    next_cycle = shown.json()["next_cycle"]
    assert next_cycle["waits_for"] == [
        "0 of 16 new train tasks (trigger_policy.min_new_tasks)",
        "no eval tasks yet (a cycle's snapshot needs one; curation holds out a share of the "
        "failure clusters for eval: curation_policy.eval_fraction)",
        NO_CHAMPION,
    ]
    assert (next_cycle["pending_traces"], next_cycle["has_champion"]) == (2, False)
    assert next_cycle["curation"] == (
        "2 traces wait for curation: curated at the loop's next trigger check (every 30 s "
        "while the loop waits)"
    )

    await _stop_workflow(temporal_env, "waiting")
    status = client.get("/v1/loops/waiting/status", headers=ADMIN).json()
    assert status["next_cycle"]["waits_for"] == next_cycle["waits_for"]
    assert status["next_cycle"]["curation"] == (
        "2 traces wait for curation: the loop's workflow is not running "
        "(`ratchet loop start waiting`)"
    )


async def test_run_now_without_a_champion_is_refused_with_the_way_to_get_one(
    client: TestClient,
    waiting: dict[str, Any],
    temporal_env: WorkflowEnvironment,
    tmp_path: Path,
) -> None:
    refused = client.post("/v1/loops/waiting/run-now", headers=ADMIN)
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "no_champion"
    assert error["message"] == f"loop 'waiting' cannot run a cycle: {NO_CHAMPION}"
    handle = temporal_env.client.get_workflow_handle("loop/waiting")
    history = await handle.fetch_history()
    assert not [
        e for e in history.events if e.HasField("workflow_execution_signaled_event_attributes")
    ]

    config = GPTConfig(max_seq_len=16, n_layer=1, n_head=1, d_model=8, mlp_ratio=1)
    save_checkpoint(GPT(config), config, tmp_path / "champion")
    champion = client.post(
        "/v1/loops/waiting/champion",
        headers=ADMIN,
        json={"checkpoint": str(tmp_path / "champion")},
    )
    assert champion.status_code == 200, champion.text
    accepted = client.post("/v1/loops/waiting/run-now", headers=ADMIN)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["note"] == (
        "no eval tasks yet: the cycle ends no_data unless curating the 2 pending traces adds one"
    )
    await handle.terminate()


def _live(stage: str, **changes: Any) -> LoopStatus:
    values: dict[str, Any] = {
        "loop": "waiting",
        "stage": stage,
        "cycle": 0,
        "paused": False,
        "pause_reason": None,
        "waiting_for": None,
        "last_outcome": None,
        "cycles_done": 0,
        **changes,
    }
    return LoopStatus(**values)


def test_the_workflow_status_becomes_the_clock_of_curation() -> None:
    due = "2026-12-06T12:00:42+00:00"
    assert workflow_clock(_live("waiting", next_check_at=due)) == WorkflowClock(
        WorkflowState.WAITING, next_check_at=dt.datetime.fromisoformat(due)
    )
    # A worker from before next_check_at answers without it.
    assert workflow_clock(_live("waiting")) == WorkflowClock(WorkflowState.WAITING)
    assert workflow_clock(_live("paused", paused=True)).state == WorkflowState.PAUSED
    assert workflow_clock(_live("train", cycle=4)) == WorkflowClock(WorkflowState.IN_CYCLE, cycle=4)
