"""Operator actions on a loop through the admin API, against real Postgres and Temporal."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

from services.db.models import Checkpoint, Cycle, Loop, Promotion
from services.db.session import SessionFactory
from services.settings import Settings
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig
from tests.services.api.support import ADMIN, ADMIN_TOKEN
from workflows.loop import LoopWorkflow


@pytest.fixture
def settings(database_url: str, temporal_env: WorkflowEnvironment, tmp_path: Path) -> Settings:
    address = temporal_env.client.service_client.config.target_host
    return Settings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        temporal_address=address,
        temporal_task_queue=f"actions-{tmp_path.name}",
        state_dir=tmp_path / "state",
    )


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    config = GPTConfig(max_seq_len=16, n_layer=1, n_head=1, d_model=8, mlp_ratio=1)
    target = tmp_path / "champion"
    save_checkpoint(GPT(config), config, target)
    return target


def test_actions_need_the_admin_token(client: TestClient, loop: dict[str, Any]) -> None:
    response = client.post(f"/v1/loops/{loop['name']}/pause")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthorized"


def test_unknown_loop_and_action(client: TestClient, loop: dict[str, Any]) -> None:
    missing = client.post("/v1/loops/nope/pause", headers=ADMIN)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "loop_not_found"
    # The same 404 as GET /v1/loops/nope: one wording for a missing loop.
    assert missing.json() == client.get("/v1/loops/nope", headers=ADMIN).json()
    unknown = client.post(f"/v1/loops/{loop['name']}/explode", headers=ADMIN)
    assert unknown.status_code in (404, 405)


def test_bad_body_names_the_field(client: TestClient, loop: dict[str, Any]) -> None:
    response = client.post(
        f"/v1/loops/{loop['name']}/approve", headers=ADMIN, json={"cycle": -1, "extra": 1}
    )
    assert response.status_code == 422
    paths = {field["path"] for field in response.json()["error"]["fields"]}
    assert paths == {"cycle", "extra"}


async def test_pause_records_and_signals(
    client: TestClient,
    loop: dict[str, Any],
    session_factory: SessionFactory,
    temporal_env: WorkflowEnvironment,
) -> None:
    response = client.post(
        f"/v1/loops/{loop['name']}/pause", headers=ADMIN, json={"reason": "maintenance"}
    )
    assert response.status_code == 200, response.text
    assert response.json()["workflow_id"] == f"loop/{loop['name']}"
    with session_factory() as session:
        row = session.scalars(select(Loop).where(Loop.name == loop["name"])).one()
        assert (row.status, row.status_reason) == ("paused", "maintenance")
    handle = temporal_env.client.get_workflow_handle(f"loop/{loop['name']}")
    description = await handle.describe()
    assert description.status == WorkflowExecutionStatus.RUNNING
    history = await handle.fetch_history()
    signals = [
        event.workflow_execution_signaled_event_attributes.signal_name
        for event in history.events
        if event.HasField("workflow_execution_signaled_event_attributes")
    ]
    assert signals == ["pause"]
    resumed = client.post(f"/v1/loops/{loop['name']}/resume", headers=ADMIN)
    assert resumed.status_code == 200
    with session_factory() as session:
        assert (
            session.scalars(select(Loop.status).where(Loop.name == loop["name"])).one() == "active"
        )
    await handle.terminate()


async def test_start_is_idempotent(
    client: TestClient, loop: dict[str, Any], temporal_env: WorkflowEnvironment
) -> None:
    first = client.post(f"/v1/loops/{loop['name']}/start", headers=ADMIN)
    second = client.post(f"/v1/loops/{loop['name']}/start", headers=ADMIN)
    assert first.status_code == second.status_code == 200
    handle = temporal_env.client.get_workflow_handle(f"loop/{loop['name']}")
    run_id = (await handle.describe()).run_id
    assert run_id == (await temporal_env.client.get_workflow_handle(handle.id).describe()).run_id
    assert LoopWorkflow.__name__ == (await handle.describe()).workflow_type
    await handle.terminate()


def test_register_champion(
    client: TestClient,
    loop: dict[str, Any],
    checkpoint_dir: Path,
    session_factory: SessionFactory,
) -> None:
    response = client.post(
        f"/v1/loops/{loop['name']}/champion",
        headers=ADMIN,
        json={"checkpoint": checkpoint_dir.as_uri()},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    manifest = json.loads((checkpoint_dir / "manifest.json").read_text())
    assert body["checkpoint_id"] == manifest["checkpoint_id"]
    with session_factory() as session:
        row = session.scalars(select(Loop).where(Loop.name == loop["name"])).one()
        assert row.champion_checkpoint_id == body["checkpoint_id"]
        stored = session.get(Checkpoint, body["checkpoint_id"])
        assert stored is not None and Path(stored.uri.removeprefix("file://")).is_dir()
        promotion = session.scalars(select(Promotion).where(Promotion.loop_id == row.id)).one()
        assert (promotion.decision, promotion.status, promotion.cycle_id) == (
            "promote",
            "held",
            None,
        )
    again = client.post(
        f"/v1/loops/{loop['name']}/champion",
        headers=ADMIN,
        json={"checkpoint": str(checkpoint_dir)},
    )
    assert again.status_code == 200
    assert again.json()["checkpoint_id"] == body["checkpoint_id"]


def test_tampered_champion_is_refused(
    client: TestClient, loop: dict[str, Any], checkpoint_dir: Path
) -> None:
    weights = checkpoint_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    response = client.post(
        f"/v1/loops/{loop['name']}/champion",
        headers=ADMIN,
        json={"checkpoint": str(checkpoint_dir)},
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_checkpoint"
    assert error["fields"][0]["path"] == "checkpoint"


def test_missing_champion_dir(client: TestClient, loop: dict[str, Any], tmp_path: Path) -> None:
    response = client.post(
        f"/v1/loops/{loop['name']}/champion",
        headers=ADMIN,
        json={"checkpoint": str(tmp_path / "absent")},
    )
    assert response.status_code == 422
    assert "not a directory" in response.json()["error"]["message"]


async def test_status_shows_a_failed_rollback(
    client: TestClient,
    loop: dict[str, Any],
    session_factory: SessionFactory,
    temporal_env: WorkflowEnvironment,
) -> None:
    handle = temporal_env.client.get_workflow_handle(f"loop/{loop['name']}")
    await handle.terminate()  # no worker here to answer the status query
    assert (
        client.get(f"/v1/loops/{loop['name']}/status", headers=ADMIN).json()["last_rollback"]
        is None
    )
    with session_factory.begin() as session:
        row = session.scalars(select(Loop).where(Loop.name == loop["name"])).one()
        session.add(
            Promotion(
                loop_id=row.id,
                decision="rollback",
                status="failed",
                reason="rollback to ckpt-a failed (bad answers): DeployFailed: refused",
                decided_by="operator",
            )
        )
    status = client.get(f"/v1/loops/{loop['name']}/status", headers=ADMIN)
    assert status.status_code == 200, status.text
    rollback = status.json()["last_rollback"]
    assert rollback["status"] == "failed"
    assert "DeployFailed: refused" in rollback["reason"]


def test_register_champion_is_refused_while_a_cycle_is_open(
    client: TestClient,
    loop: dict[str, Any],
    checkpoint_dir: Path,
    session_factory: SessionFactory,
) -> None:
    """A cycle trains from, evaluates against and restores the champion it started with: a
    new champion registered meanwhile would be overwritten or compared against the wrong
    model. The registration waits for the cycle to end."""
    with session_factory.begin() as session:
        row = session.scalars(select(Loop).where(Loop.name == loop["name"])).one()
        session.add(Cycle(loop_id=row.id, number=3, trigger="operator", stage="train"))
    response = client.post(
        f"/v1/loops/{loop['name']}/champion",
        headers=ADMIN,
        json={"checkpoint": str(checkpoint_dir)},
    )
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "cycle_open"
    assert "cycle 3" in error["message"] and "train" in error["message"]
    with session_factory.begin() as session:
        row = session.scalars(select(Loop).where(Loop.name == loop["name"])).one()
        assert row.champion_checkpoint_id is None
        assert session.scalars(select(Promotion).where(Promotion.loop_id == row.id)).all() == []
        cycle = session.scalars(select(Cycle).where(Cycle.loop_id == row.id)).one()
        cycle.ended_at = dt.datetime.now(dt.UTC)
    ended = client.post(
        f"/v1/loops/{loop['name']}/champion",
        headers=ADMIN,
        json={"checkpoint": str(checkpoint_dir)},
    )
    assert ended.status_code == 200, ended.text
