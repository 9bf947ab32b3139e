"""The model server's word on which checkpoint answered travels in its response ids (issue
28: the canary no longer trusts a trace's self-reported ``model_version``)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from pydantic import SecretStr

from services.modelserver.attestation import attested, response_id, verifies
from services.modelserver.openai_api import VERSION_HEADER
from services.serving.base import CheckpointRef
from services.serving.targets import ServingTargets
from services.settings import ServingEndpoint, Settings
from tests.services.modelserver.conftest import ServerThread

KEY = b"k" * 32
CHAT = {"model": "ratchet", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_a_signed_id_verifies_for_its_version_only() -> None:
    signed = response_id("chatcmpl", "v-new", KEY)
    assert signed.startswith("chatcmpl-")
    assert verifies(signed, "v-new", KEY)
    assert not verifies(signed, "v-old", KEY)
    assert not verifies(signed, "v-new", b"another key")
    tampered = signed[:-1] + ("0" if signed[-1] != "0" else "1")
    assert not verifies(tampered, "v-new", KEY)
    assert not verifies(response_id("chatcmpl", "v-new", None), "v-new", KEY)  # unsigned
    for junk in ("", "chatcmpl-", "x" * 56, "chatcmpl-" + "z" * 56):
        assert not verifies(junk, "v-new", KEY)


def test_a_trace_is_attested_only_when_every_id_is_signed_for_its_version() -> None:
    new = [response_id("chatcmpl", "v-new", KEY) for _ in range(3)]
    old = response_id("chatcmpl", "v-old", KEY)
    assert attested("v-new", new, key=KEY)
    assert not attested("v-old", new, key=KEY)  # the client names another version
    assert not attested("v-new", [*new, old], key=KEY)  # a swap mid-episode: mixed
    assert not attested("v-new", [], key=KEY)  # no id: the client's word only
    assert not attested(None, new, key=KEY)
    assert not attested("v-new", [*new, 7], key=KEY)  # what a stored body may hold


def test_the_server_signs_each_completion_for_the_version_that_answered(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0], attestation_key=KEY)
    response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    version = response.headers[VERSION_HEADER]
    assert version == checkpoints[0].id
    assert verifies(response.json()["id"], version, KEY)
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "stream": True})
    first = next(line for line in streamed.text.splitlines() if line.startswith("data: {"))
    assert verifies(httpx.Response(200, content=first[6:]).json()["id"], version, KEY)


def test_without_a_key_the_server_signs_nothing(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert not verifies(response.json()["id"], checkpoints[0].id, KEY)


def test_the_targets_that_sign_are_the_local_server_and_the_endpoints_marked_so() -> None:
    endpoints = {
        "vllm": ServingEndpoint(kind="openai", url="http://vllm:8000"),
        "ours": ServingEndpoint(kind="openai", url="http://serve:8100", attests=True),
    }
    settings = Settings(serve_attestation_key=SecretStr("k" * 32), serving_endpoints=endpoints)
    targets = ServingTargets(settings, start_local_server=False)
    signed = [response_id("chatcmpl", "v", KEY)]
    local = targets.attestation({"kind": "local", "model": "ratchet"})
    assert local is not None and local("v", signed)
    ours = targets.attestation({"kind": "openai", "endpoint": "ours", "model": "agent"})
    assert ours is not None and ours("v", signed) and not ours("w", signed)
    assert targets.attestation({"kind": "openai", "endpoint": "vllm", "model": "agent"}) is None
    unkeyed = ServingTargets(Settings(serving_endpoints=endpoints), start_local_server=False)
    assert unkeyed.attestation({"kind": "local", "model": "ratchet"}) is None
