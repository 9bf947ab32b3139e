"""The one check of training hyper-parameters, shared by the api and the train jobs."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest

from services.training.config import (
    ALGORITHMS,
    GRPOConfig,
    HFGRPOConfig,
    HFSFTConfig,
    HyperparameterError,
    SFTConfig,
    known_keys,
    parse_hyperparameters,
)


def test_no_hyperparameters_are_the_trainers_defaults() -> None:
    for algorithm, entry in ALGORITHMS.items():
        for family, config_cls in entry.configs.items():
            checked = parse_hyperparameters(family, algorithm, {}, seed=3)
            assert checked.config == config_cls(seed=3)
            assert checked.options.threads is None and checked.options.augment_fraction == 0.0


def test_values_are_taken_as_json_gives_them() -> None:
    checked = parse_hyperparameters(
        "hf", "grpo", {"lr": 1, "steps": 3, "lora_target_modules": "q_proj, v_proj", "threads": 2}
    )
    assert isinstance(checked.config, HFGRPOConfig)
    assert checked.config.lr == 1.0 and isinstance(checked.config.lr, float)
    assert checked.config.lora_target_modules == ("q_proj", "v_proj")
    assert checked.options.threads == 2


@pytest.mark.parametrize(
    ("family", "algorithm", "raw", "key", "message"),
    [
        ("tiny", "grpo", {"lrr": 0.1}, "lrr", "unknown hyperparameter(s) for GRPOConfig: lrr"),
        ("tiny", "grpo", {"augment_fraction": 0.1}, "augment_fraction", "unknown"),
        ("hf", "sft", {"model": {}}, "model", "unknown hyperparameter(s) for HFSFTConfig"),
        ("tiny", "grpo", {"group_size": 1}, "group_size", "group_size must be >= 2, got 1"),
        ("tiny", "grpo", {"temperature": 0}, "temperature", "temperature must be > 0"),
        ("tiny", "sft", {"lr": 0}, "lr", "lr must be > 0"),
        ("tiny", "sft", {"min_lr_ratio": 1.5}, "min_lr_ratio", "must be in [0, 1]"),
        ("tiny", "sft", {"steps": 1.5}, "steps", "steps must be an integer"),
        ("tiny", "sft", {"steps": True}, "steps", "steps must be an integer"),
        ("tiny", "sft", {"lr": "fast"}, "lr", "lr must be a number"),
        ("tiny", "sft", {"lr": float("inf")}, "lr", "lr must be a finite number"),
        ("tiny", "sft", {"augment_fraction": 2}, "augment_fraction", "in [0, 1]"),
        ("tiny", "sft", {"threads": 0}, "threads", "threads must be a positive integer"),
        ("hf", "sft", {"lora": "yes"}, "lora", "lora must be true or false"),
        ("hf", "grpo", {"lora_dropout": 1.0}, "lora_dropout", "must be in [0, 1)"),
        ("hf", "grpo", {"lora_target_modules": 3}, "lora_target_modules", "list of module"),
        ("hf", "grpo", {"kl_coef": -0.1}, "kl_coef", "kl_coef must be >= 0"),
    ],
)
def test_bad_values_are_refused_naming_the_key(
    family: str, algorithm: str, raw: dict[str, object], key: str, message: str
) -> None:
    with pytest.raises(HyperparameterError) as info:
        parse_hyperparameters(family, algorithm, raw)
    assert info.value.key == key
    assert message in info.value.message


def test_an_unknown_family_or_algorithm_is_refused() -> None:
    with pytest.raises(HyperparameterError, match="unknown model family 'big'"):
        parse_hyperparameters("big", "grpo", {})
    with pytest.raises(HyperparameterError, match="unknown algorithm 'ppo'"):
        parse_hyperparameters("tiny", "ppo", {})


def test_the_trainers_configs_refuse_out_of_range_values_when_built_directly() -> None:
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="lr"):
        SFTConfig(lr=-1.0)
    with pytest.raises(ValueError, match="lora_r"):
        HFSFTConfig(lora_r=0)


def test_known_keys_are_the_config_fields_and_the_job_options() -> None:
    grpo_fields = {f.name for f in fields(GRPOConfig)} - {"seed"}
    assert known_keys("tiny", "grpo") == grpo_fields | {"threads", "model"}
    sft_fields = {f.name for f in fields(SFTConfig)} - {"seed"}
    assert known_keys("tiny", "sft") == sft_fields | {"threads", "model", "augment_fraction"}


def test_the_config_module_imports_nothing_heavy() -> None:
    """The api checks loops with it, and the api never imports torch."""
    code = (
        "import sys, services.training.config; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'sqlalchemy') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
