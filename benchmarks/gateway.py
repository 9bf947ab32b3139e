"""Capture gateway benchmark: what the gateway adds to an agent's call, and what it keeps.

1. **Added latency.** A stub upstream that answers at once (a streamed chat completion of a
   few chunks, with token ids and log-probs when asked, as ``ratchet serve`` and vLLM answer)
   so the figure is the gateway's own; ``--clients`` (64) concurrent streaming clients, each
   alternating a request to the stub directly and one through the gateway (interleaved in one
   run, so both see the same machine). Each client's requests go in pairs, one direct and
   one through the gateway, adjacent in time (which goes first alternates between clients):
   ``added_p50_ms`` / ``added_p99_ms`` are quantiles of the per-pair differences (through
   minus direct, end to end to the last byte), so a pair shares the load it ran under. The
   difference of the two latency distributions' quantiles, the figure reported before
   (unsound at the tail: the two tails need not come from the same moments), is kept as
   ``quantile_added_p50_ms`` / ``quantile_added_p99_ms``. ``inside_p50_ms`` /
   ``inside_p99_ms`` are the gateway's own time per request measured inside it
   (``ratchet_gateway_overhead_seconds``, interpolated in its buckets): wall time less the
   wait on the upstream, so under load it includes waiting for the event loop.
   With ``--think-ms`` each client pauses that long on average between its pairs, as an
   agent does between calls (the default, 0, keeps the gateway at its capacity: then the
   added latency at many clients is mostly the queue in front of it).
2. **Low concurrency.** The same pairs with ``--low-clients`` (1) clients:
   ``added_p50_ms_low`` / ``added_p99_ms_low`` (no queueing: the per-request cost).
3. **Nothing lost.** Every call the gateway answered (its ``X-Ratchet-Call-Id``) must be in
   Postgres once the spool drained: ``captured_lost`` (must be 0).
4. **Throughput on one core.** The gateway pinned to one CPU (``sched_setaffinity``), the
   clients all through it for ``--rps-seconds``: ``gateway_rps_one_core``, and the gateway
   process's CPU time (user and system) per request, ``gateway_cpu_ms_per_request``, from
   the run's start until its calls are stored and placed into sessions (the writer's and the
   assembler's share included). Other work on the machine (the clients, the stub, which
   may run on the same CPU) changes the requests/s; it changes the CPU time far less.
5. **Time to first token.** ``--model smollm2`` (or ``tiny``, random weights, for a smoke
   run; ``none`` skips it): ``ratchet serve`` started as a user would, the same clients
   streaming greedy requests to it directly and through the gateway, pairs interleaved:
   ``ttft_ratio`` = median through / median direct (to the first chunk with text, not
   the opening chunk with the role, which ``ratchet serve`` sends before it samples),
   ``ttft_added_p50_ms`` the median per-pair difference; then with ``--low-clients``
   clients (``ttft_ratio_low``, ``ttft_added_p50_ms_low``), which tells queueing behind a
   batch (the ratio falls at low concurrency) from a cost per request (it does not).

``--py-spy FILE`` samples the gateway process with py-spy (``pip install py-spy``) from the
first measured request to the end of the throughput run, the thread holding the GIL only
(``--gil``: the process's Python work, which its event loop waits for), writes its collapsed
stacks to FILE and prints the functions that took the most samples (their own and with
callees) and each thread's share.

The clients speak HTTP through the gateway's own client (services.gateway.upstream), not
httpx: httpx's pool costs more per request the more connections it holds, and 64 clients
with it took more CPU than the gateway they were measuring.

The gateway runs as ``python -m services gateway`` (its own process, its own spool) over a
fresh Postgres of the benchmark's own. Prints readable lines, then one JSON line (last).

Usage: ``python benchmarks/gateway.py [--clients 64] [--requests 2000] [--model smollm2]``;
smoke: ``--clients 4 --requests 40 --low-requests 20 --rps-seconds 2 --model tiny
--ttft-pairs 4``. Figures depend on the machine and on what else runs on it: measure on a
quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support import free_port, random_tiny_checkpoints, temporary_postgres  # noqa: E402
from services.db.migrate import upgrade  # noqa: E402
from services.db.queries.loops import LoopFields  # noqa: E402
from services.db.session import create_db_engine, make_session_factory  # noqa: E402
from services.gateway.forward import split_events  # noqa: E402
from services.gateway.upstream import UpstreamClient  # noqa: E402
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
    client: UpstreamClient, url: str, key: str, body: bytes
) -> tuple[float, float, str | None]:
    """One streamed request: (seconds to the last byte, to the first text, call id)."""
    started = time.perf_counter()
    first = None
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    response = await client.request(
        "POST", f"{url}/v1/chat/completions", body=body, headers=headers
    )
    try:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {await response.read()!r}")
        buffer = b""
        async for chunk in response.chunks():
            if first is None:
                payloads, buffer = split_events(buffer + chunk)
                if any(has_text(payload) for payload in payloads):
                    first = time.perf_counter() - started
        call_id = response.headers.get("x-ratchet-call-id")
    finally:
        await response.aclose()
    total = time.perf_counter() - started
    return total, first if first is not None else total, call_id


def has_text(payload: bytes) -> bool:
    """Whether a streamed chunk carries text: the first token, not the opening chunk that
    ``ratchet serve`` sends with the role and empty content before it samples anything."""
    try:
        chunk = json.loads(payload)
    except ValueError:
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content") or choices[0].get("text"))


def load_client(clients: int) -> UpstreamClient:
    """The clients' HTTP client: the gateway's own (services.gateway.upstream), lighter than
    httpx, whose pool's cost per request grows with the connections it holds: with httpx
    the 64 clients took more CPU than the gateway they measure."""
    return UpstreamClient(timeout_s=600, max_connections=clients * 4)


@dataclass(frozen=True)
class Timing:
    """One request of an interleaved run: which client sent it, its turn, its target (0
    direct, 1 through the gateway), seconds to the last byte and to the first text."""

    client: int
    turn: int
    target: int
    total: float
    first: float


async def interleaved(
    targets: list[str],
    key: str,
    clients: int,
    requests: int,
    body: dict[str, Any],
    think_s: float = 0.0,
) -> tuple[list[Timing], list[str]]:
    """``clients`` concurrent clients, each alternating between ``targets`` (the first target
    alternates between clients) and pausing ``think_s`` on average (uniformly 0 to twice
    that, so the clients do not move in step) after each pair; every request's timing, and
    the gateway's call ids."""
    timings: list[Timing] = []
    call_ids: list[str] = []
    per_client = max(requests // clients, len(targets))
    per_client += -per_client % len(targets)  # whole pairs
    client, data = load_client(clients), json.dumps(body).encode()

    async def run(index: int) -> None:
        pauses = random.Random(index)
        for turn in range(per_client):
            if think_s and turn % len(targets) == 0:
                await asyncio.sleep(pauses.uniform(0, 2 * think_s))
            which = (index + turn) % len(targets)
            total, first, call_id = await one(client, targets[which], key, data)
            timings.append(Timing(index, turn, which, total, first))
            if call_id:
                call_ids.append(call_id)

    try:
        await asyncio.gather(*(run(i) for i in range(clients)))
    finally:
        await client.aclose()
    return timings, call_ids


def pair_differences(timings: list[Timing], *, first: bool = False) -> list[float]:
    """Per pair (one client's turns 2k and 2k+1: one direct, one through the gateway), the
    gateway's time less the direct one, to the last byte (or to the first text)."""
    pairs: dict[tuple[int, int], dict[int, float]] = {}
    for timing in timings:
        pairs.setdefault((timing.client, timing.turn // 2), {})[timing.target] = (
            timing.first if first else timing.total
        )
    return [pair[1] - pair[0] for pair in pairs.values() if len(pair) == 2]


def of_target(timings: list[Timing], target: int, *, first: bool = False) -> list[float]:
    return [t.first if first else t.total for t in timings if t.target == target]


async def throughput(url: str, key: str, clients: int, seconds: float) -> tuple[float, list[str]]:
    """Requests/s through the gateway, and the call ids."""
    call_ids: list[str] = []
    client, data = load_client(clients), json.dumps(REQUEST).encode()
    deadline = time.perf_counter() + seconds

    async def run() -> None:
        while time.perf_counter() < deadline:
            call_ids.append((await one(client, url, key, data))[2] or "")

    started = time.perf_counter()
    try:
        await asyncio.gather(*(run() for _ in range(clients)))
    finally:
        await client.aclose()
    return len(call_ids) / (time.perf_counter() - started), call_ids


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far, user and system."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


# Figures ---------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Buckets = list[tuple[float, float]]


def overhead_buckets(metrics: str) -> Buckets:
    """The cumulative buckets of ``ratchet_gateway_overhead_seconds{route="chat"}``."""
    buckets: Buckets = []
    for line in metrics.splitlines():
        if line.startswith("ratchet_gateway_overhead_seconds_bucket") and 'route="chat"' in line:
            bound = line.split('le="')[1].split('"')[0]
            buckets.append(
                (float("inf") if bound == "+Inf" else float(bound), float(line.split()[-1]))
            )
    return buckets


def inside_quantiles(before: Buckets, after: Buckets) -> tuple[float | None, float | None]:
    """p50 and p99 (ms) of the requests observed between two readings of the buckets,
    interpolated in their bucket."""
    earlier = dict(before)
    buckets = [(bound, count - earlier.get(bound, 0.0)) for bound, count in after]
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


def read_buckets(gateway_url: str) -> Buckets:
    return overhead_buckets(httpx.get(f"{gateway_url}/metrics", timeout=10).text)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def settled(database_url: str, call_ids: list[str]) -> int:
    """Answered calls not in Postgres once the spool drained (waits up to a minute); then
    waits (up to a minute again) for the gateway's assembler to place every stored call into
    a session, so the gateway's background work for them is done."""
    wanted = {c for c in call_ids if c}
    missing = len(wanted)
    for step in ("stored", "placed"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with psycopg.connect(database_url) as conn:
                if step == "stored":
                    rows = conn.execute("SELECT call_id FROM gateway_calls").fetchall()
                    missing = len(wanted - {row[0] for row in rows})
                    done = missing == 0
                else:
                    found = conn.execute(
                        "SELECT count(*) FROM gateway_calls WHERE session_id IS NULL"
                    ).fetchone()
                    done = found is None or found[0] == 0
            if done:
                break
            time.sleep(0.2)
    return missing


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def ttft(args: argparse.Namespace, database_url: str, key: str, tmp: Path) -> dict[str, Any]:
    """Time to first token through the gateway over directly, against ``ratchet serve``, at
    ``--clients`` and at ``--low-clients``."""
    if args.model == "none":
        return {}
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
    body = {
        **REQUEST,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    figures: dict[str, Any] = {}
    try:
        for clients, suffix in ((args.clients, ""), (args.low_clients, "_low")):
            timings, _ = asyncio.run(
                interleaved([serve_url, gateway_url], key, clients, args.ttft_pairs * 2, body)
            )
            direct = statistics.median(of_target(timings, 0, first=True))
            through = statistics.median(of_target(timings, 1, first=True))
            added = statistics.median(pair_differences(timings, first=True))
            print(
                f"ttft, {clients} clients: direct {direct * 1000:.1f} ms, through the gateway "
                f"{through * 1000:.1f} ms (per pair +{added * 1000:.1f} ms at the median)"
            )
            figures[f"ttft_ratio{suffix}"] = round(through / direct, 4)
            figures[f"ttft_added_p50_ms{suffix}"] = ms(added)
    finally:
        stop(gateway)
        stop(server)
    return figures


class Sampler:
    """py-spy recording the gateway process (``--py-spy``), until :meth:`stop`."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        beside = Path(sys.executable).with_name("py-spy")  # installed in this environment
        command = [
            str(beside) if beside.exists() else "py-spy", "record", "--pid", str(pid),
            "--rate", "250", "--format", "raw", "--nolineno", "--threads", "--gil",
            "--output", str(out),
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        time.sleep(1.0)  # attached before the first measured request

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(60)


def profile_summary(collapsed: str, top: int = 25) -> list[str]:
    """The functions with the most samples in py-spy's collapsed stacks, with callees
    (inclusive) and alone (self), as percentages of all samples; and the threads' shares."""
    inclusive: dict[str, float] = {}
    own: dict[str, float] = {}
    threads: dict[str, float] = {}
    total = 0.0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        samples = float(count)
        total += samples
        threads[frames[0]] = threads.get(frames[0], 0.0) + samples
        for frame in set(frames[1:]):
            inclusive[frame] = inclusive.get(frame, 0.0) + samples
        own[frames[-1]] = own.get(frames[-1], 0.0) + samples
    if not total:
        return ["(no samples)"]

    def rows(table: dict[str, float], title: str) -> list[str]:
        ranked = sorted(table.items(), key=lambda kv: -kv[1])[:top]
        return [title] + [f"  {100 * n / total:5.1f}%  {name}" for name, n in ranked]

    return [
        f"{int(total)} samples",
        *rows(threads, "threads:"),
        *rows(inclusive, "with callees:"),
        *rows(own, "self:"),
    ]


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
        sampler = None
        try:
            targets = [f"http://127.0.0.1:{stub_port}", gateway_url]
            asyncio.run(interleaved(targets, key, args.clients, args.clients * 2, REQUEST))
            if args.py_spy is not None:
                sampler = Sampler(gateway.pid, args.py_spy)
            start = read_buckets(gateway_url)
            timings, call_ids = asyncio.run(
                interleaved(
                    targets, key, args.clients, args.requests, REQUEST, args.think_ms / 1000
                )
            )
            middle = read_buckets(gateway_url)
            low, low_ids = asyncio.run(
                interleaved(targets, key, args.low_clients, args.low_requests, REQUEST)
            )
            inside = inside_quantiles(start, middle)
            inside_low = inside_quantiles(middle, read_buckets(gateway_url))
            captured_lost = settled(database_url, call_ids + low_ids)
            cpu_before = cpu_seconds(gateway.pid)
            rps, more_ids = asyncio.run(
                throughput(gateway_url, key, args.clients, args.rps_seconds)
            )
            captured_lost += settled(database_url, more_ids)
            cpu_ms = (cpu_seconds(gateway.pid) - cpu_before) * 1000 / max(len(more_ids), 1)
            if sampler is not None:
                sampler.stop()
                sampler = None
        finally:
            if sampler is not None:
                sampler.stop()
            stop(gateway)
            stop(stub)
        ttft_figures = ttft(args, database_url, key, tmp)
    direct, through = of_target(timings, 0), of_target(timings, 1)
    added, added_low = pair_differences(timings), pair_differences(low)
    result: dict[str, Any] = {
        "clients": args.clients,
        "think_ms": args.think_ms,
        "requests": len(timings),
        "direct_p50_ms": ms(quantile(direct, 0.5)),
        "through_p50_ms": ms(quantile(through, 0.5)),
        "added_p50_ms": ms(quantile(added, 0.5)),
        "added_p99_ms": ms(quantile(added, 0.99)),
        "quantile_added_p50_ms": ms(quantile(through, 0.5) - quantile(direct, 0.5)),
        "quantile_added_p99_ms": ms(quantile(through, 0.99) - quantile(direct, 0.99)),
        "inside_p50_ms": inside[0],
        "inside_p99_ms": inside[1],
        "low_clients": args.low_clients,
        "added_p50_ms_low": ms(quantile(added_low, 0.5)),
        "added_p99_ms_low": ms(quantile(added_low, 0.99)),
        "inside_p50_ms_low": inside_low[0],
        "inside_p99_ms_low": inside_low[1],
        "captured_lost": captured_lost,
        "gateway_rps_one_core": round(rps, 1),
        "gateway_cpu_ms_per_request": round(cpu_ms, 3),
        "ttft_ratio": ttft_figures.get("ttft_ratio"),
        "ttft_added_p50_ms": ttft_figures.get("ttft_added_p50_ms"),
        "ttft_ratio_low": ttft_figures.get("ttft_ratio_low"),
        "ttft_added_p50_ms_low": ttft_figures.get("ttft_added_p50_ms_low"),
        "model": args.model,
    }
    if args.py_spy is not None:
        print("\n".join(profile_summary(args.py_spy.read_text())))
    print(
        f"added latency per pair, {args.clients} clients: p50 {result['added_p50_ms']} ms, "
        f"p99 {result['added_p99_ms']} ms (inside the gateway: p50 {inside[0]} ms, p99 "
        f"{inside[1]} ms); {args.low_clients} clients: p50 {result['added_p50_ms_low']} ms, "
        f"p99 {result['added_p99_ms_low']} ms (inside: p50 {inside_low[0]} ms); "
        f"{result['gateway_rps_one_core']} requests/s on one core, the gateway's CPU "
        f"{result['gateway_cpu_ms_per_request']} ms a request; lost {captured_lost}"
    )
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000, help="requests, both targets")
    parser.add_argument(
        "--think-ms", type=float, default=0.0, help="the clients' mean pause between pairs"
    )
    parser.add_argument("--low-clients", type=int, default=1)
    parser.add_argument("--low-requests", type=int, default=200, help="at --low-clients")
    parser.add_argument("--rps-seconds", type=float, default=10.0)
    parser.add_argument("--model", choices=("smollm2", "tiny", "none"), default="smollm2")
    parser.add_argument("--ttft-pairs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="ratchet serve's threads")
    parser.add_argument("--cache", default="~/.cache/ratchet/smollm2")
    parser.add_argument("--py-spy", type=Path, default=None, metavar="FILE")
    parser.add_argument("--stub", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("clients", "requests", "low_clients", "low_requests", "ttft_pairs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


if __name__ == "__main__":
    arguments = parse()
    if arguments.stub is not None:
        run_stub(arguments.stub)
    else:
        print(json.dumps(main(arguments)))
