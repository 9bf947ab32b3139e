"""What the gateway refuses, in OpenAI's error shape: a bad or revoked key (401), an oversize
body (413), an upstream that cannot be reached (502), an upstream's own error (its status),
and Responses state it does not keep (400)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.modelserver.registry import ModelRegistry
from tests.services.api.support import ADMIN
from tests.services.gateway.conftest import MODEL, Stack
from tests.services.modelserver.conftest import ServerThread, path_of, write_checkpoint
from tests.support import assert_eventually

pytestmark = pytest.mark.slow


@pytest.fixture
def model_server(tmp_path: Path) -> Iterator[ServerThread]:
    """These tests need a model server, not one that calls tools: a random tiny GPT."""
    registry = ModelRegistry(device="cpu")
    registry.load(MODEL, path_of(write_checkpoint(tmp_path / "tiny", 0)))
    with ServerThread(registry) as server:
        yield server


HELLO = [{"role": "user", "content": "hello"}]


def test_a_bad_key_is_a_401_in_openai_shape(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as raised:
        stack.openai("rgk_not-a-key").chat.completions.create(model="m", messages=HELLO)  # type: ignore[arg-type]
    assert raised.value.status_code == 401
    assert raised.value.body["type"] == "authentication_error"  # type: ignore[index]
    missing = httpx.post(f"{stack.gateway.url}/v1/chat/completions", json={"messages": HELLO})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"


def test_a_revoked_key_is_refused(stack: Stack) -> None:
    client = stack.openai()
    client.chat.completions.create(model="m", messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
    rotated = httpx.post(
        f"{stack.api}/v1/loops/gw-agent/secrets/rotate",
        json={"kind": "gateway_key", "grace_seconds": 0},
        headers=ADMIN,
    )
    assert rotated.status_code == 200, rotated.text

    def refused() -> None:
        try:
            client.chat.completions.create(model="m", messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
        except openai.AuthenticationError as exc:
            assert exc.status_code == 401
            return
        raise AssertionError("the revoked key still works")

    assert_eventually(refused, timeout=10, interval=0.2)
    new = stack.openai(rotated.json()["secret"])
    answer = new.chat.completions.create(model="m", messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
    assert answer.choices[0].message is not None


def test_an_oversize_body_is_a_413_before_it_is_read(stack: Stack) -> None:
    limit = stack.settings.gateway_max_body_bytes
    huge = [{"role": "user", "content": "x" * (limit + 10)}]
    with pytest.raises(openai.APIStatusError) as raised:
        stack.openai().chat.completions.create(model="m", messages=huge)  # type: ignore[arg-type]
    assert raised.value.status_code == 413
    assert raised.value.body["code"] == "body_too_large"  # type: ignore[index]


def test_an_unreachable_upstream_is_a_502_and_an_upstream_error_keeps_its_status(
    stack: Stack,
) -> None:
    # The loop names an upstream that listens nowhere (port 9, no champion yet).
    patched = httpx.patch(
        f"{stack.api}/v1/loops/gw-agent",
        json={"serving_target": {"upstream": "hosted", "upstream_model": "gpt-4o-mini"}},
        headers=ADMIN,
    )
    assert patched.status_code == 200, patched.text
    client = stack.openai()

    def unreachable() -> None:
        try:
            client.chat.completions.create(model="m", messages=HELLO)  # type: ignore[arg-type]
        except openai.APIStatusError as exc:
            assert exc.status_code == 502
            assert exc.body["code"] == "upstream_unreachable"  # type: ignore[index]
            return
        raise AssertionError("the call went to the model server, not the upstream")

    assert_eventually(unreachable, timeout=10, interval=0.2)


def test_the_model_servers_own_refusal_comes_back_with_its_status(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        stack.openai().chat.completions.create(
            model="m",
            messages=HELLO,  # type: ignore[arg-type]
            frequency_penalty=1.5,
        )
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == "frequency_penalty"  # type: ignore[index]


def _posted_raw(stack: Stack, content: str, *, stream: bool) -> httpx.Response:
    """A chat request whose one message is ``content`` as raw JSON text (escapes as given)."""
    flag = "true" if stream else "false"
    message = '{"role": "user", "content": "' + content + '"}'
    body = f'{{"model": "m", "max_tokens": 3, "stream": {flag}, "messages": [{message}]}}'
    return httpx.post(
        f"{stack.gateway.url}/v1/chat/completions",
        content=body.encode(),
        headers={"authorization": f"Bearer {stack.key}", "content-type": "application/json"},
        timeout=30,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_nul_is_answered_and_captured_replaced_and_a_lone_surrogate_is_the_upstreams_400(
    stack: Stack, stream: bool
) -> None:
    answered = _posted_raw(stack, "a\\u0000b", stream=stream)
    assert answered.status_code == 200, answered.text
    call_id = answered.headers["x-ratchet-call-id"]
    stored = {call.call_id: call for call in stack.wait_stored(1)}
    assert stored[call_id].body["messages"][0]["content"] == "a\ufffdb"

    refused = _posted_raw(stack, "a\\ud800b", stream=stream)  # not a 500 in the gateway
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "messages[0].content"


def test_responses_state_is_refused_with_a_clear_error(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        stack.openai().responses.create(model="m", input="hello", previous_response_id="resp_123")
    assert raised.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert "stateless" in raised.value.message
