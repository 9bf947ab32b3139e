"""Ingest throughput and latency over loopback, against the ceiling of a plain COPY.

Starts its own Postgres (pgserver, in a temp dir) and the api (`python -m services api` in a
subprocess), creates a loop, then measures, each for a fixed time:

  (a) single signed traces from 32 concurrent clients (keep-alive connections);
  (b) signed batches of 100 traces from 8 concurrent clients;
  (c) a plain psycopg COPY of the same rows into the same tables (traces and their bodies):
      the ceiling (the median of
      --copy-runs runs; one run varies by +-30% even on a quiet machine).

The load generator is a minimal HTTP/1.1 client over asyncio streams in separate processes
(httpx would cost more CPU than the server it measures). Progress goes to stderr; the last
line on stdout is one JSON object. Everything runs on this one machine: client, api and
Postgres share its CPUs, so the figures are a floor for a real deployment. Each phase also
reports the CPU time per trace of the api, Postgres and the clients, and the share of the
machine that other processes used meanwhile (on a shared machine, figures taken while it is
high measure the neighbours, not Ratchet).

With no flags it measures what a user runs: the api with its default ``RATCHET_API_WORKERS``
(the usable cores of this machine, affinity and cgroup quota respected; the JSON's
``api_workers`` says how many that was). ``--api-workers N`` pins the count instead.

Usage: .venv/bin/python benchmarks/ingest.py [--seconds 15] [--api-workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import hashlib
import hmac
import json
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.support import api_over_loop, copy_traces  # noqa: E402
from services.ingest.schema import validate_trace  # noqa: E402
from services.ingest.signature import secret_key  # noqa: E402

LOOP = "bench"


def log(message: str) -> None:
    print(f"[ingest-bench] {message}", file=sys.stderr, flush=True)


def trace_document(external_id: str) -> dict[str, Any]:
    """A realistic small episode (~1.3 KB): tools, five messages, a failed outcome."""
    return {
        "schema": "ratchet.trace/v1",
        "external_id": external_id,
        "model_version": "champion-3",
        "started_at": "2026-01-02T03:04:05Z",
        "ended_at": "2026-01-02T03:04:07Z",
        "tools": [
            {
                "name": "plus",
                "description": "add two integers",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            }
        ],
        "messages": [
            {"role": "system", "content": "tools: +plus(a,b) *times(a,b) $price(item)"},
            {"role": "user", "content": "what do 3 apples and 2 pears cost together?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "name": "add", "arguments": {"a": 3, "b": 2}}],
            },
            {"role": "tool", "content": "error: unknown tool add", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "answer: 5"},
        ],
        "outcome": {
            "success": False,
            "score": 0.1,
            "error": {"kind": "unknown_tool", "message": "answer was not accepted"},
        },
        "reference_answer": None,
        "metadata": {"environment": "toolcalc", "api_version": "v2", "region": "eu-west-1"},
    }


# Load generator (runs in child processes) ---------------------------------------------------


class Signer:
    """Builds signed requests quickly: the body is a template with the ids spliced in."""

    def __init__(self, port: int, secret: str, batch: int, prefix: str) -> None:
        self.key = secret_key(secret)
        self.batch = batch
        self.prefix = prefix
        self.counter = 0
        template = json.dumps(trace_document("@@ID@@"), separators=(",", ":"))
        self.head, self.tail = template.encode().split(b"@@ID@@")
        self.request_line = f"POST /v1/loops/{LOOP}/traces HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"

    def _trace(self) -> bytes:
        self.counter += 1
        return self.head + f"{self.prefix}-{self.counter}".encode() + self.tail

    def request(self) -> bytes:
        if self.batch == 1:
            body = self._trace()
        else:
            body = b'{"traces":[' + b",".join(self._trace() for _ in range(self.batch)) + b"]}"
        msg_id = f"msg_{self.prefix}_{self.counter}"
        timestamp = int(time.time())
        digest = hmac.new(
            self.key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256
        ).digest()
        headers = (
            f"{self.request_line}content-type: application/json\r\n"
            f"content-length: {len(body)}\r\nwebhook-id: {msg_id}\r\n"
            f"webhook-timestamp: {timestamp}\r\n"
            f"webhook-signature: v1,{base64.b64encode(digest).decode()}\r\n\r\n"
        )
        return headers.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def _connection(
    port: int, signer: Signer, deadline: float, latencies: list[float], statuses: dict[int, int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            request = signer.request()
            started = time.perf_counter()
            writer.write(request)
            status = await _read_response(reader)
            latencies.append(time.perf_counter() - started)
            statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()


def load_worker(
    port: int, secret: str, batch: int, connections: int, start_at: float, seconds: float, out: Any
) -> None:
    """One client process: ``connections`` keep-alive connections until the deadline."""

    async def main() -> tuple[list[float], dict[int, int]]:
        latencies: list[float] = []
        statuses: dict[int, int] = {}
        prefix = uuid.uuid4().hex[:8]
        signers = [Signer(port, secret, batch, f"{prefix}{n}") for n in range(connections)]
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = time.perf_counter() + seconds
        await asyncio.gather(
            *(_connection(port, s, deadline, latencies, statuses) for s in signers)
        )
        return latencies, statuses

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    cpu_before = sum(os.times()[:2])
    latencies, statuses = asyncio.run(main())
    out.send((latencies, statuses, sum(os.times()[:2]) - cpu_before))
    out.close()


def run_load(
    port: int, secret: str, *, batch: int, clients: int, processes: int, seconds: float
) -> dict[str, float]:
    start_at = time.time() + 1.0
    pipes, workers = [], []
    context = multiprocessing.get_context("fork")
    for n in range(processes):
        receiver, sender = context.Pipe(duplex=False)
        share = clients // processes + (1 if n < clients % processes else 0)
        worker = context.Process(
            target=load_worker, args=(port, secret, batch, share, start_at, seconds, sender)
        )
        worker.start()
        pipes.append(receiver)
        workers.append(worker)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    client_cpu_s = 0.0
    for receiver in pipes:
        worker_latencies, worker_statuses, worker_cpu_s = receiver.recv()
        client_cpu_s += worker_cpu_s
        latencies += worker_latencies
        for status, count in worker_statuses.items():
            statuses[status] = statuses.get(status, 0) + count
    for worker in workers:
        worker.join()
    ok_requests = statuses.get(200, 0)
    latencies.sort()

    def percentile(p: float) -> float:
        return (
            latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000 if latencies else 0.0
        )

    return {
        "per_s": ok_requests * batch / seconds,
        "requests_per_s": ok_requests / seconds,
        "p50_ms": percentile(0.50),
        "p99_ms": percentile(0.99),
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else 0.0,
        "non_200": sum(c for s, c in statuses.items() if s != 200),
        "requests": len(latencies),
        "client_cpu_s": client_cpu_s,
    }


# Setup --------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int | None) -> float:
    """CPU seconds of a process and all its live descendants (api workers, Postgres backends)."""
    if root is None:
        return 0.0
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        try:
            total += cpu_seconds(pid)
        except OSError:
            continue
        stack.extend(children.get(pid, []))
    return total


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all processes, ours and others')."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measure_phase(
    port: int,
    secret: str,
    api_pid: int,
    postmaster: int | None,
    *,
    batch: int,
    clients: int,
    args: argparse.Namespace,
) -> dict[str, float]:
    """One load phase, with the CPU time per trace of the api, Postgres and the clients.

    ``other_cpu_share`` is the share of the machine's CPUs used by processes outside the
    benchmark (other jobs on a shared machine) during the phase.
    """
    api_before, pg_before = tree_cpu_seconds(api_pid), tree_cpu_seconds(postmaster)
    busy_before, wall_before = machine_busy_seconds(), time.monotonic()
    result = run_load(
        port,
        secret,
        batch=batch,
        clients=clients,
        processes=args.client_processes,
        seconds=args.seconds,
    )
    traces = max(1.0, result["per_s"] * args.seconds)
    api_s = tree_cpu_seconds(api_pid) - api_before
    pg_s = tree_cpu_seconds(postmaster) - pg_before
    busy_s = machine_busy_seconds() - busy_before
    wall_s = time.monotonic() - wall_before
    own_s = api_s + pg_s + result["client_cpu_s"]
    result["api_cpu_ms"] = api_s * 1000 / traces
    result["pg_cpu_ms"] = pg_s * 1000 / traces
    result["client_cpu_ms"] = result["client_cpu_s"] * 1000 / traces
    result["other_cpu_share"] = max(0.0, busy_s - own_s) / (wall_s * (os.cpu_count() or 1))
    result["load_average_1m"] = os.getloadavg()[0]
    return result


def default_api_workers() -> int:
    """What the api's ``RATCHET_API_WORKERS`` defaults to on this machine."""
    from services.settings import Settings

    return Settings.model_fields["api_workers"].get_default(call_default_factory=True)


def api_environment(workers: int | None) -> dict[str, str]:
    """The api's environment as ``ratchet api`` gets it; ``workers`` None leaves its default."""
    env = {key: value for key, value in os.environ.items() if key != "RATCHET_API_WORKERS"}
    if workers is not None:
        env["RATCHET_API_WORKERS"] = str(workers)
    return env


def copy_ceiling(database_url: str, loop_id: int, rows: int, run: int = 0) -> float:
    """Rows per second of a plain COPY of the same traces into the same table."""
    stored = validate_trace(trace_document("template"))
    values = [
        (
            loop_id,
            f"copy-{run}-{n}",
            "webhook",
            stored.model_version,
            stored.success,
            stored.score,
            stored.error_kind,
            stored.body_json,
            stored.size_bytes,
            stored.started_at,
            stored.ended_at,
        )
        for n in range(rows)
    ]
    with psycopg.connect(database_url) as conn:
        started = time.perf_counter()
        now = dt.datetime.now(dt.UTC)
        copy_traces(conn, values, [now] * len(values))
        conn.commit()
        return rows / (time.perf_counter() - started)


def phase_figures(name: str, phase: dict[str, float]) -> dict[str, float]:
    """One phase's figures for the JSON line, each key prefixed with the phase's name."""
    return {
        f"{name}_per_s": round(phase["per_s"], 1),
        f"{name}_p50_ms": round(phase["p50_ms"], 2),
        f"{name}_p99_ms": round(phase["p99_ms"], 2),
        f"{name}_non_200": phase["non_200"],
        f"{name}_api_cpu_ms_per_trace": round(phase["api_cpu_ms"], 3),
        f"{name}_pg_cpu_ms_per_trace": round(phase["pg_cpu_ms"], 3),
        f"{name}_client_cpu_ms_per_trace": round(phase["client_cpu_ms"], 3),
        f"{name}_other_cpu_share": round(phase["other_cpu_share"], 2),
        f"{name}_load_average_1m": round(phase["load_average_1m"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="duration of each load phase")
    parser.add_argument("--copy-rows", type=int, default=50_000)
    parser.add_argument(
        "--copy-runs", type=int, default=3, help="COPY runs; the ceiling is their median"
    )
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument(
        "--api-workers",
        type=int,
        default=None,
        help="RATCHET_API_WORKERS of the api under test (default: the api's own default, "
        "the usable cores)",
    )
    args = parser.parse_args()

    log("starting Postgres (pgserver) and the api")
    with api_over_loop("ratchet-bench-", LOOP, api_environment(args.api_workers)) as stack:
        loop_id, secret, port = stack.loop.loop.id, stack.loop.signing_secret, stack.port
        api_pid, postmaster = stack.process.pid, stack.server.get_pid()
        log(f"the api is on {stack.url}")
        cpus = os.cpu_count() or 1
        log(f"(a) single signed traces, 32 clients, {args.seconds:.0f} s ({cpus} CPUs shared)")
        single = measure_phase(port, secret, api_pid, postmaster, batch=1, clients=32, args=args)
        log(f"    {single['per_s']:.0f} traces/s, p99 {single['p99_ms']:.1f} ms")
        log(f"(b) batches of 100, 8 clients, {args.seconds:.0f} s")
        batch = measure_phase(port, secret, api_pid, postmaster, batch=100, clients=8, args=args)
        log(f"    {batch['per_s']:.0f} traces/s, p99 {batch['p99_ms']:.1f} ms")
        stack.stop_api()
        log(f"(c) plain COPY of {args.copy_rows} rows, {args.copy_runs} times")
        copy_runs = [
            copy_ceiling(stack.database_url, loop_id, args.copy_rows, run)
            for run in range(args.copy_runs)
        ]
        copy_per_s = statistics.median(copy_runs)
        log(f"    {', '.join(f'{r:.0f}' for r in copy_runs)} rows/s")

    result = {
        **phase_figures("single", single),
        **phase_figures("batch", batch),
        "copy_per_s": round(copy_per_s, 1),
        "copy_runs_per_s": [round(r) for r in copy_runs],
        "batch_vs_copy": round(batch["per_s"] / copy_per_s, 3) if copy_per_s else None,
        "api_workers": args.api_workers or default_api_workers(),
        "seconds_per_phase": args.seconds,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    from services.local.stack import stop_children_on_signals

    with stop_children_on_signals():  # SIGTERM (timeout, CI) stops its Postgres and api too
        main()
