"""Fixtures for the model server's tests, and the serving targets' and the engine's: tiny
checkpoints and model servers on real sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn

from services.modelserver.registry import ModelRegistry
from services.modelserver.server import ServerOptions, create_serving_app
from services.serving.base import CheckpointRef, ServingUnavailable
from services.serving.client import ModelServerClient
from services.serving.local import wait_until_serving
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig
from tests.support import free_port

TINY = GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=96)


def write_checkpoint(path: Path, seed: int) -> CheckpointRef:
    """A tiny, valid checkpoint; different seeds give different weights, hence versions."""
    torch.manual_seed(seed)
    manifest = save_checkpoint(GPT(TINY), TINY, path)
    return CheckpointRef(id=manifest.checkpoint_id, uri=path.resolve().as_uri())


def path_of(checkpoint: CheckpointRef) -> Path:
    return Path(checkpoint.uri.removeprefix("file://"))


@pytest.fixture
def checkpoints(tmp_path: Path) -> list[CheckpointRef]:
    return [write_checkpoint(tmp_path / f"ckpt-{seed}", seed) for seed in range(3)]


class ServerThread:
    """uvicorn serving the model server's app in a thread, on a socket bound before it starts."""

    def __init__(
        self, registry: ModelRegistry, *, bind_host: str = "127.0.0.1", **options: Any
    ) -> None:
        """``options``: :class:`ServerOptions`' fields (``api_key``, ``queue_max``...)."""
        self.registry = registry
        self.app = create_serving_app(registry, ServerOptions(**options), bind_host=bind_host)
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not self._server.started:
            raise RuntimeError("the model server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerThread]]:
    """Start model servers for a test (serving a checkpoint under a name); all stop at the end."""
    running: list[ServerThread] = []

    def start(
        checkpoint: CheckpointRef,
        *,
        name: str = "ratchet",
        registry: ModelRegistry | None = None,
        **options: Any,
    ) -> ServerThread:
        if registry is None:
            registry = ModelRegistry(device="cpu")
            registry.load(name, path_of(checkpoint))
        server = ServerThread(registry, **options)
        running.append(server.__enter__())
        return server

    yield start
    for server in running:
        server.__exit__()


class ServeProcess:
    """``python -m services serve`` in a subprocess: the real command, as a user runs it."""

    def __init__(
        self,
        checkpoint: Path,
        *,
        name: str,
        log: Path,
        token: str | None = None,
        admin_token: str | None = None,
    ):
        """``token``: its API key (serves); ``admin_token``: its admin key (loads too)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {"RATCHET_SERVE_API_KEY": token} if token else {}
        if admin_token:
            env["RATCHET_SERVE_ADMIN_KEY"] = admin_token
        import os

        self._log = log.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services",
                "serve",
                "--checkpoint",
                str(checkpoint),
                "--served-model-name",
                name,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--device",
                "cpu",
                "--threads",
                "1",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
        )
        with ModelServerClient(self.url) as client:
            try:
                wait_until_serving(self.process, client, timeout_s=120)
            except ServingUnavailable as exc:
                self.stop()
                raise RuntimeError(f"ratchet serve: {exc}: {log.read_text()[-2000:]}") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(15)
        self._log.close()


LISTING = "tools: #add(a,b) @get(item)"
TOOLCALC_TOOLS: list[dict[str, object]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get",
            "description": "price of an item",
            "parameters": {
                "type": "object",
                "properties": {"item": {"type": "string"}},
                "required": ["item"],
            },
        },
    },
]


def demo_task() -> Any:
    """The toolcalc task the tiny GPT fixture has learned to solve."""
    from services.environments.toolcalc import ToolcalcEnvironment

    return ToolcalcEnvironment().make_task("$pear*37", "v1")


@pytest.fixture(scope="session")
def tool_calling_tiny(tmp_path_factory: pytest.TempPathFactory) -> CheckpointRef:
    """Trained once per test session, whichever conftest asks first (serving or demo)."""
    path = tmp_path_factory.getbasetemp() / "tool-calling-tiny"
    if (path / "manifest.json").is_file():
        from services.training.checkpoint import read_manifest

        return CheckpointRef(id=read_manifest(path).checkpoint_id, uri=path.resolve().as_uri())
    return train_tool_calling_tiny(path)


def train_tool_calling_tiny(path: Path) -> CheckpointRef:
    """A tiny GPT taught two episodes: ``$pear`` → ``@get(pear)``, ``= 12`` → ``ans 12``; and
    toolcalc's ``$pear*37`` (v1), as the environment renders it."""
    from services.chat.protocol import ChatMessage, ToolCall
    from services.environments.toolcalc import ToolcalcEnvironment
    from services.inference.tiny import render_transcript
    from services.training.tokenizer import ByteTokenizer
    from tests.services.modelserver.hf_models import train_to_answer

    config = GPTConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=128)
    torch.manual_seed(0)
    model = GPT(config)
    system, user = ChatMessage("system", LISTING), ChatMessage("user", "$pear")
    call = ChatMessage("assistant", tool_calls=(ToolCall("call_1", "get", {"item": "pear"}),))
    result = ChatMessage("tool", "12", tool_call_id="call_1")
    tokenizer = ByteTokenizer()
    pairs = [
        (render_transcript([system, user], TOOLCALC_TOOLS), "@get(pear)\n"),
        (render_transcript([system, user, call, result], TOOLCALC_TOOLS), "ans 12\n"),
    ]
    # And one real toolcalc episode, turn by turn, as the environment renders it.
    demo = ToolcalcEnvironment().demonstration(demo_task())
    for index, turn in enumerate(demo.turns):
        if turn.role == "agent":
            before = "".join(demo.render_turn(t) for t in demo.turns[:index])
            pairs.append((demo.prompt + before + demo.agent_prefix, turn.text + "\n"))
    train_to_answer(model, [(tokenizer.encode(p), tokenizer.encode(c)) for p, c in pairs])
    manifest = save_checkpoint(model, config, path)
    return CheckpointRef(id=manifest.checkpoint_id, uri=path.resolve().as_uri())


HF_REPLY = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.fixture(scope="session")
def tool_calling_llama(tmp_path_factory: pytest.TempPathFactory) -> CheckpointRef:
    from tests.services.modelserver.hf_models import write_replying_llama

    return write_replying_llama(tmp_path_factory.mktemp("hf") / "replying", HF_REPLY)


@pytest.fixture(scope="session")
def llama_with_adapters(tmp_path_factory: pytest.TempPathFactory) -> list[CheckpointRef]:
    """A random tiny Llama and two LoRA adapters on it (each changes the greedy answer)."""
    from tests.services.modelserver.hf_models import write_lora_adapter, write_tiny_llama

    root = tmp_path_factory.mktemp("llama")
    base = write_tiny_llama(root / "base")
    return [
        base,
        write_lora_adapter(base, root / "a1", 1),
        write_lora_adapter(base, root / "a2", 2),
    ]
