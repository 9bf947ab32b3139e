"""Loops as code: PATCH /v1/loops/{loop} merges, validates per field, versions with who/when."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from services.db.models import Loop, LoopConfigVersion
from services.db.session import SessionFactory
from tests.services.api.support import ADMIN, create_loop


def patch(client: TestClient, name: str, body: dict[str, Any], **params: Any) -> Any:
    return client.patch(f"/v1/loops/{name}", json=body, headers=ADMIN, params=params)


def test_a_change_is_merged_versioned_and_listed(
    client: TestClient, session_factory: SessionFactory
) -> None:
    create_loop(
        client,
        "support",
        gate_policy={"mode": "manual", "confidence": 0.9},
        training_profile={"hyperparameters": {"lr": 0.001, "steps": 10}},
    )
    response = patch(
        client,
        "support",
        {
            "gate_policy": {"confidence": 0.99, "mode": None},
            "training_profile": {"hyperparameters": {"steps": 20}},
            "executor": "kubernetes",
            "budget_usd": 40,
            "changed_by": "ana@example.com",
            "reason": "stricter gate",
        },
    )
    assert response.status_code == 200, response.text
    change = response.json()
    assert (change["changed"], change["dry_run"], change["version"]) == (True, False, 2)
    assert {c["path"]: (c["before"], c["after"]) for c in change["changes"]} == {
        "budget_usd": (None, 40.0),
        "executor": ("local", "kubernetes"),
        "gate_policy.confidence": (0.9, 0.99),
        "gate_policy.mode": ("manual", None),
        "training_profile.hyperparameters.steps": (10, 20),
    }
    # Merged, not replaced: the learning rate stays; `null` returned mode to its default.
    assert change["config"]["training_profile"] == {"hyperparameters": {"lr": 0.001, "steps": 20}}
    assert change["config"]["gate_policy"] == {"confidence": 0.99}
    with session_factory() as session:
        loop = session.scalars(select(Loop)).one()
        assert (loop.executor, float(loop.budget_usd or 0)) == ("kubernetes", 40.0)
        assert loop.gate_policy == {"confidence": 0.99}

    # The same change again changes nothing and records no version.
    again = patch(client, "support", {"gate_policy": {"confidence": 0.99}}).json()
    assert (again["changed"], again["version"], again["changes"]) == (False, 2, [])

    versions = client.get("/v1/loops/support/config/versions", headers=ADMIN).json()
    assert [v["version"] for v in versions] == [2, 1]
    assert (versions[0]["changed_by"], versions[0]["reason"]) == (
        "ana@example.com",
        "stricter gate",
    )
    assert versions[1]["changed_by"] == "admin-api" and versions[1]["reason"] == "created"
    assert versions[1]["config"]["gate_policy"] == {"mode": "manual", "confidence": 0.9}
    assert versions[0]["created_at"] >= versions[1]["created_at"]
    # A whole policy set to null returns to all defaults.
    reset = patch(client, "support", {"gate_policy": None}).json()
    assert (reset["version"], reset["config"]["gate_policy"]) == (3, {})


def test_dry_run_shows_the_diff_and_changes_nothing(
    client: TestClient, session_factory: SessionFactory
) -> None:
    create_loop(client, "dry", trigger_policy={"min_new_tasks": 8})
    response = patch(client, "dry", {"trigger_policy": {"min_new_tasks": 64}}, dry_run="true")
    assert response.status_code == 200, response.text
    change = response.json()
    assert (change["dry_run"], change["changed"], change["version"]) == (True, True, 1)
    assert change["changes"] == [{"path": "trigger_policy.min_new_tasks", "before": 8, "after": 64}]
    with session_factory() as session:
        assert session.scalars(select(Loop)).one().trigger_policy == {"min_new_tasks": 8}
        assert len(session.scalars(select(LoopConfigVersion)).all()) == 1


def test_invalid_changes_are_422_per_field_and_lose_nothing(
    client: TestClient, session_factory: SessionFactory
) -> None:
    create_loop(client, "strict", gate_policy={"confidence": 0.9})
    response = patch(
        client,
        "strict",
        {
            "gate_policy": {"confidence": 3, "confidense": 0.9},
            "trigger_policy": {"min_new_tasks": 0},
            "serving_target": {"kind": "kubernetes"},
            "curation_policy": {"eval_fraction": 7},
            "environment": "chess",
        },
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_loop_config"
    paths = {field["path"] for field in error["fields"]}
    assert paths == {
        "environment",
        "gate_policy.confidence",
        "gate_policy.confidense",
        "trigger_policy.min_new_tasks",
        "serving_target.endpoint",
        "curation_policy",
    }
    # Shape errors are the schema's 422 with the field's path.
    bad_type = patch(client, "strict", {"executor": "slurm", "budget_usd": -1, "nope": 1})
    assert bad_type.status_code == 422
    assert {f["path"] for f in bad_type.json()["error"]["fields"]} == {
        "executor",
        "budget_usd",
        "nope",
    }
    assert patch(client, "strict", {"gate_policy": {"x": {"y": "\x00"}}}).status_code == 422
    with session_factory() as session:
        assert session.scalars(select(Loop)).one().gate_policy == {"confidence": 0.9}
        assert len(session.scalars(select(LoopConfigVersion)).all()) == 1

    assert patch(client, "absent", {"executor": "local"}).status_code == 404
    assert client.patch("/v1/loops/strict", json={}).status_code == 401
    unknown = client.get("/v1/loops/absent/config/versions", headers=ADMIN)
    assert unknown.status_code == 404


def test_the_loop_page_shows_the_history_and_an_operator_champion(
    client: TestClient, session_factory: SessionFactory
) -> None:
    from services.db.models import Checkpoint, Promotion

    create_loop(client, "paged", gate_policy={"confidence": 0.9})
    patch(client, "paged", {"gate_policy": {"confidence": 0.97}, "changed_by": "ana"})
    with session_factory.begin() as session:
        loop = session.scalars(select(Loop).where(Loop.name == "paged")).one()
        session.add(
            Checkpoint(
                id="c" * 64,
                loop_id=loop.id,
                uri="file:///tmp/base",
                format="safetensors",
                size_bytes=1,
                sha256="c" * 64,
                manifest={},
            )
        )
        session.flush()
        loop.champion_checkpoint_id = "c" * 64
        session.add(
            Promotion(
                loop_id=loop.id,
                cycle_id=None,
                decision="promote",
                status="held",
                reason="the first champion",
                candidate_checkpoint_id="c" * 64,
                decided_by="operator",
            )
        )
    page = client.get("/loops/paged")
    assert page.status_code == 200
    html = page.text
    assert "Configuration history" in html
    assert "v2" in html and "v1" in html and "ana" in html
    assert "gate_policy.confidence" in html and "0.97" in html
    assert "cycle #None" not in html
    assert "registered by the operator" in html


def test_concurrent_changes_apply_one_after_the_other(
    client: TestClient, session_factory: SessionFactory
) -> None:
    """Each change merges into what the previous one left: none is lost."""
    from concurrent.futures import ThreadPoolExecutor

    create_loop(client, "busy")
    # Eight hyper-parameters of the default trainer (tiny GRPO) for which 1 is in range.
    keys = [
        "steps",
        "tasks_per_step",
        "max_turns",
        "max_new_tokens",
        "warmup",
        "ppo_epochs",
        "micro_batch",
        "log_every",
    ]

    def change(key: str) -> int:
        body = {"training_profile": {"hyperparameters": {key: 1}}, "changed_by": key}
        return int(patch(client, "busy", body).status_code)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(change, keys)) == [200] * len(keys)
    with session_factory() as session:
        loop = session.scalars(select(Loop).where(Loop.name == "busy")).one()
        assert set(loop.training_profile["hyperparameters"]) == set(keys)
        versions = session.scalars(
            select(LoopConfigVersion.version).where(LoopConfigVersion.loop_id == loop.id)
        ).all()
    assert sorted(versions) == list(range(1, len(keys) + 2))


def test_a_change_to_hyperparameters_is_checked_against_the_trainer_and_loses_nothing(
    client: TestClient, session_factory: SessionFactory
) -> None:
    """Refused when made, naming the key, not when the next train job starts after curation."""
    create_loop(client, "tuned", training_profile={"hyperparameters": {"group_size": 8}})
    cases = [
        ({"training_profile": {"hyperparameters": {"group_size": 1}}}, "group_size"),
        ({"training_profile": {"hyperparameters": {"stepz": 3}}}, "stepz"),
        # Switching the algorithm keeps the stored keys: GRPO's group_size means nothing to SFT.
        ({"training_profile": {"algorithm": "sft"}}, "group_size"),
    ]
    for body, key in cases:
        response = patch(client, "tuned", body)
        assert response.status_code == 422, response.text
        fields = response.json()["error"]["fields"]
        assert [f["path"] for f in fields] == [f"training_profile.hyperparameters.{key}"]
        assert key in fields[0]["message"]
    with session_factory() as session:
        loop = session.scalars(select(Loop).where(Loop.name == "tuned")).one()
        assert loop.training_profile == {"hyperparameters": {"group_size": 8}}
        versions = session.scalars(
            select(LoopConfigVersion.version).where(LoopConfigVersion.loop_id == loop.id)
        ).all()
    assert list(versions) == [1]
    fixed = {"training_profile": {"algorithm": "sft", "hyperparameters": {"group_size": None}}}
    assert patch(client, "tuned", fixed).status_code == 200


def test_a_serving_target_names_a_configured_endpoint_of_its_kind(
    client: TestClient, session_factory: SessionFactory
) -> None:
    """No URL, key or Deployment comes from a loop: it picks one of the deployment's serving
    endpoints by name, and an unknown name is refused with the configured ones listed."""
    refused = client.post(
        "/v1/loops",
        json={
            "name": "unknown-endpoint",
            "environment": "toolcalc",
            "serving_target": {"kind": "openai", "endpoint": "elsewhere", "model": "agent"},
        },
        headers=ADMIN,
    )
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["code"] == "unknown_serving_endpoint"
    assert error["fields"][0]["path"] == "serving_target.endpoint"
    assert "'elsewhere'" in error["message"] and "configured: prod, vllm" in error["message"]

    create_loop(client, "served", serving_target={"kind": "local"})
    cases = {
        "serving_target.endpoint": {"kind": "kubernetes", "endpoint": "vllm"},  # an openai one
        "serving_target.url": {"kind": "openai", "url": "http://127.0.0.1:9", "model": "agent"},
        "serving_target.deployment": {"kind": "kubernetes", "deployment": "rel-ratchet-worker"},
    }
    for path, target in cases.items():
        response = patch(client, "served", {"serving_target": target})
        assert response.status_code == 422, target
        fields = response.json()["error"]["fields"]
        assert path in {field["path"] for field in fields}, fields
        assert (
            "RATCHET_SERVING_ENDPOINTS" in fields[0]["message"]
            or "configured: prod, vllm" in (fields[0]["message"])
        )

    applied = patch(
        client, "served", {"serving_target": {"kind": "kubernetes", "endpoint": "prod"}}
    )
    assert applied.status_code == 200, applied.text
    with session_factory() as session:
        stored = session.scalars(select(Loop).where(Loop.name == "served")).one()
        assert stored.serving_target == {"kind": "kubernetes", "endpoint": "prod"}


def test_a_replay_loop_names_only_judge_and_tool_endpoints_the_deployment_lists(
    client: TestClient,
) -> None:
    """A loop names a judge or a live tool endpoint; the URL and key are the deployment's.
    An unlisted name is refused on create and on change, naming the field and the setting."""
    judged = {"judge_endpoint": "grader", "judge_rubric": "Is the answer right?"}
    refused = client.post(
        "/v1/loops",
        json={
            "name": "judged",
            "environment": "replay",
            "curation_policy": {**judged, "judge_endpoint": "elsewhere"},
        },
        headers=ADMIN,
    )
    assert refused.status_code == 422, refused.text
    field = refused.json()["error"]["fields"][0]
    assert field["path"] == "curation_policy.judge_endpoint"
    assert (
        "'elsewhere'" in field["message"]
        and "RATCHET_JUDGE_ENDPOINTS lists: grader" in (field["message"])
    )

    create_loop(client, "judged", environment="replay", curation_policy=judged)
    tool = patch(client, "judged", {"curation_policy": {"tool_endpoint": "orders"}})
    assert tool.status_code == 422
    field = tool.json()["error"]["fields"][0]
    assert field["path"] == "curation_policy.tool_endpoint"
    assert "RATCHET_TOOL_ENDPOINTS lists: none" in field["message"]
