"""Fixtures for serving tests: tiny checkpoints and a model server on a real socket."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import uvicorn

from services.serving.base import CheckpointRef
from services.serving.model import ModelSlot, load_model
from services.serving.server import create_serving_app
from services.training.checkpoint import save_checkpoint
from services.training.policy import GPT, GPTConfig

TINY = GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=96)


def write_checkpoint(path: Path, seed: int) -> CheckpointRef:
    """A tiny, valid checkpoint; different seeds give different weights, hence versions."""
    torch.manual_seed(seed)
    manifest = save_checkpoint(GPT(TINY), TINY, path)
    return CheckpointRef(id=manifest.checkpoint_id, uri=path.resolve().as_uri())


@pytest.fixture
def checkpoints(tmp_path: Path) -> list[CheckpointRef]:
    return [write_checkpoint(tmp_path / f"ckpt-{seed}", seed) for seed in range(3)]


class ServerThread:
    """uvicorn serving an app in a thread, on a socket bound before it starts."""

    def __init__(self, slot: ModelSlot, admin_token: str | None = None) -> None:
        self.slot = slot
        self.app = create_serving_app(slot, admin_token=admin_token)
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self._thread.start()
        started = threading.Event()

        def check() -> None:
            while not self._server.started and self._thread.is_alive():
                started.wait(0.02)

        check()
        if not self._server.started:
            raise RuntimeError("the model server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerThread]]:
    """Start model servers for a test (serving a checkpoint ref); all stop at the end."""
    running: list[ServerThread] = []

    def start(
        checkpoint: CheckpointRef, *, admin_token: str | None = None, slot: ModelSlot | None = None
    ) -> ServerThread:
        path = Path(checkpoint.uri.removeprefix("file://"))
        server = ServerThread(slot or ModelSlot(load_model(path)), admin_token)
        running.append(server.__enter__())
        return server

    yield start
    for server in running:
        server.__exit__()
