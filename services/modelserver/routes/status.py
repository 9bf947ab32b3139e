"""``GET /health`` (and ``/healthz``), ``GET /v1/stats`` and ``GET /metrics``: whether the
server answers, what it serves and has done, and its Prometheus counters (the serving
ledger reads those: :mod:`services.modelserver.usage`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from services.metrics import render_latest
from services.modelserver.state import ServerDep

router = APIRouter()


@router.get("/v1/stats")
async def serving_stats(server: ServerDep) -> dict[str, Any]:
    scheduler = server.scheduler
    return {
        "models": {m.name: m.version for m in server.registry.names()},
        "swaps": server.registry.swaps,
        "resident_adapters": server.registry.resident_adapters(),
        "cold_adapter_loads": server.registry.cold_loads,
        "adapter_evictions": server.registry.evictions,
        "batches": scheduler.batches,
        "batched_rows": scheduler.rows,
        "decode_steps": scheduler.steps,
        "decoded_rows": scheduler.row_steps,
        "waiting_rows": scheduler.waiting(),
        "cancelled_rows": scheduler.cancelled,
        "refused_rows": scheduler.refused,
        **server.stats.snapshot(),
    }


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/metrics")
async def metrics() -> Response:
    content, content_type = render_latest()
    return Response(content, media_type=content_type)
