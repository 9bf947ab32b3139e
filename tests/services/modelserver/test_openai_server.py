"""`ratchet serve` through the official ``openai`` client: tools, streaming, sampling, errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from services.modelserver.openai_api import VERSION_HEADER
from services.serving.base import CheckpointRef
from tests.services.modelserver.conftest import HF_REPLY, LISTING, TOOLCALC_TOOLS, ServerThread

Serve = Callable[..., ServerThread]


def client_for(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_the_tiny_family_calls_tools_and_answers_through_the_openai_client(
    serve: Serve, tool_calling_tiny: CheckpointRef
) -> None:
    client = client_for(serve(tool_calling_tiny, name="agent"))
    messages: list[Any] = [
        {"role": "system", "content": LISTING},
        {"role": "user", "content": "$pear"},
    ]

    first = client.chat.completions.create(
        model="agent",
        messages=messages,
        tools=TOOLCALC_TOOLS,
        temperature=0,  # type: ignore[arg-type]
    )

    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get", {"item": "pear"})
    ]
    assert first.model == "agent"
    assert first.system_fingerprint == f"ratchet-{tool_calling_tiny.id}"
    prompt = f"{LISTING}\nuser: $pear\n> "
    assert first.usage is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(prompt), 10)

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "12"},
    ]
    second = client.chat.completions.create(
        model="agent",
        messages=messages,
        tools=TOOLCALC_TOOLS,
        temperature=0,  # type: ignore[arg-type]
    )
    assert (second.choices[0].message.content, second.choices[0].finish_reason) == ("12", "stop")
    assert second.choices[0].message.tool_calls is None


def test_the_hf_family_calls_tools_through_the_openai_client(
    serve: Serve, tool_calling_llama: CheckpointRef
) -> None:
    client = client_for(serve(tool_calling_llama, name="llama"))

    completion = client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "1+2?"}],
        tools=TOOLCALC_TOOLS,  # type: ignore[arg-type]
        temperature=0,
    )

    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    assert calls[0].id.startswith("call_")
    # With tool_choice "none" the same text comes back as content, unparsed.
    plain = client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "1+2?"}],
        tools=TOOLCALC_TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        temperature=0,
    )
    assert plain.choices[0].message.content == HF_REPLY
    assert plain.choices[0].finish_reason == "stop"


def test_streaming_sends_the_same_text_as_server_sent_events(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    client = client_for(serve(checkpoints[0]))
    asked: dict[str, Any] = {
        "model": "ratchet",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 3,
    }
    whole = client.chat.completions.create(**asked)

    chunks = list(
        client.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True})
    )

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and finishes[:-1] == [None] * (
        len(finishes) - 1
    )
    assert len(chunks) > 3  # token by token, not one blob
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_streaming_a_tool_call(serve: Serve, tool_calling_tiny: CheckpointRef) -> None:
    client = client_for(serve(tool_calling_tiny))
    stream = client.chat.completions.create(
        model="ratchet",
        messages=[{"role": "system", "content": LISTING}, {"role": "user", "content": "$pear"}],
        tools=TOOLCALC_TOOLS,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert [(c.index, c.function and c.function.name) for c in calls] == [(0, "get")]
    assert calls[0].function is not None
    assert json.loads(calls[0].function.arguments or "") == {"item": "pear"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_seeded_sampling_repeats_and_n_gives_n_choices(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    client = client_for(serve(checkpoints[0]))
    asked: dict[str, Any] = {
        "model": "ratchet",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 0.9,
        "n": 3,
        "seed": 11,
    }
    first, again = client.chat.completions.create(**asked), client.chat.completions.create(**asked)

    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # each choice draws its own sample
    assert first.usage is not None and 0 < first.usage.completion_tokens <= 3 * 8


def test_stop_sequences_end_the_text_before_them(
    serve: Serve, tool_calling_tiny: CheckpointRef
) -> None:
    client = client_for(serve(tool_calling_tiny))
    completion = client.chat.completions.create(
        model="ratchet",
        messages=[{"role": "system", "content": LISTING}, {"role": "user", "content": "$pear"}],
        temperature=0,
        stop=["("],
    )
    assert (completion.choices[0].message.content, completion.choices[0].finish_reason) == (
        "@get",
        "stop",
    )


def test_max_tokens_ends_with_length(serve: Serve, tool_calling_tiny: CheckpointRef) -> None:
    client = client_for(serve(tool_calling_tiny))
    completion = client.chat.completions.create(
        model="ratchet",
        messages=[{"role": "system", "content": LISTING}, {"role": "user", "content": "$pear"}],
        temperature=0,
        max_tokens=3,
    )
    assert (completion.choices[0].message.content, completion.choices[0].finish_reason) == (
        "@ge",
        "length",
    )


def test_models_lists_what_is_served(serve: Serve, checkpoints: list[CheckpointRef]) -> None:
    server = serve(checkpoints[0], name="agent")
    models = client_for(server).models.list().data
    assert [m.id for m in models] == ["agent"]
    card = models[0].model_dump()
    assert card["root"] == checkpoints[0].uri.removeprefix("file://")
    assert card["ratchet"] == {"version": checkpoints[0].id, "family": "tiny", "adapter": False}
    assert httpx.get(f"{server.url}/v1/models/agent").json()["id"] == "agent"


def test_concurrent_requests_are_decoded_together(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    client = client_for(server)
    prompts = [f"question {i}" for i in range(12)]

    def ask(prompt: str) -> str | None:
        completion = client.chat.completions.create(
            model="ratchet",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0,
        )
        return completion.choices[0].message.content

    alone = [ask(p) for p in prompts]
    batches_before = server.app.state.server.scheduler.batches
    together: dict[int, str | None] = {}
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, ask(prompts[i])))
        for i in range(len(prompts))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert [together[i] for i in range(len(prompts))] == alone  # batching changes no answer
    batches = server.app.state.server.scheduler.batches - batches_before
    assert batches < len(prompts)  # several requests shared a batch


BAD_REQUESTS: list[tuple[dict[str, Any], int, str | None, str]] = [
    ({"model": "nope"}, 404, "model", "does not exist"),
    ({"messages": []}, 400, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", "content is required"),
    ({"messages": [{"role": "tool", "content": "1"}]}, 400, "messages[0].tool_call_id", "requir"),
    ({"temperature": 3}, 400, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, 400, "top_p", "greater than 0"),
    ({"n": 0}, 400, "n", "greater than or equal to 1"),
    ({"max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ({"best_of": 2}, 400, "best_of", "unknown field"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "needs logprobs"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    (
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        400,
        "tools[0].function.name",
        "must match",
    ),
    (
        {"tools": TOOLCALC_TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        400,
        "tool_choice",
        "unknown tool",
    ),
    ({"tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"messages": [{"role": "user", "content": "x" * 500}]}, 400, "messages", "context is 96"),
]


@pytest.mark.parametrize(("change", "status", "param", "message"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(
    serve: Serve,
    checkpoints: list[CheckpointRef],
    change: dict[str, Any],
    status: int,
    param: str | None,
    message: str,
) -> None:
    server = serve(checkpoints[0])
    body = {"model": "ratchet", "messages": [{"role": "user", "content": "hi"}], **change}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"


def test_the_openai_client_raises_its_own_errors(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    client = client_for(serve(checkpoints[0]))
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gone", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="ratchet", messages=[{"role": "user", "content": "x"}], temperature=-1
        )


def test_malformed_json_is_a_400_not_a_500(serve: Serve, checkpoints: list[CheckpointRef]) -> None:
    server = serve(checkpoints[0])
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_every_completion_names_its_version(serve: Serve, checkpoints: list[CheckpointRef]) -> None:
    server = serve(checkpoints[0])
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "ratchet", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    )
    assert response.headers[VERSION_HEADER] == checkpoints[0].id
    stats = httpx.get(f"{server.url}/v1/stats").json()
    assert stats["requests_by_version"] == {checkpoints[0].id: 1}
    assert "ratchet_serving_tokens_total" in httpx.get(f"{server.url}/metrics").text


def test_a_batch_mixing_short_and_long_budgets_stays_inside_the_context(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    """A row near the context's end finishes first; the batch keeps decoding the others."""
    server = serve(checkpoints[0])
    long_prompt = "x" * 80  # 80 of the 96 positions
    bodies = [
        {"model": "ratchet", "messages": [{"role": "user", "content": c}], "max_tokens": 60}
        for c in (long_prompt, "hi", "hello")
    ]
    results: dict[int, int] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(
                i, httpx.post(f"{server.url}/v1/chat/completions", json=bodies[i]).status_code
            )
        )
        for i in range(len(bodies))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {0: 200, 1: 200, 2: 200}
