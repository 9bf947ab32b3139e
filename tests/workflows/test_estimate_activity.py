"""The estimate stage's activity and the ledger's costs by phase, against a real Postgres.

A closed cycle's runs (with the phases their jobs reported) are the rates the next cycle is
estimated from; a cycle over what is left of the budget is refused and pauses its loop.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from temporalio.exceptions import ApplicationError

from services.db.models import Cycle, Loop, Run
from services.db.session import SessionFactory
from services.loop.estimate import CALIBRATED_SPREAD, DEFAULT_COMPUTE_S_PER_UNIT, Prices
from services.loop.policies import TrainingProfile
from tests.workflows.test_loop_activities import RecordingTarget, make_loop
from workflows.activities.estimate import CalibrationInput, EstimateActivities, EstimateInput
from workflows.activities.stages import StageActivities
from workflows.payloads.cycle import CloseCycleInput

T0 = dt.datetime(2026, 12, 2, 8, 0, tzinfo=dt.UTC)
PRICES = Prices(accelerator_hour_usd=3.6, cpu_hour_usd=0.36)
PROFILE = TrainingProfile(hyperparameters={"steps": 10, "tasks_per_step": 2, "group_size": 2})


def open_cycle(session_factory: SessionFactory, loop_id: int, number: int) -> int:
    with session_factory.begin() as session:
        cycle = Cycle(loop_id=loop_id, number=number, trigger="operator", stage="snapshot")
        session.add(cycle)
        session.flush()
        return cycle.id


def add_run(
    session_factory: SessionFactory,
    loop_id: int,
    cycle_id: int,
    run_id: str,
    *,
    kind: str,
    metrics: dict[str, object],
    cost: str,
    wall_s: float,
) -> None:
    with session_factory.begin() as session:
        session.add(
            Run(
                id=run_id,
                loop_id=loop_id,
                cycle_id=cycle_id,
                kind=kind,
                executor="local",
                spec={},
                status="succeeded",
                metrics=metrics,
                compute_seconds=wall_s,
                cost_usd=Decimal(cost),
                started_at=T0,
                ended_at=T0 + dt.timedelta(seconds=wall_s),
            )
        )


def accounted_cycle(session_factory: SessionFactory, loop_id: int, name: str) -> int:
    """Cycle 1 with a train job ($1.00) and an eval job ($0.20), closed by the real activity."""
    cycle_id = open_cycle(session_factory, loop_id, 1)
    train_phases = {
        "rollout": {"seconds": 50.0, "compute_s": 50.0},
        "scoring": {"seconds": 10.0, "compute_s": 10.0},
        "update": {"seconds": 20.0, "compute_s": 20.0},
        "sync": {"seconds": 10.0, "compute_s": 10.0},
    }
    add_run(
        session_factory,
        loop_id,
        cycle_id,
        f"{name}-c1-train",
        kind="train",
        metrics={"phases": train_phases, "steps": 10, "episodes": 40},
        cost="1.00",
        wall_s=100.0,
    )
    eval_phases = {"sync": {"seconds": 2.0}, "evaluation": {"seconds": 18.0}}
    add_run(
        session_factory,
        loop_id,
        cycle_id,
        f"{name}-c1-eval",
        kind="eval",
        metrics={"phases": eval_phases, "n": 10, "samples": 2},
        cost="0.20",
        wall_s=20.0,
    )
    StageActivities.build(session_factory, RecordingTarget()).cycle.close_cycle(
        CloseCycleInput(name, 1, "rejected", "no win")
    )
    return cycle_id


def set_budget(session_factory: SessionFactory, loop_id: int, budget: str | None) -> None:
    with session_factory.begin() as session:
        session.get_one(Loop, loop_id).budget_usd = Decimal(budget) if budget else None


@pytest.fixture
def estimates(session_factory: SessionFactory) -> EstimateActivities:
    return EstimateActivities(session_factory, PRICES)


def test_phase_costs_land_in_the_ledger(session_factory: SessionFactory) -> None:
    loop_id, name = make_loop(session_factory)
    cycle_id = accounted_cycle(session_factory, loop_id, name)
    with session_factory() as session:
        cycle = session.get_one(Cycle, cycle_id)
        phases, cost = cycle.cost_by_phase, cycle.cost_usd
    assert cost == Decimal("1.2")
    assert {name: p["cost_usd"] for name, p in phases.items()} == pytest.approx(
        {
            "rollout": 0.5,
            "scoring": 0.1,
            "update": 0.2,
            "sync": 0.12,
            "evaluation": 0.18,
            "other": 0.1,
        }
    )
    assert phases["rollout"]["seconds"] == 50.0
    assert sum(p["cost_usd"] for p in phases.values()) == pytest.approx(1.2)


def test_a_fitting_cycle_is_estimated_from_the_last_cycles_rates_and_recorded_once(
    session_factory: SessionFactory, estimates: EstimateActivities
) -> None:
    loop_id, name = make_loop(session_factory)
    accounted_cycle(session_factory, loop_id, name)
    set_budget(session_factory, loop_id, "10")
    cycle_id = open_cycle(session_factory, loop_id, 2)
    # cycle 1's work again: 10 steps of 2 tasks x 2 episodes, 10 eval tasks x 1 sample x two
    # checkpoints, three jobs (train, and one eval set for each checkpoint)
    ask = EstimateInput(name, 2, PROFILE, eval_task_counts=[10], samples_per_task=1)
    result = estimates.estimate_cycle(ask)
    # rollout+scoring 0.6 per 40 episodes, update 0.2, evaluation 0.18, sync+other 0.11 a job
    assert result.fits and result.reason == ""
    assert result.estimate_usd == pytest.approx(0.6 + 0.2 + 0.18 + 3 * 0.11)
    assert result.left_usd == pytest.approx(8.8) and result.budget_usd == 10.0
    with session_factory() as session:
        cycle = session.get_one(Cycle, cycle_id)
        stored, usd = dict(cycle.estimate), cycle.estimate_usd
    assert float(usd or 0) == pytest.approx(result.estimate_usd)
    assert stored["measured_cycles"] == 1 and stored["rates"]["rollout"]["measured"] is True
    assert stored["planned"] == {
        "steps": 10,
        "episodes": 40,
        "eval_tasks": 10,
        "eval_samples": 20,
        "jobs": 3,
    }
    # a retry answers as the first attempt did, whatever changed since
    set_budget(session_factory, loop_id, "0.01")
    assert estimates.estimate_cycle(ask) == result


def test_an_over_budget_cycle_is_refused_and_pauses_the_loop(
    session_factory: SessionFactory, estimates: EstimateActivities
) -> None:
    loop_id, name = make_loop(session_factory)
    accounted_cycle(session_factory, loop_id, name)
    set_budget(session_factory, loop_id, "1.50")  # $1.20 spent, $0.30 left
    open_cycle(session_factory, loop_id, 2)
    result = estimates.estimate_cycle(
        EstimateInput(name, 2, PROFILE, eval_task_counts=[10], samples_per_task=1)
    )
    assert not result.fits
    assert "exceeds the $0.3000 left of the loop's $1.50 budget" in result.reason
    with session_factory() as session:
        loop = session.get_one(Loop, loop_id)
        assert loop.status == "paused"
        assert loop.status_reason == f"cycle 2 refused: {result.reason}"


def test_before_any_cycle_the_documented_defaults_price_the_estimate(
    session_factory: SessionFactory, estimates: EstimateActivities
) -> None:
    loop_id, name = make_loop(session_factory)
    open_cycle(session_factory, loop_id, 1)
    result = estimates.estimate_cycle(
        EstimateInput(name, 1, PROFILE, eval_task_counts=[10], samples_per_task=1)
    )
    d = DEFAULT_COMPUTE_S_PER_UNIT
    compute_s = (
        40 * (d["rollout"] + d["scoring"])
        + 10 * d["update"]
        + 20 * d["evaluation"]
        + 3 * (d["sync"] + d["other"])
    )
    assert result.fits and result.left_usd is None  # no budget: nothing to refuse
    assert result.estimate_usd == pytest.approx(compute_s * 0.0001)  # CPU jobs


def test_an_invalid_profile_or_an_unknown_cycle_fails_without_retrying(
    session_factory: SessionFactory, estimates: EstimateActivities
) -> None:
    loop_id, name = make_loop(session_factory)
    open_cycle(session_factory, loop_id, 1)
    bad = EstimateInput(name, 1, TrainingProfile.model_construct(hyperparameters={"steps": -1}))
    with pytest.raises(ApplicationError, match="invalid training profile") as caught:
        estimates.estimate_cycle(bad)
    assert caught.value.non_retryable and caught.value.type == "InvalidPolicy"
    with pytest.raises(ApplicationError, match="cycle 9") as missing:
        estimates.estimate_cycle(EstimateInput(name, 9, PROFILE))
    assert missing.value.non_retryable and missing.value.type == "NotFound"


def test_a_loop_that_has_measured_nothing_calibrates_and_is_estimated_from_the_pass(
    session_factory: SessionFactory, estimates: EstimateActivities
) -> None:
    """Cycle 1 of a fresh loop needs a calibration pass; its succeeded run prices the
    estimate (with the pass's range), and a failed one leaves the defaults, said so."""
    loop_id, name = make_loop(session_factory)
    cycle_id = open_cycle(session_factory, loop_id, 1)
    assert estimates.calibration_needed(CalibrationInput(name, 1)).needed
    phases = {
        "rollout": {"seconds": 8.0},
        "scoring": {"seconds": 2.0},
        "update": {"seconds": 4.0},
        "sync": {"seconds": 4.0},
    }
    add_run(
        session_factory,
        loop_id,
        cycle_id,
        f"{name}-c1-calibrate",
        kind="calibrate",
        metrics={"phases": phases, "steps": 2, "episodes": 8, "calibration": True},
        cost="0.04",
        wall_s=20.0,
    )
    result = estimates.estimate_cycle(
        EstimateInput(
            name,
            1,
            PROFILE,
            eval_task_counts=[10],
            samples_per_task=1,
            calibration_run_id=f"{name}-c1-calibrate",
        )
    )
    # 40 episodes and 20 eval samples at $0.0025, 10 steps at $0.004, 3 jobs at $0.012
    assert result.estimate_usd == pytest.approx(40 * 0.0025 + 20 * 0.0025 + 10 * 0.004 + 0.036)
    assert result.calibrated and result.basis == f"calibrated by run {name}-c1-calibrate"
    assert result.low_usd == pytest.approx(result.estimate_usd * CALIBRATED_SPREAD[0])
    assert result.high_usd == pytest.approx(result.estimate_usd * CALIBRATED_SPREAD[1])
    # estimated: no second pass on a retry
    assert not estimates.calibration_needed(CalibrationInput(name, 1)).needed

    # A pass that left no run (or failed): the defaults, and the refusal says so.
    other_id, other = make_loop(session_factory)
    open_cycle(session_factory, other_id, 1)
    set_budget(session_factory, other_id, "0.0001")
    failed = estimates.estimate_cycle(
        EstimateInput(other, 1, PROFILE, calibration_run_id=f"{other}-c1-calibrate")
    )
    assert not failed.fits and not failed.calibrated
    assert f"NOT calibrated (the calibration pass, run {other}-c1-calibrate (missing)" in (
        failed.reason
    )


def test_once_a_cycle_is_accounted_no_calibration_is_needed(
    session_factory: SessionFactory, estimates: EstimateActivities
) -> None:
    loop_id, name = make_loop(session_factory)
    accounted_cycle(session_factory, loop_id, name)
    open_cycle(session_factory, loop_id, 2)
    assert not estimates.calibration_needed(CalibrationInput(name, 2)).needed
    result = estimates.estimate_cycle(EstimateInput(name, 2, PROFILE, eval_task_counts=[10]))
    assert result.basis.startswith("measured over 1 cycle(s)")
