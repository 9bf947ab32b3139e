"""Job accounting: exact compute-seconds and cost, metrics.json reading, job metrics."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from services.executors.accounting import (
    FinishedJob,
    job_cost,
    observe_finished_job,
    read_job_metrics,
)
from services.executors.base import JobStatus
from services.metrics import REGISTRY

PRICES = {"accelerator_hour_price_usd": 2.5, "cpu_hour_price_usd": 0.036}


def test_a_gpu_job_bills_accelerator_seconds_and_both_prices() -> None:
    status = JobStatus("succeeded", wall_seconds=1800.0, cpu_seconds=100.0, accelerators=2)
    cost = job_cost(status, **PRICES)
    assert cost.compute_seconds == 3600.0
    # 1 accelerator-hour at $2.5 plus 100 CPU seconds at $0.036/h = 2.5 + 0.001.
    assert cost.cost_usd == Decimal("2.501000")


def test_a_cpu_job_bills_cpu_seconds_rounded_to_a_millionth() -> None:
    status = JobStatus("failed", wall_seconds=50.0, cpu_seconds=7.0, accelerators=0)
    cost = job_cost(status, **PRICES)
    assert cost.compute_seconds == 7.0
    assert cost.cost_usd == Decimal("0.000070")  # 7 / 3600 * 0.036 = 0.00007


def test_metrics_json_must_be_a_regular_file_with_an_object(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    with pytest.raises(ValueError, match=r"wrote no metrics\.json"):
        read_job_metrics(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_job_metrics(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        read_job_metrics(path)
    (tmp_path / "elsewhere.json").write_text('{"loss": 1.0}')
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ValueError):
        read_job_metrics(path)
    path.unlink()
    path.write_text('{"loss": 0.5}')
    assert read_job_metrics(path) == {"loss": 0.5}


def test_a_finished_job_is_counted_with_its_reported_throughput() -> None:
    job = FinishedJob("acct-loop", "train", "local", "succeeded", 3.0, 3.0, 0.01)
    labels = {"loop": "acct-loop", "kind": "train", "executor": "local", "status": "succeeded"}
    before = REGISTRY.get_sample_value("ratchet_job_runs_total", labels) or 0.0
    observe_finished_job(job, {"train_tokens_per_second": 120.0, "flag": True, "note": "x"})
    assert REGISTRY.get_sample_value("ratchet_job_runs_total", labels) == before + 1
    throughput = {"loop": "acct-loop", "kind": "train", "phase": "train"}
    assert REGISTRY.get_sample_value("ratchet_job_tokens_per_second", throughput) == 120.0
