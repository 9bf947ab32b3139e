"""The demo's model server: ``ratchet serve`` with the champion, on the stack's serve port."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.cores import thread_budget
from services.local.stack import StackError
from services.settings import Settings


def start_model_server(settings: Settings, checkpoint: Path) -> subprocess.Popen[bytes]:
    """Start ``ratchet serve`` and wait until it answers its health check.

    It gets the model server's keys (``settings.serve_api_key``, which the demo's agents
    send, and ``settings.serve_admin_key``, which the worker's local serving target sends to
    load models), the stack's artifact store as the root it loads adapters from, and none of
    the control plane's secrets."""
    from services.serving.local import model_server_environment

    log = (settings.logs_dir / "serve.log").open("ab")
    env = model_server_environment(settings)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services",
            "serve",
            "--checkpoint",
            str(checkpoint),
            "--host",
            settings.serve_host,
            "--port",
            str(settings.serve_port),
            # Its share of the cores; the jobs the demo runs beside it take the rest.
            "--threads",
            str(thread_budget().server),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://{settings.serve_host}:{settings.serve_port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(f"the model server exited ({process.returncode}); see {log.name}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return process
        time.sleep(0.3)
    raise StackError(f"the model server did not answer at {url}")


def stop_model_server(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the server if it still runs and give it ``grace_s`` to drain."""
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
