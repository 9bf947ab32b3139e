"""Simulated production traffic for `ratchet demo` and the loop benchmark.

A "user" asks a toolcalc question under the tool API in force; the served model answers
through the model server's act endpoint, the environment runs the tools, the verifier
says whether the answer is right, and the episode is posted to Ratchet's webhook as a signed
``ratchet.trace/v1`` trace — exactly what an instrumented agent runtime would send. The
outcome of every episode is also kept here, so the demo can plot the live success rate.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.client import sign_and_post_traces
from services.environments import get_environment
from services.environments.base import TaskSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """One production episode as the demo saw it."""

    at: float  # seconds since the traffic started
    api_version: str
    model_version: str
    success: bool


@dataclass
class TrafficStats:
    outcomes: list[Outcome] = field(default_factory=list)
    posted: int = 0
    post_errors: int = 0
    act_errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def success_rate(
        self,
        *,
        since: float = 0.0,
        api_version: str | None = None,
        model_version: str | None = None,
        last: int | None = None,
    ) -> tuple[float | None, int]:
        """Success rate (and count) of the outcomes matching the filters."""
        with self._lock:
            picked = [
                o
                for o in self.outcomes
                if o.at >= since
                and (api_version is None or o.api_version == api_version)
                and (model_version is None or o.model_version == model_version)
            ]
        if last is not None:
            picked = picked[-last:]
        if not picked:
            return None, 0
        return sum(o.success for o in picked) / len(picked), len(picked)


class TrafficSimulator:
    """Posts ``rate_per_s`` signed traces per second from ``workers`` threads until stopped."""

    def __init__(
        self,
        *,
        serve_url: str,
        api_url: str,
        loop: str,
        signing_secret: str,
        api_version: Callable[[], str],
        rate_per_s: float = 4.0,
        workers: int = 2,
        environment: str = "toolcalc",
        seed: int = 0,
        batch_size: int = 4,
    ) -> None:
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be > 0")
        self.stats = TrafficStats()
        self._serve_url = serve_url.rstrip("/")
        self._api_url = api_url
        self._loop = loop
        self._secret = signing_secret
        self._api_version = api_version
        self._interval = workers / rate_per_s
        self._workers = workers
        self._environment = get_environment(environment)
        self._seed = seed
        self._batch_size = batch_size
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = time.monotonic()

    def start(self) -> None:
        self._started = time.monotonic()
        for index in range(self._workers):
            thread = threading.Thread(
                target=self._run, args=(index,), name=f"traffic-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self._threads.clear()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _run(self, index: int) -> None:
        rng = random.Random(f"traffic/{self._seed}/{index}")
        pending: list[dict[str, Any]] = []
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                trace = self._one_episode(http, rng)
                if trace is not None:
                    pending.append(trace)
                if len(pending) >= self._batch_size:
                    self._post(http, pending)
                    pending = []
                self._stop.wait(max(0.0, self._interval - (time.monotonic() - started)))
            if pending:
                self._post(http, pending)

    def _one_episode(self, http: httpx.Client, rng: random.Random) -> dict[str, Any] | None:
        version = self._api_version()
        task = self._environment.generate_tasks(1, seed=rng.randrange(2**31), api_version=version)[
            0
        ]
        served: dict[str, str] = {}

        def act(transcript: str) -> str:
            response = http.post(
                f"{self._serve_url}/v1/act",
                json={"transcript": transcript, "max_new_tokens": 48, "temperature": 0.0},
            )
            response.raise_for_status()
            body = response.json()
            served["version"] = body["model_version"]
            return str(body["text"])

        started_at = dt.datetime.now(dt.UTC)
        try:
            episode = self._environment.run_episode(task, act, max_turns=5)
        except httpx.HTTPError as exc:
            self.stats.act_errors += 1
            logger.warning("the model server did not answer: %s", exc)
            return None
        reward = self._environment.verify(task, episode)
        model_version = served.get("version", "unknown")
        self.stats.add(Outcome(self.elapsed(), version, model_version, bool(reward.passed)))
        return _trace(task, episode.to_trace_messages(), model_version, version, reward, started_at)

    def _post(self, http: httpx.Client, traces: list[dict[str, Any]]) -> None:
        try:
            sign_and_post_traces(self._api_url, self._loop, self._secret, traces, http=http)
            self.stats.posted += len(traces)
        except Exception as exc:  # the demo keeps going; the count shows it
            self.stats.post_errors += len(traces)
            logger.warning("posting %d traces failed: %s", len(traces), exc)


def _trace(
    task: TaskSpec,
    messages: list[dict[str, Any]],
    model_version: str,
    api_version: str,
    reward: Any,
    started_at: dt.datetime,
) -> dict[str, Any]:
    passed = bool(reward.passed)
    return {
        "schema": "ratchet.trace/v1",
        "external_id": f"demo-{uuid.uuid4().hex}",
        "model_version": model_version,
        "started_at": started_at.isoformat(),
        "ended_at": dt.datetime.now(dt.UTC).isoformat(),
        "tools": task.tools,
        "messages": messages,
        "outcome": {
            "success": passed,
            "score": float(reward.total),
            "error": None if passed else {"kind": "wrong_answer", "message": "verifier failed"},
        },
        "reference_answer": None,
        "metadata": {"environment": task.environment, "api_version": api_version},
    }
