"""Hot-swap benchmark: swap latency and failed requests under steady concurrent load.

Starts the model server (``python -m services.serving``, its own process, as in production)
on a checkpoint of the reference policy, drives it with closed-loop clients calling
``POST /v1/chat/completions`` on the served name, and meanwhile deploys other checkpoints
through the local serving target, which loads each under its versioned name, moves the
served name to it and verifies (see ``services/serving/openai_target.py``).
``benchmarks/serving.py`` measures the same under 16 ``openai`` clients, on SmolLM2 too.

Figures:

- ``swap_latency_ms`` — median time from ``deploy()`` called to the new version verified
  served (``swap_latency_ms_max`` the worst);
- ``first_new_response_ms`` — median time from ``deploy()`` called to the first client
  response produced by the new version;
- ``requests_total``, ``requests_failed`` (must be 0), ``requests_during_swaps`` (answered
  while a deploy was in progress), request latency p50/p95 and throughput.

Usage: ``python benchmarks/swap.py [--clients 8] [--duration-s 12] [--swaps 3]``. Prints a few
readable lines, then one JSON line (last). Runtime is bounded by ``--duration-s`` plus the
server's start (a hard deadline stops it otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support import free_port, random_tiny_checkpoints
from services.modelserver.openai_api import VERSION_HEADER
from services.serving.base import CheckpointRef
from services.serving.local import LocalServerProcess, LocalServingTarget
from services.training.tiny.model import GPT, GPTConfig

MESSAGES = [
    {"role": "system", "content": "tools: #add(a,b) &mul(a,b) @get(item)"},
    {"role": "user", "content": "$grape+$peach"},
]
MODEL = "ratchet"


@dataclass
class Sample:
    started: float
    ended: float
    ok: bool
    version: str | None


@dataclass
class Load:
    """Closed-loop clients; each records every request it made."""

    url: str
    clients: int
    max_new_tokens: int
    samples: list[list[Sample]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.samples = [[] for _ in range(self.clients)]
        for index in range(self.clients):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _client(self, index: int) -> None:
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": self.max_new_tokens,
            "temperature": 0,
        }
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    response = http.post("/v1/chat/completions", json=body)
                    ok = response.status_code == 200
                    version = response.headers.get(VERSION_HEADER) if ok else None
                except (httpx.HTTPError, ValueError):
                    ok, version = False, None
                self.samples[index].append(Sample(started, time.perf_counter(), ok, version))

    def finish(self) -> list[Sample]:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        return sorted((s for per in self.samples for s in per), key=lambda s: s.started)

    def count(self) -> int:
        return sum(len(per) for per in self.samples)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    deadline = time.monotonic() + args.duration_s + 180.0
    with tempfile.TemporaryDirectory(prefix="ratchet-swap-") as tmp:
        root = Path(tmp)
        checkpoints = random_tiny_checkpoints(root, max(2, min(args.swaps + 1, 4)))
        port = free_port()
        process = LocalServerProcess(
            host="127.0.0.1", port=port, logs_dir=root / "logs", device=args.device
        )
        target = LocalServingTarget(f"http://127.0.0.1:{port}", model=MODEL, process=process)
        try:
            target.deploy(checkpoints[0])  # starts the server on the first checkpoint
            load = Load(f"http://127.0.0.1:{port}", args.clients, args.max_new_tokens)
            load.start()
            swaps = _swap_under_load(args, target, load, checkpoints, deadline)
            samples = load.finish()
        finally:
            process.stop()
            target.close()
    return _summary(args, samples, swaps)


def _swap_under_load(
    args: argparse.Namespace,
    target: LocalServingTarget,
    load: Load,
    checkpoints: list[CheckpointRef],
    deadline: float,
) -> list[tuple[float, float, str]]:
    """Deploys spread over the load window: (called at, verified at, version) each."""
    window_start = time.perf_counter()
    gap = args.duration_s / (args.swaps + 1)
    swaps: list[tuple[float, float, str]] = []
    for index in range(args.swaps):
        _sleep_until(window_start + gap * (index + 1), deadline)
        checkpoint = checkpoints[(index + 1) % len(checkpoints)]
        called = time.perf_counter()
        outcome = target.deploy(checkpoint)
        swaps.append((called, time.perf_counter(), outcome.version))
        print(
            f"swap {index + 1}: serving {outcome.version[:12]} after "
            f"{outcome.latency_ms:.1f} ms ({load.count()} requests so far)",
            flush=True,
        )
    _sleep_until(window_start + args.duration_s, deadline)
    return swaps


def _sleep_until(moment: float, deadline: float) -> None:
    while time.perf_counter() < moment:
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark exceeded its hard deadline")
        time.sleep(0.01)


def _summary(
    args: argparse.Namespace, samples: list[Sample], swaps: list[tuple[float, float, str]]
) -> dict[str, Any]:
    latencies = [(s.ended - s.started) * 1000.0 for s in samples if s.ok]
    swap_ms = [(verified - called) * 1000.0 for called, verified, _ in swaps]
    first_new = []
    during = 0
    for called, verified, version in swaps:
        answered = [s.ended for s in samples if s.version == version and s.ended >= called]
        if answered:
            first_new.append((min(answered) - called) * 1000.0)
        during += sum(1 for s in samples if s.started < verified and s.ended > called)
    span = (samples[-1].ended - samples[0].started) if samples else 0.0
    return {
        "benchmark": "swap",
        "clients": args.clients,
        "duration_s": args.duration_s,
        "swaps": len(swaps),
        "model_parameters": GPT(GPTConfig()).num_parameters(),
        "swap_latency_ms": round(statistics.median(swap_ms), 3) if swap_ms else None,
        "swap_latency_ms_max": round(max(swap_ms), 3) if swap_ms else None,
        "first_new_response_ms": round(statistics.median(first_new), 3) if first_new else None,
        "requests_total": len(samples),
        "requests_failed": sum(1 for s in samples if not s.ok),
        "requests_during_swaps": during,
        "request_latency_ms_p50": percentile(latencies, 0.5),
        "request_latency_ms_p95": percentile(latencies, 0.95),
        "throughput_rps": round(len(samples) / span, 1) if span else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=12.0)
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    args = parser.parse_args(argv)
    if args.clients < 1 or args.swaps < 1 or args.duration_s <= 0:
        parser.error("--clients and --swaps must be >= 1 and --duration-s > 0")
    result = run(args)
    print(
        f"{result['requests_total']} requests, {result['requests_failed']} failed, "
        f"{result['requests_during_swaps']} during swaps; swap latency median "
        f"{result['swap_latency_ms']} ms, max {result['swap_latency_ms_max']} ms",
        flush=True,
    )
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0 if result["requests_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
