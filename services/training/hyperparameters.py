"""The hyper-parameter names each trainer accepts, for validating a loop's training profile.

Standard library only, so the api can check a profile without importing torch; a test keeps
these in step with the trainers' config dataclasses.
"""

from __future__ import annotations

LORA_KEYS = frozenset({"lora", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"})
HF_SFT_KEYS = LORA_KEYS | frozenset(
    {
        "steps",
        "batch_size",
        "micro_batch",
        "lr",
        "warmup",
        "min_lr_ratio",
        "weight_decay",
        "grad_clip",
        "log_every",
        "threads",
    }
)
HF_GRPO_KEYS = LORA_KEYS | frozenset(
    {
        "steps",
        "tasks_per_step",
        "group_size",
        "temperature",
        "max_turns",
        "max_new_tokens",
        "lr",
        "warmup",
        "min_lr_ratio",
        "weight_decay",
        "grad_clip",
        "clip_eps",
        "kl_coef",
        "adv_eps",
        "micro_batch",
        "log_every",
        "threads",
    }
)


def unknown_hf_keys(algorithm: str, keys: set[str]) -> list[str]:
    """The keys an hf trainer of ``algorithm`` would refuse, sorted."""
    known = HF_GRPO_KEYS if algorithm == "grpo" else HF_SFT_KEYS
    return sorted(keys - known)
