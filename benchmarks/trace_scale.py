"""Traces at scale: what ingest, the listing, curation and retention cost at 1M and at 10M traces.

Starts its own Postgres (pgserver, in a temp dir) with two databases, each migrated and
holding one loop: the *small* one gets ``--sizes``' first count of generated traces, the
*large* one the second (1M and 10M by default), loaded with COPY (rows into ``traces``,
bodies of ~1.3 KB into their daily partitions of ``trace_bodies``), spread evenly over the
last ``--days`` days (ids in time order, as ingest makes them), a third of them successes;
all but the last day's are curated, the last day's are curation's queue. Both are then
vacuumed and analyzed, and a ``ratchet api`` is started over each.

Then, ``--pairs`` times, small then large (pairs of runs interleaved, so what the machine
does meanwhile falls on both sizes alike), it measures:

- ``single``: ``--single`` signed single-trace webhook posts, one at a time over one
  keep-alive connection → p50 and p99 latency (ms);
- ``batch``: ``--batches`` signed batches of 100 traces, one at a time → traces/s;
- ``listing_recent``: ``--listings`` GETs of the newest page (50 traces) → p99 (ms);
- ``listing_filtered``: ``--listings`` GETs of a filtered page (failures received in one
  day three days ago) → p99 (ms);
- ``curation_scan``: the curation queue's scan, as a curation batch does it: lock the oldest
  2000 uncurated traces of the loop and read their bodies (then roll back) → seconds, the
  median of ``--scans``;
- ``retention_day``: retiring the oldest day (detach its partition, commit, drop it, as the
  retention schedule does) → seconds;
- ``retention_lock``: the first of those two transactions alone, the time the table is
  locked, which every ingest and listing waits for (the drop locks only the detached table;
  freeing its file takes time in proportion to its bytes) → seconds.

Each figure is taken as a cost (a time; a rate's inverse), its median over the pairs per
size, and ``<figure>_ratio`` is the large size's cost over the small size's. The bar
(issue 44): every ratio at most 1.3 and ``retention_day_s`` (the larger of the two sizes')
under 1 s; ``bar_met`` says whether this run met it. The JSON also carries each size's
figures, the tables' and indexes' sizes on disk (for projections), and the load average.

Prints progress to stderr and one JSON line (last) to stdout. Take the figures on a quiet
machine: the 10M load needs ~25 GB of disk and some tens of minutes.

    python benchmarks/trace_scale.py                  # 1M and 10M
    python benchmarks/trace_scale.py --quick          # 10k and 100k: a smoke run
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import hmac
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.ingest import trace_document  # noqa: E402
from benchmarks.support import (  # noqa: E402
    Postgres,
    create_loop_database,
    free_port,
    start_api_process,
    temporary_postgres,
)
from services.db.partitions import (  # noqa: E402
    TRACE_BODIES,
    create_partition,
    partitions,
    period_end,
    period_start,
)
from services.db.queries.retention import drop_retired, retire_trace_bodies  # noqa: E402
from services.db.queries.traces import lock_uncurated_traces  # noqa: E402
from services.db.session import create_db_engine, make_session_factory  # noqa: E402
from services.ingest.signature import secret_key  # noqa: E402
from workflows.payloads.curation import CURATION_BATCH_SIZE  # noqa: E402

LOOP = "scale"
BATCH = 100
PAGE = 50
LOAD_CHUNK = 50_000
NULL = "\\N"  # COPY's text format
QUICK_SIZES = (10_000, 100_000)
# The figures, each a cost: a time, or (batch) seconds per trace.
FIGURES = (
    "single_p50_ms",
    "single_p99_ms",
    "batch_s_per_trace",
    "listing_recent_p99_ms",
    "listing_filtered_p99_ms",
    "curation_scan_s",
    "retention_day_s",
    "retention_lock_s",
)
BAR_RATIO = 1.3
BAR_RETENTION_S = 1.0


def log(message: str) -> None:
    print(f"[trace-scale] {message}", file=sys.stderr, flush=True)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# Loading ---------------------------------------------------------------------------------


def _copy_lines(
    loop_id: int, first_id: int, start: int, stop: int, n: int, t0: dt.datetime, span: float
) -> tuple[bytes, bytes]:
    """COPY text lines of traces ``[start, stop)`` of ``n`` and of their bodies."""
    template = json.dumps(trace_document("@@ID@@"), separators=(",", ":"))
    head, tail = template.split("@@ID@@")
    curated_before = t0 + dt.timedelta(seconds=span) - dt.timedelta(days=1)
    rows, bodies = [], []
    for i in range(start, stop):
        at = t0 + dt.timedelta(seconds=span * (i + 0.5) / n)
        external_id = f"load-{i}"
        body = head + external_id + tail
        success = i % 3 == 0
        curated = (
            f"{(at + dt.timedelta(minutes=1)).isoformat()}\tskipped"
            if at < curated_before
            else f"{NULL}\t{NULL}"
        )
        outcome = f"t\t1.0\t{NULL}" if success else "f\t0.1\tunknown_tool"
        rows.append(
            f"{first_id + i}\t{loop_id}\t{external_id}\twebhook\tchampion-3\t{outcome}\t"
            f"{len(body)}\t{at.isoformat()}\t{curated}\n"
        )
        bodies.append(f"{first_id + i}\t{at.isoformat()}\t{body}\n")
    return "".join(rows).encode(), "".join(bodies).encode()


def load(database_url: str, loop_id: int, n: int, days: int) -> None:
    """``n`` traces over the last ``days`` days, in daily partitions made first."""
    now = dt.datetime.now(dt.UTC)
    t0 = now - dt.timedelta(days=days)
    engine = create_db_engine(database_url, pool_size=1)
    with make_session_factory(engine).begin() as session:
        have = {p.lower for p in partitions(session=session, table=TRACE_BODIES)}
        day = period_start(t0, "daily")
        while day <= now:
            if day not in have:
                create_partition(
                    session=session, table=TRACE_BODIES, lower=day, upper=period_end(day, "daily")
                )
            day = period_end(day, "daily")
    engine.dispose()
    span = (now - t0).total_seconds()
    columns = (
        "id, loop_id, external_id, source, model_version, success, score, error_kind, "
        "size_bytes, received_at, curated_at, curation_outcome"
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        last = conn.execute(
            "SELECT setval(pg_get_serial_sequence('traces', 'id'), "
            "nextval(pg_get_serial_sequence('traces', 'id')) + %s - 1)",
            (n,),
        ).fetchone()
        assert last is not None
        first_id = int(last[0]) - n + 1
        for start in range(0, n, LOAD_CHUNK):
            stop = min(n, start + LOAD_CHUNK)
            rows, bodies = _copy_lines(loop_id, first_id, start, stop, n, t0, span)
            with conn.transaction():
                with conn.cursor().copy(f"COPY traces ({columns}) FROM STDIN") as copy:
                    copy.write(rows)
                with conn.cursor().copy(
                    "COPY trace_bodies (trace_id, received_at, body) FROM STDIN"
                ) as copy:
                    copy.write(bodies)
            if stop % (LOAD_CHUNK * 20) == 0 or stop == n:
                log(f"loaded {stop:,} of {n:,} traces")
        conn.execute("VACUUM ANALYZE traces")
        conn.execute("VACUUM ANALYZE trace_bodies")


def disk_bytes(database_url: str) -> dict[str, int]:
    """Heap (with TOAST) and index bytes of the trace tables, for projections."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            """
            SELECT pg_table_size('traces'), pg_indexes_size('traces'),
                   (SELECT coalesce(sum(pg_table_size(inhrelid)), 0) FROM pg_inherits
                     WHERE inhparent = 'trace_bodies'::regclass),
                   (SELECT coalesce(sum(pg_indexes_size(inhrelid)), 0) FROM pg_inherits
                     WHERE inhparent = 'trace_bodies'::regclass)
            """
        ).fetchone()
    assert row is not None
    keys = ("traces_table", "traces_indexes", "bodies_table", "bodies_indexes")
    return {f"{key}_bytes": int(value) for key, value in zip(keys, row, strict=True)}


# One size's stack and measurements ------------------------------------------------------------


@dataclass
class Size:
    label: str
    n: int
    database_url: str
    loop_id: int
    secret: bytes
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _signed(size: Size, body: bytes) -> dict[str, str]:
    msg_id = f"msg_{uuid.uuid4().hex}"
    timestamp = int(time.time())
    digest = hmac.new(size.secret, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": f"v1,{base64.b64encode(digest.digest()).decode()}",
    }


def _timed(call: Callable[[], httpx.Response], expect: int) -> float:
    started = time.perf_counter()
    response = call()
    elapsed = time.perf_counter() - started
    if response.status_code != expect:
        raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
    return elapsed


def measure(size: Size, args: argparse.Namespace, pair: int) -> dict[str, float]:
    """One run of every figure on one size."""
    figures: dict[str, float] = {}
    template = json.dumps(trace_document("@@ID@@"), separators=(",", ":"))
    path = f"/v1/loops/{LOOP}/traces"
    with httpx.Client(base_url=size.url, timeout=60) as client:
        single = []
        for i in range(args.single):
            body = template.replace("@@ID@@", f"single-{pair}-{i}").encode()
            single.append(
                _timed(lambda b=body: client.post(path, content=b, headers=_signed(size, b)), 200)
            )
        figures["single_p50_ms"] = statistics.median(single) * 1000
        figures["single_p99_ms"] = quantile(single, 0.99) * 1000
        spent = 0.0
        for i in range(args.batches):
            items = ",".join(
                template.replace("@@ID@@", f"batch-{pair}-{i}-{j}") for j in range(BATCH)
            )
            body = f'{{"traces":[{items}]}}'.encode()
            spent += _timed(
                lambda b=body: client.post(path, content=b, headers=_signed(size, b)), 200
            )
        figures["batch_s_per_trace"] = spent / (args.batches * BATCH)
        admin = {"authorization": "Bearer bench"}
        day = period_start(dt.datetime.now(dt.UTC), "daily") - dt.timedelta(days=3)
        filtered = {
            "outcome": "failure",
            "since": day.isoformat(),
            "until": (day + dt.timedelta(days=1)).isoformat(),
            "limit": PAGE,
        }
        for name, params in (("recent", {"limit": PAGE}), ("filtered", filtered)):
            times = [
                _timed(lambda p=params: client.get(path, params=p, headers=admin), 200)
                for _ in range(args.listings)
            ]
            figures[f"listing_{name}_p99_ms"] = quantile(times, 0.99) * 1000
    engine = create_db_engine(size.database_url, pool_size=1)
    sessions = make_session_factory(engine)
    try:
        scans = []
        for _ in range(args.scans):
            with sessions() as session:
                started = time.perf_counter()
                rows = lock_uncurated_traces(
                    session=session, loop_id=size.loop_id, limit=CURATION_BATCH_SIZE
                )
                scans.append(time.perf_counter() - started)
                session.rollback()
            if not rows:
                raise RuntimeError("the curation queue is empty")
        figures["curation_scan_s"] = statistics.median(scans)
        with sessions.begin() as session:
            oldest = partitions(session=session, table=TRACE_BODIES)[0]
        started = time.perf_counter()
        with sessions.begin() as session:
            retired = retire_trace_bodies(
                session=session, received_before=oldest.upper, now=dt.datetime.now(dt.UTC)
            )
        figures["retention_lock_s"] = time.perf_counter() - started
        with sessions.begin() as session:
            drop_retired(session=session, table=TRACE_BODIES)
        figures["retention_day_s"] = time.perf_counter() - started
        if not retired:
            raise RuntimeError("retention dropped nothing")
    finally:
        engine.dispose()
    return figures


# The run -------------------------------------------------------------------------------------


@contextmanager
def sizes_over(server: Postgres, counts: tuple[int, int], days: int) -> Iterator[list[Size]]:
    """Both databases loaded, an api over each; the apis stopped afterwards."""
    with ExitStack() as stack:
        sizes = []
        for label, n in zip(("small", "large"), counts, strict=True):
            database_url, created = create_loop_database(server, LOOP, database=f"scale_{label}")
            log(f"loading {n:,} traces into the {label} database")
            started = time.monotonic()
            load(database_url, created.loop.id, n, days)
            log(f"loaded in {time.monotonic() - started:.0f} s")
            port = free_port()
            process = start_api_process(database_url, port, {**os.environ})
            stack.callback(lambda p=process: (p.terminate(), p.wait(timeout=30)))
            sizes.append(
                Size(
                    label,
                    n,
                    database_url,
                    created.loop.id,
                    secret_key(created.signing_secret),
                    port,
                )
            )
        yield sizes


def summarize(
    runs: dict[str, list[dict[str, float]]], sizes: list[Size], disks: dict[str, Any]
) -> dict[str, Any]:
    small, large = sizes
    result: dict[str, Any] = {
        "benchmark": "trace_scale",
        "sizes": [small.n, large.n],
        "pairs": len(runs[small.label]),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    met = True
    for figure in FIGURES:
        costs = {
            size.label: statistics.median(run[figure] for run in runs[size.label]) for size in sizes
        }
        ratio = costs["large"] / costs["small"] if costs["small"] > 0 else float("inf")
        result[f"{figure}_small"] = round(costs["small"], 6)
        result[f"{figure}_large"] = round(costs["large"], 6)
        result[f"{figure.removesuffix('_s').removesuffix('_ms')}_ratio"] = round(ratio, 3)
        met = met and ratio <= BAR_RATIO
    result["retention_day_s"] = round(
        max(run["retention_day_s"] for size in sizes for run in runs[size.label]), 4
    )
    result["bar_met"] = met and result["retention_day_s"] < BAR_RETENTION_S
    result["disk"] = disks
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000", help="small,large trace counts")
    parser.add_argument("--quick", action="store_true", help="sizes 10k and 100k, fewer calls")
    parser.add_argument("--days", type=int, default=30, help="days the loaded traces span")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--single", type=int, default=400, help="single posts per run")
    parser.add_argument("--batches", type=int, default=40, help="batch posts per run")
    parser.add_argument("--listings", type=int, default=200, help="GETs per listing per run")
    parser.add_argument("--scans", type=int, default=5, help="curation scans per run")
    args = parser.parse_args(argv)
    try:
        counts = tuple(int(part) for part in args.sizes.split(","))
    except ValueError:
        parser.error("--sizes must be two integers, e.g. 1000000,10000000")
    if args.quick:
        counts = QUICK_SIZES
        args.single, args.batches, args.listings, args.scans = 50, 5, 30, 2
        args.pairs = min(args.pairs, 2)
    if len(counts) != 2 or not 0 < counts[0] < counts[1]:
        parser.error("--sizes must be two increasing positive counts")
    if args.days < args.pairs + 4:
        parser.error("--days must exceed --pairs by 4 (each run retires a day)")
    if min(args.pairs, args.single, args.batches, args.listings, args.scans) < 1:
        parser.error("--pairs, --single, --batches, --listings and --scans must be at least 1")
    args.counts = counts
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with (
        temporary_postgres("ratchet-trace-scale-") as (server, _),
        sizes_over(server, args.counts, args.days) as sizes,
    ):
        disks = {size.label: disk_bytes(size.database_url) for size in sizes}
        runs: dict[str, list[dict[str, float]]] = {size.label: [] for size in sizes}
        for pair in range(args.pairs):
            for size in sizes:
                figures = measure(size, args, pair)
                runs[size.label].append(figures)
                log(f"pair {pair + 1} {size.label}: {json.dumps(figures)}")
        result = summarize(runs, sizes, disks)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
