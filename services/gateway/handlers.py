"""The gateway's OpenAI routes: forward, capture, answer.

Each handler turns the agent's request into the upstream's (the loop's model; token ids and
log-probs asked for when the route can give them), forwards it, reads what was sampled from
the answer (whole or as it streams), writes the call to the spool, and only then sends the
answer's end (the whole answer, or the stream's ``[DONE]`` / ``response.completed``): an
agent that has its answer has its call captured.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Send

from services.chat.text import utf8_json
from services.gateway.capture import CHAT, COMPLETION, RESPONSES, CapturedCall
from services.gateway.conversation import ConversationError, chat_messages, tool_specs
from services.gateway.errors import GatewayError, send_bytes
from services.gateway.forward import Timer, events, read_body, send
from services.gateway.keys import GatewayLoop
from services.gateway.responses import ResponseWriter, to_chat
from services.gateway.routing import Route
from services.gateway.streams import Added, Reading, encode_sse, strip
from services.gateway.upstream import Response, UpstreamClient

VERSION_HEADER = "x-ratchet-model-version"
CALL_HEADER = "x-ratchet-call-id"
_JSON = b"application/json"
_SSE = b"text/event-stream"

Record = Callable[[CapturedCall], None]


@dataclass
class Call:
    """One request in flight: its loop and route, its body, the session id it gave, the
    upstream client, where captured calls go, and its timer."""

    loop: GatewayLoop
    route: Route
    body: dict[str, Any]
    session_key: str | None
    client: UpstreamClient
    record: Record
    timer: Timer
    call_id: str

    def captured(
        self, kind: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> Callable[[Reading, str | None, str | None], None]:
        """A function that records the call once its answer has been read."""

        def done(reading: Reading, version: str | None, prompt: str | None = None) -> None:
            self.record(
                CapturedCall(
                    loop_id=self.loop.loop_id,
                    loop=self.loop.name,
                    kind=kind,
                    messages=messages,
                    tools=tools,
                    reply=reading.choice.message(),
                    started_at=self.timer.wall_started,
                    call_id=self.call_id,
                    session_key=self.session_key,
                    model=self.route.model,
                    upstream=self.route.name,
                    model_version=version or reading.version,
                    response_id=reading.id,
                    prompt=prompt,
                    usage=reading.usage,
                )
            )

        return done


def _headers(call: Call, response: Response) -> dict[str, str]:
    headers = {CALL_HEADER: call.call_id}
    version = response.headers.get(VERSION_HEADER)
    if version:
        headers[VERSION_HEADER] = version
    return headers


def _raw_headers(headers: dict[str, str], content_type: bytes) -> list[tuple[bytes, bytes]]:
    raw = [(b"content-type", content_type), (b"cache-control", b"no-cache")]
    return raw + [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]


def _parse_conversation(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    try:
        return chat_messages(body.get("messages")), tool_specs(body.get("tools"))
    except ConversationError as exc:
        raise GatewayError(400, str(exc), param=exc.param) from None


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        payload = json.loads(data)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise GatewayError(
            502, f"the upstream's {what} is not a JSON object", kind="upstream_error"
        )
    return payload


async def chat(call: Call, send_: Send) -> None:
    """``POST /v1/chat/completions``."""
    body, route = call.body, call.route
    messages, tools = _parse_conversation(body)
    added = Added(
        token_ids=route.token_ids and not body.get("return_token_ids"),
        logprobs=route.token_ids and not body.get("logprobs"),
    )
    upstream = {**body, "model": route.model}
    if added.token_ids:
        upstream["return_token_ids"] = True
    if added.logprobs:
        upstream["logprobs"] = True
    done = call.captured(CHAT, messages, tools)
    await _exchange(call, send_, "/chat/completions", upstream, added, Reading(), done)


async def completion(call: Call, send_: Send) -> None:
    """``POST /v1/completions`` (a text prompt, or token ids)."""
    body, route = call.body, call.route
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str | list) or not prompt:
        raise GatewayError(400, "prompt must be a string or a list of token ids", param="prompt")
    text = prompt if isinstance(prompt, str) else None
    message: dict[str, Any] = {"role": "user", "content": text}
    if text is None:
        message["token_ids"] = [int(t) for t in prompt if isinstance(t, int)]
    added = Added(
        token_ids=route.token_ids and not body.get("return_token_ids"),
        logprobs=route.token_ids and body.get("logprobs") is None,
    )
    upstream = {**body, "model": route.model}
    if added.token_ids:
        upstream["return_token_ids"] = True
    if added.logprobs:
        upstream["logprobs"] = 0
    record = call.captured(COMPLETION, [message], [])

    def done(reading: Reading, version: str | None, _prompt: str | None = None) -> None:
        record(reading, version, text)

    await _exchange(call, send_, "/completions", upstream, added, Reading(text=True), done)


async def _exchange(
    call: Call,
    send_: Send,
    path: str,
    upstream: dict[str, Any],
    added: Added,
    reading: Reading,
    done: Callable[[Reading, str | None, str | None], None],
) -> None:
    response = await send(call.client, call.route, "POST", path, upstream, call.timer)
    headers = _headers(call, response)
    version = response.headers.get(VERSION_HEADER)
    if not upstream.get("stream"):
        payload = _json_object(await read_body(response, call.timer, call.route), "answer")
        reading.whole(payload)
        done(reading, version, None)
        data = utf8_json(strip(payload, added))
        await send_bytes(send_, 200, data, _JSON, headers)
        return
    await send_(
        {"type": "http.response.start", "status": 200, "headers": _raw_headers(headers, _SSE)}
    )
    captured = False
    async for batch in events(response, call.timer):
        out = []
        for data in batch:
            if data == b"[DONE]":
                done(reading, version, None)  # captured before the stream's end is sent
                captured = True
                out.append(b"data: [DONE]\n\n")
                continue
            try:
                payload = json.loads(data)
            except ValueError:
                continue
            reading.chunk(payload)
            out.append(
                encode_sse(strip(payload, added)) if added.any else b"data: " + data + b"\n\n"
            )
        if out:
            await send_({"type": "http.response.body", "body": b"".join(out), "more_body": True})
    if not captured:
        done(reading, version, None)
    await send_({"type": "http.response.body", "body": b"", "more_body": False})


async def responses(call: Call, send_: Send) -> None:
    """``POST /v1/responses``, over the upstream's chat completions (services.gateway.responses)."""
    body, route = call.body, call.route
    chat_body = to_chat(body)
    messages, tools = _parse_conversation(chat_body)
    upstream = {**chat_body, "model": route.model}
    if route.token_ids:
        upstream["return_token_ids"] = True
        upstream["logprobs"] = True
    writer = ResponseWriter(call.call_id, body, route.model)
    done = call.captured(RESPONSES, messages, tools)
    response = await send(call.client, route, "POST", "/chat/completions", upstream, call.timer)
    headers = _headers(call, response)
    version = response.headers.get(VERSION_HEADER)
    reading = Reading()
    if not body.get("stream"):
        payload = _json_object(await read_body(response, call.timer, route), "answer")
        reading.whole(payload)
        done(reading, version, None)
        data = utf8_json(writer.response("completed", reading))
        await send_bytes(send_, 200, data, _JSON, headers)
        return
    await send_(
        {"type": "http.response.start", "status": 200, "headers": _raw_headers(headers, _SSE)}
    )
    out = writer.opening()
    ended = False
    async for batch in events(response, call.timer):
        for data in batch:
            if data == b"[DONE]":
                ended = True
                break
            try:
                payload = json.loads(data)
            except ValueError:
                continue
            before = len(reading.choice.content)
            reading.chunk(payload)
            for piece in reading.choice.content[before:]:
                if piece:
                    out += writer.text_delta(piece)
        if ended:
            break
        await _send_all(send_, out)
        out = []
    done(reading, version, None)
    await _send_all(send_, out + writer.closing(reading))
    await send_({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_all(send_: Send, chunks: list[bytes]) -> None:
    if chunks:
        await send_({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})


async def models(call: Call, send_: Send) -> None:
    """``GET /v1/models``, passed through from the route's upstream."""
    response = await send(call.client, call.route, "GET", "/models", None, call.timer)
    data = await read_body(response, call.timer, call.route)
    await send_bytes(send_, 200, data, _JSON, {CALL_HEADER: call.call_id})


Handler = Callable[[Call, Send], Awaitable[None]]
HANDLERS: dict[tuple[str, str], tuple[str, Handler]] = {
    ("POST", "/v1/chat/completions"): ("chat", chat),
    ("POST", "/v1/completions"): ("completions", completion),
    ("POST", "/v1/responses"): ("responses", responses),
    ("GET", "/v1/models"): ("models", models),
}
