"""The key that serves never swaps (issue 43, item 2): ``ratchet serve`` takes an API key
(``RATCHET_SERVE_API_KEY``: completions, model list, stats) and an admin key
(``RATCHET_SERVE_ADMIN_KEY``: the adapter routes too), and the adapter routes refuse the API
key. Tested against the real command (``python -m services serve`` in a subprocess) and, for
the door's finer cases, the app on a real socket."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from services.modelserver.openai_api import VERSION_HEADER
from services.serving.base import CheckpointRef
from tests.services.modelserver.conftest import ServeProcess, ServerThread, path_of

Serve = Callable[..., ServerThread]
AGENT_KEY = "key-the-agents-hold"
ADMIN_KEY = "key-only-the-worker-holds"
AGENT = {"Authorization": f"Bearer {AGENT_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def load_body(name: str, checkpoint: CheckpointRef) -> dict[str, str]:
    return {"lora_name": name, "lora_path": str(path_of(checkpoint))}


@pytest.fixture
def process(checkpoints: list[CheckpointRef], tmp_path: Path) -> Iterator[ServeProcess]:
    """The real ``ratchet serve`` with both keys."""
    server = ServeProcess(
        path_of(checkpoints[0]),
        name="agent",
        log=tmp_path / "serve.log",
        token=AGENT_KEY,
        admin_token=ADMIN_KEY,
    )
    yield server
    server.stop()


def test_the_api_key_alone_never_loads_or_unloads_a_model(
    checkpoints: list[CheckpointRef], tmp_path: Path
) -> None:
    """The reproduction: with one key set, that key (the one handed to agents) swapped the
    served model. Now a server with an API key and no admin key swaps for no one."""
    server = ServeProcess(
        path_of(checkpoints[0]), name="agent", log=tmp_path / "serve.log", token=AGENT_KEY
    )
    try:
        load = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={**load_body("agent", checkpoints[1]), "load_inplace": True},
            headers=AGENT,
        )
        assert load.status_code == 403, load.text
        assert load.json()["error"]["code"] == "admin_key_required"
        unload = httpx.post(
            f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "agent"}, headers=AGENT
        )
        assert unload.status_code == 403
        answered = httpx.post(
            f"{server.url}/v1/chat/completions", json=chat("agent"), headers=AGENT
        )
        assert answered.status_code == 200
        assert answered.headers[VERSION_HEADER] == checkpoints[0].id  # still the same
    finally:
        server.stop()


def post(url: str, path: str, body: object, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers)


def served_names(url: str, headers: dict[str, str]) -> dict[str, str]:
    """Served name -> the card's ``root`` as this client sees it."""
    cards = httpx.get(f"{url}/v1/models", headers=headers).json()["data"]
    return {card["id"]: card["root"] for card in cards}


def test_the_api_key_serves_and_the_admin_key_swaps(
    process: ServeProcess, checkpoints: list[CheckpointRef]
) -> None:
    url, candidate = process.url, checkpoints[1]
    # The API key: completions, the model list (without checkpoint paths), stats, metrics.
    assert post(url, "/v1/chat/completions", chat("agent"), AGENT).status_code == 200
    assert "/" not in served_names(url, AGENT)["agent"]
    assert httpx.get(f"{url}/v1/stats", headers=AGENT).status_code == 200
    assert httpx.get(f"{url}/metrics", headers=AGENT).status_code == 200
    # ... and never the adapter routes, under a new name or in place of the served one.
    for path, body in (
        ("/v1/load_lora_adapter", load_body("v2", candidate)),
        ("/v1/load_lora_adapter", {**load_body("agent", candidate), "load_inplace": True}),
        ("/v1/unload_lora_adapter", {"lora_name": "agent"}),
    ):
        refused = post(url, path, body, AGENT)
        assert refused.status_code == 403, (path, refused.text)
        assert refused.json()["error"]["code"] == "admin_key_required"
        assert refused.json()["error"]["type"] == "permission_error"
    # No key, or a wrong one: 401 on every route but the health checks.
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert (
            post(url, "/v1/load_lora_adapter", load_body("v2", candidate), headers).status_code
            == 401
        )
        assert post(url, "/v1/chat/completions", chat("agent"), headers).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    # The admin key: loads, sees the paths, unloads; what it loaded serves the API key.
    assert post(url, "/v1/load_lora_adapter", load_body("v2", candidate), ADMIN).status_code == 200
    answered = post(url, "/v1/chat/completions", chat("v2"), AGENT)
    assert answered.headers[VERSION_HEADER] == candidate.id
    assert served_names(url, ADMIN)["v2"] == str(path_of(candidate))
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "v2"}, ADMIN).status_code == 200
    assert list(served_names(url, AGENT)) == ["agent"]


def test_one_key_for_both_is_refused_at_start(
    checkpoints: list[CheckpointRef], tmp_path: Path
) -> None:
    env = {**os.environ, "RATCHET_SERVE_API_KEY": "same", "RATCHET_SERVE_ADMIN_KEY": "same"}
    done = subprocess.run(
        [sys.executable, "-m", "services", "serve", "--checkpoint", str(path_of(checkpoints[0]))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "RATCHET_SERVE_ADMIN_KEY must differ from RATCHET_SERVE_API_KEY" in done.stderr


def test_with_only_an_admin_key_anyone_local_serves_and_only_the_admin_swaps(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0], admin_key=ADMIN_KEY)
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat("ratchet")).is_success
    anonymous = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json=load_body("v2", checkpoints[1])
    )
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    # A proxy on this machine with the admin key is the admin, not a forwarded stranger.
    forwarded = {**ADMIN, "X-Forwarded-For": "203.0.113.7"}
    loaded = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json=load_body("v2", checkpoints[1]),
        headers=forwarded,
    )
    assert loaded.status_code == 200
    stranger = httpx.post(
        f"{server.url}/v1/chat/completions", json=chat("v2"), headers={"X-Forwarded-For": "x"}
    )
    assert stranger.status_code == 403


def test_beyond_loopback_without_an_admin_key_no_one_swaps(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0], api_key=AGENT_KEY, bind_host="0.0.0.0")
    refused = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json=load_body("v2", checkpoints[1]), headers=AGENT
    )
    assert refused.status_code == 403
    assert "RATCHET_SERVE_ADMIN_KEY" in refused.json()["error"]["message"]
