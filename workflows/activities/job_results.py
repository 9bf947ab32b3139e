"""What a run's job came to, as ``run_job`` answers it: its result from the run's row, the
details its heartbeat and logs carry, its error, and whether it ran past its deadline."""

from __future__ import annotations

import datetime as dt
from typing import Any

from services.db.models import Run
from services.executors.base import JobStatus
from services.loop.states import RunStatus
from workflows.payloads.jobs import RunJobResult


def result_of(run: Run) -> RunJobResult:
    return RunJobResult(
        run_id=run.id,
        status=RunStatus(run.status),
        output_uri=run.output_uri or "",
        metrics=dict(run.metrics or {}),
        compute_seconds=float(run.compute_seconds or 0.0),
        cost_usd=float(run.cost_usd or 0),
        error=run.error,
    )


def result_details(result: RunJobResult) -> dict[str, Any]:
    return {
        "run_id": result.run_id,
        "status": result.status,
        "error": result.error,
        "compute_seconds": result.compute_seconds,
        "cost_usd": result.cost_usd,
    }


def error_of(status: JobStatus) -> str | None:
    if status.state == RunStatus.SUCCEEDED:
        return None
    return status.describe()


def past_deadline(deadline_s: float | None, started_at: dt.datetime | None) -> bool:
    if deadline_s is None or started_at is None:
        return False
    return (dt.datetime.now(dt.UTC) - started_at).total_seconds() > deadline_s


def datetime_of(timestamp: float | None) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC) if timestamp else None
