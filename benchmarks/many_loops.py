"""Many loops on one deployment: what a loop costs idle, and what many loops' traffic costs.

A team runs one loop per agent or per customer over one base model. This starts the stack of
``ratchet up`` (embedded Postgres, the Temporal dev server, ``ratchet api`` and ``ratchet
worker`` as their own processes) in a fresh state directory, then:

1. **baseline**: one warm-up loop gets traffic and curates it (the worker has imported what
   curation imports), then the worker's CPU and memory are sampled over ``--baseline-s``;
2. **loops**: ``--loops`` toolcalc loops are created through the admin API (each starts its
   LoopWorkflow), with a trigger policy that never starts a cycle (``min_new_tasks`` out of
   reach, drift off), so what is measured is the loops' standing cost, not their training;
3. **mixed traffic** for ``--traffic-s``: ``--concurrency`` clients, each picking a random
   loop per request: signed trace batches through the light client (``ratchet_client``,
   80%), the loop's trace listing (10%), the loop itself (5%) and its live status (5%, a
   Temporal query the worker answers) → ``api_p50_ms``, ``api_p99_ms`` and each kind's p99;
   then until every trace is curated → each loop's curation lag (``curated_at -
   received_at``), ``curation_lag_p99_s`` of the median and of the worst loop, and
   ``curation_fairness`` = worst / median (1 means no loop waits longer than the others);
4. **idle** for ``--idle-s``: the worker process and its children (curation processes)
   sampled with psutil → ``idle_cpu_core_per_loop`` (cores, net of the baseline's rate) and
   ``idle_mib_per_loop`` (USS growth over the baseline, per loop); and from the Temporal dev
   server, every loop's history events in the window (every run of its workflow) →
   ``temporal_actions_per_loop_hour`` (activities and timers scheduled, signals, search
   attribute upserts, markers, runs started), ``activities_per_loop_hour`` and
   ``history_events_per_loop_hour``. An idle loop backs off its checks up to
   ``--idle-check-interval-s`` (workflows/trigger.py): the window starts ``--settle-s`` after
   the traffic, so that it measures the steady state (the ramp takes about twice the
   ceiling);
5. **model server** (with ``--model-dir``, a converted SmolLM2 checkpoint): ``ratchet serve``
   on it with ``--adapters`` random LoRA adapters registered (r=8 on the attention
   projections) and ``RATCHET_SERVE_MAX_ADAPTERS=--max-resident``; ``--serve-clients`` clients
   for ``--serve-s`` each on the base model alone, then spread over ``--hot`` adapters (the
   ones requested in the last minute) → ``serve_base_tokens_per_s``,
   ``serve_hot_tokens_per_s``, their ratio, and ``serve_cold_load_ms`` (a request to an
   adapter that was unloaded to make room, loaded again on demand).

The bar (docs/deploy.md, "Many loops"): idle cost per loop under 1% of a core and 20 MiB;
no loop starves another's cycle. Prints readable lines, then one JSON line (last).

    python benchmarks/many_loops.py --loops 100 --model-dir /work/cache/smollm2 \\
        --adapters 100 --hot 10          # defaults: 120 s traffic, 1200 s settle, 1200 s idle
    python benchmarks/many_loops.py --loops 5 --traffic-s 15 --settle-s 40 --idle-s 60 \\
        --check-interval-s 2 --idle-check-interval-s 16 --baseline-s 10     # a smoke run

Figures depend on the machine and on what else runs on it: take them on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from pydantic import SecretStr
from sqlalchemy import text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "clients" / "python" / "src"))

from ratchet_client import AsyncTraceClient  # noqa: E402

from benchmarks.support import free_port  # noqa: E402
from services.client import LoopPolicies, RatchetClient  # noqa: E402
from services.db.session import create_db_engine  # noqa: E402
from services.environments import get_environment  # noqa: E402
from services.environments.base import build_trace  # noqa: E402
from services.local.stack import Stack, stop_children_on_signals  # noqa: E402
from services.settings import Settings  # noqa: E402
from services.temporal import connect_temporal  # noqa: E402

MIB = 1024 * 1024
# History events that Temporal counts as actions (what a hosted Temporal bills per loop).
ACTION_EVENTS = frozenset(
    {
        "activity_task_scheduled_event_attributes",
        "timer_started_event_attributes",
        "workflow_execution_signaled_event_attributes",
        "upsert_workflow_search_attributes_event_attributes",
        "marker_recorded_event_attributes",
        "start_child_workflow_execution_initiated_event_attributes",
        "workflow_execution_started_event_attributes",
    }
)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 2)


# The stack ---------------------------------------------------------------------------------


@dataclass
class LiveStack:
    settings: Settings
    token: str
    stack: Stack

    @property
    def url(self) -> str:
        return self.settings.api_base_url

    @property
    def worker(self) -> psutil.Process:
        return psutil.Process(self.stack.children["worker"].pid)


@contextmanager
def running_stack(state_dir: Path, threads: int) -> Iterator[LiveStack]:
    """``ratchet up``'s stack under ``state_dir`` on free ports, logs under ``logs/``."""
    token = secrets.token_urlsafe(24)
    settings = Settings(
        state_dir=state_dir,
        database_url=None,
        temporal_address=None,
        api_port=free_port(),
        worker_port=free_port(),
        temporal_port=free_port(),
        temporal_ui_port=free_port(),
        serve_port=free_port(),
        admin_token=SecretStr(token),
        executor="local",
    )
    extra = {"RATCHET_LOG_LEVEL": "WARNING", "RATCHET_API_WORKERS": str(threads)}
    stack = Stack(settings, extra_env=extra)
    try:
        stack.preflight()
        stack.start_servers()
        stack.migrate()
        stack.start_children(log_to_files=True)
        stack.wait_api_ready(timeout=180)
        yield LiveStack(settings, token, stack)
    finally:
        stack.stop()


# Loops and traces --------------------------------------------------------------------------


def trace_pool(count: int, seed: int = 7) -> list[dict[str, Any]]:
    """``count`` toolcalc episodes answered right or wrong (a third right), as traces."""
    env = get_environment("toolcalc")
    traces = []
    for index, task in enumerate(env.generate_tasks(count, seed=seed, api_version="v2")):
        right = int(task.reference_answer or 0)
        answer = right if index % 3 == 0 else right + 1
        episode = env.run_episode(task, lambda _transcript, a=answer: f"ans {a}", max_turns=3)
        now = dt.datetime.now(dt.UTC).isoformat()
        traces.append(
            build_trace(
                task,
                episode,
                env.verify(task, episode),
                external_id=f"pool-{index}",
                model_version="bench-champion",
                started_at=now,
                ended_at=now,
            )
        )
    return traces


def create_loops(live: LiveStack, names: list[str], trigger: dict[str, Any]) -> dict[str, str]:
    """Create the loops (each starts its workflow); their signing secrets by name."""
    created = {}
    with RatchetClient(live.url, live.token) as client:
        for name in names:
            # each loop serves under a name of its own (one served name per loop per server)
            policies = LoopPolicies(trigger_policy=trigger, serving_target={"model": name})
            loop = client.create_loop(name, "toolcalc", policies=policies)
            if not loop.workflow_started:
                raise RuntimeError(f"the workflow of loop {name} did not start")
            created[name] = loop.signing_secret
    return created


@dataclass
class Traffic:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    posted: int = 0

    def record(self, kind: str, seconds: float, ok: bool) -> None:
        self.latencies.setdefault(kind, []).append(seconds)
        if not ok:
            self.failures[kind] = self.failures.get(kind, 0) + 1


async def mixed_traffic(
    live: LiveStack, loops: dict[str, str], pool: list[dict[str, Any]], args: argparse.Namespace
) -> Traffic:
    """``args.concurrency`` clients for ``args.traffic_s``, each request to a random loop."""
    traffic = Traffic()
    headers = {"Authorization": f"Bearer {live.token}"}
    deadline = time.monotonic() + args.traffic_s
    names = list(loops)
    counter = iter(range(10**9))

    async def client(http: httpx.AsyncClient, rng: random.Random) -> None:
        posters = {
            name: AsyncTraceClient(live.url, name, secret, http=http, max_retries=0)
            for name, secret in loops.items()
        }
        while time.monotonic() < deadline:
            name, roll = rng.choice(names), rng.random()
            started = time.perf_counter()
            ok = True
            try:
                if roll < 0.8:
                    kind = "post_traces"
                    batch = [
                        {**rng.choice(pool), "external_id": f"{name}-{next(counter)}"}
                        for _ in range(args.batch)
                    ]
                    result = await posters[name].post(batch)
                    traffic.posted += result.accepted
                else:
                    kind, path = _read_request(name, roll)
                    response = await http.get(f"{live.url}{path}", headers=headers)
                    ok = response.status_code == 200
            except Exception:
                ok = False
            traffic.record(kind, time.perf_counter() - started, ok)

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(client(http, random.Random(i)) for i in range(args.concurrency)))
    return traffic


def _read_request(name: str, roll: float) -> tuple[str, str]:
    if roll < 0.9:
        return "list_traces", f"/v1/loops/{name}/traces?limit=20"
    if roll < 0.95:
        return "get_loop", f"/v1/loops/{name}"
    return "loop_status", f"/v1/loops/{name}/status"


def curation_lags(live: LiveStack, names: list[str], timeout_s: float) -> dict[str, list[float]]:
    """Wait until every trace of ``names`` is curated; each loop's lags in seconds."""
    assert live.stack.database_url is not None
    engine = create_db_engine(live.stack.database_url, pool_size=1, application="bench")
    try:
        deadline = time.monotonic() + timeout_s
        with engine.connect() as conn:
            while time.monotonic() < deadline:
                waiting = conn.execute(
                    text(
                        "SELECT count(*) FROM traces t JOIN loops l ON l.id = t.loop_id "
                        "WHERE l.name = ANY(:names) AND t.curated_at IS NULL"
                    ),
                    {"names": names},
                ).scalar_one()
                conn.commit()
                if waiting == 0:
                    break
                time.sleep(1.0)
            rows = conn.execute(
                text(
                    "SELECT l.name, EXTRACT(EPOCH FROM t.curated_at - t.received_at) "
                    "FROM traces t JOIN loops l ON l.id = t.loop_id "
                    "WHERE l.name = ANY(:names) AND t.curated_at IS NOT NULL"
                ),
                {"names": names},
            ).all()
    finally:
        engine.dispose()
    lags: dict[str, list[float]] = {name: [] for name in names}
    for name, lag in rows:
        lags[name].append(float(lag))
    return lags


# The worker's cost -------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    at: float
    cpu_s: float
    uss: int
    rss: int


def sample(process: psutil.Process) -> Sample:
    """CPU seconds and memory of ``process`` and its children (curation processes)."""
    cpu, uss, rss = 0.0, 0, 0
    for member in [process, *process.children(recursive=True)]:
        try:
            times = member.cpu_times()
            memory = member.memory_full_info()
        except psutil.Error:
            continue
        cpu += times.user + times.system
        uss += memory.uss
        rss += memory.rss
    return Sample(time.monotonic(), cpu, uss, rss)


def cpu_rate(first: Sample, last: Sample) -> float:
    """Cores used between two samples."""
    return (last.cpu_s - first.cpu_s) / max(1e-9, last.at - first.at)


async def history_counts(
    live: LiveStack, names: list[str], since: dt.datetime, until: dt.datetime
) -> dict[str, dict[str, int]]:
    """Per loop: actions, activities and events of its workflow (every run) in the window."""
    client = await connect_temporal(live.settings)
    counts = {}
    for name in names:
        tally = {"actions": 0, "activities": 0, "events": 0}
        query = f'WorkflowId = "loop/{name}"'
        async for execution in client.list_workflows(query):
            if execution.close_time is not None and execution.close_time < since:
                continue
            handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
            async for event in handle.fetch_history_events():
                at = event.event_time.ToDatetime(tzinfo=dt.UTC)
                if not since <= at < until:
                    continue
                kind = event.WhichOneof("attributes")
                tally["events"] += 1
                tally["actions"] += kind in ACTION_EVENTS
                tally["activities"] += kind == "activity_task_scheduled_event_attributes"
        counts[name] = tally
    return counts


# The model server --------------------------------------------------------------------------


def random_adapters(model_dir: Path, root: Path, count: int) -> list[Path]:
    """``count`` LoRA adapters over the checkpoint at ``model_dir``, random weights each
    (they change the answers; their throughput is what is measured, not their quality)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from services.training.checkpoint import read_manifest
    from services.training.hf.checkpoint import load_hf_checkpoint, save_lora_adapter

    base = read_manifest(model_dir)
    model = get_peft_model(
        load_hf_checkpoint(model_dir).model,
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    paths = []
    for seed in range(count):
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name:
                    param.normal_(0.0, 0.02)
                elif "lora_B" in name:
                    param.normal_(0.0, 0.01)
        path = root / f"adapter-{seed:03d}"
        save_lora_adapter(model, path, base=base)
        paths.append(path)
    return paths


async def serve_load(url: str, models: list[str], args: argparse.Namespace) -> tuple[int, float]:
    """Completion tokens generated and seconds taken, ``args.serve_clients`` clients asking
    a random one of ``models`` for ``args.serve_s``."""
    deadline = time.monotonic() + args.serve_s
    tokens = 0

    async def client(http: httpx.AsyncClient, rng: random.Random) -> None:
        nonlocal tokens
        while time.monotonic() < deadline:
            response = await http.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": rng.choice(models),
                    "messages": [{"role": "user", "content": f"Count to {rng.randint(3, 9)}."}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                },
            )
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=600) as http:
        clients = (client(http, random.Random(i)) for i in range(args.serve_clients))
        await asyncio.gather(*clients)
    return tokens, time.monotonic() - started


def model_server_figures(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from benchmarks.serving import MODEL_NAME, start_server

    adapters = random_adapters(args.model_dir, work / "adapters", args.adapters)
    serve_args = argparse.Namespace(device="cpu", threads=args.threads, max_batch_rows=32)
    os.environ["RATCHET_SERVE_MAX_ADAPTERS"] = str(args.max_resident)  # start_server's env
    process, url = start_server(args.model_dir, serve_args, work / "serve.log", [work])
    try:
        names = [f"{MODEL_NAME}-{i:03d}" for i in range(len(adapters))]
        for name, path in zip(names, adapters, strict=True):
            body = {"lora_name": name, "lora_path": str(path)}
            httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=600).raise_for_status()
        hot = names[: args.hot]
        asyncio.run(serve_load(url, hot, argparse.Namespace(**{**vars(args), "serve_s": 1})))
        base_tokens, base_s = asyncio.run(serve_load(url, [MODEL_NAME], args))
        hot_tokens, hot_s = asyncio.run(serve_load(url, hot, args))
        cold_ms = cold_request_ms(url, names[args.hot :])
        stats = httpx.get(f"{url}/v1/stats").json()
    finally:
        process.terminate()
        process.wait(60)
    base_rate, hot_rate = base_tokens / base_s, hot_tokens / hot_s
    return {
        "serve_adapters_registered": len(adapters),
        "serve_hot_adapters": len(hot),
        "serve_max_resident": args.max_resident,
        "serve_resident_adapters": stats["resident_adapters"],
        "serve_base_tokens_per_s": round(base_rate, 2),
        "serve_hot_tokens_per_s": round(hot_rate, 2),
        "serve_hot_over_base": round(hot_rate / base_rate, 3) if base_rate else None,
        "serve_cold_load_ms": None if cold_ms is None else round(cold_ms, 1),
        "serve_cold_loads": stats["cold_adapter_loads"],
    }


def cold_request_ms(url: str, others: list[str]) -> float | None:
    """How long one request to an adapter unloaded to make room takes (its load included);
    None when every adapter stayed loaded (no more adapters than the server keeps)."""
    before = httpx.get(f"{url}/v1/stats").json()["cold_adapter_loads"]
    if not others:
        return None
    started = time.perf_counter()
    httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": others[0], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        timeout=600,
    ).raise_for_status()
    elapsed = (time.perf_counter() - started) * 1000.0
    after = httpx.get(f"{url}/v1/stats").json()["cold_adapter_loads"]
    return elapsed if after > before else None


# The run -----------------------------------------------------------------------------------


def loops_figures(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    trigger = {
        "min_new_tasks": 1_000_000,
        "drift_enabled": False,
        "check_interval_s": args.check_interval_s,
        "idle_check_interval_s": args.idle_check_interval_s,
    }
    pool = trace_pool(args.pool)
    names = [f"agent-{i:03d}" for i in range(args.loops)]
    with running_stack(work / "state", args.threads) as live:
        warm = create_loops(live, ["warm-up"], trigger)
        asyncio.run(mixed_traffic(live, warm, pool, _short(args)))
        curation_lags(live, ["warm-up"], timeout_s=300)
        first = sample(live.worker)
        time.sleep(args.baseline_s)
        baseline = sample(live.worker)
        print(f"baseline: {cpu_rate(first, baseline):.4f} cores, {baseline.uss / MIB:.0f} MiB")

        loops = create_loops(live, names, trigger)
        print(f"created {len(loops)} loops; mixed traffic for {args.traffic_s:.0f} s")
        traffic = asyncio.run(mixed_traffic(live, loops, pool, args))
        lags = curation_lags(live, names, timeout_s=args.curation_timeout_s)
        print(f"posted {traffic.posted} traces, all curated; settling for {args.settle_s:.0f} s")
        time.sleep(args.settle_s)  # the loops back off to their idle ceiling
        print(f"idle window of {args.idle_s:.0f} s")

        since = dt.datetime.now(dt.UTC)
        start = sample(live.worker)
        time.sleep(args.idle_s)
        end = sample(live.worker)
        until = dt.datetime.now(dt.UTC)
        counts = asyncio.run(history_counts(live, names, since, until))
    hours = (until - since).total_seconds() / 3600.0
    per_hour = {
        key: statistics.mean(c[key] for c in counts.values()) / hours
        for key in ("actions", "activities", "events")
    }
    loop_p99 = sorted(q for q in (quantile(v, 0.99) for v in lags.values()) if q is not None)
    every = [s for values in traffic.latencies.values() for s in values]
    net = max(0.0, cpu_rate(start, end) - cpu_rate(first, baseline))
    return {
        "loops": args.loops,
        "traces_posted": traffic.posted,
        "traces_per_s": round(traffic.posted / args.traffic_s, 1),
        "api_requests": len(every),
        "api_failures": sum(traffic.failures.values()),
        "api_p50_ms": ms(quantile(every, 0.5)),
        "api_p99_ms": ms(quantile(every, 0.99)),
        **{f"api_{k}_p99_ms": ms(quantile(v, 0.99)) for k, v in sorted(traffic.latencies.items())},
        "curation_lag_p99_s_median_loop": _round(statistics.median(loop_p99)) if loop_p99 else None,
        "curation_lag_p99_s_worst_loop": _round(loop_p99[-1]) if loop_p99 else None,
        "curation_fairness": (
            _round(loop_p99[-1] / max(1e-9, statistics.median(loop_p99))) if loop_p99 else None
        ),
        "idle_window_s": round(end.at - start.at, 1),
        "worker_idle_cores": _round(cpu_rate(start, end)),
        "worker_baseline_cores": _round(cpu_rate(first, baseline)),
        "idle_cpu_core_per_loop": _round(net / args.loops, 6),
        "worker_uss_mib": round(end.uss / MIB, 1),
        "worker_baseline_uss_mib": round(baseline.uss / MIB, 1),
        "idle_mib_per_loop": round(max(0, end.uss - baseline.uss) / MIB / args.loops, 3),
        "temporal_actions_per_loop_hour": round(per_hour["actions"], 1),
        "activities_per_loop_hour": round(per_hour["activities"], 1),
        "history_events_per_loop_hour": round(per_hour["events"], 1),
        "check_interval_s": args.check_interval_s,
        "idle_check_interval_s": args.idle_check_interval_s,
    }


def _short(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "traffic_s": min(10.0, args.traffic_s)})


def _round(value: float, digits: int = 4) -> float:
    return round(value, digits)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--loops", type=int, default=100, help="loops on the one stack (default 100)")
    add("--traffic-s", type=float, default=120.0, help="seconds of mixed traffic")
    add("--concurrency", type=int, default=16, help="clients of the mixed traffic")
    add("--batch", type=int, default=5, help="traces per signed post")
    add("--pool", type=int, default=300, help="distinct toolcalc episodes the traces reuse")
    add("--idle-s", type=float, default=1200.0, help="seconds of the idle window")
    add(
        "--settle-s",
        type=float,
        default=1200.0,
        help="seconds between the traffic and the idle window, for the loops to back off to "
        "their idle ceiling (about twice --idle-check-interval-s reaches the steady state)",
    )
    add("--baseline-s", type=float, default=60.0, help="seconds of the one-loop baseline")
    add("--curation-timeout-s", type=float, default=900.0)
    add("--check-interval-s", type=float, default=30.0, help="the loops' check_interval_s")
    add("--idle-check-interval-s", type=float, default=600.0, help="their idle ceiling")
    add("--threads", type=int, default=1, help="api workers, and the model server's threads")
    add("--model-dir", type=Path, default=None, help="converted SmolLM2 checkpoint (serving)")
    add("--adapters", type=int, default=100, help="LoRA adapters registered on the server")
    add("--hot", type=int, default=10, help="adapters the serving traffic asks for")
    add("--max-resident", type=int, default=32, help="RATCHET_SERVE_MAX_ADAPTERS")
    add("--serve-s", type=float, default=60.0, help="seconds of each serving phase")
    add("--serve-clients", type=int, default=16)
    add("--max-tokens", type=int, default=16)
    add("--skip-loops", action="store_true", help="only the model server's figures")
    args = parser.parse_args(argv)
    for name in ("loops", "concurrency", "batch", "pool", "adapters", "hot", "serve_clients"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hot > args.adapters:
        parser.error("--hot cannot exceed --adapters")
    if args.model_dir is not None and not (args.model_dir / "manifest.json").is_file():
        parser.error(f"--model-dir {args.model_dir} holds no converted checkpoint")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figures: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="ratchet-many-loops-") as tmp,
        stop_children_on_signals(),
    ):
        work = Path(tmp)
        if not args.skip_loops:
            figures.update(loops_figures(args, work))
        if args.model_dir is not None:
            figures.update(model_server_figures(args, work))
    for key, value in figures.items():
        print(f"{key:>36}: {value}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
