"""Capture gateway benchmark: what the gateway adds to an agent's call, and what it keeps.

1. **Added latency.** A stub upstream that answers at once (a streamed chat completion of a
   few chunks, with token ids and log-probs when asked, as ``ratchet serve`` and vLLM answer)
   so the figure is the gateway's own; ``--clients`` (64) concurrent streaming clients,
   each alternating a request to the stub directly and one through the gateway (interleaved
   in one run, so both see the same machine). ``added_p50_ms`` / ``added_p99_ms`` are the
   differences of the two latency distributions' quantiles (end to end, last byte);
   ``inside_p50_ms`` / ``inside_p99_ms`` are the gateway's own time per request measured
   inside it (``ratchet_gateway_overhead_seconds``, interpolated in its buckets).
2. **Nothing lost.** Every call the gateway answered (its ``X-Ratchet-Call-Id``) must be in
   Postgres once the spool drained: ``captured_lost`` (must be 0).
3. **Throughput on one core.** The gateway pinned to one CPU (``sched_setaffinity``), the
   clients all through it for ``--rps-seconds``: ``gateway_rps_one_core``.
4. **Time to first token.** ``--model smollm2`` (or ``tiny``, random weights, for a smoke
   run; ``none`` skips it): ``ratchet serve`` started as a user would, the same clients
   streaming greedy requests to it directly and through the gateway, pairs interleaved:
   ``ttft_ratio`` = median through / median direct.

The gateway runs as ``python -m services gateway`` (its own process, its own spool) over a
fresh Postgres of the benchmark's own. Prints readable lines, then one JSON line (last).

Usage: ``python benchmarks/gateway.py [--clients 64] [--requests 2000] [--model smollm2]``;
smoke: ``--clients 4 --requests 40 --rps-seconds 2 --model tiny --ttft-pairs 4``. Figures
depend on the machine and on what else runs on it: measure on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support import free_port, random_tiny_checkpoints, temporary_postgres  # noqa: E402
from services.db.migrate import upgrade  # noqa: E402
from services.db.queries.loops import LoopFields  # noqa: E402
from services.db.session import create_db_engine, make_session_factory  # noqa: E402
from services.ingest.provisioning import provision_loop  # noqa: E402
from services.secrets import SecretBox  # noqa: E402

MODEL = "bench"
SECRET_KEY = "YmVuY2gtc2VjcmV0LWtleS1yYXRjaGV0LTMyLWJ5dGU="
REQUEST = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


# The stub upstream ---------------------------------------------------------------------------


def _stub_chunks(token_ids: bool) -> bytes:
    out = []
    for index, piece in enumerate(("Hel", "lo", "!")):
        choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
        if token_ids:
            choice["token_ids"] = [index + 1]
            choice["logprobs"] = {"content": [{"token": piece, "logprob": -0.5}]}
        chunk = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": MODEL}
        out.append(b"data: " + json.dumps({**chunk, "choices": [choice]}).encode() + b"\n\n")
    last = {
        "id": "chatcmpl-stub",
        "model": MODEL,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
    out.append(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
    return b"".join(out)


async def stub_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An OpenAI-compatible upstream that answers every chat completion at once."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    asked = json.loads(body) if body else {}
    data = _stub_chunks(bool(asked.get("return_token_ids")))
    headers = [
        (b"content-type", b"text/event-stream"),
        (b"content-length", str(len(data)).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def run_stub(port: int) -> None:
    import uvicorn

    uvicorn.run(stub_app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# Processes -------------------------------------------------------------------------------


def wait_http(url: str, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer at {url}")


def start_gateway(
    database_url: str, serve_port: int, spool: Path, cpu: int | None
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RATCHET_DATABASE_URL": database_url,
        "RATCHET_STATE_DIR": str(spool.parent / "state"),
        "RATCHET_GATEWAY_PORT": str(port),
        "RATCHET_GATEWAY_SPOOL_DIR": str(spool),
        "RATCHET_SERVE_HOST": "127.0.0.1",
        "RATCHET_SERVE_PORT": str(serve_port),
        "RATCHET_LOG_LEVEL": "WARNING",
    }

    def pin() -> None:
        if cpu is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {cpu})

    process = subprocess.Popen(
        [sys.executable, "-m", "services", "gateway"],
        env=env,
        preexec_fn=pin,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", process, "the gateway")
    return process, url


def provision(database_url: str) -> str:
    """A loop served by the local serving target (the stub or ``ratchet serve``); its key."""
    upgrade(database_url)
    engine = create_db_engine(database_url, pool_size=1)
    try:
        with make_session_factory(engine).begin() as session:
            created = provision_loop(
                session,
                fields=LoopFields(
                    name="bench",
                    environment="toolcalc",
                    serving_target={"kind": "local", "model": MODEL},
                ),
                box=SecretBox.from_keys(SECRET_KEY),
            )
            return created.gateway_key
    finally:
        engine.dispose()


# Clients ---------------------------------------------------------------------------------


async def one(
    client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any]
) -> tuple[float, float, str | None]:
    """One streamed request: (seconds to the last byte, to the first content, call id)."""
    started = time.perf_counter()
    first = None
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        response.raise_for_status()
        async for chunk in response.aiter_raw():
            if first is None and b'"content"' in chunk:
                first = time.perf_counter() - started
        call_id = response.headers.get("x-ratchet-call-id")
    total = time.perf_counter() - started
    return total, first if first is not None else total, call_id


async def interleaved(
    targets: list[str], key: str, clients: int, requests: int, body: dict[str, Any]
) -> tuple[list[list[tuple[float, float]]], list[str]]:
    """``clients`` concurrent clients, each alternating between ``targets``; per target its
    (total, first-content) times, and the gateway's call ids."""
    times: list[list[tuple[float, float]]] = [[] for _ in targets]
    call_ids: list[str] = []
    per_client = max(requests // clients, len(targets))
    limits = httpx.Limits(max_connections=clients * len(targets) * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def run(index: int) -> None:
            for turn in range(per_client):
                which = (index + turn) % len(targets)
                total, first, call_id = await one(client, targets[which], key, body)
                times[which].append((total, first))
                if call_id:
                    call_ids.append(call_id)

        await asyncio.gather(*(run(i) for i in range(clients)))
    return times, call_ids


async def throughput(url: str, key: str, clients: int, seconds: float) -> tuple[float, list[str]]:
    call_ids: list[str] = []
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(
        timeout=600, limits=httpx.Limits(max_connections=clients * 2)
    ) as client:

        async def run() -> None:
            while time.perf_counter() < deadline:
                call_ids.append((await one(client, url, key, REQUEST))[2] or "")

        started = time.perf_counter()
        await asyncio.gather(*(run() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return len(call_ids) / elapsed, call_ids


# Figures ---------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def inside_quantiles(metrics: str) -> tuple[float | None, float | None]:
    """p50 and p99 of ``ratchet_gateway_overhead_seconds{route="chat"}``, interpolated."""
    buckets: list[tuple[float, float]] = []
    for line in metrics.splitlines():
        if line.startswith("ratchet_gateway_overhead_seconds_bucket") and 'route="chat"' in line:
            bound = line.split('le="')[1].split('"')[0]
            buckets.append(
                (float("inf") if bound == "+Inf" else float(bound), float(line.split()[-1]))
            )
    if not buckets or buckets[-1][1] == 0:
        return None, None
    total = buckets[-1][1]

    def at(q: float) -> float:
        previous_bound, previous_count = 0.0, 0.0
        for bound, count in buckets:
            if count >= q * total:
                if bound == float("inf"):
                    return previous_bound * 1000
                share = (q * total - previous_count) / max(count - previous_count, 1e-9)
                return (previous_bound + share * (bound - previous_bound)) * 1000
            previous_bound, previous_count = bound, count
        return previous_bound * 1000

    return round(at(0.5), 3), round(at(0.99), 3)


def lost(database_url: str, call_ids: list[str]) -> int:
    """Answered calls not in Postgres after the spool drained (waits up to a minute)."""
    wanted = {c for c in call_ids if c}
    deadline = time.monotonic() + 60
    while True:
        with psycopg.connect(database_url) as conn:
            stored = {row[0] for row in conn.execute("SELECT call_id FROM gateway_calls")}
        missing = len(wanted - stored)
        if missing == 0 or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def ttft(args: argparse.Namespace, database_url: str, key: str, tmp: Path) -> float | None:
    """Time to first token through the gateway over directly, against ``ratchet serve``."""
    if args.model == "none":
        return None
    from benchmarks.serving import smollm2_checkpoints, start_server

    if args.model == "smollm2":
        checkpoint = Path(
            smollm2_checkpoints(tmp, Path(args.cache).expanduser(), 0)[0].uri.removeprefix(
                "file://"
            )
        )
    else:
        checkpoint = Path(random_tiny_checkpoints(tmp / "tiny", 1)[0].uri.removeprefix("file://"))
    serve_args = argparse.Namespace(device="cpu", max_batch_rows=64, threads=args.threads)
    import benchmarks.serving as serving

    serving.MODEL_NAME = MODEL
    server, serve_url = start_server(checkpoint, serve_args, tmp / "serve.log", [checkpoint.parent])
    gateway, gateway_url = start_gateway(
        database_url, int(serve_url.rsplit(":", 1)[1]), tmp / "spool-ttft", None
    )
    try:
        body = {
            **REQUEST,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        times, _ = asyncio.run(
            interleaved([serve_url, gateway_url], key, args.clients, args.ttft_pairs * 2, body)
        )
        direct = statistics.median(first for _, first in times[0])
        through = statistics.median(first for _, first in times[1])
        print(f"ttft: direct {direct * 1000:.1f} ms, through the gateway {through * 1000:.1f} ms")
        return round(through / direct, 4)
    finally:
        stop(gateway)
        stop(server)


def main(args: argparse.Namespace) -> dict[str, Any]:
    with temporary_postgres("ratchet-bench-gateway-") as (server, tmp):
        with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE ratchet_bench")
        database_url = server.get_uri("ratchet_bench")
        key = provision(database_url)
        stub_port = free_port()
        stub = subprocess.Popen([sys.executable, __file__, "--stub", str(stub_port)])
        wait_http(f"http://127.0.0.1:{stub_port}/", stub, "the stub upstream")
        cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        gateway, gateway_url = start_gateway(database_url, stub_port, tmp / "spool", cpu)
        try:
            stub_url = f"http://127.0.0.1:{stub_port}"
            asyncio.run(
                interleaved([stub_url, gateway_url], key, args.clients, args.clients * 2, REQUEST)
            )
            times, call_ids = asyncio.run(
                interleaved([stub_url, gateway_url], key, args.clients, args.requests, REQUEST)
            )
            direct = [total for total, _ in times[0]]
            through = [total for total, _ in times[1]]
            inside = inside_quantiles(httpx.get(f"{gateway_url}/metrics", timeout=10).text)
            rps, more_ids = asyncio.run(
                throughput(gateway_url, key, args.clients, args.rps_seconds)
            )
            captured_lost = lost(database_url, call_ids + more_ids)
        finally:
            stop(gateway)
            stop(stub)
        ratio = ttft(args, database_url, key, tmp)
    result = {
        "clients": args.clients,
        "requests": len(through) * 2,
        "direct_p50_ms": round(quantile(direct, 0.5) * 1000, 3),
        "through_p50_ms": round(quantile(through, 0.5) * 1000, 3),
        "added_p50_ms": round((quantile(through, 0.5) - quantile(direct, 0.5)) * 1000, 3),
        "added_p99_ms": round((quantile(through, 0.99) - quantile(direct, 0.99)) * 1000, 3),
        "inside_p50_ms": inside[0],
        "inside_p99_ms": inside[1],
        "captured_lost": captured_lost,
        "gateway_rps_one_core": round(rps, 1),
        "ttft_ratio": ratio,
        "model": args.model,
    }
    print(
        f"added latency: p50 {result['added_p50_ms']} ms, p99 {result['added_p99_ms']} ms "
        f"(inside the gateway: p50 {inside[0]} ms, p99 {inside[1]} ms); "
        f"{result['gateway_rps_one_core']} requests/s on one core; lost {captured_lost}"
    )
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000, help="requests, both targets")
    parser.add_argument("--rps-seconds", type=float, default=10.0)
    parser.add_argument("--model", choices=("smollm2", "tiny", "none"), default="smollm2")
    parser.add_argument("--ttft-pairs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="ratchet serve's threads")
    parser.add_argument("--cache", default="~/.cache/ratchet/smollm2")
    parser.add_argument("--stub", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    if arguments.stub is not None:
        run_stub(arguments.stub)
    else:
        print(json.dumps(main(arguments)))
