"""Curation throughput: traces/s through the full curation path at 10k and 100k traces.

Starts its own Postgres (pgserver, in a temp dir), migrates it, and for each size creates a
toolcalc loop and COPYs in that many ``ratchet.trace/v1`` traces made by the real toolcalc
environment, in a production-like mix:

- 75% failures (wrong answers on drifted tool APIs), 25% successes (5% of them sampled into
  regression tasks by the default policy);
- 35% of the failures repeat an earlier request (exact duplicates after normalization);
- 10% of the failures carry an email and a phone number in their metadata (redacted);
- 2% are unverifiable requests (rejected by the adapter with a reason).

Then it times the ``curate_batch`` activity (the real activity code, run through Temporal's
``ActivityEnvironment``; each batch is one transaction: lock, adapt, redact, MinHash-LSH
dedup against all earlier tasks, cluster, split, write, stamp) in batches of 500 until no
trace is left, and one dataset snapshot. The per-trace work runs on a ``PreparePool`` of
``--processes`` processes (default: ``RATCHET_CURATION_PROCESSES``, i.e. the usable cores),
as the worker runs it. The machine is shared by Postgres and the curation processes, so the
figures are a floor.

Figures (JSON, last line of stdout): ``per_s_10k``, ``per_s_100k`` (traces/s),
``time_ratio_100k_10k`` (near-linear scaling is 10; the target is <= 11), ``peak_rss_mb``
(the largest of the curation process and its pool workers), plus ``seconds_*``,
``tasks_*``, ``snapshot_s_*``, and:

- ``compute_only_per_s``: the same per-trace work (screen, adapt, redact, normalise, hash,
  MinHash: ``services.curation.workers.prepare_traces``) on the same mix, in one process
  with no database: the ceiling of one core on this machine;
- ``db_share``: the share of curation time spent on Postgres (the ``lock``, ``lookup`` and
  ``write`` phases of ``ratchet_curation_phase_seconds_total``), at the largest size;
- ``cpu_ms_per_trace``: CPU time of the curation process and its pool per trace (Postgres
  not included), at the largest size: a figure that holds on a busy machine too;
- ``loadavg``: the 1-minute load average before and after, to judge the others.

Each size gets a fresh database and a fresh curation process (traces are loaded by the
parent), so the two runs start from the same state and the ratio shows the scaling alone.

Usage: ``.venv/bin/python benchmarks/curation.py [--sizes 10000,100000] [--batch-size 2000]
[--processes N] [--compute-only-traces 5000]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import random
import resource
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.support import copy_traces, temporary_postgres  # noqa: E402
from services.artifacts import ArtifactStore  # noqa: E402
from services.curation.snapshot import snapshot  # noqa: E402
from services.db.migrate import upgrade  # noqa: E402
from services.db.session import create_db_engine, make_session_factory  # noqa: E402
from services.environments.base import build_trace  # noqa: E402
from services.environments.toolcalc import ToolcalcEnvironment  # noqa: E402
from services.environments.toolcalc.tasks import sample_request  # noqa: E402
from workflows.payloads.curation import CURATION_BATCH_SIZE  # noqa: E402

BASELINE = 10_000


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def traces(n: int, *, seed: int) -> Iterator[dict[str, Any]]:
    """``n`` toolcalc traces in the mix described in the module docstring."""
    env = ToolcalcEnvironment()
    rng = random.Random(seed)
    seen: list[str] = []
    for index in range(n):
        api = rng.choice(("v2", "v3"))
        failed = rng.random() < 0.75
        if failed and seen and rng.random() < 0.35:
            request = rng.choice(seen)
        elif rng.random() < 0.02:
            request = f"what is the weather in city {index}"
        else:
            request = sample_request(rng)
            seen.append(request)
        metadata: dict[str, Any] = {"api_version": api, "session": f"s-{index // 7}"}
        if failed and rng.random() < 0.10:
            metadata["customer"] = f"user{index}@example.com, +1 (555) 010-{index % 10000:04d}"
        yield _trace(env, request, api, failed, f"bench-{seed}-{index}", metadata)


def _trace(
    env: ToolcalcEnvironment,
    request: str,
    api: str,
    failed: bool,
    external_id: str,
    metadata: dict[str, Any],
) -> dict[str, Any]:
    try:
        task = env.make_task(request, api)
    except ValueError:  # an unverifiable request: build the trace by hand, as a runtime would
        return {
            "schema": "ratchet.trace/v1",
            "external_id": external_id,
            "model_version": "champion-1",
            "tools": [],
            "messages": [{"role": "user", "content": request}],
            "outcome": {"success": False, "score": 0.0, "error": {"kind": "wrong_answer"}},
            "metadata": metadata,
        }
    answer = "ans 0" if failed else f"ans {task.reference_answer}"
    episode = env.run_episode(task, lambda _: answer, max_turns=2)
    reward = env.verify(task, episode)
    return build_trace(
        task,
        episode,
        reward,
        external_id=external_id,
        model_version="champion-1",
        metadata=metadata,
    )


def trace_columns(body: dict[str, Any]) -> tuple[Any, ...]:
    """A trace's stored columns after its loop id, in ``traces`` (and ``TraceRow``) order:
    external_id, model_version, success, score, error_kind, body, size_bytes."""
    text = json.dumps(body)
    outcome = body["outcome"]
    error_kind = (outcome.get("error") or {}).get("kind")
    return (
        body["external_id"],
        body["model_version"],
        outcome["success"],
        outcome["score"],
        error_kind,
        text,
        len(text),
    )


def load_traces(database_url: str, loop_id: int, n: int, *, seed: int) -> None:
    """COPY the traces in (rows and bodies), with the outcome columns ingest would extract."""
    rows = []
    for body in traces(n, seed=seed):
        external_id, version, success, score, error_kind, text, size = trace_columns(body)
        outcome = (success, score, error_kind)
        rows.append((loop_id, external_id, "webhook", version, *outcome, text, size, None, None))
    with psycopg.connect(database_url) as conn:
        copy_traces(conn, rows, [dt.datetime.now(dt.UTC)] * len(rows))
        conn.commit()


def create_loop(database_url: str, name: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "INSERT INTO loops (name, environment) VALUES (%s, 'toolcalc') RETURNING id", (name,)
        ).fetchone()
        conn.commit()
    assert row is not None
    return int(row[0])


def fresh_database(server_url: str, name: str) -> str:
    """A new, migrated database on the benchmark's server, so every size starts equal."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    return url


def curate(
    database_url: str, artifacts: Path, loop: str, batch_size: int, processes: int
) -> dict[str, Any]:
    """Run in a fresh process: curate every trace of ``loop``, then snapshot it."""
    from temporalio.testing import ActivityEnvironment

    from services.curation.pipeline import DATABASE_PHASES, PHASES
    from services.curation.workers import PreparePool
    from services.metrics import REGISTRY
    from workflows.activities.curation import CurationActivities
    from workflows.payloads.curation import CurateBatchInput

    engine = create_db_engine(database_url, pool_size=2, application="bench-curation")
    sessions = make_session_factory(engine)
    pool = PreparePool(processes)
    workers = pool.start()  # as in a running worker, where the pool outlives the batches
    warmup_cpu = sum(_process_cpu_seconds(pid) for pid in workers)
    activities = CurationActivities(sessions, ArtifactStore(artifacts), pool=pool)
    env = ActivityEnvironment()
    totals = {"traces": 0, "tasks": 0, "duplicates": 0, "rejected": 0, "skipped": 0}
    cpu_started = _cpu_seconds()
    started = time.perf_counter()
    while True:
        result = env.run(activities.curate_batch, CurateBatchInput(loop, batch_size=batch_size))
        totals["traces"] += result.traces_seen
        totals["tasks"] += result.tasks_created
        totals["duplicates"] += result.duplicates
        totals["rejected"] += result.rejected
        totals["skipped"] += result.skipped
        if totals["traces"] % (40 * batch_size) == 0 and result.traces_seen:
            rate = totals["traces"] / (time.perf_counter() - started)
            log(f"{loop}: {totals['traces']} traces curated ({rate:.0f}/s)")
        if not result.more:
            break
    seconds = time.perf_counter() - started
    pool.close()  # its workers' CPU time and peak memory count once they are reaped
    cpu_seconds = _cpu_seconds() - cpu_started - warmup_cpu
    phases = {
        phase: REGISTRY.get_sample_value(
            "ratchet_curation_phase_seconds_total", {"loop": loop, "phase": phase}
        )
        or 0.0
        for phase in PHASES
    }
    snap_started = time.perf_counter()
    dataset = snapshot(sessions, ArtifactStore(artifacts), loop_name=loop, cycle=1)
    snapshot_s = time.perf_counter() - snap_started
    engine.dispose()
    return {
        "seconds": seconds,
        "snapshot_s": snapshot_s,
        "train": dataset.train_count,
        "eval": dataset.eval_count,
        "peak_rss_mb": max(
            resource.getrusage(who).ru_maxrss / 1024
            for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        ),
        "cpu_seconds": cpu_seconds,
        "db_seconds": sum(phases[p] for p in DATABASE_PHASES),
        "phases": phases,
        **totals,
    }


def _cpu_seconds() -> float:
    """User + system time of this process and of its reaped children (the pool workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _process_cpu_seconds(pid: int) -> float:
    """User + system time of a running process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compute_only(n: int) -> float:
    """Run in a fresh process: traces/s of the per-trace work alone, one process, no database.

    The bodies are the JSON text Postgres would send, so decoding is part of the work, as it
    is in a batch.
    """
    from services.curation.policy import CurationPolicy
    from services.curation.workers import PrepareJob, prepare_traces
    from services.db.queries.traces import TraceRow

    rows = []
    for index, body in enumerate(traces(n, seed=n + 1), start=1):
        rows.append(TraceRow(index, *trace_columns(body)))
    job = PrepareJob(1, "toolcalc", CurationPolicy.from_json({}), ToolcalcEnvironment(), rows)
    started = time.perf_counter()
    prepare_traces(job)
    return n / (time.perf_counter() - started)


def measure(
    server_url: str, artifacts: Path, n: int, batch_size: int, processes: int
) -> dict[str, Any]:
    """Load ``n`` traces into a fresh database, then time curation in a child process."""
    url = fresh_database(server_url, f"bench_{n}")
    name = f"bench-{n}"
    loop_id = create_loop(url, name)
    started = time.perf_counter()
    load_traces(url, loop_id, n, seed=n)
    log(f"{n}: loaded traces in {time.perf_counter() - started:.1f}s")
    with _fresh_process() as child:
        figures: dict[str, Any] = child.submit(
            curate, url, artifacts, name, batch_size, processes
        ).result()
    if figures["traces"] != n:
        raise SystemExit(f"curated {figures['traces']} traces, expected {n}")
    figures["per_s"] = n / figures["seconds"]
    log(
        f"{n}: {figures['seconds']:.1f}s, {figures['per_s']:.0f} traces/s, "
        f"{figures['tasks']} tasks, {figures['duplicates']} duplicates, "
        f"{figures['rejected']} rejected; snapshot {figures['snapshot_s']:.1f}s "
        f"({figures['train']} train, {figures['eval']} eval); "
        f"phases {', '.join(f'{k} {v:.1f}s' for k, v in figures['phases'].items())}"
    )
    return figures


def _fresh_process() -> ProcessPoolExecutor:
    """One spawned, non-daemonic process (curation starts its own pool workers in it)."""
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--sizes", default="10000,100000", help="comma-separated trace counts")
    parser.add_argument("--batch-size", type=int, default=CURATION_BATCH_SIZE)
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="curation processes (default: RATCHET_CURATION_PROCESSES, i.e. the usable cores)",
    )
    parser.add_argument(
        "--compute-only-traces", type=int, default=5000, help="traces for compute_only_per_s"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    from services.settings import load_settings

    processes = args.processes or load_settings().curation_processes
    load_before = os.getloadavg()[0]
    with _fresh_process() as child:
        compute_only_per_s = child.submit(compute_only, args.compute_only_traces).result()
    log(f"compute only: {compute_only_per_s:.0f} traces/s in one process")
    with temporary_postgres("ratchet-bench-curation-") as (server, scratch):
        url = server.get_uri("postgres")
        results = {
            n: measure(url, scratch / "artifacts", n, args.batch_size, processes) for n in sizes
        }
    out: dict[str, Any] = {"batch_size": args.batch_size, "processes": processes}
    for n, figures in results.items():
        label = f"{n // 1000}k" if n % 1000 == 0 else str(n)
        out[f"per_s_{label}"] = round(figures["per_s"], 1)
        out[f"seconds_{label}"] = round(figures["seconds"], 2)
        out[f"tasks_{label}"] = figures["tasks"]
        out[f"duplicates_{label}"] = figures["duplicates"]
        out[f"rejected_{label}"] = figures["rejected"]
        out[f"snapshot_s_{label}"] = round(figures["snapshot_s"], 2)
    if BASELINE in results and 10 * BASELINE in results:
        out["time_ratio_100k_10k"] = round(
            results[10 * BASELINE]["seconds"] / results[BASELINE]["seconds"], 2
        )
    out["peak_rss_mb"] = round(max(f["peak_rss_mb"] for f in results.values()), 1)
    largest = results[max(results)]
    out["compute_only_per_s"] = round(compute_only_per_s, 1)
    out["per_s_vs_compute_only"] = round(largest["per_s"] / compute_only_per_s, 3)
    out["db_share"] = round(largest["db_seconds"] / largest["seconds"], 3)
    out["cpu_ms_per_trace"] = round(1000 * largest["cpu_seconds"] / max(results), 3)
    out["loadavg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out))


if __name__ == "__main__":
    from services.local.stack import stop_children_on_signals

    with stop_children_on_signals():  # SIGTERM (timeout, CI) stops its Postgres and api too
        main()
