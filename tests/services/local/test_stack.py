"""`ratchet up` as a user runs it: real processes, a fresh state dir, kill -9, restart."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest

from services.local.binaries import temporal_cli_path
from tests.support import assert_eventually, free_port


@dataclass
class UpProcess:
    env: dict[str, str]
    state_dir: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.env['RATCHET_API_PORT']}"

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services", "up"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 90) -> None:
        def ready() -> None:
            assert self.process is not None and self.process.poll() is None, self.log.read_text()
            try:
                response = httpx.get(f"{self.api}/readyz", timeout=2)
            except httpx.HTTPError as exc:
                raise AssertionError(str(exc)) from exc
            assert response.status_code == 200, response.text

        assert_eventually(ready, timeout=timeout, interval=0.5)

    def kill_group(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                return self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
                return -9
        return self.process.returncode

    def database_url(self) -> str:
        return f"postgresql://postgres:@/postgres?host={self.state_dir / 'postgres'}"


def _stack_env(state_dir: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("RATCHET_")}
    env.update(
        RATCHET_STATE_DIR=str(state_dir),
        RATCHET_API_PORT=str(free_port()),
        RATCHET_WORKER_PORT=str(free_port()),
        RATCHET_GATEWAY_PORT=str(free_port()),
        RATCHET_TEMPORAL_PORT=str(free_port()),
        RATCHET_TEMPORAL_UI_PORT=str(free_port()),
        RATCHET_LOG_FORMAT="text",
    )
    return env


def _stop_leftover_postgres(state_dir: Path) -> None:
    """Stop the embedded Postgres of the runs (pg_ctl may leave it outside the killed group).

    pgserver's own cleanup stops only servers its process started, so stop it by data dir.
    """
    from pgserver import pg_ctl

    data = state_dir / "postgres"
    if (data / "postmaster.pid").exists():
        as_user = {"user": "pgserver"} if os.geteuid() == 0 else {}
        with contextlib.suppress(subprocess.CalledProcessError):
            pg_ctl(["-m", "fast", "-w", "stop"], pgdata=data, **as_user)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[UpProcess]:
    state_dir = tmp_path / "state"
    stack = UpProcess(_stack_env(state_dir), state_dir, tmp_path / "up.log")
    yield stack
    if stack.process is not None:
        stack.stop()
    _stop_leftover_postgres(state_dir)


def test_up_serves_survives_kill9_and_keeps_data(up: UpProcess) -> None:
    up.start()
    up.wait_ready(timeout=90)

    def banner_printed() -> str:
        # `ratchet up` prints once it has seen the api ready itself, a moment after we did.
        output = up.log.read_text()
        assert "Ratchet is up." in output
        return output

    output = assert_eventually(banner_printed, timeout=30)
    assert f"Temporal Web UI   http://127.0.0.1:{up.env['RATCHET_TEMPORAL_UI_PORT']}" in output

    health = subprocess.run(
        [
            str(temporal_cli_path()),
            "operator",
            "cluster",
            "health",
            "--address",
            f"127.0.0.1:{up.env['RATCHET_TEMPORAL_PORT']}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "SERVING" in health.stdout, health.stdout + health.stderr
    for url in (
        f"http://127.0.0.1:{up.env['RATCHET_TEMPORAL_UI_PORT']}/",
        f"http://127.0.0.1:{up.env['RATCHET_WORKER_PORT']}/readyz",
    ):
        assert_eventually(lambda url=url: _answers_200(url), timeout=60, interval=0.5)

    with psycopg.connect(up.database_url(), autocommit=True) as conn:
        conn.execute("INSERT INTO loops (name, environment) VALUES ('survivor', 'toolcalc')")

    up.kill_group()
    # Killed with -9, `ratchet up` could not stop its Postgres: it keeps running (its data
    # safe) until the next `ratchet up` adopts it...
    with psycopg.connect(up.database_url(), connect_timeout=5) as conn:
        conn.execute("SELECT 1")
    up.start()
    up.wait_ready(timeout=90)
    with psycopg.connect(up.database_url()) as conn:
        names = [row[0] for row in conn.execute("SELECT name FROM loops")]
    assert names == ["survivor"]

    assert up.stop() == 0
    assert "Traceback" not in up.log.read_text()
    # ... and stops it with everything else when that one is stopped.
    postmaster = up.state_dir / "postgres" / "postmaster.pid"

    def postgres_stopped() -> None:
        assert not postmaster.exists(), "the adopted Postgres is still running"

    assert_eventually(postgres_stopped, timeout=30, interval=0.5)


def _answers_200(url: str) -> None:
    try:
        response = httpx.get(url, timeout=5)
    except httpx.HTTPError as exc:
        raise AssertionError(f"{url}: {exc}") from exc
    assert response.status_code == 200, f"{url}: {response.status_code}"


def _run_up(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services", "up"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def _assert_one_clear_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    error_lines = [
        line for line in result.stderr.splitlines() if line.startswith("ratchet: error:")
    ]
    assert len(error_lines) == 1, result.stderr
    for needle in needles:
        assert needle in error_lines[0]


def test_port_in_use(tmp_path: Path) -> None:
    env = _stack_env(tmp_path / "state")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", int(env["RATCHET_API_PORT"])))
        busy.listen()
        result = _run_up(env)
    _assert_one_clear_line(result, "RATCHET_API_PORT", "already in use")


def test_unwritable_state_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = _run_up(_stack_env(blocker / "state"))
    _assert_one_clear_line(result, "RATCHET_STATE_DIR", "not writable")


def test_unreachable_postgres(tmp_path: Path) -> None:
    env = _stack_env(tmp_path / "state")
    env["RATCHET_DATABASE_URL"] = f"postgresql://ratchet@127.0.0.1:{free_port()}/ratchet"
    result = _run_up(env)
    _assert_one_clear_line(result, "RATCHET_DATABASE_URL", "not reachable")


def test_unreachable_temporal(tmp_path: Path, database_url: str) -> None:
    env = _stack_env(tmp_path / "state")
    env["RATCHET_DATABASE_URL"] = database_url
    env["RATCHET_TEMPORAL_ADDRESS"] = f"127.0.0.1:{free_port()}"
    result = _run_up(env)
    _assert_one_clear_line(result, "RATCHET_TEMPORAL_ADDRESS", "not reachable")


def test_bad_setting(tmp_path: Path) -> None:
    env = _stack_env(tmp_path / "state")
    env["RATCHET_API_PORT"] = "not-a-port"
    result = _run_up(env)
    _assert_one_clear_line(result, "RATCHET_API_PORT")
