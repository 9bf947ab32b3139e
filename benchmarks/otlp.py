"""OTLP ingest: episodes per second as exporters really send them, and decode memory per byte.

Starts its own Postgres (pgserver, in a temp dir) and the api (`python -m services api` in a
subprocess), creates a loop, builds GenAI episodes with the real OpenTelemetry SDK (an
``invoke_agent`` span, two ``chat`` spans with messages, one ``execute_tool`` span: 4 spans,
~2.6 KB of protobuf), then measures, each for a fixed time:

  (a) batch: exports of 25 whole episodes (100 spans, what a BatchSpanProcessor or a
      Collector sends) from 4 concurrent clients;
  (b) simple: every span its own export, children first (a SimpleSpanProcessor), episodes
      from 8 concurrent clients; every span waits in Postgres until its agent span arrives;
  (c) memory, in this process: the peak Python allocation (tracemalloc) of decoding one export
      (services.ingest.otlp.read_spans) per byte of body, for the batch export of (a) and for
      a hostile body of the maximum size packed with tiny attributes.

Progress goes to stderr; the last line on stdout is one JSON object. Client, api and Postgres
share this machine's CPUs, so on a shared machine the figures measure the neighbours too
(``load_average_1m`` is printed with them).

Usage: .venv/bin/python benchmarks/otlp.py [--seconds 10] [--api-repo PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from benchmarks.support import api_over_loop  # noqa: E402
from services.ingest.otlp import Limits, decode_export, read_spans  # noqa: E402

LOOP = "otlp-bench"
PROTOBUF = {"content-type": "application/x-protobuf"}


def log(message: str) -> None:
    print(f"[otlp-bench] {message}", file=sys.stderr, flush=True)


def episodes(count: int) -> list[list[ReadableSpan]]:
    """``count`` episodes, each its spans in the order they ended (the agent span last)."""
    recorder = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(recorder))
    tracer = provider.get_tracer("bench")
    user = {"role": "user", "parts": [{"type": "text", "content": "What is 2+3? " * 8}]}
    call = {
        "role": "assistant",
        "parts": [{"type": "tool_call", "id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}}],
    }
    result = {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": 5}]}
    final = {"role": "assistant", "parts": [{"type": "text", "content": "5"}]}
    out: list[list[ReadableSpan]] = []
    for _ in range(count):
        recorder.clear()
        with tracer.start_as_current_span(
            "invoke_agent bench", attributes={"gen_ai.operation.name": "invoke_agent"}
        ):
            with tracer.start_as_current_span(
                "chat m",
                attributes={
                    "gen_ai.operation.name": "chat",
                    "gen_ai.request.model": "m",
                    "gen_ai.input.messages": json.dumps([user]),
                    "gen_ai.output.messages": json.dumps([call]),
                },
            ):
                pass
            with tracer.start_as_current_span(
                "execute_tool add",
                attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "add"},
            ):
                pass
            with tracer.start_as_current_span(
                "chat m",
                attributes={
                    "gen_ai.operation.name": "chat",
                    "gen_ai.input.messages": json.dumps([user, call, result]),
                    "gen_ai.output.messages": json.dumps([final]),
                },
            ):
                pass
        out.append(list(recorder.get_finished_spans()))
    provider.shutdown()
    return out


async def _clients(
    url: str,
    token: str,
    jobs: list[list[bytes]],
    clients: int,
    seconds: float,
) -> dict[str, Any]:
    """Each job is a sequence of exports sent one after the other (one episode, or one
    batch); ``clients`` jobs run at once, for ``seconds``."""
    headers = {**PROTOBUF, "authorization": f"Bearer {token}"}
    latencies: list[float] = []
    failures = 0
    done_jobs = 0
    deadline = time.monotonic() + seconds
    queue = iter(jobs)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures, done_jobs
        while time.monotonic() < deadline:
            job = next(queue, None)
            if job is None:
                return
            for body in job:
                started = time.perf_counter()
                response = await http.post(f"{url}/otlp/v1/traces", content=body, headers=headers)
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    failures += 1
            done_jobs += 1

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    elapsed = time.monotonic() - started
    latencies.sort()
    return {
        "jobs": done_jobs,
        "exports": len(latencies),
        "seconds": elapsed,
        "non_200": failures,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
    }


def stored_traces(database_url: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT count(*) FROM traces").fetchone()
        return int(row[0]) if row else 0


def decode_peak_per_byte(body: bytes, limits: Limits) -> tuple[float, int]:
    tracemalloc.start()
    read_spans(decode_export(body, ExportTraceServiceRequest, protobuf=True), limits)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / len(body), peak


def hostile_body(size: int) -> bytes:
    """One span per trace id is cheap; one span with as many tiny attributes as fit is not."""
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    number = 0
    while request.ByteSize() < size - 4096:
        span = scope.spans.add()
        span.trace_id = (number % 400).to_bytes(16, "big")
        span.span_id = (number + 1).to_bytes(8, "big")
        span.name = "chat"
        for k in range(500):
            attribute = span.attributes.add()
            attribute.key = f"k{k}"
            attribute.value.int_value = k
        number += 1
    return request.SerializeToString()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each phase")
    parser.add_argument(
        "--api-repo",
        type=Path,
        default=REPO,
        help="run the api from this checkout (to compare commits; migrations are this one's)",
    )
    args = parser.parse_args()

    log("building episodes with the OpenTelemetry SDK")
    pool = episodes(6_000)
    batch_jobs = [
        [encode_spans([s for e in pool[i : i + 25] for s in e]).SerializeToString()]
        for i in range(0, 3_000, 25)
    ]
    simple_jobs = [[encode_spans([span]).SerializeToString() for span in e] for e in pool[3_000:]]
    limits = Limits(max_traces=500, max_spans=10_000, max_attribute_bytes=1 << 20)

    log("starting Postgres (pgserver) and the api")
    repo = args.api_repo.resolve()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    with api_over_loop("ratchet-otlp-bench-", LOOP, env, repo=repo) as stack:
        token, database_url = stack.loop.ingest_token, stack.database_url
        log(f"(a) batches of 25 episodes, 4 clients, {args.seconds:.0f} s")
        before = stored_traces(database_url)
        batch = asyncio.run(_clients(stack.url, token, batch_jobs, 4, args.seconds))
        batch_traces = stored_traces(database_url) - before
        log(f"    {batch_traces / batch['seconds']:.0f} episodes/s")
        log(f"(b) one span per export, 8 clients, {args.seconds:.0f} s")
        before = stored_traces(database_url)
        simple = asyncio.run(_clients(stack.url, token, simple_jobs, 8, args.seconds))
        simple_traces = stored_traces(database_url) - before
        log(f"    {simple_traces / simple['seconds']:.0f} episodes/s")

    log("(c) decode memory")
    typical_per_byte, _ = decode_peak_per_byte(batch_jobs[0][0], limits)
    hostile = hostile_body(5 * 1024 * 1024)
    hostile_per_byte, hostile_peak = decode_peak_per_byte(hostile, limits)
    result = {
        "batch_episodes_per_s": round(batch_traces / batch["seconds"], 1),
        "batch_spans_per_s": round(4 * batch_traces / batch["seconds"], 1),
        "batch_exports": batch["exports"],
        "batch_p50_ms": round(batch["p50_ms"] or 0, 2),
        "batch_p99_ms": round(batch["p99_ms"] or 0, 2),
        "batch_non_200": batch["non_200"],
        "simple_episodes_per_s": round(simple_traces / simple["seconds"], 1),
        "simple_exports_per_s": round(simple["exports"] / simple["seconds"], 1),
        "simple_p50_ms": round(simple["p50_ms"] or 0, 2),
        "simple_p99_ms": round(simple["p99_ms"] or 0, 2),
        "simple_non_200": simple["non_200"],
        "decode_peak_bytes_per_body_byte_typical": round(typical_per_byte, 1),
        "decode_peak_bytes_per_body_byte_hostile": round(hostile_per_byte, 1),
        "decode_peak_mib_hostile_5mib": round(hostile_peak / (1 << 20), 1),
        "seconds_per_phase": args.seconds,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
