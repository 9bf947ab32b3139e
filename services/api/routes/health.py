"""Liveness, readiness, dependency health and metrics. Health answers even when Postgres or
Temporal is down."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from services.api.deps import StateDep
from services.api.errors import ApiError
from services.api.state import AppState
from services.db.session import ping
from services.metrics import render_latest

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process is up")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def dependency_checks(state: AppState) -> dict[str, str]:
    """Whether Postgres and Temporal answer, each as ``ok`` or why not."""
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
    return checks


@router.get("/readyz", summary="Readiness: this process can serve requests")
async def readyz(state: StateDep) -> JSONResponse:
    """Ready while the process serves, whatever Postgres and Temporal do.

    A pod that left the Service when a dependency failed would turn the webhook's designed
    answer (503 with ``Retry-After``, which senders retry) into connection refused on every
    replica at once. Dependency health is ``/health/dependencies``, for alerts, not routing.
    """
    serving = state.ingest is not None and state.ingest.writer.running
    checks = {"ingest_writer": "ok" if serving else "not running"}
    return JSONResponse(
        {"status": "ready" if serving else "not_ready", "checks": checks},
        status_code=200 if serving else 503,
    )


@router.get(
    "/health/dependencies", summary="Dependencies: Postgres and Temporal are reachable (503 if not)"
)
async def dependencies(state: StateDep) -> JSONResponse:
    checks = await dependency_checks(state)
    healthy = all(value == "ok" for value in checks.values())
    return JSONResponse(
        {"status": "ok" if healthy else "degraded", "checks": checks},
        status_code=200 if healthy else 503,
    )


@router.get("/metrics", summary="Prometheus metrics", include_in_schema=False)
async def metrics(state: StateDep) -> Response:
    if state.settings.api_metrics_port is not None:
        # Served on its own port (services.api.metrics_server), never next to the webhook.
        raise ApiError(404, "not_found", "metrics are served on RATCHET_API_METRICS_PORT")
    body, content_type = render_latest()
    return Response(body, media_type=content_type)
