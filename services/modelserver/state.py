"""What the model server's routes share: its registry, scheduler, door policy and counters.

``create_serving_app`` builds one :class:`ServerState` and keeps it on ``app.state.server``;
each route module takes it as a typed dependency (:data:`ServerDep`), so the routes can live
in small modules of their own and a test can read what the server holds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request

from services.modelserver.guards import DoorPolicy, adapter_access_refusal
from services.modelserver.registry import ModelRegistry
from services.modelserver.scheduler import BatchScheduler


class ServingStats:
    """Counters and a latency window for ``/v1/stats`` (the Prometheus metrics are global)."""

    def __init__(self, window: int = 2048) -> None:
        self._lock = threading.Lock()
        self.started_at = time.time()
        self.requests_total = 0
        self.requests_failed = 0
        self.completion_tokens = 0
        self.by_version: dict[str, int] = {}
        self._latencies: deque[float] = deque(maxlen=window)

    def record(self, version: str | None, seconds: float, *, failed: bool, tokens: int = 0) -> None:
        with self._lock:
            self.requests_total += 1
            self.requests_failed += int(failed)
            self.completion_tokens += tokens
            if version is not None and not failed:
                self.by_version[version] = self.by_version.get(version, 0) + 1
            self._latencies.append(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            ordered = sorted(self._latencies)
            by_version = dict(self.by_version)
            total, failed, tokens = (
                self.requests_total,
                self.requests_failed,
                self.completion_tokens,
            )

        def quantile(q: float) -> float | None:
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0, 3)

        return {
            "uptime_s": round(time.time() - self.started_at, 3),
            "requests_total": total,
            "requests_failed": failed,
            "completion_tokens": tokens,
            "requests_by_version": by_version,
            "latency_ms_p50": quantile(0.5),
            "latency_ms_p95": quantile(0.95),
        }


@dataclass(frozen=True)
class ServerState:
    """One model server's parts. ``roots``: the directories adapter loads may come from;
    ``attestation_key``: signs each response id for the version that answered."""

    registry: ModelRegistry
    scheduler: BatchScheduler
    stats: ServingStats
    policy: DoorPolicy
    roots: list[Path]
    attestation_key: bytes | None

    def may_load(self, request: Request) -> bool:
        """Whether this client may use the adapter routes (and so see checkpoint paths)."""
        authorization = request.headers.get("authorization")
        return adapter_access_refusal(self.policy, _peer(request), authorization) is None

    def check_adapter_access(self, request: Request) -> None:
        """Refuse (401/403) a client that may not load or unload models."""
        authorization = request.headers.get("authorization")
        refusal = adapter_access_refusal(self.policy, _peer(request), authorization)
        if refusal is not None:
            raise refusal


def _peer(request: Request) -> str | None:
    return request.client.host if request.client else None


def server_state(request: Request) -> ServerState:
    """The state ``create_serving_app`` put on the app."""
    state: ServerState = request.app.state.server
    return state


ServerDep = Annotated[ServerState, Depends(server_state)]
