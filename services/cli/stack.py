"""`ratchet up`, `ratchet api`, `ratchet worker`, `ratchet gateway`: the processes of DESIGN §3."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.cli.common import add_command, cli_settings
from services.logs import configure_logging

if TYPE_CHECKING:
    from fastapi import FastAPI

    from services.settings import Settings


def register(subparsers: Any) -> None:
    up = add_command(
        subparsers,
        "up",
        _up,
        help="run everything: embedded Postgres + Temporal dev server (when unset), api, worker",
    )
    up.add_argument(
        "--logs",
        choices=("auto", "files", "terminal"),
        default="auto",
        help="where api, worker and gateway log: files under <state dir>/logs, or this "
        "terminal (auto: files when the output is a terminal, so the banner stays readable)",
    )
    add_command(
        subparsers, "api", _api, help="run the api: webhook, admin API, dashboard, /metrics"
    )
    add_command(
        subparsers, "worker", _worker, help="run the Temporal worker (workflows, activities)"
    )
    add_command(
        subparsers,
        "gateway",
        _gateway,
        help="run the capture gateway: an OpenAI-compatible proxy whose calls become traces",
    )


def _up(args: argparse.Namespace) -> int:
    """Start Ratchet on one machine. When RATCHET_DATABASE_URL is unset an embedded Postgres
    keeps its data under RATCHET_STATE_DIR; when RATCHET_TEMPORAL_ADDRESS is unset the
    Temporal dev server runs with its Web UI. Then migrate, run the api, the worker and the
    capture gateway, and print where everything is (URLs, the admin token, where the logs
    are) once they are ready. On a terminal they log to files under <state dir>/logs
    (--logs).
    Ctrl-C stops everything.
    """
    import sys

    from services.cli import CliError
    from services.local.stack import StackError, run_up

    settings = cli_settings()
    configure_logging(settings.log_level, settings.log_format, component="up")
    to_files = args.logs == "files" or (args.logs == "auto" and sys.stdout.isatty())
    try:
        return run_up(
            settings, announce=lambda banner: print(banner, flush=True), log_to_files=to_files
        )
    except StackError as exc:
        raise CliError(str(exc), exit_code=1) from None


def _api(args: argparse.Namespace) -> int:
    import uvicorn

    from services.api.app import create_app
    from services.metrics import MULTIPROCESS_DIR_ENV
    from services.serving.kinds import check_serving_endpoints

    settings = cli_settings(require_database=True)
    configure_logging(settings.log_level, settings.log_format, component="api")
    options = uvicorn_options(settings)
    if settings.api_workers == 1:
        app = create_app(settings)
        freeze_startup_heap()
        with metrics_server(settings, None):
            uvicorn.run(app, **options)
        return 0
    # Several processes on one socket (uvicorn's supervisor), each building its app with
    # api_worker_app(); their metrics meet in a fresh directory (see services.metrics).
    # create_app's own check of the serving endpoints would fail in every child instead of
    # as one line here.
    check_serving_endpoints(settings.serving_endpoints)
    metrics_dir = tempfile.mkdtemp(prefix="ratchet-api-metrics-")
    os.environ[MULTIPROCESS_DIR_ENV] = metrics_dir
    try:
        with metrics_server(settings, Path(metrics_dir)):
            uvicorn.run(
                "services.cli.stack:api_worker_app",
                factory=True,
                workers=settings.api_workers,
                **options,
            )
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


@contextlib.contextmanager
def metrics_server(settings: Settings, multiprocess_dir: Path | None) -> Iterator[None]:
    """``/metrics`` on RATCHET_API_METRICS_PORT while the api runs (when that is set)."""
    from services.api.metrics_server import MetricsServer

    if settings.api_metrics_port is None:
        yield
        return
    server = MetricsServer(settings.api_host, settings.api_metrics_port, multiprocess_dir)
    server.start()
    try:
        yield
    finally:
        server.stop()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """How uvicorn serves the api: bounded connections (past the limit a client gets a 503,
    not a process that runs out of memory) and idle connections closed after a few seconds."""
    return {
        "host": settings.api_host,
        "port": settings.api_port,
        "log_level": "warning",
        "access_log": False,
        "timeout_graceful_shutdown": 10,
        "limit_concurrency": settings.api_limit_concurrency,
        "timeout_keep_alive": settings.api_timeout_keep_alive_s,
    }


def api_worker_app() -> FastAPI:
    """The app of one process of a multi-process api (uvicorn calls it in each worker)."""
    from services.api.app import create_app

    settings = cli_settings(require_database=True)
    configure_logging(settings.log_level, settings.log_format, component="api")
    app = create_app(settings)
    freeze_startup_heap()
    return app


def freeze_startup_heap() -> None:
    """Keep the garbage collector off what imports and setup built: it lives as long as the
    process, yet every full collection walked it (~150k objects, tens of ms per collection;
    under batch ingest most of a second of CPU per 10 s, and pauses in the latency tail)."""
    gc.collect()
    gc.freeze()


def _gateway(args: argparse.Namespace) -> int:
    """The capture gateway on RATCHET_GATEWAY_HOST:PORT (one process; scale with replicas,
    each with its own RATCHET_GATEWAY_SPOOL_DIR)."""
    import uvicorn

    from services.api.metrics_server import MetricsServer
    from services.gateway.server import build_gateway

    settings = cli_settings(require_database=True)
    configure_logging(settings.log_level, settings.log_format, component="gateway")
    app = build_gateway(settings, serve_metrics=settings.gateway_metrics_port is None)
    metrics = None
    if settings.gateway_metrics_port is not None:
        metrics = MetricsServer(settings.gateway_host, settings.gateway_metrics_port)
        metrics.start()
    freeze_startup_heap()
    try:
        uvicorn.run(
            app,
            host=settings.gateway_host,
            port=settings.gateway_port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=15,
            timeout_keep_alive=30,
            lifespan="on",
        )
    finally:
        if metrics is not None:
            metrics.stop()
    return 0


def _worker(args: argparse.Namespace) -> int:
    from workflows.worker import run_worker

    settings = cli_settings(require_database=True)
    configure_logging(settings.log_level, settings.log_format, component="worker")
    asyncio.run(run_worker(settings))
    return 0
