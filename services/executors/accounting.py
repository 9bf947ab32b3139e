"""What a finished job cost, what it reported, and the metrics that count it.

Compute-seconds are accelerator-seconds (accelerators x wall time) for a job that held
accelerators and CPU seconds otherwise; the cost prices both at the configured hourly rates
(DESIGN §8) and is rounded to a millionth of a dollar, so a run's ``cost_usd`` adds up to the
cycle's exactly. Free of Temporal and of the database: the jobs activity calls it between
reading the executor's status and writing the run row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

from services.chat.text import load_job_json
from services.executors.base import METRICS_FILE, JobStatus
from services.metrics import (
    JOB_COMPUTE_SECONDS,
    JOB_COST,
    JOB_DURATION,
    JOB_RUNS,
    JOB_TOKENS_PER_SECOND,
)

_CENT_FRACTION = Decimal("0.000001")
# Keys of a job's metrics.json that report throughput, by how they end.
_THROUGHPUT_SUFFIXES = ("tokens_per_second", "tokens_per_s")


@dataclass(frozen=True)
class JobCost:
    compute_seconds: float
    cost_usd: Decimal


def job_cost(
    status: JobStatus, *, accelerator_hour_price_usd: float, cpu_hour_price_usd: float
) -> JobCost:
    """Compute-seconds (accelerator-seconds, or CPU seconds on CPU) and their cost."""
    accelerator_seconds = status.accelerators * status.wall_seconds
    compute_seconds = accelerator_seconds if status.accelerators else status.cpu_seconds
    dollars = (
        accelerator_seconds / 3600.0 * accelerator_hour_price_usd
        + status.cpu_seconds / 3600.0 * cpu_hour_price_usd
    )
    cost = Decimal(str(dollars)).quantize(_CENT_FRACTION, rounding=ROUND_HALF_UP)
    return JobCost(compute_seconds, cost)


# What one job may add to the ledger for the LLM judge it called; the figure is the job's
# own report (metrics.json), so it is bounded and a malformed one counts as nothing.
MAX_JUDGE_COST_USD = 10_000.0


def judge_cost_usd(metrics: Mapping[str, Any]) -> Decimal:
    """The dollars a job reports spending on LLM judges (``metrics["judge"][name]
    ["cost_usd"]``, see services.environments.replay.judge), to add to the run's cost."""
    judges = metrics.get("judge")
    total = 0.0
    if isinstance(judges, Mapping):
        for usage in judges.values():
            value = usage.get("cost_usd") if isinstance(usage, Mapping) else None
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value > 0
            ):
                total += float(value)
    total = min(total, MAX_JUDGE_COST_USD)
    return Decimal(str(total)).quantize(_CENT_FRACTION, rounding=ROUND_HALF_UP)


def read_job_metrics(path: Path) -> dict[str, Any]:
    """A job's ``metrics.json``; ``ValueError`` saying what is wrong with it."""
    from services.evaluation.results import read_job_output

    try:  # job output: regular files only, no symlinks; finite numbers, storable text
        data = load_job_json(read_job_output(path))
    except FileNotFoundError:
        raise ValueError(f"the job exited 0 but wrote no {METRICS_FILE}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"cannot read the job's {METRICS_FILE}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"the job's {METRICS_FILE} is not a JSON object")
    return data


@dataclass(frozen=True)
class FinishedJob:
    """A job's end as the metrics see it (low-cardinality labels: no run id)."""

    loop: str
    kind: str
    executor: str
    status: str
    wall_seconds: float
    compute_seconds: float
    cost_usd: float


def observe_finished_job(job: FinishedJob, reported: dict[str, Any]) -> None:
    """Count the job in the registry's job metrics; throughput from what the job reported."""
    JOB_RUNS.labels(job.loop, job.kind, job.executor, job.status).inc()
    JOB_DURATION.labels(job.kind, job.executor).observe(job.wall_seconds)
    JOB_COMPUTE_SECONDS.labels(job.loop, job.kind).inc(job.compute_seconds)
    JOB_COST.labels(job.loop, job.kind).inc(job.cost_usd)
    for key, value in reported.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        for suffix in _THROUGHPUT_SUFFIXES:
            if key.endswith(suffix):
                phase = key.removesuffix(suffix).rstrip("_") or "total"
                JOB_TOKENS_PER_SECOND.labels(job.loop, job.kind, phase).set(float(value))
                break
