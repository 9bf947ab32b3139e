"""The model server (``ratchet serve``): the OpenAI chat-completions API, batched, hot-swapping.

It is what vLLM or SGLang are on a GPU cluster, for a laptop and for CI, and it speaks the
same API, so an agent written against the ``openai`` client runs against either unchanged:

- ``POST /v1/chat/completions`` — messages, ``tools``, ``tool_choice``, ``temperature``,
  ``top_p``, ``max_tokens``, ``n``, ``seed``, ``stop``, ``stream`` (server-sent events);
  answers with ``tool_calls`` (parsed per model family), ``finish_reason`` and ``usage``;
  ``logprobs``/``top_logprobs`` and vLLM's ``return_token_ids`` return what was sampled
  (:mod:`services.serving.openai_api` says which log-probs);
- ``POST /v1/completions`` — a prompt as text or as token ids, the same sampling, stopping,
  streaming, ``logprobs`` (0..20, OpenAI's legacy shape) and ``return_token_ids``: what a
  remote rollout sends (:mod:`services.inference.remote`);
- ``GET /v1/models`` — every served name with its checkpoint directory (``root``) and, for
  an adapter, its base (``parent``); ``ratchet.version`` is the checkpoint id;
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` — vLLM's runtime adapter API. Here
  ``lora_path`` may also name a full checkpoint (vLLM accepts adapters only), and
  ``load_inplace`` swaps what a name serves without a failed request
  (:mod:`services.serving.registry`);
- ``GET /health``, ``GET /v1/stats``, ``GET /metrics``.

Concurrent requests are decoded together (:mod:`services.serving.scheduler`). Every
completion names the checkpoint that produced it in ``system_fingerprint`` and in the
``X-Ratchet-Model-Version`` header (so traffic can be tagged by the server's word, not the
client's).

Under careless or hostile clients (:mod:`services.serving.guards` is the door): with
``RATCHET_SERVE_API_KEY`` set every route but ``/health`` needs it as a Bearer token; bodies
are capped before parsing (413); a conversation too long for the context is refused before
it is rendered, and rendering runs off the event loop; at most ``queue_max`` rows wait (429
with ``Retry-After`` past that); a client that hangs up has its rows cancelled, streaming or
not. The adapter endpoints need the key whenever the server listens beyond loopback, and
load only checkpoints inside the model roots; a checkpoint is loaded from a private copy of
exactly the files its manifest lists (:func:`services.serving.registry.verified_copy`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.chat.protocol import ChatMessage
from services.inference.engine import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    SampledToken,
    SamplingParams,
    cut_at_stop,
)
from services.metrics import (
    SERVING_PROMPT_TOKENS,
    SERVING_REQUEST_DURATION,
    SERVING_SWAPS,
    SERVING_TOKENS,
    render_latest,
)
from services.serving.base import VERSION_HEADER
from services.serving.guards import (
    DoorPolicy,
    ServingDoor,
    adapter_access_refusal,
    is_loopback,
)
from services.serving.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadAdapterRequest,
    OpenAIError,
    UnloadAdapterRequest,
    prompt_chars,
    validation_error,
)
from services.serving.registry import (
    LoadRefused,
    ModelNotFound,
    ModelRegistry,
    ServedModel,
    checkpoint_dir_within,
)
from services.serving.scheduler import BatchScheduler, QueueFull
from services.training.rng import derive_seed

logger = logging.getLogger(__name__)

MAX_DEFAULT_TOKENS = 1024
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_QUEUE_MAX = 256
_DONE = -1
_GONE = -2  # the client hung up: the stream ends


class ServingStats:
    """Counters and a latency window for ``/v1/stats`` (the Prometheus metrics are global)."""

    def __init__(self, window: int = 2048) -> None:
        self._lock = threading.Lock()
        self.started_at = time.time()
        self.requests_total = 0
        self.requests_failed = 0
        self.completion_tokens = 0
        self.by_version: dict[str, int] = {}
        self._latencies: deque[float] = deque(maxlen=window)

    def record(self, version: str | None, seconds: float, *, failed: bool, tokens: int = 0) -> None:
        with self._lock:
            self.requests_total += 1
            self.requests_failed += int(failed)
            self.completion_tokens += tokens
            if version is not None and not failed:
                self.by_version[version] = self.by_version.get(version, 0) + 1
            self._latencies.append(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            ordered = sorted(self._latencies)
            by_version = dict(self.by_version)
            total, failed, tokens = (
                self.requests_total,
                self.requests_failed,
                self.completion_tokens,
            )

        def quantile(q: float) -> float | None:
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0, 3)

        return {
            "uptime_s": round(time.time() - self.started_at, 3),
            "requests_total": total,
            "requests_failed": failed,
            "completion_tokens": tokens,
            "requests_by_version": by_version,
            "latency_ms_p50": quantile(0.5),
            "latency_ms_p95": quantile(0.95),
        }


def create_serving_app(
    registry: ModelRegistry,
    *,
    api_key: str | None = None,
    bind_host: str = "127.0.0.1",
    max_batch_rows: int = 32,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    queue_max: int = DEFAULT_QUEUE_MAX,
    model_roots: Sequence[Path] | None = None,
) -> FastAPI:
    """The model server's app over ``registry`` (loaded by the caller: nothing loads here).

    ``api_key``: required of every request but /health when set. ``bind_host``: where the
    server listens (beyond loopback the adapter routes need the key). ``model_roots``: the
    directories adapter loads may come from (default: those holding the models served now).
    """
    scheduler = BatchScheduler(max_batch_rows=max_batch_rows, max_waiting_rows=queue_max)
    scheduler.start()
    stats = ServingStats()
    policy = DoorPolicy(api_key=api_key, bind_host=bind_host, max_body_bytes=max_body_bytes)
    roots = (
        list(model_roots)
        if model_roots is not None
        else list(dict.fromkeys(Path(m.root).parent for m in registry.names()))
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.stop()

    app = FastAPI(
        title="Ratchet model server",
        description="OpenAI-compatible chat completions, batched, with hot swap.",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.registry = registry
    app.state.scheduler = scheduler
    app.state.stats = stats
    app.add_middleware(ServingDoor, policy=policy)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = OpenAIError(exc.status_code, str(exc.detail), code=code)
        response = error_response(error)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> Response:
        logger.exception("the model server failed on a request")
        return error_response(
            OpenAIError(500, "internal error", kind="server_error", code="internal_error")
        )

    def adapter_access(request: Request) -> None:
        refusal = adapter_access_refusal(policy, request.client.host if request.client else None)
        if refusal is not None:
            raise refusal

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        started = time.perf_counter()
        refused = body.unsupported() or body.unencodable()
        if refused is not None:
            raise refused
        messages = body.parsed_messages()
        tools = body.parsed_tools()
        forced = body.forced_tool(tools)
        served = acquire(body.model)
        try:
            completion = await _Completion.create(body, served, messages, tools, forced, scheduler)
        except BaseException:
            registry.release(served)
            raise
        return await answer(completion, request, started)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        started = time.perf_counter()
        refused = body.unsupported() or body.unencodable()
        if refused is not None:
            raise refused
        served = acquire(body.model)
        try:
            completion: _Completion = await _TextCompletion.create_text(body, served, scheduler)
        except BaseException:
            registry.release(served)
            raise
        return await answer(completion, request, started)

    def acquire(name: str) -> ServedModel:
        try:
            return registry.acquire(name)
        except ModelNotFound:
            raise OpenAIError(
                404,
                f"the model {name!r} does not exist; GET /v1/models lists the served ones",
                param="model",
                code="model_not_found",
            ) from None

    async def answer(completion: _Completion, request: Request, started: float) -> Response:
        """Decode a rendered completion and answer it, streaming or whole; the served model
        is released however this ends."""
        served, body = completion.served, completion.body
        try:
            rows = completion.submit()
        except BaseException:
            registry.release(served)
            raise
        if body.stream:
            return StreamingResponse(
                _released(completion, rows, request, registry, stats, started),
                media_type="text/event-stream",
                headers={VERSION_HEADER: served.version, "Cache-Control": "no-cache"},
            )
        watch = asyncio.ensure_future(_watch_disconnect(request, completion.hang_up))
        try:
            results = [await asyncio.wrap_future(future) for future in rows]
        except Exception as exc:
            stats.record(served.version, time.perf_counter() - started, failed=True)
            raise OpenAIError(
                500, f"generation failed: {exc}", kind="server_error", code="generation_failed"
            ) from exc
        finally:
            watch.cancel()
            registry.release(served)
        if completion.gone:  # nobody reads the answer
            stats.record(served.version, time.perf_counter() - started, failed=True)
            return Response(status_code=499)
        payload = completion.response(results)
        elapsed = time.perf_counter() - started
        tokens = payload["usage"]["completion_tokens"]
        stats.record(served.version, elapsed, failed=False, tokens=tokens)
        SERVING_REQUEST_DURATION.observe(elapsed)
        return JSONResponse(payload, headers={VERSION_HEADER: served.version})

    def shows_paths(request: Request) -> bool:
        """Checkpoint directories are shown to who may load models, not to every client."""
        peer = request.client.host if request.client else None
        return adapter_access_refusal(policy, peer) is None

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        paths = shows_paths(request)
        return {"object": "list", "data": [_model_card(m, paths) for m in registry.names()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        for served in registry.names():
            if served.name == name:
                return _model_card(served, shows_paths(request))
        raise OpenAIError(
            404, f"the model {name!r} does not exist", param="model", code="model_not_found"
        )

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load_adapter(body: LoadAdapterRequest, request: Request) -> Response:
        adapter_access(request)
        try:
            path = checkpoint_dir_within(body.lora_path, roots)
        except LoadRefused as exc:
            SERVING_SWAPS.labels("rejected").inc()
            raise OpenAIError(400, str(exc), param="lora_path", code="load_refused") from None
        try:
            served = await run_in_threadpool(
                registry.load, body.lora_name, path, replace=body.load_inplace
            )
        except LoadRefused as exc:
            SERVING_SWAPS.labels("rejected").inc()
            logger.warning("loading %s as %s refused: %s", path, body.lora_name, exc)
            raise OpenAIError(400, str(exc), param="lora_path", code="load_refused") from exc
        SERVING_SWAPS.labels("ok").inc()
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' added successfully.",
            headers={VERSION_HEADER: served.version},
        )

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_adapter(body: UnloadAdapterRequest, request: Request) -> Response:
        adapter_access(request)
        try:
            registry.unload(body.lora_name)
        except ModelNotFound:
            raise OpenAIError(
                404,
                f"no model named {body.lora_name!r} is loaded",
                param="lora_name",
                code="model_not_found",
            ) from None
        except LoadRefused as exc:
            raise OpenAIError(400, str(exc), param="lora_name") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/v1/stats")
    async def serving_stats() -> dict[str, Any]:
        return {
            "models": {m.name: m.version for m in registry.names()},
            "swaps": registry.swaps,
            "batches": scheduler.batches,
            "batched_rows": scheduler.rows,
            "decode_steps": scheduler.steps,
            "decoded_rows": scheduler.row_steps,
            "waiting_rows": scheduler.waiting(),
            "cancelled_rows": scheduler.cancelled,
            "refused_rows": scheduler.refused,
            **stats.snapshot(),
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        content, content_type = render_latest()
        return Response(content, media_type=content_type)

    return app


class _Completion:
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
    ) -> _Completion:
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
        self.id = f"{self.ID_PREFIX}-{uuid.uuid4().hex}"
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
            futures = self.scheduler.submit_all(self.engine, rows)
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
        SERVING_TOKENS.labels("prompt").inc(len(self.prompt))
        SERVING_TOKENS.labels("completion").inc(completion)
        for result in results:
            SERVING_PROMPT_TOKENS.labels("cached").inc(result.cached_tokens)
            SERVING_PROMPT_TOKENS.labels("computed").inc(
                result.prompt_tokens - result.cached_tokens
            )
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

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
        options = self.body.stream_options
        if options is not None and options.include_usage:
            usage = {
                **self._envelope(self.CHUNK_OBJECT),
                "choices": [],
                "usage": self.usage([r for r in self.results.values()]),
            }
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"


class _TextCompletion(_Completion):
    """One ``/v1/completions`` request: a raw prompt (text or ids), OpenAI's legacy shape."""

    ID_PREFIX = "cmpl"
    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"  # OpenAI's legacy stream chunks say so too
    PROMPT_IDS_ON_CHOICE = True

    @classmethod
    async def create_text(
        cls, body: CompletionRequest, served: ServedModel, scheduler: BatchScheduler
    ) -> _TextCompletion:
        """The request with its prompt as ids: text is encoded off the event loop (refused
        first when longer than the context could hold), ids are checked against the vocab."""
        engine = served.engine
        context = engine.context_length()
        if isinstance(body.prompt, str):
            if len(body.prompt) > context * engine.max_chars_per_token:
                raise OpenAIError(
                    400,
                    f"the prompt holds {len(body.prompt)} characters, more than fit in this "
                    f"model's context; this model's context is {context} tokens",
                    param="prompt",
                    code="context_length_exceeded",
                )
            prompt = await run_in_threadpool(engine.encode_text, body.prompt)
            if not prompt:
                raise OpenAIError(400, "the prompt encodes to no tokens", param="prompt")
        else:
            prompt = [int(i) for i in body.prompt]
            vocab = engine.vocab_size()
            bad = next((i for i, token in enumerate(prompt) if token >= vocab), None)
            if bad is not None:
                raise OpenAIError(
                    400,
                    f"prompt[{bad}] is token id {prompt[bad]}; this model's ids are 0 to "
                    f"{vocab - 1}",
                    param=f"prompt[{bad}]",
                )
        return cls(body, served, prompt, [], None, scheduler)

    @staticmethod
    def _prompt_param() -> str:
        return "prompt"

    def _text(self, result: GenerationResult) -> str:
        return cut_at_stop(self.engine.decode_text(result.token_ids), self.stops)

    def _choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        return {
            "index": index,
            "text": self._text(result),
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }

    def _logprobs(self, tokens: Sequence[SampledToken], offset: int) -> dict[str, Any]:
        return text_logprobs(self.engine.decode_text, tokens, offset)

    @staticmethod
    def _chunk_choice(index: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "index": index,
            "text": delta.get("text", ""),
            "finish_reason": finish,
            "logprobs": None,
        }

    @staticmethod
    def _text_delta(text: str) -> dict[str, Any]:
        return {"text": text}

    def _opening(self, index: int) -> str | None:
        return None

    def _closing(
        self, index: int, result: GenerationResult, sent: int, tokens: list[SampledToken], at: int
    ) -> list[str]:
        rest = self._text(result)[sent:]
        chunks = []
        if rest or tokens:
            chunks.append(self._chunk(index, self._text_delta(rest), None, tokens, at))
        chunks.append(self._chunk(index, {}, result.finish_reason))
        return chunks


LOGPROB_FLOOR = -9999.0  # -inf cannot travel in JSON; vLLM clamps to the same floor


def sampled_tokens(result: GenerationResult) -> list[SampledToken]:
    """A finished row's sampled tokens (the end-of-turn token included) with their log-probs."""
    tops = result.top_logprobs or [()] * len(result.sampled_ids)
    return [
        SampledToken(token, logprob, top)
        for token, logprob, top in zip(result.sampled_ids, result.logprobs, tops, strict=True)
    ]


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if value == value else LOGPROB_FLOOR  # NaN too


def chat_logprobs(
    decode: Callable[[Sequence[int]], str], tokens: Sequence[SampledToken]
) -> list[dict[str, Any]]:
    """OpenAI's ``choices[].logprobs.content``: each token's text, log-prob, UTF-8 bytes and
    its ``top_logprobs`` alternatives."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = decode([token])
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    return [
        {**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
        for t in tokens
    ]


def text_logprobs(
    decode: Callable[[Sequence[int]], str], tokens: Sequence[SampledToken], offset: int
) -> dict[str, Any]:
    """OpenAI's legacy completions ``logprobs``: parallel lists of token texts, their
    log-probs, the top alternatives (with the sampled token) and each text's offset."""
    texts = [decode([t.id]) for t in tokens]
    starts = []
    for text in texts:
        starts.append(offset)
        offset += len(text)
    tops = [{decode([i]): _logprob(lp) for i, lp in (*t.top, (t.id, t.logprob))} for t in tokens]
    return {
        "tokens": texts,
        "token_logprobs": [_logprob(t.logprob) for t in tokens],
        "top_logprobs": tops,
        "text_offset": starts,
    }


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` when the client hangs up (the body is read by then, so the next
    ASGI message is the disconnect); cancelled when the answer is complete."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def _released(
    completion: _Completion,
    rows: list[Future[GenerationResult]],
    request: Request,
    registry: ModelRegistry,
    stats: ServingStats,
    started: float,
) -> AsyncIterator[str]:
    """Stream the completion, cancel its rows if the client hangs up, and give the model back
    at the end, however the stream ends."""
    served = completion.served
    failed = True
    watch = asyncio.ensure_future(_watch_disconnect(request, completion.hang_up))
    try:
        async for chunk in completion.stream(rows):
            yield chunk
        failed = completion.gone
    except Exception as exc:  # the status line is sent: the error goes in the stream
        logger.exception("streaming a completion failed")
        error = OpenAIError(500, f"generation failed: {exc}", kind="server_error")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        watch.cancel()
        if not completion.gone and not all(f.done() for f in rows):
            completion.hang_up()  # the stream was closed early: nobody reads the rest
        registry.release(served)
        stats.record(served.version, time.perf_counter() - started, failed=failed)


def error_response(error: OpenAIError) -> Response:
    """OpenAI's error object as ASCII JSON (a lone surrogate in a message cannot break it)."""
    content = json.dumps(error.body(), ensure_ascii=True)
    return Response(
        content, status_code=error.status, media_type="application/json", headers=error.headers
    )


def fingerprint(version: str) -> str:
    return f"ratchet-{version}"


def _model_card(served: ServedModel, show_path: bool) -> dict[str, Any]:
    """vLLM's model card; ``root`` is the checkpoint directory for clients that may load
    models (a serving target compares it with what it loaded), else only its name."""
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "ratchet",
        "root": served.root if show_path else Path(served.root).name,
        "parent": served.parent,
        "max_model_len": served.engine.context_length(),
        "ratchet": {
            "version": served.version,
            "family": served.engine.family,
            "adapter": served.adapter is not None,
        },
    }


def serve(
    checkpoint: Path,
    *,
    host: str,
    port: int,
    model_name: str,
    api_key: str | None = None,
    device: str = "auto",
    threads: int | None = None,
    max_batch_rows: int = 32,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    queue_max: int = DEFAULT_QUEUE_MAX,
    model_roots: Sequence[Path] = (),
) -> None:
    """Load ``checkpoint`` as ``model_name`` (refusing an invalid one before binding), serve.

    Adapter loads may come from ``model_roots``; none given means the directory holding
    ``checkpoint``."""
    import torch
    import uvicorn

    if threads is not None:
        torch.set_num_threads(threads)
    registry = ModelRegistry(device=device)
    served = registry.load(model_name, checkpoint)
    app = create_serving_app(
        registry,
        api_key=api_key,
        bind_host=host,
        max_batch_rows=max_batch_rows,
        max_body_bytes=max_body_bytes,
        queue_max=queue_max,
        model_roots=list(model_roots) or [checkpoint.parent],
    )
    if api_key is None and not is_loopback(host):
        logger.warning(
            "listening on %s without RATCHET_SERVE_API_KEY: anyone who reaches the port may "
            "ask for completions, and the adapter routes are refused",
            host,
        )
    logger.info(
        "serving %s (%s) as %r on http://%s:%d",
        served.version[:12],
        checkpoint,
        model_name,
        host,
        port,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
