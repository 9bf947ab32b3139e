"""A demo's options follow the champion it is asked for, and what the caller sets wins."""

from __future__ import annotations

import pytest

from services.curation.policy import CurationPolicy
from services.demo import smollm2
from services.demo.options import DemoOptions
from services.demo.run import loop_policies, served_model
from services.loop.policies import GatePolicy
from services.settings import Settings
from services.training.config import HFRFTConfig, parse_hyperparameters


def test_a_real_lm_demo_drifts_to_v3_and_waits_longer_unless_told() -> None:
    tiny = DemoOptions.for_model("tiny")
    real = DemoOptions.for_model("smollm2")
    assert (tiny.drift_to, tiny.timeout_s) == ("v2", 1500.0)
    assert (real.model, real.drift_to, real.timeout_s) == ("smollm2", "v3", 7200.0)
    assert real.drift_to == smollm2.DRIFT_TO


def test_what_the_caller_sets_wins_and_none_is_not_set() -> None:
    options = DemoOptions.for_model("smollm2", timeout_s=60.0, drift_to=None, cycles=2)
    assert (options.timeout_s, options.drift_to, options.cycles) == (60.0, "v3", 2)


def test_a_real_lm_demo_has_more_users_at_once_unless_told() -> None:
    assert DemoOptions.for_model("tiny").traffic_workers == 2
    assert DemoOptions.for_model("smollm2").traffic_workers == 8
    assert DemoOptions.for_model("smollm2", traffic_workers=3).traffic_workers == 3
    assert DemoOptions.for_model("smollm2", traffic_workers=None).traffic_workers == 8


def test_the_real_lm_champion_is_the_measured_recipe_its_job_accepts() -> None:
    parsed = parse_hyperparameters("hf", "sft", smollm2.SFT_HYPERPARAMETERS)
    assert parsed.config.recovery_fraction == 0.5  # type: ignore[attr-defined]
    assert smollm2.SFT_TASKS == 96


def test_the_real_lm_demo_trains_rft_candidates_its_jobs_accept() -> None:
    profile = smollm2.training_profile()
    assert (profile["algorithm"], profile["family"]) == ("rft", "hf")
    parsed = parse_hyperparameters("hf", "rft", profile["hyperparameters"])
    assert isinstance(parsed.config, HFRFTConfig)
    assert parsed.config.samples_per_task == 16 and parsed.config.iterations == 2


def test_the_demo_curates_a_held_out_set_sized_for_its_interval() -> None:
    """Every success curated (the held-out set has the traffic's mix) and three clusters in
    ten held out, a valid curation policy."""
    policy = CurationPolicy.from_json(DemoOptions.for_model("tiny").curation_policy)
    assert (policy.success_sample_rate, policy.heldout_fraction) == (1.0, 0.3)
    assert DemoOptions.for_model("smollm2").curation_policy == DemoOptions().curation_policy


@pytest.mark.parametrize(("temperature", "samples"), [(0.0, 1), (0.7, 4)])
def test_the_demos_gate_evaluates_at_the_temperature_its_agents_are_served_at(
    temperature: float, samples: int
) -> None:
    """Offline pass rates measure what is served: the demo's agents ask the model server
    for ``traffic_temperature`` and its gate samples the evaluations at the same one."""
    options = DemoOptions.for_model("smollm2", traffic_temperature=temperature)
    gate = GatePolicy.model_validate(loop_policies(options).gate_policy)
    assert (gate.eval_temperature, gate.eval_samples) == (temperature, samples)
    settings = Settings(serve_api_key="k", serve_port=9999)
    served = served_model(options, settings)
    assert (served.temperature, served.style) == (temperature, "chat")
