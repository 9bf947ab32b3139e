"""The local serving target: the built-in model server, hot-swapped, verified after each deploy.

``deploy(checkpoint)`` asks the server to swap (the server loads and verifies the new model
beside the old one and switches atomically, so no request fails), then asks the server which
version it serves and fails unless it is the checkpoint asked for — the target does not
trust the swap's "ok". ``rollback()`` switches back to the previous model, still loaded on
the server, and verifies the same way.

When no server is running and the target has a :class:`LocalServerProcess`, the first deploy
starts one serving that checkpoint (``python -m services.serving``), in its own session with
its log under the logs directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.artifacts import uri_to_path
from services.metrics import SERVING_SWAP_DURATION
from services.serving.base import (
    CheckpointRef,
    DeployFailed,
    DeployOutcome,
    ServedVersion,
    ServingUnavailable,
)
from services.serving.client import ModelServerClient

logger = logging.getLogger(__name__)


class LocalServerProcess:
    """Starts and stops a model server process on this machine."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        logs_dir: Path,
        device: str = "auto",
        python: str | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.host, self.port = host, port
        self._logs_dir = logs_dir
        self._device = device
        self._python = python or sys.executable
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self, checkpoint_dir: Path, client: ModelServerClient) -> None:
        """Start serving ``checkpoint_dir``; return once the server answers."""
        self._logs_dir.mkdir(parents=True, exist_ok=True)
        command = [
            self._python,
            "-m",
            "services.serving",
            "--checkpoint",
            str(checkpoint_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--device",
            self._device,
        ]
        with (self._logs_dir / "serve.log").open("ab") as log:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        logger.info("started the model server (pid %s) for %s", self._process.pid, checkpoint_dir)
        deadline = time.monotonic() + self._start_timeout_s
        while not client.healthy():
            code = self._process.poll()
            if code is not None:
                raise DeployFailed(
                    f"the model server exited with code {code} before serving; see "
                    f"{self._logs_dir / 'serve.log'}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServingUnavailable(
                    f"the model server did not answer within {self._start_timeout_s:.0f}s"
                )
            time.sleep(0.1)

    def stop(self, timeout_s: float = 10.0) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout_s)


class LocalServingTarget:
    """Deploys to the local model server at ``base_url``."""

    kind = "local"

    def __init__(
        self,
        base_url: str,
        *,
        admin_token: str | None = None,
        process: LocalServerProcess | None = None,
        swap_timeout_s: float = 300.0,
    ) -> None:
        self._client = ModelServerClient(
            base_url, admin_token=admin_token, swap_timeout_s=swap_timeout_s
        )
        self._process = process

    def close(self) -> None:
        self._client.close()

    def current(self) -> ServedVersion | None:
        try:
            info = self._client.model()
        except ServingUnavailable:
            if self._process is not None and not self._client.healthy():
                return None  # nothing started yet
            raise
        return _served(info)

    def deploy(self, checkpoint: CheckpointRef) -> DeployOutcome:
        """Swap to ``checkpoint`` (or start serving it), then verify what is served."""
        started = time.perf_counter()
        before = self.current()
        if before is None:
            if self._process is None:
                raise ServingUnavailable("the model server is not running")
            self._process.start(uri_to_path(checkpoint.uri), self._client)
            changed = True
        else:
            report = self._client.swap(checkpoint.uri, expected_version=checkpoint.id)
            changed = bool(report.get("changed", True))
        outcome = self._verified(
            checkpoint.id,
            before.version if before else None,
            started,
            changed,
            what="deploy",
        )
        SERVING_SWAP_DURATION.observe(outcome.latency_ms / 1000.0)
        return outcome

    def rollback(self) -> DeployOutcome:
        started = time.perf_counter()
        report = self._client.rollback()
        expected = str(report["model_version"])
        return self._verified(
            expected, report.get("previous_version"), started, True, what="rollback"
        )

    def stats(self) -> dict[str, Any]:
        return self._client.stats()

    def _verified(
        self,
        expected: str,
        previous: str | None,
        started: float,
        changed: bool,
        *,
        what: str,
    ) -> DeployOutcome:
        """Ask the server what it serves; anything but ``expected`` fails the deploy."""
        served = _served(self._client.model())
        if served.version != expected:
            raise DeployFailed(
                f"{what} not verified: the model server serves {served.version[:12]}, "
                f"expected {expected[:12]}"
            )
        latency_ms = (time.perf_counter() - started) * 1000.0
        logger.info("%s verified: serving %s (%.0f ms)", what, expected[:12], latency_ms)
        return DeployOutcome(
            version=served.version,
            previous_version=previous,
            latency_ms=latency_ms,
            changed=changed,
            details={"checkpoint_uri": served.uri},
        )


def _served(info: dict[str, Any]) -> ServedVersion:
    return ServedVersion(
        version=str(info["model_version"]),
        uri=info.get("checkpoint_uri"),
        previous_version=info.get("previous_version"),
    )
