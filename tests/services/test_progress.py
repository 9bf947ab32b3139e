"""Progress: a rich bar on a terminal, plain lines elsewhere; the demo follows a job's steps."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

from services.demo.jobs import follow_job_progress
from services.progress import Progress


def test_plain_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    with Progress("copying", total=4_000_000, unit="B", stream=stream, interval_s=0) as progress:
        progress.advance(1_000_000)
        progress.advance(3_000_000)
    lines = stream.getvalue().splitlines()
    assert lines == [
        "copying: 1.0 MB/4.0 MB (25%) ...",
        "copying: 4.0 MB/4.0 MB (100%) ...",
        "copying: 4.0 MB/4.0 MB (100%) done",
    ]
    assert "\r" not in stream.getvalue()


def test_plain_lines_are_rate_limited() -> None:
    stream = io.StringIO()
    with Progress("steps", total=None, unit="steps", stream=stream, interval_s=3600) as progress:
        for step in range(1, 1001):
            progress.update(step, total=1000)
    assert stream.getvalue().splitlines() == ["steps: 1000 steps/1000 steps (100%) done"]


def test_a_bar_on_a_terminal() -> None:
    stream = io.StringIO()
    with Progress("training", total=10, unit="steps", stream=stream, force_terminal=True) as bar:
        bar.update(10)
    out = stream.getvalue()
    assert "training" in out and "10/10" in out and "━" in out


def follow_a_job(tmp_path: Path, job: str) -> tuple[int | None, list[str]]:
    """Run ``job`` as a Python process and follow its log as the demo does: its exit code and the
    lines the demo wrote to stderr."""
    log_path = tmp_path / "job.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", job], stdout=log)
        stream = io.StringIO()
        real_stderr, sys.stderr = sys.stderr, stream
        try:
            follow_job_progress(process, log_path, "[demo] train job")
        finally:
            sys.stderr = real_stderr
    return process.returncode, stream.getvalue().splitlines()


def test_the_demo_follows_a_jobs_step_lines(tmp_path: Path) -> None:
    job = textwrap.dedent(
        """
        import time
        for step in (1, 2, 3):
            print(f"sft step {step}/3 loss 0.5", flush=True)
            time.sleep(0.2)
        """
    )
    returncode, lines = follow_a_job(tmp_path, job)
    assert returncode == 0
    assert lines[-1] == "[demo] train job: 3 steps/3 steps (100%) done"


def test_a_failed_job_ends_with_failed_not_done(tmp_path: Path) -> None:
    job = 'import sys\nprint("sft step 1/4 loss 2.0", flush=True)\nsys.exit(1)\n'
    returncode, lines = follow_a_job(tmp_path, job)
    assert returncode == 1
    assert lines[-1] == "[demo] train job: 1 steps/4 steps (25%) failed"
