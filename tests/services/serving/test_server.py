"""The model server over HTTP: act, versions in every response, hot swap, rollback, auth."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from services.environments.registry import get_environment
from services.serving.base import VERSION_HEADER, CheckpointRef
from services.serving.client import ModelServerClient
from tests.services.serving.conftest import ServerThread


def swap(server: ServerThread, checkpoint: CheckpointRef, **body: object) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/admin/swap",
        json={"checkpoint": checkpoint.uri, **body},
        timeout=60,
    )


def test_act_answers_with_the_served_version(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    response = httpx.post(
        f"{server.url}/v1/act", json={"transcript": "user: 1+1\n> ", "max_new_tokens": 4}
    )
    assert response.status_code == 200
    body = response.json()
    assert isinstance(body["text"], str)
    assert body["model_version"] == checkpoints[0].id
    assert response.headers[VERSION_HEADER] == checkpoints[0].id

    batch = httpx.post(f"{server.url}/v1/generate", json={"prompts": ["a", "b"]}).json()
    assert len(batch["texts"]) == 2 and batch["model_version"] == checkpoints[0].id

    model = httpx.get(f"{server.url}/v1/model").json()
    assert model["model_version"] == checkpoints[0].id
    assert model["checkpoint_uri"] == checkpoints[0].uri
    assert model["previous_version"] is None
    health = httpx.get(f"{server.url}/healthz")
    assert health.json()["status"] == "ok"
    assert health.headers[VERSION_HEADER] == checkpoints[0].id
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "ratchet_serving_requests_total" in metrics
    assert "ratchet_serving_request_duration_seconds" in metrics


def test_the_act_endpoint_plays_episodes_for_a_traffic_simulator(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    env = get_environment("toolcalc")
    task = env.generate_tasks(1, seed=3, api_version="v1")[0]
    with ModelServerClient(server.url) as client:
        episode = env.run_episode(task, client.actor(max_new_tokens=16), max_turns=2)
        assert client.last_version == checkpoints[0].id
    assert episode.done
    assert len(episode.agent_turns) >= 1


def test_bad_requests_are_refused_with_422(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    bodies: list[dict[str, object]] = [
        {"transcript": "x", "max_new_tokens": 0},
        {"prompt": "x"},
        {"prompts": []},
    ]
    for body in bodies:
        path = "/v1/generate" if "prompts" in body else "/v1/act"
        assert httpx.post(f"{server.url}{path}", json=body).status_code == 422


def test_swap_serves_the_new_checkpoint_and_rollback_the_old(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    old, new = checkpoints[0], checkpoints[1]

    swapped = swap(server, new, expected_version=new.id)
    assert swapped.status_code == 200
    assert swapped.json()["model_version"] == new.id
    assert swapped.json()["previous_version"] == old.id
    assert swapped.json()["changed"] is True
    assert httpx.get(f"{server.url}/v1/model").json()["previous_version"] == old.id
    act = httpx.post(f"{server.url}/v1/act", json={"transcript": "hi"}).json()
    assert act["model_version"] == new.id

    again = swap(server, new)
    assert again.json()["changed"] is False

    rolled = httpx.post(f"{server.url}/v1/admin/rollback")
    assert rolled.status_code == 200
    assert rolled.json()["model_version"] == old.id
    assert httpx.get(f"{server.url}/v1/model").json()["model_version"] == old.id


def test_a_corrupt_checkpoint_is_refused_and_the_old_one_keeps_serving(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    corrupt = Path(checkpoints[1].uri.removeprefix("file://"))
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)

    refused = swap(server, checkpoints[1])
    assert refused.status_code == 422
    assert "model.safetensors" in refused.json()["detail"]
    assert "still serving" in refused.json()["detail"]
    assert httpx.get(f"{server.url}/v1/model").json()["model_version"] == checkpoints[0].id

    wrong = swap(server, checkpoints[2], expected_version=checkpoints[1].id)
    assert wrong.status_code == 422
    assert "not the expected" in wrong.json()["detail"]
    missing = httpx.post(f"{server.url}/v1/admin/swap", json={"checkpoint": "/no/such/checkpoint"})
    assert missing.status_code == 422


def test_non_finite_weights_fail_the_smoke_check(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef], tmp_path: Path
) -> None:
    import torch

    from services.training.checkpoint import save_checkpoint
    from services.training.policy import GPT
    from tests.services.serving.conftest import TINY

    model = GPT(TINY)
    with torch.no_grad():
        model.head.weight.fill_(float("nan"))
    path = tmp_path / "nan"
    save_checkpoint(model, TINY, path)
    server = serve(checkpoints[0])

    refused = swap(server, CheckpointRef(id="", uri=path.as_uri()))
    assert refused.status_code == 422
    assert "non-finite" in refused.json()["detail"]


def test_rollback_without_a_previous_model_is_a_conflict(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    response = httpx.post(f"{server.url}/v1/admin/rollback")
    assert response.status_code == 409


def test_a_configured_admin_token_is_required(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0], admin_token="s3cret")
    assert swap(server, checkpoints[1]).status_code == 401
    wrong = httpx.post(
        f"{server.url}/v1/admin/swap",
        json={"checkpoint": checkpoints[1].uri},
        headers={"Authorization": "Bearer nope"},
    )
    assert wrong.status_code == 401
    ok = httpx.post(
        f"{server.url}/v1/admin/swap",
        json={"checkpoint": checkpoints[1].uri},
        headers={"Authorization": "Bearer s3cret"},
        timeout=60,
    )
    assert ok.status_code == 200


def test_a_hot_swap_under_concurrent_requests_fails_none(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    old, new = checkpoints[0], checkpoints[1]
    stop = threading.Event()
    swapped = threading.Event()
    results: list[list[tuple[int, str | None, bool]]] = [[] for _ in range(4)]

    def client(index: int) -> None:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while not stop.is_set():
                after_swap = swapped.is_set()
                try:
                    response = http.post("/v1/act", json={"transcript": "user: 2+2\n> "})
                    version = response.json().get("model_version")
                    results[index].append((response.status_code, version, after_swap))
                except httpx.HTTPError:
                    results[index].append((0, None, after_swap))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    _wait_for_requests(results, 20)
    assert swap(server, new, expected_version=new.id).status_code == 200
    swapped.set()
    _wait_for_requests(results, 40)
    stop.set()
    for thread in threads:
        thread.join(30)

    flat = [entry for per_client in results for entry in per_client]
    assert all(status == 200 for status, _, _ in flat), [e for e in flat if e[0] != 200][:5]
    assert {version for _, version, _ in flat} <= {old.id, new.id}
    # Requests started after the swap returned were all answered by the new model, and each
    # client saw the versions change once, from old to new.
    assert all(version == new.id for _, version, after in flat if after)
    for per_client in results:
        versions = [version for _, version, _ in per_client]
        first_new = versions.index(new.id)
        assert all(v == new.id for v in versions[first_new:])
    stats = httpx.get(f"{server.url}/v1/stats").json()
    assert stats["requests_failed"] == 0
    assert stats["requests_by_version"][new.id] > 0


def _wait_for_requests(results: list[list[tuple[int, str | None, bool]]], count: int) -> None:
    import time

    deadline = time.monotonic() + 60
    while sum(len(r) for r in results) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(len(r) for r in results) >= count, json.dumps([len(r) for r in results])


def test_a_model_server_client_reports_refusals(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    from services.serving.base import DeployFailed, ServingUnavailable

    server = serve(checkpoints[0])
    with ModelServerClient(server.url) as client, pytest.raises(DeployFailed, match="409"):
        client.rollback()
    nowhere = ModelServerClient("http://127.0.0.1:9")
    with nowhere, pytest.raises(ServingUnavailable, match="did not answer"):
        nowhere.model()
