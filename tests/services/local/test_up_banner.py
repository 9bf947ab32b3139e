"""`ratchet up`'s banner is the last thing it prints, and says where the logs are: on a
terminal api and worker log to files, so their startup lines no longer bury the URLs and the
admin token. The unit part reads the banner; the slow part runs `ratchet up --logs files`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.local.stack import Stack
from services.settings import Settings
from tests.services.local.test_stack import _stack_env, _stop_leftover_postgres
from tests.support import assert_eventually


def test_the_banner_says_where_the_logs_are(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path)
    logs = tmp_path / "logs"
    to_files = Stack(settings, log_to_files=True).banner().splitlines()
    assert (
        f"  Logs              {logs}/{{api,worker,gateway}}.log (`tail -f` them; "
        "`ratchet up --logs terminal` shows them here)" in to_files
    )
    assert to_files[-1] == "Press Ctrl-C to stop."
    here = Stack(settings).banner().splitlines()
    assert "  Logs              api, worker, gateway on this terminal" in here


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    yield state
    _stop_leftover_postgres(state)


@pytest.mark.slow
def test_up_with_log_files_ends_its_output_with_the_banner(state_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "up.out"
    with out.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "services", "up", "--logs", "files"],
            env=_stack_env(state_dir),
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:

        def banner() -> str:
            assert process.poll() is None, out.read_text()
            text = out.read_text()
            assert "Press Ctrl-C to stop." in text
            return text

        text = assert_eventually(banner, timeout=180, interval=0.5)
        # The worker's startup is in its log file, not around the banner.
        worker_log = (state_dir / "logs" / "worker.log").read_text()
        assert worker_log.strip()
        assert f"Logs              {state_dir / 'logs'}/{{api,worker,gateway}}.log" in text
        banner_at = text.index("Ratchet is up.")
        assert text[banner_at:].rstrip().endswith("Press Ctrl-C to stop.")
        assert "services.worker" not in text and "workflows.worker" not in text
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
