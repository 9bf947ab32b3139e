"""Small test helpers shared across the suite."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from services.environments.base import read_task_file
from services.training.episode_file import read_demonstrations

T = TypeVar("T")

_HANDED_OUT: set[int] = set()  # ports free_port gave this process, never given twice


def free_port() -> int:
    """A port nothing listens on, below Linux's ephemeral range (32768+) and not handed out
    before in this process.

    A port from ``bind(("127.0.0.1", 0))`` comes from the ephemeral range, where every
    process's random ports come from too: the Temporal dev server's own HTTP and metrics
    ports, the source ports of outgoing connections. A test picks its ports before it starts
    the processes that bind them, so such a port can be taken in between (CI once: the
    stack's worker exited with code 3, its port in use). Below the range only tests pick."""
    for _ in range(1000):
        port = random.randint(20000, 32767)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port in 20000-32767")


def assert_eventually(
    check: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, message: str = ""
) -> T:
    """Poll ``check`` until it returns without raising AssertionError; return its value."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(interval)


async def assert_eventually_async(
    check: Callable[[], Awaitable[T]],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
) -> T:
    """Async twin of :func:`assert_eventually`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await check()
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(interval)


def assert_nothing_trained_is_judged(
    train_spec: Mapping[str, Any], judged: Mapping[str, Path | str | None]
) -> None:
    """No task a train job's spec trains on (its ``dataset``, ``replay_dataset`` and
    ``demonstrations``) is in a task file that judges its candidate (``judged``: the eval,
    regression and held-out files by name), by job task id and, for task files, by the
    curation cluster their lineage names (DESIGN §8: replay included)."""
    trained_ids: dict[str, str] = {}
    trained_clusters: dict[str, str] = {}
    for key in ("dataset", "replay_dataset"):
        if train_spec.get(key):
            for task in read_task_file(Path(str(train_spec[key]))):
                trained_ids[task.task_id] = key
                cluster = task.metadata.get("ratchet", {}).get("cluster_id")
                if cluster:
                    trained_clusters[str(cluster)] = key
    if train_spec.get("demonstrations"):
        for record in read_demonstrations(Path(str(train_spec["demonstrations"]))):
            trained_ids[record.task_id] = "demonstrations"
    for name, path in judged.items():
        if not path:
            continue
        for task in read_task_file(Path(str(path))):
            assert task.task_id not in trained_ids, (
                f"task {task.task_id[:12]} of the {name} set is trained on "
                f"(the train spec's {trained_ids[task.task_id]})"
            )
            cluster = str(task.metadata.get("ratchet", {}).get("cluster_id") or "")
            assert cluster not in trained_clusters, (
                f"cluster {cluster[:12]} has a task of the {name} set and one the train "
                f"spec's {trained_clusters[cluster]} trains on"
            )
