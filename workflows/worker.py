"""The composition root: builds real dependencies and registers every workflow and activity.

Only this module wires real parts (engine, executor, serving target, artifact store); tests
build workers from the same function with their own dependencies. The worker process also
serves ``/healthz``, ``/readyz`` and ``/metrics`` (Ratchet's registry plus the Temporal
SDK's own metrics) on ``RATCHET_WORKER_PORT``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import socket
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from sqlalchemy import Engine
from temporalio.client import Client
from temporalio.worker import Worker

from services.artifacts import ArtifactStore
from services.db.session import engine_from_settings, make_session_factory, ping
from services.metrics import render_latest
from services.serving.kinds import check_serving_endpoints
from services.settings import Settings
from services.temporal import connect_temporal, metrics_runtime
from workflows.registry import WORKFLOWS, WorkerDependencies, build_activities

logger = logging.getLogger(__name__)


def workflow_classes() -> list[type]:
    """Every workflow type Ratchet runs."""
    return list(WORKFLOWS)


def activity_callables(deps: WorkerDependencies) -> list[Callable[..., Any]]:
    """Every activity, bound to its dependencies."""
    return build_activities(deps)


def build_worker(
    client: Client,
    deps: WorkerDependencies,
    *,
    task_queue: str | None = None,
    workflows: Sequence[type] | None = None,
    activities: Sequence[Callable[..., Any]] | None = None,
    max_concurrent_activities: int = 32,
    max_followed_jobs: int | None = None,
) -> Worker:
    """A worker on the settings' task queue with every workflow and activity registered.

    Activity slots come in two budgets: ``max_concurrent_activities`` for the activities
    that work (a transaction, a curation batch, a deploy: one thread each), and
    ``max_followed_jobs`` (``RATCHET_WORKER_MAX_JOBS``) more for ``run_job``, which holds its
    slot while its job runs but costs nothing meanwhile (it waits on the event loop). With
    one budget, as many long jobs as slots would leave no slot for any loop's next database
    call: every other loop's cycle would stall behind them.
    """
    jobs = deps.settings.worker_max_jobs if max_followed_jobs is None else max_followed_jobs
    with warnings.catch_warnings():
        # The SDK warns when slots outnumber the executor's threads: here on purpose, as the
        # job slots' activities are async and never take a thread of it.
        warnings.filterwarnings("ignore", message="Worker max_concurrent_activities is")
        return Worker(
            client,
            task_queue=task_queue or deps.settings.temporal_task_queue,
            workflows=list(workflows) if workflows is not None else workflow_classes(),
            activities=list(activities) if activities is not None else activity_callables(deps),
            activity_executor=concurrent.futures.ThreadPoolExecutor(max_concurrent_activities),
            max_concurrent_activities=max_concurrent_activities + jobs,
        )


def _free_local_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def health_app(engine: Engine, client: Client, sdk_metrics_url: str) -> FastAPI:
    """The worker's small HTTP surface: liveness, readiness and metrics."""
    app = FastAPI(title="Ratchet worker", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        checks: dict[str, str] = {}
        try:
            await asyncio.wait_for(asyncio.to_thread(ping, engine), 5)
            checks["postgres"] = "ok"
        except Exception as exc:
            checks["postgres"] = f"unreachable: {type(exc).__name__}"
        try:
            await asyncio.wait_for(client.service_client.check_health(), 5)
            checks["temporal"] = "ok"
        except Exception as exc:
            checks["temporal"] = f"unreachable: {type(exc).__name__}"
        ready = all(value == "ok" for value in checks.values())
        return JSONResponse(
            {"status": "ready" if ready else "not_ready", "checks": checks},
            status_code=200 if ready else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = render_latest()
        try:
            async with httpx.AsyncClient(timeout=2) as http:
                sdk = await http.get(sdk_metrics_url)
            body += b"\n" + sdk.content
        except httpx.HTTPError:
            logger.warning("the Temporal SDK metrics endpoint did not answer")
        return Response(body, media_type=content_type)

    return app


def build_dependencies(settings: Settings, engine: Engine) -> WorkerDependencies:
    return WorkerDependencies(
        settings=settings,
        session_factory=make_session_factory(engine),
        artifacts=ArtifactStore(settings.artifacts_dir),
    )


async def run_worker(settings: Settings) -> None:
    """Run the worker until SIGTERM/SIGINT, finishing in-flight activities first."""
    # A serving endpoint its kind refuses is a SettingsError before anything is connected
    # (ServingTargets checks again, for workers built without this function).
    check_serving_endpoints(settings.serving_endpoints)
    sdk_metrics_port = _free_local_port()
    runtime = metrics_runtime(f"127.0.0.1:{sdk_metrics_port}")
    client = await connect_temporal(settings, runtime=runtime)
    engine = engine_from_settings(settings, application="ratchet-worker")
    deps = build_dependencies(settings, engine)
    worker = build_worker(client, deps)
    from temporalio.service import RPCError

    from workflows.schedules import (
        ensure_retention_schedule,
        ensure_serving_ledger_schedule,
        retention_input,
    )
    from workflows.search_attributes import ensure_search_attributes

    try:
        added = await ensure_search_attributes(client, settings.temporal_namespace)
        if added:
            logger.info("registered search attributes %s", ", ".join(added))
    except RPCError as exc:  # e.g. Temporal Cloud: created once in the namespace's settings
        logger.error(
            "cannot register search attributes in namespace %s (%s); create them as "
            "docs/deploy.md shows, or workflows that set them fail their tasks",
            settings.temporal_namespace,
            exc,
        )
    try:
        await ensure_retention_schedule(
            client, retention_input(settings), settings.temporal_task_queue
        )
    except RPCError as exc:  # the loops still run; only the purge is not scheduled
        logger.error("cannot set up the retention (partitions) schedule: %s", exc)
    try:
        await ensure_serving_ledger_schedule(
            client, settings.serving_ledger_sample_s, settings.temporal_task_queue
        )
    except RPCError as exc:  # deploys and cycle closes still sample the ledger
        logger.error("cannot set up the serving ledger schedule: %s", exc)
    server = uvicorn.Server(
        uvicorn.Config(
            health_app(engine, client, f"http://127.0.0.1:{sdk_metrics_port}/metrics"),
            host=settings.worker_host,
            port=settings.worker_port,
            log_level="warning",
            lifespan="off",
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server_task = asyncio.create_task(server.serve())
    logger.info(
        "worker polling task queue %s on %s",
        settings.temporal_task_queue,
        settings.effective_temporal_address,
    )
    try:
        async with worker:
            await stop.wait()
    finally:
        server.should_exit = True
        await server_task
        engine.dispose()
