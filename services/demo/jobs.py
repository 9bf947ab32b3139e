"""Running one job of the job contract in a subprocess, as the local executor would.

The demo makes its first champion before any loop exists, so there is no workflow to run
the job: it writes the spec, runs ``python -m services job <kind>``, shows the job's
``step N/M`` log lines as progress and stops the job if the demo itself is stopped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.cores import thread_budget, thread_env
from services.demo.options import Printer
from services.local.stack import StackError


def run_job(kind: str, spec: dict[str, Any], work_dir: Path, out: Printer) -> Path:
    """Run a job of the job contract in a subprocess; its output dir."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path = work_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    # Every usable core: the demo makes its champion before the model server starts (the
    # loop's own jobs get their share from the local executor); a spec's own
    # hyperparameters.threads is the job's to apply.
    env = {
        **os.environ,
        **thread_env(thread_budget().cores),
        "RATCHET_OUTPUT_DIR": str(work_dir / "output"),
    }
    log_path = work_dir / "job.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services", "job", kind, "--spec", str(spec_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            follow_job_progress(process, log_path, f"[demo] {kind} job")
        finally:
            # Ctrl-C or SIGTERM unwinds through here: the job must not outlive the demo.
            stop_job(process)
    if process.returncode != 0:
        tail = (work_dir / "job.log").read_text()[-2000:]
        raise StackError(f"the {kind} job in {work_dir} failed ({process.returncode}): {tail}")
    return work_dir / "output"


def stop_job(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """End a job that is still running: SIGTERM, then SIGKILL after ``grace_s``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


_STEP = re.compile(rb"(?:sft|grpo|dpo) step (\d+)/(\d+)")


def follow_job_progress(process: subprocess.Popen[bytes], log_path: Path, label: str) -> None:
    """Wait for a job, showing its ``step N/M`` log lines as progress (a bar on a terminal)."""
    from services.progress import Progress

    with Progress(label, total=None, unit="steps") as progress, log_path.open("rb") as log:
        while True:
            done = process.poll() is not None
            for line in log.readlines():
                match = _STEP.search(line)
                if match is not None:
                    progress.update(int(match.group(1)), total=int(match.group(2)))
            if done:
                progress.failed = process.returncode != 0
                return
            time.sleep(0.5)
