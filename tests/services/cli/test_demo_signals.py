"""`ratchet demo` stopped with SIGTERM (what `timeout`, CI and containers send) stops its stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support import assert_eventually

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_sigterm_stops_every_process_the_demo_started(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    log = tmp_path / "demo.log"
    env = {key: value for key, value in os.environ.items() if not key.startswith("RATCHET_")}
    env["RATCHET_STATE_DIR"] = str(tmp_path / "base")
    with log.open("wb") as output:
        demo = subprocess.Popen(
            [sys.executable, "-m", "services", "demo", "--state-dir", str(state)],
            cwd=REPO,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # so the test can clean up the group if the fix fails
        )
    try:

        def stack_up() -> None:
            assert demo.poll() is None, log.read_text()
            assert "[demo] Ratchet is up" in log.read_text()

        assert_eventually(stack_up, timeout=180, interval=0.5)

        def champion_job_running() -> None:
            # Signal while the first job runs too: it is a child the demo must also stop.
            commands = [p.cmdline() for p in psutil.Process(demo.pid).children(recursive=True)]
            assert any("job" in command for command in commands), commands

        assert_eventually(champion_job_running, timeout=120, interval=0.2)
        started = psutil.Process(demo.pid).children(recursive=True)
        postmaster = state / "postgres" / "postmaster.pid"
        started.append(psutil.Process(int(postmaster.read_text().split()[0])))
        assert len(started) >= 4  # api, worker, Temporal, Postgres at least

        demo.send_signal(signal.SIGTERM)
        assert demo.wait(90) == 143, log.read_text()

        def all_gone() -> None:
            alive = [p for p in started if p.is_running() and p.status() != "zombie"]
            assert alive == [], [p.cmdline()[:3] for p in alive]

        assert_eventually(all_gone, timeout=30, interval=0.5)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
