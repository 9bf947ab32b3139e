"""Pre-auth gzip work, measured: how long the api's inflater spends on hostile bodies.

Before the fix, inflating was quadratic in the gzip member count (20k/40k/80k empty members
took 0.22/0.95/3.65 s of blocked event loop, before the signature was checked). Now the
input goes in bounded chunks and the 65th member is refused. This prints, for bodies of
N empty members (up to the 5 MiB body limit) and for one honest 5 MiB member, the median
time of ``gunzip_limited`` over a few runs, then ONE JSON line.

    python benchmarks/gzip_members.py [--runs 5]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.ingest.body import gunzip_limited
from services.ingest.errors import IngestError

LIMIT = 5 * 1024 * 1024


def seconds(body: bytes, runs: int) -> tuple[float, str]:
    """Median seconds of one inflate, and how it ended (ok / the error code)."""
    times = []
    outcome = "ok"
    for _ in range(runs):
        started = time.perf_counter()
        try:
            gunzip_limited(body, LIMIT)
        except IngestError as exc:
            outcome = f"{exc.status_code} {exc.code}"
        times.append(time.perf_counter() - started)
    return statistics.median(times), outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    empty = gzip.compress(b"")
    figures: dict[str, float | str] = {}
    for members in (20_000, 80_000, LIMIT // len(empty)):
        took, outcome = seconds(empty * members, args.runs)
        print(f"{members:>7} empty members: {took * 1000:8.3f} ms  ({outcome})")
        figures[f"members_{members}_ms"] = round(took * 1000, 3)
    honest = gzip.compress(bytes(range(256)) * (LIMIT // 256 - 1))
    took, outcome = seconds(honest, args.runs)
    print(f"one 5 MiB member:      {took * 1000:8.3f} ms  ({outcome})")
    figures["one_member_5mib_ms"] = round(took * 1000, 3)
    print(json.dumps({"benchmark": "gzip_members", "runs": args.runs, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
