"""``training_profile.base_checkpoint`` and ``training_profile.bootstrap``: a bootstrap that
could never run is refused when the loop is saved, each error naming its key; a recorded
profile is read as it was; the bootstrap's train profile is SFT with its own keys."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from services.loop.policies import RECORDED, TrainingProfile

BASE = "c0ffee" + "0" * 58


def _errors(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ValidationError) as refused:
        TrainingProfile.model_validate(raw)
    return {".".join(map(str, e["loc"])): e["msg"] for e in refused.value.errors()}


@pytest.mark.parametrize(
    ("raw", "path", "words"),
    [
        (
            {"bootstrap": {"hyperparameters": {"stepz": 3}}},
            "bootstrap.hyperparameters.stepz",
            "unknown",
        ),
        (
            {"bootstrap": {"hyperparameters": {"lr": 0}}},
            "bootstrap.hyperparameters.lr",
            "lr must be",
        ),
        (
            {"bootstrap": {"hyperparameters": {"lora": False}}},
            "bootstrap.hyperparameters.lora",
            "LoRA",
        ),
        (
            {"bootstrap": {"hyperparameters": {"recovery_fraction": 0.5}}},
            "bootstrap.hyperparameters.recovery_fraction",
            "recorded conversations",
        ),
        ({"family": "hf", "bootstrap": {"auto": True}}, "bootstrap.auto", "base_checkpoint"),
        ({"base_checkpoint": BASE, "bootstrap": {"auto": True}}, "bootstrap.auto", "family hf"),
        ({"bootstrap": {"min_successes": 0}}, "bootstrap.min_successes", "greater than"),
        ({"base_checkpoint": "my-model"}, "base_checkpoint", "pattern"),
        ({"bootstrap": {"auto": True, "autoo": 1}}, "bootstrap.autoo", "Extra inputs"),
    ],
)
def test_a_bootstrap_that_could_never_run_is_refused(
    raw: dict[str, Any], path: str, words: str
) -> None:
    errors = _errors(raw)
    assert path in errors and words in errors[path], errors


def test_the_bootstraps_train_profile_is_sft_with_its_own_keys() -> None:
    profile = TrainingProfile.model_validate(
        {
            "family": "hf",
            "algorithm": ["rft", "grpo"],
            "hyperparameters": {"rft.steps": 4},
            "base_checkpoint": BASE,
            "bootstrap": {"auto": True, "hyperparameters": {"steps": 30, "lora_r": 8}},
        }
    )
    trained = profile.bootstrap_profile()
    assert (trained.algorithm, trained.hyperparameters) == ("sft", {"steps": 30, "lora_r": 8})
    assert (trained.family, trained.base_checkpoint) == ("hf", BASE)
    assert profile.algorithm == ["rft", "grpo"]  # the loop's own profile is untouched


def test_a_recorded_profile_reads_as_it_was() -> None:
    """A payload recorded before the bootstrap keys has none; one recorded with a key a later
    release refuses still reads (it is a fact of the history)."""
    assert TrainingProfile.model_validate({}, context=RECORDED).bootstrap.auto is False
    recorded = {"bootstrap": {"hyperparameters": {"lora": False}}}
    assert TrainingProfile.model_validate(recorded, context=RECORDED).bootstrap.hyperparameters
