"""Costs by phase and the estimate's arithmetic (services.loop.estimate), with exact values."""

from __future__ import annotations

import pytest

from services.loop.estimate import (
    CALIBRATED_SPREAD,
    DEFAULT_COMPUTE_S_PER_UNIT,
    DEFAULT_SPREAD,
    PlannedWork,
    Prices,
    RunRecord,
    calibrated_rates,
    cycle_phase_costs,
    default_rates,
    estimate_cycle,
    measured_rates,
    planned_work,
    run_phase_costs,
)
from services.loop.policies import TrainingProfile

PRICES = Prices(accelerator_hour_usd=3.6, cpu_hour_usd=0.36)  # $0.001 / $0.0001 a second


def train_run(*, cost: float = 1.0, episodes: int = 40, steps: int = 10) -> RunRecord:
    phases = {
        "rollout": {"seconds": 50.0},
        "scoring": {"seconds": 10.0},
        "update": {"seconds": 20.0},
        "sync": {"seconds": 10.0},
    }
    metrics = {"phases": phases, "episodes": episodes, "steps": steps}
    return RunRecord("train", metrics, wall_s=100.0, compute_s=200.0, cost_usd=cost)


def eval_run(*, n: int = 10, samples: int = 2, cost: float = 0.2) -> RunRecord:
    metrics = {"phases": {"sync": {"seconds": 2.0}, "evaluation": {"seconds": 18.0}}}
    metrics |= {"n": n, "samples": samples}
    return RunRecord("eval", metrics, wall_s=20.0, compute_s=20.0, cost_usd=cost)


def test_a_runs_cost_is_split_by_its_phase_seconds_and_the_rest_is_other() -> None:
    costs = run_phase_costs(train_run())
    assert {name: c.cost_usd for name, c in costs.items()} == pytest.approx(
        {"rollout": 0.5, "scoring": 0.1, "update": 0.2, "sync": 0.1, "other": 0.1}
    )
    assert costs["rollout"].compute_s == pytest.approx(100.0)
    assert costs["other"].seconds == pytest.approx(10.0)
    assert sum(c.cost_usd for c in costs.values()) == pytest.approx(1.0)


def test_a_job_without_phases_is_all_evaluation_or_all_other() -> None:
    bare_eval = RunRecord("eval", {}, wall_s=5.0, compute_s=5.0, cost_usd=0.3)
    assert run_phase_costs(bare_eval)["evaluation"].cost_usd == pytest.approx(0.3)
    byo_trainer = RunRecord("train", {"phases": "junk"}, wall_s=5.0, compute_s=5.0, cost_usd=0.3)
    assert set(run_phase_costs(byo_trainer)) == {"other"}


def test_cycle_phases_add_up_to_the_cycles_cost() -> None:
    phases = cycle_phase_costs([train_run(), eval_run(), eval_run()])
    assert list(phases) == ["rollout", "scoring", "update", "sync", "evaluation", "other"]
    assert phases["evaluation"]["cost_usd"] == pytest.approx(0.36)
    assert sum(p["cost_usd"] for p in phases.values()) == pytest.approx(1.4)


def test_measured_rates_are_per_episode_step_eval_sample_and_job() -> None:
    rates = measured_rates([train_run(), eval_run(n=10, samples=2)])
    assert rates["rollout"].usd == pytest.approx(0.5 / 40)  # per episode
    assert rates["update"].usd == pytest.approx(0.2 / 10)  # per step
    assert rates["evaluation"].usd == pytest.approx(0.18 / 20)  # per eval sample
    assert rates["sync"].usd == pytest.approx((0.1 + 0.02) / 2)  # per job
    assert rates["rollout"].compute_s == pytest.approx(100.0 / 40)
    assert all(rate.measured for rate in rates.values())


def test_planned_work_from_the_profile_and_the_snapshot() -> None:
    grpo = TrainingProfile(hyperparameters={"steps": 5, "tasks_per_step": 4, "group_size": 8})
    work = planned_work(grpo, eval_task_counts=[20, 10, 0], samples_per_task=4)
    assert work == PlannedWork(steps=5, episodes=160, eval_tasks=30, eval_samples=240, jobs=5)
    sft = TrainingProfile(algorithm="sft", hyperparameters={"steps": 7})
    assert planned_work(sft, eval_task_counts=[3], samples_per_task=1).episodes == 0


def test_default_rates_are_priced_at_each_jobs_resources() -> None:
    profile = TrainingProfile(accelerators=2, nodes=2, eval_accelerators=0)
    rates = default_rates(profile, PRICES)
    assert rates["update"].usd == pytest.approx(DEFAULT_COMPUTE_S_PER_UNIT["update"] * 0.001)
    assert rates["evaluation"].usd == pytest.approx(
        DEFAULT_COMPUTE_S_PER_UNIT["evaluation"] * 0.0001
    )
    assert not any(rate.measured for rate in rates.values())


WORK = PlannedWork(steps=10, episodes=40, eval_tasks=10, eval_samples=40, jobs=3)


def test_the_estimate_prices_the_planned_work_at_the_measured_rates() -> None:
    measured = measured_rates([train_run(), eval_run(), eval_run()])
    defaults = default_rates(TrainingProfile(), PRICES)
    estimate = estimate_cycle(
        WORK, measured=measured, defaults=defaults, measured_cycles=1, budget_usd=10, spent_usd=2
    )
    # the same work as the measured cycle (one train and two eval jobs of the same size)
    assert estimate.usd == pytest.approx(1.4)
    assert estimate.fits and estimate.left_usd == 8.0 and estimate.reason == ""
    assert estimate.phases["rollout"] == {"units": 40.0, "compute_s": 100.0, "cost_usd": 0.5}
    stored = estimate.to_json()
    assert stored["rates"]["update"]["measured"] is True and stored["planned"]["steps"] == 10


def test_an_estimate_over_what_is_left_is_refused_with_its_reason() -> None:
    measured = measured_rates([train_run(cost=10.0)])
    defaults = default_rates(TrainingProfile(), PRICES)
    estimate = estimate_cycle(
        WORK, measured=measured, defaults=defaults, measured_cycles=1, budget_usd=12, spent_usd=9
    )
    assert not estimate.fits
    assert "exceeds the $3.0000 left of the loop's $12.00 budget" in estimate.reason
    assert "10 steps, 40 episodes and 40 eval samples" in estimate.reason
    no_budget = estimate_cycle(
        WORK, measured=measured, defaults=defaults, measured_cycles=1, budget_usd=None, spent_usd=9
    )
    assert no_budget.fits and no_budget.left_usd is None


def calibration_run() -> RunRecord:
    """A calibration pass: 8 episodes and 2 steps in 20 s, $0.04 (services.training.calibration)."""
    phases = {
        "rollout": {"seconds": 8.0},
        "scoring": {"seconds": 2.0},
        "update": {"seconds": 4.0},
        "sync": {"seconds": 4.0},
    }
    metrics = {"phases": phases, "episodes": 8, "steps": 2, "calibration": True}
    return RunRecord("calibrate", metrics, wall_s=20.0, compute_s=20.0, cost_usd=0.04)


def test_a_calibration_pass_prices_every_phase_with_its_spread() -> None:
    rates = calibrated_rates(calibration_run())
    assert rates["rollout"].usd == pytest.approx(0.016 / 8)  # per episode
    assert rates["update"].usd == pytest.approx(0.008 / 2)  # per step
    assert rates["other"].usd == pytest.approx(0.004)  # per job: the 2 s nothing claimed
    # an eval sample is an episode of the same model through the same engine
    assert rates["evaluation"].usd == pytest.approx(rates["rollout"].usd + rates["scoring"].usd)
    low, high = CALIBRATED_SPREAD
    assert rates["update"].usd_range == pytest.approx((0.004 * low, 0.004 * high))
    assert {rate.basis for rate in rates.values()} == {"calibrated"}
    # a pass is not a cycle's rate: measured rates leave it out
    assert measured_rates([calibration_run()]) == {}


def test_the_estimate_says_what_it_rests_on_and_spans_its_range() -> None:
    defaults = default_rates(TrainingProfile(), PRICES)
    blind = estimate_cycle(
        WORK, measured={}, defaults=defaults, measured_cycles=0, budget_usd=None, spent_usd=0
    )
    low, high = DEFAULT_SPREAD
    assert (blind.low_usd, blind.high_usd) == pytest.approx((blind.usd * low, blind.usd * high))
    assert not blind.calibrated and blind.basis.startswith("NOT calibrated: default rates")
    failed = estimate_cycle(
        WORK,
        measured={},
        defaults=defaults,
        measured_cycles=0,
        budget_usd=None,
        spent_usd=0,
        calibration="run demo-c1-calibrate (failed)",
    )
    assert "NOT calibrated (the calibration pass, run demo-c1-calibrate (failed)" in failed.basis
    calibrated = estimate_cycle(
        WORK,
        measured={},
        defaults=defaults,
        measured_cycles=0,
        budget_usd=0.01,
        spent_usd=0,
        calibrated=calibrated_rates(calibration_run()),
        calibration="run demo-c1-calibrate",
    )
    assert calibrated.calibrated and calibrated.basis == "calibrated by run demo-c1-calibrate"
    # 40 episodes, 10 steps, 40 eval samples, 3 jobs at the pass's rates
    assert calibrated.usd == pytest.approx(40 * 0.0025 + 10 * 0.004 + 40 * 0.0025 + 3 * 0.012)
    assert calibrated.low_usd < calibrated.usd < calibrated.high_usd
    assert not calibrated.fits
    assert "(range $" in calibrated.reason and "calibrated by run demo-c1-calibrate" in (
        calibrated.reason
    )
    # measured over cycles: the range is the runs' own
    measured = measured_rates([train_run(cost=1.0), train_run(cost=2.0)])
    assert measured["update"].usd_range == pytest.approx((0.2 / 10, 0.4 / 10))
    both = estimate_cycle(
        WORK, measured=measured, defaults=defaults, measured_cycles=2, budget_usd=None, spent_usd=0
    )
    assert both.basis.startswith("measured over 2 cycle(s); ")
    assert both.basis.endswith("at default rates, not measured for this loop")
    assert "NOT calibrated" not in both.basis  # it measured something: the defaults by phase


def test_planned_work_counts_rfts_replay() -> None:
    rft = TrainingProfile(
        algorithm="rft",
        hyperparameters={"samples_per_task": 4, "iterations": 2, "replay_tasks": 8},
    )
    work = planned_work(
        rft, eval_task_counts=[], samples_per_task=1, train_tasks=10, replay_tasks=5
    )
    assert work.episodes == 2 * 4 * 10 + 5  # rounds, then one greedy episode x 5 tasks
    sampled = TrainingProfile(
        algorithm="rft",
        hyperparameters={**rft.hyperparameters, "replay_temperature": 0.7},
    )
    work = planned_work(
        sampled, eval_task_counts=[], samples_per_task=1, train_tasks=10, replay_tasks=5
    )
    assert work.episodes == 2 * 4 * 10 + 2 * 5  # replay_samples (2) x 5 tasks
