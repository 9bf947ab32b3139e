"""How long migration 0017 (trace bodies into their partitioned table) takes per million traces.

Starts its own Postgres (pgserver, in a temp dir), migrates a database to 0016, loads
``--traces`` traces with ~1.3 KB bodies spread over ``--days`` days (COPY, then VACUUM
ANALYZE: the steady state of an installation), then times ``upgrade`` to 0017: the unique
keys, the partitions, the batched copy and the final step. Prints one JSON line (last):
``migration_s``, ``s_per_million`` and the table's size before.

    python benchmarks/partition_migration.py --traces 300000
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.ingest import trace_document  # noqa: E402
from benchmarks.support import temporary_postgres  # noqa: E402
from services.db.migrate import upgrade  # noqa: E402

CHUNK = 50_000


def load(database_url: str, n: int, days: int) -> int:
    """``n`` traces of one loop at 0016 (the body still a column); the table's bytes."""
    template = json.dumps(trace_document("@@ID@@"), separators=(",", ":"))
    now = dt.datetime.now(dt.UTC)
    t0 = now - dt.timedelta(days=days)
    columns = "loop_id, external_id, body, size_bytes, received_at"
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO loops (name, environment) VALUES ('m', 'toolcalc') RETURNING id"
        ).fetchone()
        assert row is not None
        for start in range(0, n, CHUNK):
            lines = []
            for i in range(start, min(n, start + CHUNK)):
                at = t0 + dt.timedelta(seconds=days * 86_400 * (i + 0.5) / n)
                body = template.replace("@@ID@@", f"t{i}")
                lines.append(f"{row[0]}\tt{i}\t{body}\t{len(body)}\t{at.isoformat()}\n")
            with (
                conn.transaction(),
                conn.cursor().copy(f"COPY traces ({columns}) FROM STDIN") as copy,
            ):
                copy.write("".join(lines).encode())
        conn.execute("VACUUM ANALYZE traces")
        size = conn.execute("SELECT pg_total_relation_size('traces')").fetchone()
    assert size is not None
    return int(size[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=300_000)
    parser.add_argument("--days", type=int, default=30)
    args = parser.parse_args()
    if args.traces < 1 or args.days < 1:
        parser.error("--traces and --days must be at least 1")
    with temporary_postgres("ratchet-partition-migration-") as (server, _):
        with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE migration")
        url = server.get_uri("migration")
        upgrade(url, "0016")
        size = load(url, args.traces, args.days)
        started = time.perf_counter()
        upgrade(url)
        elapsed = time.perf_counter() - started
    print(
        json.dumps(
            {
                "benchmark": "partition_migration",
                "traces": args.traces,
                "traces_bytes_before": size,
                "migration_s": round(elapsed, 2),
                "s_per_million": round(elapsed / args.traces * 1e6, 1),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
