"""`ratchet serve` under careless and hostile clients (issue 28): body cap, budget before
rendering, a bounded queue, cancellation on hang-up, loopback that is not an identity, and
errors in OpenAI's shape for every bad input."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.inference.forward import BatchForward
from services.modelserver.openai_api import VERSION_HEADER
from services.modelserver.registry import ModelRegistry
from services.serving.base import CheckpointRef
from tests.services.modelserver.conftest import LISTING, ServerThread, path_of
from tests.support import assert_eventually

Serve = Callable[..., ServerThread]
CHAT = {"model": "ratchet", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0], max_body_bytes=4096)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
    declared = httpx.post(f"{server.url}/v1/chat/completions", json=big)
    assert openai_error(declared, 413)["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:
        body = json.dumps(big).encode()
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    chunked = httpx.post(f"{server.url}/v1/chat/completions", content=chunks())
    assert openai_error(chunked, 413)["code"] == "body_too_large"
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200


def test_a_conversation_too_long_for_the_context_is_refused_before_rendering(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    engine = server.registry.names()[0].engine
    rendered: list[int] = []
    original = engine.render

    def counting(*args: Any) -> list[int]:
        rendered.append(1)
        return original(*args)

    engine.render = counting  # type: ignore[method-assign,assignment]
    long = {**CHAT, "messages": [{"role": "user", "content": "x" * 5_000}]}
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=long)
    assert openai_error(refused, 400)["code"] == "context_length_exceeded"
    assert rendered == []
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200
    assert rendered == [1]


def test_a_full_queue_answers_429_with_retry_after(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0], queue_max=2)
    refused = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "n": 3})
    error = openai_error(refused, 429)
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
    assert refused.headers["Retry-After"] == "1"
    assert httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "n": 2}).is_success


class Gate:
    """Holds the engine's decode steps until opened: a client can hang up mid-decode."""

    def __init__(self, engine: Any) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        original = engine.forward
        engine.eos_ids = frozenset()  # never stops by itself: only its budget or a cancel

        def forward(adapters: Any) -> BatchForward:
            batch: BatchForward = original(adapters)
            step = batch.step

            def gated(tokens: Any) -> Any:
                self.entered.set()
                self.opened.wait(30)
                return step(tokens)

            batch.step = gated
            return batch

        engine.forward = forward


def hang_up_after_sending(url: str, body: dict[str, Any], gate: Gate) -> None:
    """Send a request on a raw socket, wait until it decodes, and close the connection."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        assert gate.entered.wait(30)


@pytest.mark.parametrize("stream", [False, True])
def test_rows_of_a_client_that_hangs_up_stop_decoding(
    serve: Serve, checkpoints: list[CheckpointRef], stream: bool
) -> None:
    server = serve(checkpoints[0])
    scheduler = server.app.state.server.scheduler
    gate = Gate(server.registry.names()[0].engine)
    body = {**CHAT, "max_tokens": 80, "n": 2, "stream": stream}

    hang_up_after_sending(server.url, body, gate)

    assert_eventually(lambda: _equal(scheduler.cancelled, 2))
    gate.opened.set()
    stats = f"{server.url}/v1/stats"
    assert_eventually(lambda: _equal(httpx.get(stats).json()["requests_total"], 1))
    assert scheduler.row_steps <= 2 * 2  # two rows, at most a step each after the hang-up
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200


def _equal(actual: object, expected: object) -> None:
    assert actual == expected


@pytest.mark.parametrize(
    "headers",
    [
        {"Host": "rebound.attacker.example"},
        {"Host": "rebound.attacker.example:8100"},
        {"Forwarded": "for=203.0.113.7"},
        {"X-Forwarded-For": "203.0.113.7"},
    ],
)
def test_without_a_key_foreign_hosts_and_forwarded_requests_are_refused(
    serve: Serve, checkpoints: list[CheckpointRef], headers: dict[str, str]
) -> None:
    server = serve(checkpoints[0])
    load = {"lora_name": "v2", "lora_path": str(path_of(checkpoints[1]))}
    for path, body in (("/v1/load_lora_adapter", load), ("/v1/chat/completions", CHAT)):
        refused = httpx.post(f"{server.url}{path}", json=body, headers=headers)
        assert openai_error(refused, 403)["type"] == "permission_error"
    assert [m.name for m in server.registry.names()] == ["ratchet"]
    assert httpx.get(f"{server.url}/health", headers=headers).status_code == 200
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=load).status_code == 200


def test_beyond_loopback_the_adapter_routes_need_a_key_and_paths_are_hidden(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0], bind_host="0.0.0.0")
    load = {"lora_name": "v2", "lora_path": str(path_of(checkpoints[1]))}
    refused = httpx.post(f"{server.url}/v1/load_lora_adapter", json=load)
    assert openai_error(refused, 403)["code"] == "admin_key_required"
    unload = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "ratchet"})
    assert openai_error(unload, 403)["code"] == "admin_key_required"
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["root"] == path_of(checkpoints[0]).name
    assert "/" not in json.dumps(httpx.get(f"{server.url}/v1/models/ratchet").json()["root"])


def test_adapter_loads_come_only_from_the_model_roots_and_say_nothing_of_what_exists(
    serve: Serve, checkpoints: list[CheckpointRef], tmp_path: Path
) -> None:
    server = serve(checkpoints[0], model_roots=[tmp_path])
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (tmp_path / "linked").symlink_to(path_of(checkpoints[1]), target_is_directory=True)
    candidates = [
        "/etc",  # exists, outside
        "/nonexistent/checkpoint",  # does not exist
        str(outside),
        str(tmp_path / "linked"),  # a symlinked directory inside the root
        f"{tmp_path}/../{tmp_path.name}/ckpt-1",  # `..`
        "ckpt-1",  # relative
        str(tmp_path / "missing"),
        str(tmp_path),  # the root itself holds no manifest
    ]
    messages = set()
    for raw in candidates:
        refused = httpx.post(
            f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": raw}
        )
        error = openai_error(refused, 400)
        messages.add(error["message"].replace(repr(raw), "<path>"))
    assert len(messages) == 1
    ok = {"lora_name": "x", "lora_path": path_of(checkpoints[1]).as_uri()}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=ok).status_code == 200


def test_a_lone_surrogate_is_a_400(serve: Serve, checkpoints: list[CheckpointRef]) -> None:
    server = serve(checkpoints[0])
    changes: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
        ({"stop": ["\udfff"]}, "stop[0]"),
        ({"model": "\ud800"}, "model"),
    ]
    for change, param in changes:
        body = json.dumps({**CHAT, **change})  # ensure_ascii: "\\ud800" on the wire
        response = httpx.post(
            f"{server.url}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        assert openai_error(response, 400)["param"] == param
    for path, adapter_body in [
        ("/v1/load_lora_adapter", {"lora_name": "\ud800", "lora_path": "/x"}),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp/\ud800"}),
        ("/v1/unload_lora_adapter", {"lora_name": "\udfff"}),
    ]:
        response = httpx.post(
            f"{server.url}{path}",
            content=json.dumps(adapter_body),
            headers={"content-type": "application/json"},
        )
        openai_error(response, 400)
    assert httpx.get(f"{server.url}/v1/models").status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "content", "status"),
    [
        ("GET", "/nowhere", None, 404),
        ("GET", "/v1/chat/completions", None, 405),
        ("DELETE", "/v1/models", None, 405),
        ("POST", "/v1/chat/completions", b"{not json", 400),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400),
        ("POST", "/v1/chat/completions", b"\xff\xfe", 400),
        ("POST", "/v1/load_lora_adapter", b"", 400),
    ],
)
def test_every_error_is_openai_shaped(
    serve: Serve,
    checkpoints: list[CheckpointRef],
    method: str,
    path: str,
    content: bytes | None,
    status: int,
) -> None:
    server = serve(checkpoints[0])
    headers = {"content-type": "application/json"}
    response = httpx.request(method, f"{server.url}{path}", content=content, headers=headers)
    openai_error(response, status)


def test_streaming_with_stop_never_sends_the_stop_string(
    serve: Serve, tool_calling_tiny: CheckpointRef
) -> None:
    server = serve(tool_calling_tiny)
    body = {
        "model": "ratchet",
        "messages": [{"role": "system", "content": LISTING}, {"role": "user", "content": "$pear"}],
        "temperature": 0,
        "stream": True,
    }
    for stop in (["("], ["(p"], ["(pea", "r)"]):
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json={**body, "stop": stop}
        ) as response:
            assert response.headers[VERSION_HEADER] == tool_calling_tiny.id
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
        assert "".join(deltas) == "@get", (stop, deltas)


def test_the_registry_serves_only_what_the_manifest_lists(
    tool_calling_llama: CheckpointRef, tmp_path: Path
) -> None:
    import shutil

    from services.training.checkpoint import write_manifest

    # A checkpoint whose template is in tokenizer_config.json (as older transformers save it)...
    planted = tmp_path / "planted"
    shutil.copytree(path_of(tool_calling_llama), planted)
    template = (planted / "chat_template.jinja").read_text()
    (planted / "chat_template.jinja").unlink()
    config = json.loads((planted / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (planted / "tokenizer_config.json").write_text(json.dumps(config))
    write_manifest(planted, family="hf")
    reference_dir = tmp_path / "reference"
    shutil.copytree(planted, reference_dir)
    # ... and files planted after its manifest was written: from_pretrained would read them.
    (planted / "chat_template.jinja").write_text("PLANTED {{ messages[0].content }}")
    (planted / "special_tokens_map.json").unlink(missing_ok=True)
    (planted / "special_tokens_map.json").symlink_to("/etc/hostname")
    registry = ModelRegistry(device="cpu")
    clean = ModelRegistry(device="cpu")
    served = registry.load("planted", planted)
    reference = clean.load("clean", reference_dir)

    assert served.version == reference.version
    assert served.engine.tokenizer.chat_template == reference.engine.tokenizer.chat_template  # type: ignore[attr-defined]
    assert "PLANTED" not in str(served.engine.tokenizer.chat_template)  # type: ignore[attr-defined]


def test_state_space_models_are_refused_at_load(tmp_path: Path) -> None:
    from services.modelserver.registry import LoadRefused
    from services.training.checkpoint import write_manifest

    for model_type in ("mamba", "mamba2", "falcon_mamba", "jamba"):
        directory = tmp_path / model_type
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
        (directory / "model.safetensors").write_bytes(b"weights are never read")
        write_manifest(directory, family="hf")
        with pytest.raises(LoadRefused, match="state-space or hybrid model"):
            ModelRegistry(device="cpu").load("m", directory)


def test_serving_stops_at_the_end_of_turn_when_eos_names_another_token(
    serve: Serve, tool_calling_llama: CheckpointRef, tmp_path: Path
) -> None:
    """A Qwen2-base-like checkpoint: ChatML template, eos some other token. Evaluation stops
    at <|im_end|> (services.chat.stops); so must serving, instead of running to max_tokens."""
    import shutil

    from services.chat.stops import stop_token_ids
    from services.training.checkpoint import write_manifest

    directory = tmp_path / "base-like"
    shutil.copytree(path_of(tool_calling_llama), directory)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<|pad|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    registry = ModelRegistry(device="cpu")
    pad = registry.load("probe", path_of(tool_calling_llama)).engine.tokenizer.pad_token_id  # type: ignore[attr-defined]
    for name in ("config.json", "generation_config.json"):
        config = json.loads((directory / name).read_text())
        config["eos_token_id"] = pad
        (directory / name).write_text(json.dumps(config))
    write_manifest(directory, family="hf")
    registry = ModelRegistry(device="cpu")
    served = registry.load("ratchet", directory)
    tokenizer = served.engine.tokenizer  # type: ignore[attr-defined]
    assert tokenizer.eos_token_id == pad
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in stop_token_ids(tokenizer) and im_end in served.engine.eos_ids
    from services.training.hf.model import HFModel

    assert set(HFModel.load(directory, device="cpu").stop_ids) == served.engine.eos_ids

    server = serve(tool_calling_llama, registry=registry)
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "max_tokens": 20})
    choice = answer.json()["choices"][0]
    assert (choice["finish_reason"], answer.json()["usage"]["completion_tokens"]) == ("stop", 1)
