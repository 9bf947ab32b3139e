"""`ratchet loop show NAME | head`: a reader that stops reading ends the command quietly,
as `git log | head` does (no BrokenPipeError traceback), with SIGPIPE's status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services.cli.support import run

REPO = Path(__file__).resolve().parents[3]


def test_a_reader_that_goes_away_ends_the_command_quietly(
    api_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "loop", "create", "calc", "--env", "toolcalc", "--show-secrets")[0] == 0
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'clients' / 'python' / 'src'}"}
    # `true` reads nothing and exits at once: every write of the command meets a closed pipe.
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{sys.executable} -m services loop show calc | true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stderr == ""
    assert done.returncode == 141  # 128 + SIGPIPE, as a shell reports `git log | true`
