"""What ``ratchet serve`` sampled comes back: log-probs, top alternatives and token ids.

The log-probs are the raw model's (temperature 1), as vLLM returns them by default, whatever
temperature the request samples at: the tests recompute them with the engine itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from services.inference.engine import ActiveBatch, GenerationRequest, SamplingParams
from services.modelserver.registry import ModelRegistry
from services.serving.base import CheckpointRef
from tests.services.modelserver.conftest import ServerThread, path_of

Serve = Callable[..., ServerThread]
HELLO = [{"role": "user", "content": "hello"}]


def local_row(
    registry: ModelRegistry, prompt: list[int], *, max_tokens: int, temperature: float, seed: int
) -> tuple[list[int], list[float], list[tuple[tuple[int, float], ...]]]:
    """The same row decoded in-process: sampled ids, their log-probs, the top 3 of each."""
    served = registry.acquire("ratchet")
    try:
        batch: ActiveBatch[int] = ActiveBatch(served.engine)
        sampling = SamplingParams(max_tokens, temperature=temperature, seed=seed, top_logprobs=3)
        batch.join([(GenerationRequest(prompt, sampling), 0)])
        while True:
            done = batch.step()
            if done:
                result = done[0][1]
                return result.sampled_ids, result.logprobs, result.top_logprobs
    finally:
        registry.release(served)


def served(serve: Serve, checkpoint: CheckpointRef) -> tuple[ServerThread, ModelRegistry]:
    registry = ModelRegistry(device="cpu")
    registry.load("ratchet", path_of(checkpoint))
    return serve(checkpoint, registry=registry), registry


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_chat_returns_the_sampled_ids_and_the_raw_models_logprobs(
    serve: Serve, checkpoints: list[CheckpointRef], temperature: float
) -> None:
    server, registry = served(serve, checkpoints[0])
    body = {
        "model": "ratchet",
        "messages": HELLO,
        "max_tokens": 8,
        "temperature": temperature,
        "seed": 11,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
    }

    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()

    choice = answer["choices"][0]
    ids, logprobs, tops = local_row(
        registry, answer["prompt_token_ids"], max_tokens=8, temperature=temperature, seed=11
    )
    assert choice["token_ids"] == ids
    content = choice["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == pytest.approx(logprobs, abs=1e-9)
    for entry, top in zip(content, tops, strict=True):
        assert len(entry["top_logprobs"]) == 3
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            [lp for _, lp in top], abs=1e-9
        )
        assert entry["bytes"] == list(entry["token"].encode())
        assert math.fsum(math.exp(t["logprob"]) for t in entry["top_logprobs"]) <= 1 + 1e-9
    if temperature == 0:  # greedy picks the most likely token: its log-prob is the top one
        assert all(e["logprob"] == e["top_logprobs"][0]["logprob"] for e in content)
    assert answer["usage"]["completion_tokens"] <= len(ids)


def test_the_openai_client_reads_the_logprobs(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server, _ = served(serve, checkpoints[0])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    answer = client.chat.completions.create(
        model="ratchet", messages=HELLO, max_tokens=5, logprobs=True, top_logprobs=2, seed=1
    )

    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in logprobs.content)
    assert "token_ids" not in (answer.choices[0].model_extra or {})  # only when asked


def test_streaming_sends_the_same_logprobs_and_ids_chunk_by_chunk(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server, _ = served(serve, checkpoints[0])
    body = {
        "model": "ratchet",
        "messages": HELLO,
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 1,
        "return_token_ids": True,
    }
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()

    chunks = stream(server, "/v1/chat/completions", body)

    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    choices = [c["choices"][0] for c in chunks]
    entries = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    assert entries == whole["choices"][0]["logprobs"]["content"]
    assert [i for c in choices for i in c["token_ids"]] == whole["choices"][0]["token_ids"]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    assert text == whole["choices"][0]["message"]["content"]


def test_completions_take_token_ids_and_return_what_was_sampled(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server, registry = served(serve, checkpoints[0])
    prompt = list(b"user: hello\n> ")
    body = {
        "model": "ratchet",
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 3,
        "return_token_ids": True,
    }

    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()

    assert answer["object"] == "text_completion" and "prompt_token_ids" not in answer
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == prompt  # on the choice, as vLLM puts it
    ids, logprobs, _ = local_row(registry, prompt, max_tokens=6, temperature=0, seed=0)
    assert choice["token_ids"] == ids
    legacy = choice["logprobs"]
    assert legacy["token_logprobs"] == pytest.approx(logprobs, abs=1e-9)
    assert len(legacy["tokens"]) == len(legacy["top_logprobs"]) == len(ids)
    assert legacy["text_offset"][0] == 0
    assert all(
        token in top for token, top in zip(legacy["tokens"], legacy["top_logprobs"], strict=True)
    )
    assert choice["text"] == bytes(ids).decode("utf-8", "replace")[: len(choice["text"])]

    text_prompt = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "prompt": "user: hello\n> "},
        timeout=60,
    ).json()
    assert text_prompt["choices"][0]["prompt_token_ids"] == prompt
    assert text_prompt["choices"][0]["token_ids"] == ids

    chunks = stream(server, "/v1/completions", body)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [i for c in chunks for i in c["choices"][0].get("token_ids", [])] == ids
    streamed = [
        lp
        for c in chunks
        if c["choices"][0].get("logprobs")
        for lp in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert streamed == legacy["token_logprobs"]


def stream(server: ServerThread, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed answer (the choices' ones, [DONE] excluded)."""
    with httpx.stream(
        "POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


BAD_CHAT = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs", "needs logprobs"),
    ({"return_token_ids": "maybe"}, "return_token_ids", "boolean"),
]


@pytest.mark.parametrize(("change", "param", "message"), BAD_CHAT)
def test_bad_logprob_requests_are_openai_400s(
    serve: Serve, checkpoints: list[CheckpointRef], change: dict[str, Any], param: str, message: str
) -> None:
    server = serve(checkpoints[0])
    body = {"model": "ratchet", "messages": HELLO, **change}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert message in error["message"]


BAD_COMPLETIONS = [
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": 7}, "prompt", "a string or a list of token ids"),
    ({"prompt": [[1, 2]]}, "prompt", "one prompt per request"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": [1, -2]}, "prompt", ">= 0"),
    ({"prompt": [1, 2, 256]}, "prompt[2]", "ids are 0 to 255"),
    ({"prompt": [1] * 96}, "prompt", "context is 96"),
    ({"prompt": "x" * 500}, "prompt", "context is 96"),
    ({"echo": True}, "echo", "not supported"),
    ({"suffix": "z"}, "suffix", "not supported"),
    ({"best_of": 3}, "best_of", "must equal n"),
    ({"presence_penalty": 1}, "presence_penalty", "not supported"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": HELLO}, "messages", "unknown field"),
]


@pytest.mark.parametrize(("change", "param", "message"), BAD_COMPLETIONS)
def test_bad_completions_are_openai_400s(
    serve: Serve, checkpoints: list[CheckpointRef], change: dict[str, Any], param: str, message: str
) -> None:
    server = serve(checkpoints[0])
    body = {"model": "ratchet", "prompt": [1, 2, 3], **change}
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]


def test_a_completion_for_an_unknown_model_is_a_404(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "gone", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
