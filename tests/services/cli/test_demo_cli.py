"""`ratchet demo`'s options: a bad value is refused in one line naming the option, before
anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("argument", "reason"),
    [
        (["--traffic-workers", "0"], "argument --traffic-workers: 0 must be at least 1"),
        (["--traffic-workers", "many"], "argument --traffic-workers: 'many' is not a whole"),
        (["--model", "gpt5"], "argument --model: invalid choice: 'gpt5'"),
    ],
)
def test_a_bad_option_is_refused_with_its_name(
    argument: list[str], reason: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services", "demo", "--state-dir", str(tmp_path), *argument],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert reason in done.stderr
    assert "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())  # nothing started, nothing written
