"""The local model server (``ratchet serve``): the reference policy over HTTP, with hot swap.

It stands in for vLLM or Dynamo on a laptop. Endpoints:

- ``POST /v1/act`` — a transcript in, the agent's next turn out (what a traffic simulator
  calls with ``Environment.run_episode``); ``POST /v1/generate`` — a batch of prompts;
- ``GET /v1/model`` — the served version (the checkpoint id) and where it came from;
- ``GET /v1/stats`` — live numbers; ``GET /metrics`` — Prometheus; ``GET /healthz``;
- ``POST /v1/admin/swap`` — serve another checkpoint (loaded and verified beside the
  current one, then switched atomically: see :mod:`services.serving.model`);
  ``POST /v1/admin/rollback`` — serve the previous one again.

Every response carries the version that produced it, in the body where there is one and in
the ``X-Ratchet-Model-Version`` header always. The admin endpoints need
``Authorization: Bearer $RATCHET_ADMIN_TOKEN`` when a token is configured; without one
they answer only clients on this machine.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from services.artifacts import uri_to_path
from services.metrics import (
    SERVING_REQUEST_DURATION,
    SERVING_REQUESTS,
    SERVING_SWAPS,
    render_latest,
)
from services.serving.base import VERSION_HEADER
from services.serving.model import LoadedModel, ModelSlot, SwapRefused, load_model

logger = logging.getLogger(__name__)

MAX_TRANSCRIPT_CHARS = 64_000
MAX_BATCH = 64


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampling(_Body):
    max_new_tokens: int = Field(default=32, ge=1, le=1024)
    temperature: float = Field(default=0.0, ge=0.0, le=5.0)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)


class ActRequest(Sampling):
    transcript: str = Field(max_length=MAX_TRANSCRIPT_CHARS)


class ActResponse(BaseModel):
    text: str
    model_version: str


class GenerateRequest(Sampling):
    prompts: list[str] = Field(min_length=1, max_length=MAX_BATCH)


class GenerateResponse(BaseModel):
    texts: list[str]
    model_version: str


class ModelInfo(BaseModel):
    model_version: str
    checkpoint_uri: str
    loaded_at: float
    previous_version: str | None
    swaps: int


class SwapRequest(_Body):
    checkpoint: str = Field(min_length=1, description="checkpoint directory: a path or file:// URI")
    expected_version: str | None = Field(
        default=None, description="refuse the swap unless the checkpoint has this id"
    )


class SwapResponse(BaseModel):
    model_version: str
    previous_version: str | None
    changed: bool
    load_ms: float
    total_ms: float


class ServingStats:
    """Counters and a latency window for ``/v1/stats`` (the Prometheus metrics are global)."""

    def __init__(self, window: int = 2048) -> None:
        self._lock = threading.Lock()
        self.started_at = time.time()
        self.requests_total = 0
        self.requests_failed = 0
        self.by_version: dict[str, int] = {}
        self._latencies: deque[float] = deque(maxlen=window)

    def record(self, version: str | None, seconds: float, failed: bool) -> None:
        with self._lock:
            self.requests_total += 1
            self.requests_failed += int(failed)
            if version is not None and not failed:
                self.by_version[version] = self.by_version.get(version, 0) + 1
            self._latencies.append(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            ordered = sorted(self._latencies)
            by_version = dict(self.by_version)
            total, failed = self.requests_total, self.requests_failed

        def quantile(q: float) -> float | None:
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0, 3)

        return {
            "uptime_s": round(time.time() - self.started_at, 3),
            "requests_total": total,
            "requests_failed": failed,
            "requests_by_version": by_version,
            "latency_ms_p50": quantile(0.5),
            "latency_ms_p95": quantile(0.95),
        }


def create_serving_app(slot: ModelSlot, *, admin_token: str | None = None) -> FastAPI:
    """The model server's app around ``slot`` (built by the caller: nothing loads here)."""
    app = FastAPI(
        title="Ratchet model server",
        description="The reference policy, served with hot swap.",
        docs_url=None,
        redoc_url=None,
    )
    stats = ServingStats()
    app.state.slot = slot
    app.state.stats = stats

    @app.exception_handler(RequestRejected)
    async def rejected(_request: Request, exc: RequestRejected) -> JSONResponse:
        return _error(422, "request_rejected", str(exc))

    @app.middleware("http")
    async def count(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        measured = request.url.path in ("/v1/act", "/v1/generate")
        try:
            response = await call_next(request)
        except Exception:
            SERVING_REQUESTS.labels("5xx").inc()
            if measured:
                stats.record(None, time.perf_counter() - started, failed=True)
            raise
        if VERSION_HEADER not in response.headers:
            response.headers[VERSION_HEADER] = slot.current.version
        SERVING_REQUESTS.labels(f"{response.status_code // 100}xx").inc()
        if measured:
            elapsed = time.perf_counter() - started
            SERVING_REQUEST_DURATION.observe(elapsed)
            stats.record(response.headers.get(VERSION_HEADER), elapsed, response.status_code >= 500)
        return response

    @app.post("/v1/act", response_model=ActResponse)
    async def act(body: ActRequest) -> JSONResponse:
        model = slot.current  # this request's model, whatever swaps happen meanwhile
        texts = await run_in_threadpool(_generate, model, [body.transcript], body)
        return _versioned(ActResponse(text=texts[0], model_version=model.version), model)

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(body: GenerateRequest) -> JSONResponse:
        model = slot.current
        texts = await run_in_threadpool(_generate, model, body.prompts, body)
        return _versioned(GenerateResponse(texts=texts, model_version=model.version), model)

    @app.get("/v1/model", response_model=ModelInfo)
    async def model_info() -> JSONResponse:
        model = slot.current
        previous = slot.previous
        info = ModelInfo(
            model_version=model.version,
            checkpoint_uri=model.path.resolve().as_uri(),
            loaded_at=model.loaded_at,
            previous_version=previous.version if previous else None,
            swaps=slot.swaps,
        )
        return _versioned(info, model)

    @app.get("/v1/stats")
    async def serving_stats() -> dict[str, Any]:
        return {"model_version": slot.current.version, "swaps": slot.swaps, **stats.snapshot()}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "model_version": slot.current.version}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = render_latest()
        return Response(body, media_type=content_type)

    @app.post("/v1/admin/swap", response_model=SwapResponse)
    async def swap(body: SwapRequest, request: Request) -> JSONResponse:
        denied = _check_admin(request, admin_token)
        if denied is not None:
            return denied
        started = time.perf_counter()
        try:
            path = uri_to_path(body.checkpoint)
        except ValueError as exc:
            return _error(422, "bad_checkpoint_uri", str(exc))
        try:
            report = await run_in_threadpool(
                slot.swap, Path(path), expected_version=body.expected_version
            )
        except SwapRefused as exc:
            SERVING_SWAPS.labels("rejected").inc()
            logger.warning("swap to %s refused: %s", path, exc)
            return _error(422, "swap_refused", f"swap refused, still serving: {exc}")
        SERVING_SWAPS.labels("ok" if report.changed else "noop").inc()
        total_ms = (time.perf_counter() - started) * 1000.0
        response = SwapResponse(
            model_version=report.version,
            previous_version=report.previous_version,
            changed=report.changed,
            load_ms=round(report.load_ms, 3),
            total_ms=round(total_ms, 3),
        )
        return _versioned(response, slot.current)

    @app.post("/v1/admin/rollback", response_model=SwapResponse)
    async def rollback(request: Request) -> JSONResponse:
        denied = _check_admin(request, admin_token)
        if denied is not None:
            return denied
        started = time.perf_counter()
        try:
            report = slot.rollback()
        except SwapRefused as exc:
            return _error(409, "no_previous_model", str(exc))
        SERVING_SWAPS.labels("rollback").inc()
        response = SwapResponse(
            model_version=report.version,
            previous_version=report.previous_version,
            changed=True,
            load_ms=0.0,
            total_ms=round((time.perf_counter() - started) * 1000.0, 3),
        )
        return _versioned(response, slot.current)

    return app


def _generate(model: LoadedModel, prompts: list[str], sampling: Sampling) -> list[str]:
    try:
        texts = model.policy.generate(
            prompts,
            max_new_tokens=min(sampling.max_new_tokens, model.policy.model.config.max_seq_len - 1),
            temperature=sampling.temperature,
            seed=sampling.seed,
        )
    except ValueError as exc:  # e.g. a context the model cannot take
        raise RequestRejected(str(exc)) from exc
    # The byte tokenizer keeps bytes that are not UTF-8 as surrogates; JSON cannot carry
    # them, so they become U+FFFD on the wire.
    return [text.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for text in texts]


class RequestRejected(Exception):
    """A request the model cannot answer as asked (answered with 422, not 500)."""


def _versioned(body: BaseModel, model: LoadedModel) -> JSONResponse:
    return JSONResponse(body.model_dump(), headers={VERSION_HEADER: model.version})


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": code, "detail": message}, status_code=status)


def _check_admin(request: Request, admin_token: str | None) -> JSONResponse | None:
    """A configured token is required; without one only this machine may swap."""
    if admin_token is not None:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), admin_token.encode()
        ):
            return JSONResponse(
                {"error": "unauthorized", "detail": "missing or wrong admin token"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return None
    host = request.client.host if request.client else ""
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = host in ("localhost", "testclient")
    if not local:
        return _error(
            403,
            "admin_disabled",
            "swaps from other machines need RATCHET_ADMIN_TOKEN on the model server",
        )
    return None


def serve(
    checkpoint: Path,
    *,
    host: str,
    port: int,
    admin_token: str | None = None,
    device: str = "auto",
) -> None:
    """Load ``checkpoint`` (refusing an invalid one before binding) and serve until stopped."""
    import uvicorn

    model = load_model(checkpoint, device=device)
    app = create_serving_app(ModelSlot(model, device=device), admin_token=admin_token)
    logger.info("serving %s from %s on http://%s:%d", model.version[:12], checkpoint, host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
