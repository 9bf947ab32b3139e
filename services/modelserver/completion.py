"""One chat completion from request to answer: its rows, its response, its stream.

A :class:`Completion` is built once its prompt is rendered; ``submit`` queues one engine row
per choice (``n``) with the batch scheduler, and the answer is either ``response`` (the
whole reply) or ``stream`` (server-sent events as tokens arrive). Streaming never sends a
stop string, a tail that may become one or half a character; tool calls are parsed from the
whole reply, so they stream at its end. :mod:`services.modelserver.text_completion` is the
same for ``/v1/completions``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from starlette.concurrency import run_in_threadpool

from services.chat.protocol import ChatMessage
from services.inference.engine import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    SampledToken,
    SamplingParams,
    cut_at_stop,
)
from services.modelserver.attestation import response_id
from services.modelserver.logprobs import chat_logprobs, sampled_tokens
from services.modelserver.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    prompt_chars,
)
from services.modelserver.registry import ServedModel
from services.modelserver.scheduler import BatchScheduler, QueueFull
from services.modelserver.usage import count_completion
from services.training.rng import derive_seed

MAX_DEFAULT_TOKENS = 1024
_DONE = -1
_GONE = -2  # the client hung up: the stream ends


def fingerprint(version: str) -> str:
    """The ``system_fingerprint`` of a completion: the checkpoint that produced it."""
    return f"ratchet-{version}"


class Completion:
    """One chat completion request: its rows, its response, its stream."""

    ID_PREFIX = "chatcmpl"
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"
    # vLLM's return_token_ids: chat puts prompt_token_ids on the response, completions on
    # each choice
    PROMPT_IDS_ON_CHOICE = False

    @classmethod
    async def create(
        cls,
        body: ChatCompletionRequest,
        served: ServedModel,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]],
        forced: str | None,
        scheduler: BatchScheduler,
    ) -> Completion:
        """The request with its prompt rendered: refused before rendering when its text alone
        is more than the context could hold, rendered on a worker thread (a long template
        run or tokenization never stalls the event loop, /health included)."""
        engine = served.engine
        context = engine.context_length()
        chars = prompt_chars(messages)
        if chars > context * engine.max_chars_per_token:
            raise OpenAIError(
                400,
                f"the messages hold {chars} characters, more than fit in this model's "
                f"context; this model's context is {context} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        try:
            prompt = await run_in_threadpool(engine.render, messages, tools)
        except EngineError as exc:
            raise OpenAIError(400, str(exc), param="messages") from exc
        return cls(body, served, prompt, tools, forced, scheduler)

    def __init__(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        served: ServedModel,
        prompt: list[int],
        tools: list[dict[str, Any]],
        forced: str | None,
        scheduler: BatchScheduler,
    ) -> None:
        self.body = body
        self.served = served
        self.engine = served.engine
        self.tools = tools
        self.forced = forced
        self.parse_tools = bool(tools) and getattr(body, "tool_choice", None) != "none"
        self.stops = body.stops()
        self.scheduler = scheduler
        self.id = response_id(self.ID_PREFIX, served.version, None)  # the route signs it
        self.created = int(time.time())
        self.prompt = prompt
        self.logprob_count = body.logprob_count()  # None: no log-probs asked for
        self.token_ids = body.wants_token_ids()
        context = self.engine.context_length()
        if len(self.prompt) >= context:
            raise OpenAIError(
                400,
                f"the {self._prompt_param()} is {len(self.prompt)} tokens; this model's context "
                f"is {context} tokens",
                param=self._prompt_param(),
                code="context_length_exceeded",
            )
        asked = body.asked_tokens()
        self.max_tokens = min(asked or MAX_DEFAULT_TOKENS, context - len(self.prompt))
        self.stream_queue: asyncio.Queue[tuple[int, SampledToken | int]] | None = None
        self.results: dict[int, GenerationResult] = {}
        self.rows: list[GenerationRequest] = []
        self.futures: list[Future[GenerationResult]] = []
        self.gone = False  # the client hung up
        self._prompt_ids_sent: set[int] = set()  # streaming: they go in the first chunk

    @staticmethod
    def _prompt_param() -> str:
        return "messages"

    def submit(self) -> list[Future[GenerationResult]]:
        """Queue the request's rows (all or none); 429 when the queue is full."""
        base_seed = self.body.seed if self.body.seed is not None else secrets.randbits(32)
        loop = asyncio.get_running_loop()
        if self.body.stream:
            self.stream_queue = asyncio.Queue()
        rows = []
        for index in range(self.body.n):
            sampling = SamplingParams(
                max_tokens=self.max_tokens,
                temperature=self.body.temperature,
                top_p=self.body.top_p,
                seed=self._choice_seed(base_seed, index),
                stop=self.stops,
                top_logprobs=self.logprob_count or 0,
            )
            rows.append(
                GenerationRequest(
                    list(self.prompt),
                    sampling,
                    adapter=self.served.adapter,
                    on_token=self._token_callback(index, loop),
                )
            )
        try:
            futures = self.scheduler.submit_all(self.engine, rows, version=self.served.version)
        except QueueFull as exc:
            raise OpenAIError(
                429,
                f"the model server is busy: {exc}",
                kind="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        if self.stream_queue is not None:
            for index, future in enumerate(futures):
                future.add_done_callback(self._done_callback(index, loop, self.stream_queue))
        self.rows, self.futures = rows, futures
        return futures

    @staticmethod
    def _choice_seed(seed: int, index: int) -> int:
        """Choice 0 samples as an engine row seeded ``seed`` does (so a remote rollout's turn
        equals the local one's); choice ``i`` with ``derive_seed(seed, i)``."""
        return seed if index == 0 else derive_seed(seed, index)

    def hang_up(self) -> None:
        """The client left: stop decoding the rows nobody will read, end the stream."""
        self.gone = True
        running = zip(self.rows, self.futures, strict=True)
        self.scheduler.cancel([row for row, future in running if not future.done()])
        if self.stream_queue is not None:
            self.stream_queue.put_nowait((0, _GONE))

    @staticmethod
    def _done_callback(
        index: int,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[tuple[int, SampledToken | int]],
    ) -> Callable[[Future[GenerationResult]], None]:
        def done(_future: Future[GenerationResult]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, _DONE))

        return done

    def _token_callback(
        self, index: int, loop: asyncio.AbstractEventLoop
    ) -> Callable[[SampledToken], None] | None:
        if not self.body.stream or self.parse_tools:
            return None  # tool calls are parsed from the whole reply, so they stream at its end

        def on_token(token: SampledToken) -> None:
            queue = self.stream_queue
            assert queue is not None
            loop.call_soon_threadsafe(queue.put_nowait, (index, token))

        return on_token

    def message(self, result: GenerationResult) -> tuple[ChatMessage, str]:
        text = cut_at_stop(self.engine.decode_text(result.token_ids), self.stops)
        if not self.parse_tools:
            return ChatMessage(role="assistant", content=text), result.finish_reason
        message = self.engine.parse_reply(text, self.tools)
        if self.forced is not None:
            calls = tuple(c for c in message.tool_calls if c.name == self.forced)
            message = ChatMessage(role="assistant", content=message.content, tool_calls=calls)
        calls = tuple(
            type(c)(id=f"call_{uuid.uuid4().hex[:24]}", name=c.name, arguments=c.arguments)
            for c in message.tool_calls
        )
        message = ChatMessage(role="assistant", content=message.content, tool_calls=calls)
        return message, "tool_calls" if calls else result.finish_reason

    def usage(self, results: list[GenerationResult]) -> dict[str, Any]:
        """OpenAI's usage: the prompt counts once (all choices share it); ``cached_tokens`` is
        the part of it every choice reused from the prefix cache instead of computing."""
        completion = sum(len(r.token_ids) for r in results)
        cached = min((r.cached_tokens for r in results), default=0)
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def count(self, results: list[GenerationResult]) -> None:
        """Count the answered request's tokens to its served version (the serving ledger)."""
        count_completion(self.served.version, len(self.prompt), results)

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.served.name,
            "system_fingerprint": fingerprint(self.served.version),
        }

    def response(self, results: list[GenerationResult]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            choice = self._choice(index, result)
            if self.logprob_count is not None:
                choice["logprobs"] = self._logprobs(sampled_tokens(result), 0)
            if self.token_ids:
                choice["token_ids"] = list(result.sampled_ids)
                if self.PROMPT_IDS_ON_CHOICE:
                    choice["prompt_token_ids"] = list(self.prompt)
            choices.append(choice)
        self.count(results)
        payload = {**self._envelope(self.OBJECT), "choices": choices}
        if self.token_ids and not self.PROMPT_IDS_ON_CHOICE:
            payload["prompt_token_ids"] = list(self.prompt)
        payload["usage"] = self.usage(results)
        return payload

    def _choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        message, finish = self.message(result)
        return {
            "index": index,
            "message": message.to_openai(),
            "finish_reason": finish,
            "logprobs": None,
        }

    def _logprobs(self, tokens: Sequence[SampledToken], offset: int) -> dict[str, Any]:
        """OpenAI's chat ``logprobs``: one entry per sampled token (``offset`` is unused here:
        the legacy completions shape counts characters)."""
        return {"content": chat_logprobs(self.engine.decode_text, tokens), "refusal": None}

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish: str | None,
        tokens: Sequence[SampledToken] = (),
        offset: int = 0,
    ) -> str:
        choice = self._chunk_choice(index, delta, finish)
        if self.logprob_count is not None and tokens:
            choice["logprobs"] = self._logprobs(tokens, offset)
        if self.token_ids:
            choice["token_ids"] = [token.id for token in tokens]
        chunk = {**self._envelope(self.CHUNK_OBJECT), "choices": [choice]}
        first = index if self.PROMPT_IDS_ON_CHOICE else -1  # per choice, or once
        if self.token_ids and first not in self._prompt_ids_sent:
            (choice if self.PROMPT_IDS_ON_CHOICE else chunk)["prompt_token_ids"] = list(self.prompt)
            self._prompt_ids_sent.add(first)
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    @staticmethod
    def _chunk_choice(index: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}

    @staticmethod
    def _text_delta(text: str) -> dict[str, Any]:
        return {"content": text}

    def _opening(self, index: int) -> str | None:
        """The chunk a row's stream opens with (the assistant's role), if any."""
        return self._chunk(index, {"role": "assistant", "content": ""}, None)

    def _closing(
        self, index: int, result: GenerationResult, sent: int, tokens: list[SampledToken], at: int
    ) -> list[str]:
        """A finished row's last chunks: what was not streamed yet (tool calls, the text held
        back, the tokens not yet reported), then its finish reason."""
        message, finish = self.message(result)
        chunks = []
        if message.tool_calls:
            calls = enumerate(message.tool_calls)
            delta: dict[str, Any] = {
                "tool_calls": [{"index": i, **call.to_openai()} for i, call in calls]
            }
            if message.content:
                delta["content"] = message.content
            chunks.append(self._chunk(index, delta, None, tokens, at))
        else:
            rest = (message.content or "")[sent:]
            if rest or tokens:
                chunks.append(self._chunk(index, self._text_delta(rest), None, tokens, at))
        chunks.append(self._chunk(index, {}, finish))
        return chunks

    def _safe_prefix(self, text: str) -> int:
        """How much of a row's text may go out now: never a stop string, nor a tail that may
        become one (the row stops only after the token that completes it), nor a character
        still being decoded (U+FFFD at the end)."""
        if text.endswith("\ufffd"):
            text = text[:-1]
        before = cut_at_stop(text, self.stops)
        if len(before) < len(text):
            return len(before)
        held = max(
            (k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])),
            default=0,
        )
        return len(text) - held

    async def stream(self, futures: list[Future[GenerationResult]]) -> AsyncIterator[str]:
        queue = self.stream_queue
        assert queue is not None
        for index in range(len(futures)):
            opening = self._opening(index)
            if opening is not None:
                yield opening
        ids: list[list[int]] = [[] for _ in futures]
        sent = [0] * len(futures)  # characters of each row's text sent
        reported = [0] * len(futures)  # sampled tokens of each row sent with a chunk
        offsets = [0] * len(futures)  # characters of those tokens' strings (text_offset)
        pending: list[list[SampledToken]] = [[] for _ in futures]
        open_rows = len(futures)
        while open_rows:
            index, token = await queue.get()
            if token == _GONE:
                return
            if isinstance(token, SampledToken):
                ids[index].append(token.id)
                pending[index].append(token)
                text = self.engine.decode_text(ids[index])
                safe = self._safe_prefix(text)
                if safe > sent[index]:
                    piece, at = pending[index], offsets[index]
                    offsets[index] += sum(len(self.engine.decode_text([t.id])) for t in piece)
                    reported[index] += len(piece)
                    pending[index] = []
                    delta = self._text_delta(text[sent[index] : safe])
                    yield self._chunk(index, delta, None, piece, at)
                    sent[index] = safe
                continue
            open_rows -= 1
            result = futures[index].result()  # raises the decode error, ending the stream
            rest = sampled_tokens(result)[reported[index] :]
            for chunk in self._closing(index, result, sent[index], rest, offsets[index]):
                yield chunk
            self.results[index] = result
        self.count(list(self.results.values()))
        options = self.body.stream_options
        if options is not None and options.include_usage:
            usage = {
                **self._envelope(self.CHUNK_OBJECT),
                "choices": [],
                "usage": self.usage([r for r in self.results.values()]),
            }
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
