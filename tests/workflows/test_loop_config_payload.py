"""``LoopConfig`` on the wire: nested typed policies, and the flat shape of older releases.

Committed histories (and workflows running in production) hold the flat payload that
``load_loop_config`` wrote before the policies were nested; the replay gate replays them, and
these tests pin the converter that reads both shapes and keeps writing the flat keys for a
worker of the previous release during a rolling deploy.
"""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from temporalio.converter import DataConverter

from services.curation.policy import CurationPolicy
from services.loop.policies import GatePolicy, TrainingProfile
from tests.workflows.test_loop import BASE_CONFIG, with_gate
from workflows.payloads.loop import LoopConfig

HISTORIES = Path(__file__).parent / "histories"


def encode(value: object) -> dict[str, Any]:
    [payload] = DataConverter.default.payload_converter.to_payloads([value])
    data: dict[str, Any] = json.loads(payload.data)
    return data


def decode(data: dict[str, Any], hint: type) -> Any:
    [payload] = DataConverter.default.payload_converter.to_payloads([data])
    [value] = DataConverter.default.payload_converter.from_payloads([payload], [hint])
    return value


def recorded_loop_config(history: str) -> dict[str, Any]:
    """The first ``load_loop_config`` result of a committed history, as JSON."""
    events = json.loads((HISTORIES / history).read_text())["events"]
    for event in events:
        attributes = event.get("activityTaskCompletedEventAttributes")
        for payload in (attributes or {}).get("result", {}).get("payloads", []):
            data = json.loads(base64.b64decode(payload["data"]))
            if isinstance(data, dict) and "loop_id" in data:
                return data
    raise AssertionError(f"{history} has no load_loop_config result")


def test_a_config_round_trips_with_its_policies_typed() -> None:
    config = replace(
        with_gate(BASE_CONFIG, mode="manual", eval_samples=4, eval_temperature=0.7),
        training_profile=TrainingProfile.model_validate(
            {"algorithm": "sft", "hyperparameters": {"steps": 10, "augment_fraction": 0.3}}
        ),
        curation_policy=CurationPolicy(difficulty_filter=True, probe_attempts=4),
        budget_usd=12.5,
        last_cycle_number=7,
    )
    data = encode(config)
    assert data["gate_policy"]["mode"] == "manual"
    assert data["training_profile"]["hyperparameters"] == {"steps": 10, "augment_fraction": 0.3}
    decoded = decode(data, LoopConfig)
    assert decoded == config
    assert isinstance(decoded.gate_policy, GatePolicy)


def test_the_flat_payload_of_a_committed_history_decodes_to_the_same_values() -> None:
    flat = recorded_loop_config("loop-honest.json")
    assert "gate_policy" not in flat  # recorded before the policies were nested
    config = decode(flat, LoopConfig)
    assert isinstance(config, LoopConfig)
    assert config.trigger_policy.min_new_tasks == flat["min_new_tasks"]
    assert config.trigger_policy.check_interval_s == flat["check_interval_s"]
    assert config.gate_policy.mode == flat["gate_mode"]
    assert config.gate_policy.eval_samples == flat["eval_samples"] == 4
    assert config.gate_policy.eval_temperature == flat["eval_temperature"]
    assert config.gate_policy.min_discordant_pairs == flat["min_discordant_pairs"]
    assert config.gate_policy.canary_seconds == flat["canary_seconds"]
    assert config.curation_policy.difficulty_filter == flat["difficulty_filter"]
    assert config.training_profile.algorithm == "grpo"
    assert config.last_cycle_number == flat["last_cycle_number"]


def test_a_flat_payload_from_before_the_sampled_gate_gets_that_releases_defaults() -> None:
    flat = recorded_loop_config("loop-promoted.json")
    assert "eval_temperature" not in flat and "min_discordant_pairs" not in flat
    config = decode(flat, LoopConfig)
    assert (config.gate_policy.eval_temperature, config.gate_policy.min_discordant_pairs) == (0, 0)
    assert config.curation_policy.difficulty_filter is False
    assert config.last_cycle_number == 0


def test_a_worker_of_the_previous_release_reads_what_a_new_activity_writes() -> None:
    """Its decoder reads the keys of the flat payload (a committed history holds one)."""
    config = replace(
        with_gate(BASE_CONFIG, mode="manual", eval_samples=2, eval_temperature=0.5),
        curation_policy=CurationPolicy(difficulty_filter=True, probe_attempts=3),
        last_cycle_number=4,
    )
    written = encode(config)
    previous_keys = set(recorded_loop_config("loop-honest.json"))
    assert previous_keys <= set(written)
    # Only what the flat keys carry: these policies' other fields are at their defaults.
    assert decode({key: written[key] for key in previous_keys}, LoopConfig) == config
    assert (written["gate_mode"], written["eval_samples"], written["eval_temperature"]) == (
        "manual",
        2,
        0.5,
    )
    assert written["training_profile"] == config.training_profile.model_dump(mode="json")


def test_a_recorded_profile_decodes_even_if_todays_trainer_check_would_refuse_it() -> None:
    """A history is a fact: a stricter check in a later release must not break its replay."""
    data = encode(BASE_CONFIG)
    data["training_profile"]["hyperparameters"] = {"retired_knob": 1}
    config = decode(data, LoopConfig)
    assert config.training_profile.hyperparameters == {"retired_knob": 1}


def test_the_typed_config_history_holds_the_nested_payload() -> None:
    """loop-typed-config.json (replayed by the gate) was recorded with this release's shape."""
    data = recorded_loop_config("loop-typed-config.json")
    assert data["gate_policy"]["eval_samples"] == data["eval_samples"] == 4
    assert data["curation_policy"]["difficulty_filter"] is data["difficulty_filter"] is True
    assert decode(data, LoopConfig).curation_policy.probe_attempts == 4
