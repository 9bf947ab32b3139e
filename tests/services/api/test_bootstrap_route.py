"""``POST /v1/loops/{loop}/bootstrap`` against real Postgres and Temporal: the answer says
what a bootstrap learns from, a dry run starts nothing, the loop's workflow is signalled,
and every refusal has its status, code and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from services.db.models import Checkpoint, Loop
from services.db.session import SessionFactory
from services.settings import Settings
from tests.services.api.support import ADMIN, ADMIN_TOKEN, create_loop
from tests.services.curation.bootstrap_traces import POLICY, curate, failure, post, success
from tests.services.training.hf_support import build_tiny_llama

HF_PROFILE = {"family": "hf", "algorithm": "grpo"}


@pytest.fixture
def settings(database_url: str, temporal_env: WorkflowEnvironment, tmp_path: Path) -> Settings:
    address = temporal_env.client.service_client.config.target_host
    return Settings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        temporal_address=address,
        temporal_task_queue=f"bootstrap-{tmp_path.name}",
        state_dir=tmp_path / "state",
    )


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("base") / "tiny-llama"
    build_tiny_llama(directory)
    return directory


def _replay_loop(client: TestClient, name: str = "desk", **fields: Any) -> dict[str, Any]:
    fields = {
        "training_profile": HF_PROFILE,
        "curation_policy": POLICY,
        "serving_target": {"model": name},  # each loop serves under a name of its own
        **fields,
    }
    return create_loop(client, name, environment="replay", **fields)


def _loop_id(session_factory: SessionFactory, name: str) -> int:
    with session_factory() as session:
        return session.scalars(select(Loop.id).where(Loop.name == name)).one()


def _traffic(session_factory: SessionFactory, name: str) -> None:
    """A dozen failing tickets (tasks in every split) and the same tickets solved."""
    loop_id = _loop_id(session_factory, name)
    post(session_factory, loop_id, [failure(n) for n in range(12)])
    curate(session_factory, loop_id)
    post(session_factory, loop_id, [success(n) for n in range(12)])
    curate(session_factory, loop_id)


async def _signals(temporal_env: WorkflowEnvironment, workflow_id: str) -> list[str]:
    """The signals the workflow got (none when it never ran)."""
    handle = temporal_env.client.get_workflow_handle(workflow_id)
    try:
        history = await handle.fetch_history()
    except RPCError:
        return []
    return [
        event.workflow_execution_signaled_event_attributes.signal_name
        for event in history.events
        if event.HasField("workflow_execution_signaled_event_attributes")
    ]


def _bootstrap(client: TestClient, loop: str, **body: Any) -> Any:
    return client.post(f"/v1/loops/{loop}/bootstrap", headers=ADMIN, json=body)


async def test_a_dry_run_says_what_it_learns_from_and_starts_nothing(
    client: TestClient,
    session_factory: SessionFactory,
    base_dir: Path,
    temporal_env: WorkflowEnvironment,
) -> None:
    _replay_loop(client, "desk-dry")
    _traffic(session_factory, "desk-dry")

    response = _bootstrap(client, "desk-dry", base=str(base_dir), dry_run=True)

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "dry_run" and body["heldout_tasks"] > 0
    report = body["report"]
    assert (report["traces"], report["successes"], report["failures"]) == (24, 12, 12)
    assert report["used"] + sum(report["left_out"].values()) == 12
    assert set(report["left_out"]) <= {"eval_cluster", "heldout_cluster"}
    assert f"{report['used']} successes used" in body["summary"]
    with session_factory() as session:  # nothing recorded, no workflow started
        assert session.get(Checkpoint, body["base_checkpoint_id"]) is None
    assert await _signals(temporal_env, "loop/desk-dry") == []


async def test_a_bootstrap_signals_the_loop(
    client: TestClient,
    session_factory: SessionFactory,
    base_dir: Path,
    temporal_env: WorkflowEnvironment,
) -> None:
    _replay_loop(client, "desk-go")
    _traffic(session_factory, "desk-go")

    response = _bootstrap(client, "desk-go", base=str(base_dir), reason="first champion")

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "signalled" and body["workflow_id"] == "loop/desk-go"
    with session_factory() as session:
        assert session.get(Checkpoint, body["base_checkpoint_id"]) is not None
    assert await _signals(temporal_env, "loop/desk-go") == ["bootstrap"]
    await temporal_env.client.get_workflow_handle("loop/desk-go").terminate()
    # The base is in the store now: its id names it.
    again = _bootstrap(client, "desk-go", base=body["base_checkpoint_id"], dry_run=True)
    assert (
        again.status_code == 200
        and again.json()["base_checkpoint_id"] == body["base_checkpoint_id"]
    )


def test_refusals_name_the_reason_and_the_field(
    client: TestClient, session_factory: SessionFactory, base_dir: Path, tmp_path: Path
) -> None:
    assert _bootstrap(client, "nope").json()["error"]["code"] == "loop_not_found"
    create_loop(client, "calc")  # toolcalc
    unsupported = _bootstrap(client, "calc", base=str(base_dir))
    assert unsupported.status_code == 422
    assert unsupported.json()["error"]["code"] == "bootstrap_unsupported"
    assert unsupported.json()["error"]["fields"][0]["path"] == "environment"
    _replay_loop(client, "tiny", training_profile={"family": "tiny"})
    wrong = _bootstrap(client, "tiny", base=str(base_dir)).json()["error"]
    assert (wrong["code"], wrong["fields"][0]["path"]) == (
        "wrong_family",
        "training_profile.family",
    )

    _replay_loop(client)
    no_base = _bootstrap(client, "desk")
    assert no_base.status_code == 422 and no_base.json()["error"]["code"] == "no_base_model"
    assert "--base" in no_base.json()["error"]["message"]
    missing = _bootstrap(client, "desk", base=str(tmp_path / "absent")).json()["error"]
    assert (missing["code"], missing["fields"][0]["path"]) == ("invalid_base", "base")
    unknown_id = _bootstrap(client, "desk", base="ab" * 32).json()["error"]
    assert unknown_id["code"] == "invalid_base" and "not in the store" in unknown_id["message"]

    nothing = _bootstrap(client, "desk", base=str(base_dir))
    assert nothing.status_code == 409
    assert nothing.json()["error"]["code"] == "no_demonstrations"
    assert "no successful train-split traces" in nothing.json()["error"]["message"]

    bad = _bootstrap(client, "desk", force=[1], extra=1)
    assert bad.status_code == 422
    assert {f["path"] for f in bad.json()["error"]["fields"]} == {"force", "extra"}


def test_a_loop_with_a_champion_is_refused_unless_forced(
    client: TestClient,
    session_factory: SessionFactory,
    base_dir: Path,
    temporal_env: WorkflowEnvironment,
) -> None:
    _replay_loop(client, "desk-champ")
    _traffic(session_factory, "desk-champ")
    registered = client.post(
        "/v1/loops/desk-champ/champion", headers=ADMIN, json={"checkpoint": str(base_dir)}
    )
    assert registered.status_code == 200, registered.text

    refused = _bootstrap(client, "desk-champ", base=str(base_dir))

    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "has_champion" and "--force" in error["message"]
    forced = _bootstrap(client, "desk-champ", base=str(base_dir), force=True, dry_run=True)
    assert forced.status_code == 200, forced.text
