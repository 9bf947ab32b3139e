"""A job's reported judge spend reaches its run's cost, bounded: it is the job's own word."""

from __future__ import annotations

from decimal import Decimal

from services.executors.accounting import MAX_JUDGE_COST_USD, judge_cost_usd


def test_the_judges_a_job_reports_add_up() -> None:
    metrics = {"judge": {"a": {"cost_usd": 0.25, "requests": 3}, "b": {"cost_usd": 1}}}
    assert judge_cost_usd(metrics) == Decimal("1.25")


def test_malformed_or_hostile_reports_count_as_nothing_or_the_bound() -> None:
    assert judge_cost_usd({}) == Decimal(0)
    assert judge_cost_usd({"judge": "lots"}) == Decimal(0)
    hostile = {
        "judge": {
            "neg": {"cost_usd": -100.0},
            "nan": {"cost_usd": float("nan")},
            "inf": {"cost_usd": float("inf")},
            "text": {"cost_usd": "5"},
            "flag": {"cost_usd": True},
            "list": [1, 2],
        }
    }
    assert judge_cost_usd(hostile) == Decimal(0)
    assert judge_cost_usd({"judge": {"x": {"cost_usd": 1e12}}}) == Decimal(str(MAX_JUDGE_COST_USD))
