"""Hot swap through vLLM's adapter endpoints: several adapters on one base, full models, and
swaps of the default name while clients keep asking — no request may fail."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from services.modelserver.openai_api import VERSION_HEADER
from services.modelserver.registry import ModelRegistry
from services.serving.base import CheckpointRef
from tests.services.modelserver.conftest import ServerThread, path_of, write_checkpoint

Serve = Callable[..., ServerThread]


def load(
    server: ServerThread, name: str, checkpoint: CheckpointRef | Path, **extra: object
) -> httpx.Response:
    path = checkpoint if isinstance(checkpoint, Path) else path_of(checkpoint)
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=120)


def greedy(server: ServerThread, model: str) -> tuple[str, str]:
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6,
            "temperature": 0,
        },
        timeout=60,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"], response.headers[VERSION_HEADER]


def test_several_adapters_are_resident_on_one_base_each_under_its_name(
    serve: Serve, llama_with_adapters: list[CheckpointRef]
) -> None:
    base, first, second = llama_with_adapters
    server = serve(base, name="base")

    assert load(server, "agent-a1", first).status_code == 200
    assert load(server, "agent-a2", second).text.startswith("Success")

    cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert set(cards) == {"base", "agent-a1", "agent-a2"}
    assert cards["agent-a1"]["parent"] == base.id
    assert cards["agent-a1"]["root"] == str(path_of(first))
    assert cards["agent-a2"]["ratchet"]["version"] == second.id
    answers = {name: greedy(server, name) for name in cards}
    assert {version for _, version in answers.values()} == {base.id, first.id, second.id}
    assert len({text for text, _ in answers.values()}) == 3  # each adapter changes the answer
    engine = server.registry.names()[0].engine
    assert len(engine.adapters()) == 2  # one base in memory, two adapters on it

    assert (
        httpx.post(
            f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "agent-a1"}
        ).status_code
        == 200
    )
    assert len(engine.adapters()) == 1
    assert greedy(server, "agent-a2") == answers["agent-a2"]
    gone = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "agent-a1", "messages": [{"role": "user", "content": "x"}]},
    )
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_a_mixed_batch_answers_each_row_with_its_own_adapter(
    serve: Serve, llama_with_adapters: list[CheckpointRef]
) -> None:
    base, first, second = llama_with_adapters
    server = serve(base, name="base")
    load(server, "a1", first)
    load(server, "a2", second)
    alone = {name: greedy(server, name) for name in ("base", "a1", "a2")}
    results: dict[int, tuple[str, str]] = {}
    names = ["base", "a1", "a2"] * 4
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, greedy(server, names[i])))
        for i in range(len(names))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [results[i] for i in range(len(names))] == [alone[n] for n in names]


def test_swapping_the_default_model_under_load_fails_no_request(
    serve: Serve, llama_with_adapters: list[CheckpointRef]
) -> None:
    base, first, second = llama_with_adapters
    server = serve(base, name="agent")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    stop = threading.Event()
    failures: list[str] = []
    versions: Counter[str] = Counter()
    lock = threading.Lock()

    def traffic() -> None:
        while not stop.is_set():
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="agent",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=4,
                    temperature=0,
                )
                with lock:
                    versions[raw.headers[VERSION_HEADER]] += 1
            except Exception as exc:  # a failed request is what this test is about
                with lock:
                    failures.append(repr(exc))

    threads = [threading.Thread(target=traffic) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for checkpoint in (first, second, base, first):  # adapter, adapter, full, adapter
            assert load(server, "agent", checkpoint, load_inplace=True).status_code == 200
            assert greedy(server, "agent")[1] == checkpoint.id
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)

    assert failures == []
    assert set(versions) <= {base.id, first.id, second.id}
    assert versions[first.id] > 0
    assert server.registry.swaps == 4
    # The replaced adapters were unloaded once nothing pointed at them.
    assert len(server.registry.names()[0].engine.adapters()) == 1


def test_full_models_swap_too_and_share_weights_across_names(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0], name="agent")
    assert load(server, "agent", checkpoints[1], load_inplace=True).status_code == 200
    assert load(server, "agent-v1", checkpoints[1]).status_code == 200
    served = {m.name: m for m in server.registry.names()}
    assert served["agent"].engine is served["agent-v1"].engine  # one copy for both names
    assert greedy(server, "agent")[1] == checkpoints[1].id


def test_refused_loads_change_nothing(
    serve: Serve,
    checkpoints: list[CheckpointRef],
    llama_with_adapters: list[CheckpointRef],
    tmp_path: Path,
) -> None:
    roots = [tmp_path, path_of(llama_with_adapters[1]).parent]
    server = serve(checkpoints[0], name="agent", model_roots=roots)
    before = greedy(server, "agent")

    exists = load(server, "agent", checkpoints[1])
    assert exists.status_code == 400 and "load_inplace" in exists.json()["error"]["message"]
    missing = load(server, "agent", tmp_path / "nowhere", load_inplace=True)
    assert missing.status_code == 400
    assert "not a checkpoint directory" in missing.json()["error"]["message"]

    tampered = tmp_path / "tampered"
    shutil.copytree(path_of(checkpoints[1]), tampered)
    config = json.loads((tampered / "config.json").read_text())
    (tampered / "config.json").write_text(json.dumps({**config, "n_layer": 2}))
    refused = load(server, "agent", tampered, load_inplace=True)
    assert refused.status_code == 400
    assert "sha256" in refused.json()["error"]["message"]

    pickled = tmp_path / "pickled"
    shutil.copytree(path_of(llama_with_adapters[1]), pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    manifest = json.loads((pickled / "manifest.json").read_text())
    digest = hashlib.sha256(b"\x80\x04").hexdigest()
    manifest["files"]["adapter_model.bin"] = {"sha256": digest, "size": 2}
    (pickled / "manifest.json").write_text(json.dumps(manifest))
    refused = load(server, "agent", pickled, load_inplace=True)
    assert refused.status_code == 400 and "pickle" in refused.json()["error"]["message"]

    # An adapter needs its base model, which this tiny-GPT server does not serve.
    orphan = load(server, "agent", llama_with_adapters[1], load_inplace=True)
    assert orphan.status_code == 400 and "base model" in orphan.json()["error"]["message"]

    bad_uri = load(server, "agent", Path("s3://bucket/ckpt"))
    assert bad_uri.status_code == 400
    assert greedy(server, "agent") == before
    assert server.registry.swaps == 0


def test_unload_errors_are_clear(serve: Serve, llama_with_adapters: list[CheckpointRef]) -> None:
    base, first, _ = llama_with_adapters
    server = serve(base, name="base")
    load(server, "a1", first)
    unknown = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert unknown.status_code == 404
    in_use = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "base"})
    assert in_use.status_code == 400 and "a1" in in_use.json()["error"]["message"]
    empty = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "lora_name"


def test_with_an_api_key_every_route_but_health_needs_it(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    registry = ModelRegistry(device="cpu")
    registry.load("agent", path_of(checkpoints[0]))
    server = serve(checkpoints[0], api_key="s3cret", admin_key="adm1n", registry=registry)
    denied = load(server, "v2", checkpoints[1])
    assert denied.status_code == 401
    assert denied.json()["error"]["type"] == "authentication_error"
    key = {"Authorization": "Bearer s3cret"}
    allowed = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": "v2", "lora_path": str(path_of(checkpoints[1]))},
        headers={"Authorization": "Bearer adm1n"},
    )
    assert allowed.status_code == 200
    chat = {"model": "v2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for method, path, body in [
        ("POST", "/v1/chat/completions", chat),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/v2", None),
        ("GET", "/v1/stats", None),
        ("GET", "/metrics", None),
        ("GET", "/openapi.json", None),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "v2"}),
        ("GET", "/nowhere", None),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = httpx.request(method, f"{server.url}{path}", json=body, headers=headers)
            assert refused.status_code == 401, (path, headers)
            assert refused.json()["error"]["code"] == "invalid_api_key"
    answered = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=key)
    assert answered.status_code == 200
    assert answered.headers[VERSION_HEADER] == checkpoints[1].id
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_fresh_checkpoint_directory_serves_under_a_new_name(
    serve: Serve, checkpoints: list[CheckpointRef], tmp_path: Path
) -> None:
    server = serve(checkpoints[0], name="agent")
    fresh = write_checkpoint(tmp_path / "fresh", seed=42)
    assert load(server, "fresh", fresh).status_code == 200
    assert greedy(server, "fresh")[1] == fresh.id
    assert greedy(server, "agent")[1] == checkpoints[0].id


def test_a_request_finishing_while_an_adapter_loads_does_not_unload_it(
    llama_with_adapters: list[CheckpointRef],
) -> None:
    """A request's release collects unused adapters; one loaded but not yet switched to its
    name is in use, not garbage (the race that failed requests during swaps under load)."""
    base, first, second = llama_with_adapters
    registry = ModelRegistry(device="cpu")
    registry.load("agent", path_of(base))
    registry.load("agent-a1", path_of(first))
    engine = registry.names()[0].engine
    held = registry.acquire("agent-a1")
    real_load = engine.load_adapter

    def load_then_a_request_finishes(name: str, path: Path) -> str:
        version = real_load(name, path)
        registry.release(held)  # lands between the load and the name's switch
        return version

    engine.load_adapter = load_then_a_request_finishes  # type: ignore[method-assign]
    served = registry.load("agent-a2", path_of(second))
    assert served.adapter in engine.adapters()
    assert registry.acquire("agent-a2").adapter in engine.adapters()
