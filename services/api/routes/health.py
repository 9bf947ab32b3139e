"""Liveness, readiness and metrics. Health answers even when Postgres or Temporal is down."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from services.api.deps import StateDep
from services.db.session import ping
from services.metrics import render_latest

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process is up")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: Postgres and Temporal are reachable")
async def readyz(state: StateDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(asyncio.to_thread(ping, state.engine), 5)
        checks["postgres"] = "ok"
    except Exception as exc:
        checks["postgres"] = f"unreachable: {type(exc).__name__}"
    try:
        client = await state.temporal.get()
        await asyncio.wait_for(client.service_client.check_health(), 5)
        checks["temporal"] = "ok"
    except Exception as exc:
        checks["temporal"] = f"unreachable: {type(exc).__name__}"
    ready = all(value == "ok" for value in checks.values())
    return JSONResponse(
        {"status": "ready" if ready else "not_ready", "checks": checks},
        status_code=200 if ready else 503,
    )


@router.get("/metrics", summary="Prometheus metrics", include_in_schema=False)
async def metrics() -> Response:
    body, content_type = render_latest()
    return Response(body, media_type=content_type)
