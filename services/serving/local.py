"""The local serving target: ``ratchet serve`` on this machine, driven as an ``openai`` target.

Deploys and verification are the ``openai`` target's (load under the versioned name, move
the alias, ask ``/v1/models`` and probe both names): the local server is an
OpenAI-compatible server like any other. What this adds is the process: when no server
answers and the target has a :class:`LocalServerProcess`, the first deploy starts one
serving that checkpoint under the alias (``python -m services.modelserver``), in its own
session, with one CPU thread so the rest of the machine keeps its cores for training, and
its log under the logs directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr

from services.artifacts import uri_to_path
from services.cores import thread_budget
from services.serving.base import (
    DEFAULT_MODEL,
    BuildContext,
    CheckpointRef,
    DeployFailed,
    DeployOutcome,
    ServerAddress,
    ServingUnavailable,
)
from services.serving.client import ModelServerClient
from services.serving.openai_target import Heartbeat, OpenAIServingTarget
from services.settings import ENV_PREFIX, ServingEndpoint, Settings, secret_field_names

if TYPE_CHECKING:
    from services.loop.policies import ServingTarget as ServingConfig

logger = logging.getLogger(__name__)


class ServerExited(ServingUnavailable):
    """The model server process ended before it answered its health check."""


def wait_until_serving(
    process: subprocess.Popen[bytes], client: ModelServerClient, *, timeout_s: float
) -> None:
    """Return once the model server that ``process`` runs answers ``/health``.

    Every start of a model server process waits this way (the local target; the tests and
    benchmarks that start ``ratchet serve``). Raises :class:`ServerExited` when the process
    ends first and :class:`ServingUnavailable` once ``timeout_s`` has passed; stopping the
    process is the caller's.
    """
    deadline = time.monotonic() + timeout_s
    while not client.healthy():
        code = process.poll()
        if code is not None:
            raise ServerExited(f"the model server exited with code {code} before serving")
        if time.monotonic() > deadline:
            raise ServingUnavailable(f"the model server did not answer within {timeout_s:.0f}s")
        time.sleep(0.1)


class LocalServerProcess:
    """Starts and stops a model server process on this machine."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        logs_dir: Path,
        device: str = "auto",
        threads: int | None = 1,
        python: str | None = None,
        start_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """``env``: the server's whole environment (default: this process's). Secrets go
        there, never into argv, which every user of the machine can read."""
        self.host, self.port = host, port
        self._logs_dir = logs_dir
        self._device = device
        self._threads = threads
        self._python = python or sys.executable
        self._start_timeout_s = start_timeout_s
        self._env = env
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def command(self, checkpoint_dir: Path, model_name: str) -> list[str]:
        command = [
            self._python,
            "-m",
            "services.modelserver",
            "--checkpoint",
            str(checkpoint_dir),
            "--served-model-name",
            model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--device",
            self._device,
        ]
        if self._threads is not None:
            command += ["--threads", str(self._threads)]
        return command

    def start(self, checkpoint_dir: Path, model_name: str, client: ModelServerClient) -> None:
        """Start serving ``checkpoint_dir`` as ``model_name``; return once the server answers."""
        self._logs_dir.mkdir(parents=True, exist_ok=True)
        with (self._logs_dir / "serve.log").open("ab") as log:
            self._process = subprocess.Popen(
                self.command(checkpoint_dir, model_name),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self._env,
            )
        logger.info("started the model server (pid %s) for %s", self._process.pid, checkpoint_dir)
        try:
            wait_until_serving(self._process, client, timeout_s=self._start_timeout_s)
        except ServerExited as exc:
            raise DeployFailed(f"{exc}; see {self._logs_dir / 'serve.log'}") from None
        except ServingUnavailable:
            self.stop()
            raise

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


class LocalServingTarget(OpenAIServingTarget):
    """Deploys to the local model server at ``base_url``, starting it when asked to.

    ``api_key`` is the model server's admin key (``RATCHET_SERVE_ADMIN_KEY``: deploys load
    models), never the control plane's admin token: no credential of the control plane goes
    to a model server."""

    kind = "local"

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "ratchet",
        api_key: str | None = None,
        process: LocalServerProcess | None = None,
        heartbeat: Heartbeat | None = None,
        verify_timeout_s: float = 60.0,
    ) -> None:
        key = SecretStr(api_key) if api_key is not None else None
        super().__init__(
            ServingEndpoint(kind="openai", url=base_url, api_key=key),
            model=model,
            heartbeat=heartbeat,
            verify_timeout_s=verify_timeout_s,
        )
        self._process = process

    def deploy(self, checkpoint: CheckpointRef) -> DeployOutcome:
        if self.client.healthy():
            return super().deploy(checkpoint)
        if self._process is None:
            raise ServingUnavailable(f"the model server at {self.client.display_url} is down")
        self._process.start(uri_to_path(checkpoint.uri), self.model, self.client)
        outcome = super().deploy(checkpoint)  # verifies it, as every deploy
        return dataclasses.replace(outcome, previous_version=None, changed=True)


def build(config: ServingConfig, context: BuildContext) -> LocalServingTarget:
    """The ``local`` kind: the model server at ``RATCHET_SERVE_HOST:PORT``, started by the
    first deploy when none answers (and the worker may start one), with one share of the
    thread budget (the jobs beside it take the rest)."""
    settings = context.settings
    server = address(settings)
    process = None
    if context.start_local_server:
        process = LocalServerProcess(
            host=settings.serve_host,
            port=settings.serve_port,
            logs_dir=settings.logs_dir,
            threads=thread_budget().server,
            env=model_server_environment(settings),
        )
    return LocalServingTarget(
        server.url,
        model=config.model or DEFAULT_MODEL,
        api_key=deploy_key(settings),
        process=process,
        heartbeat=context.heartbeat,
        verify_timeout_s=config.verify_timeout_s,
    )


def address(settings: Settings) -> ServerAddress:
    """Where the local model server answers, with the key that serves (its API key: what
    reads its counters, or forwards an agent's request), never the admin token."""
    key = settings.serve_api_key.get_secret_value() if settings.serve_api_key else None
    return ServerAddress(f"http://{settings.serve_host}:{settings.serve_port}", key)


def deploy_key(settings: Settings) -> str | None:
    """The key a deploy sends the local model server: its admin key (a deploy loads and
    unloads models; the API key may not), else its API key."""
    key = settings.serve_admin_key or settings.serve_api_key
    return key.get_secret_value() if key is not None else None


def model_server_environment(settings: Settings) -> dict[str, str]:
    """The environment of a model server this worker starts: its own, minus every secret
    setting (the admin token, the database URL, the secret key, endpoint keys), plus the
    model server's API and admin keys, its attestation key and the roots it may load
    checkpoints from
    (this worker's artifact store, whatever the worker's settings came from). The model
    server loads checkpoints; it holds no credential of the control plane."""
    hidden = {f"{ENV_PREFIX}{name.upper()}" for name in secret_field_names()}
    env = {name: value for name, value in os.environ.items() if name not in hidden}
    if settings.serve_api_key is not None:
        env[f"{ENV_PREFIX}SERVE_API_KEY"] = settings.serve_api_key.get_secret_value()
    if settings.serve_admin_key is not None:
        env[f"{ENV_PREFIX}SERVE_ADMIN_KEY"] = settings.serve_admin_key.get_secret_value()
    if settings.serve_attestation_key is not None:
        key = settings.serve_attestation_key.get_secret_value()
        env[f"{ENV_PREFIX}SERVE_ATTESTATION_KEY"] = key
    roots = settings.serve_model_roots or [settings.artifacts_dir]
    env[f"{ENV_PREFIX}SERVE_MODEL_ROOTS"] = json.dumps([str(root.absolute()) for root in roots])
    return env
