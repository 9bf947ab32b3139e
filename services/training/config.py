"""The trainers' hyper-parameters, defined once, and the one check of a loop's or job's values.

Standard library only, on purpose: the api checks a loop's training profile with this module
when the loop is created or changed (the api never imports torch), so a typo or an
out-of-range value is refused at the door instead of failing a train job hours later, after
curation. Every train job checks its spec with the same code again, because a job trusts
nothing it is handed.

Each algorithm has one config dataclass (:class:`GRPOConfig`, :class:`SFTConfig`) that its
one trainer (``grpo``, ``sft``) takes for every family; a family with other defaults or
fields of its own has a subclass (hf: :class:`HFGRPOConfig`, :class:`HFSFTConfig`, with
LoRA and ``recovery_fraction``). ``CONFIGS`` names the class of each (family, algorithm)
pair, so a job or a loop profile refuses another family's keys. A bound a value must keep
lives next to its field (``field(metadata=_bounds(...))``), so the error names the key and
the range. The few keys a
job reads besides its trainer's config (``threads``; for tiny SFT ``augment_fraction``; for
a tiny model built from scratch ``model``) are listed in ``_JOB_OPTIONS``.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

FAMILIES = ("tiny", "hf")
ALGORITHMS = ("grpo", "sft")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class HyperparameterError(ValueError):
    """A hyper-parameter a trainer cannot use; ``key`` names it (None: a relation of keys)."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


def _bounds(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    why: str = "",
) -> dict[str, Any]:
    return {"bounds": (low, high, low_open, high_open), "why": why}


def _range_text(bounds: tuple[float | None, float | None, bool, bool]) -> str:
    low, high, low_open, high_open = bounds
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _out_of_range(value: float, bounds: tuple[float | None, float | None, bool, bool]) -> bool:
    low, high, low_open, high_open = bounds
    if low is not None and (value < low or (low_open and value == low)):
        return True
    return high is not None and (value > high or (high_open and value == high))


def check_bounds(config: object) -> None:
    """Raise :class:`HyperparameterError` for the first field outside its declared range."""
    for f in fields(config):  # type: ignore[arg-type]
        bounds = f.metadata.get("bounds")
        value = getattr(config, f.name)
        if bounds is not None and _out_of_range(value, bounds):
            why = f": {f.metadata['why']}" if f.metadata.get("why") else ""
            raise HyperparameterError(
                f.name, f"{f.name} must be {_range_text(bounds)}, got {value!r}{why}"
            )


_GROUP = "advantages are relative to the group"
_SAMPLING = "GRPO samples its groups"


class _Checked:
    """What every trainer config does: refuse out-of-range fields, and dump as JSON would."""

    def __post_init__(self) -> None:
        check_bounds(self)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)  # type: ignore[call-overload]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}


@dataclass(frozen=True)
class GRPOConfig(_Checked):
    """GRPO hyper-parameters of every family; the defaults are the tiny toolcalc
    drift-recovery run (:class:`HFGRPOConfig` has the hf defaults and LoRA)."""

    steps: int = field(default=40, metadata=_bounds(0))
    tasks_per_step: int = field(default=8, metadata=_bounds(1))
    group_size: int = field(default=16, metadata=_bounds(2, why=_GROUP))
    temperature: float = field(default=1.0, metadata=_bounds(0, low_open=True, why=_SAMPLING))
    max_turns: int = field(default=4, metadata=_bounds(1))
    max_new_tokens: int = field(default=16, metadata=_bounds(1))
    lr: float = field(default=3e-4, metadata=_bounds(0, low_open=True))
    warmup: int = field(default=0, metadata=_bounds(0))
    min_lr_ratio: float = field(default=1.0, metadata=_bounds(0, 1))
    weight_decay: float = field(default=0.0, metadata=_bounds(0))
    grad_clip: float = field(default=1.0, metadata=_bounds(0))
    clip_eps: float = field(default=0.2, metadata=_bounds(0, low_open=True))
    kl_coef: float = field(default=0.0, metadata=_bounds(0))
    sft_coef: float = field(default=0.0, metadata=_bounds(0))
    ppo_epochs: int = field(default=1, metadata=_bounds(1))
    adv_eps: float = field(default=1e-4, metadata=_bounds(0))
    micro_batch: int = field(default=64, metadata=_bounds(1))
    # steps between resume points (0: none), given a state dir
    checkpoint_every: int = field(default=10, metadata=_bounds(0))
    seed: int = 0
    log_every: int = field(default=1, metadata=_bounds(0))


@dataclass(frozen=True)
class SFTConfig(_Checked):
    """SFT hyper-parameters of every family; the defaults make the tiny toolcalc champion on
    two CPU cores (:class:`HFSFTConfig` has the hf defaults, LoRA and recovery)."""

    steps: int = field(default=1200, metadata=_bounds(0))
    batch_size: int = field(default=48, metadata=_bounds(1))
    # sequences per forward/backward pass (a step's gradient is the same whatever it is)
    micro_batch: int = field(default=64, metadata=_bounds(1))
    lr: float = field(default=3e-3, metadata=_bounds(0, low_open=True))
    warmup: int = field(default=30, metadata=_bounds(0))
    min_lr_ratio: float = field(default=0.05, metadata=_bounds(0, 1))
    weight_decay: float = field(default=0.01, metadata=_bounds(0))
    grad_clip: float = field(default=1.0, metadata=_bounds(0))
    seed: int = 0
    log_every: int = field(default=100, metadata=_bounds(0))


@dataclass(frozen=True)
class LoRAOptions(_Checked):
    """Whether and how to train an adapter rather than every weight (hf only)."""

    lora: bool = True
    lora_r: int = field(default=16, metadata=_bounds(1))
    lora_alpha: int = field(default=32, metadata=_bounds(1))
    lora_dropout: float = field(default=0.0, metadata=_bounds(0, 1, high_open=True))
    lora_target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field in its range (``check_bounds``) and at least one module to adapt."""
        check_bounds(self)
        if not self.lora_target_modules or not all(
            isinstance(m, str) and m for m in self.lora_target_modules
        ):
            raise ValueError("lora_target_modules must be a non-empty list of module names")


@dataclass(frozen=True)
class HFSFTConfig(SFTConfig, LoRAOptions):
    """:class:`SFTConfig` for hf models (defaults: SmolLM2-135M, LoRA, toolcalc chat), plus
    the hf-only ``recovery_fraction``."""

    steps: int = field(default=60, metadata=_bounds(0))
    batch_size: int = field(default=8, metadata=_bounds(1))
    micro_batch: int = field(default=4, metadata=_bounds(1))
    lr: float = field(default=1e-3, metadata=_bounds(0, low_open=True))
    warmup: int = field(default=5, metadata=_bounds(0))
    min_lr_ratio: float = field(default=0.1, metadata=_bounds(0, 1))
    weight_decay: float = field(default=0.0, metadata=_bounds(0))
    # share of the conversations that first recover from a tool's usage error (the slip is
    # context, never a target): see services.training.hf.rollout.demonstration_sequences
    recovery_fraction: float = field(default=0.0, metadata=_bounds(0, 1))
    log_every: int = field(default=10, metadata=_bounds(0))


@dataclass(frozen=True)
class HFGRPOConfig(GRPOConfig, LoRAOptions):
    """:class:`GRPOConfig` for hf models (defaults sized for SmolLM2-135M on CPU), plus LoRA."""

    steps: int = field(default=8, metadata=_bounds(0))
    tasks_per_step: int = field(default=4, metadata=_bounds(1))
    group_size: int = field(default=4, metadata=_bounds(2, why=_GROUP))
    max_new_tokens: int = field(default=40, metadata=_bounds(1))
    lr: float = field(default=2e-4, metadata=_bounds(0, low_open=True))
    micro_batch: int = field(default=4, metadata=_bounds(1))
    # an hf step takes minutes on CPU; a LoRA resume point is a few MB
    checkpoint_every: int = field(default=2, metadata=_bounds(0))


TrainerConfig = GRPOConfig | SFTConfig  # HFGRPOConfig and HFSFTConfig are subclasses

CONFIGS: dict[tuple[str, str], type[TrainerConfig]] = {
    ("tiny", "grpo"): GRPOConfig,
    ("tiny", "sft"): SFTConfig,
    ("hf", "grpo"): HFGRPOConfig,
    ("hf", "sft"): HFSFTConfig,
}


@dataclass(frozen=True)
class JobOptions:
    """What a train job reads besides its trainer's config."""

    threads: int | None = None  # torch threads; None: torch's default
    augment_fraction: float = 0.0  # tiny SFT: share of demonstrations with a drifted tool API
    model: Mapping[str, Any] | None = None  # tiny, no base checkpoint: the GPTConfig to build


# The job options each (family, algorithm) accepts, besides its trainer config's fields.
_JOB_OPTIONS: dict[tuple[str, str], frozenset[str]] = {
    ("tiny", "grpo"): frozenset({"threads", "model"}),
    ("tiny", "sft"): frozenset({"threads", "model", "augment_fraction"}),
    ("hf", "grpo"): frozenset({"threads"}),
    ("hf", "sft"): frozenset({"threads"}),
}


@dataclass(frozen=True)
class Hyperparameters:
    """A job's hyper-parameters, checked: the trainer's config and the job's own options."""

    config: TrainerConfig
    options: JobOptions


def known_keys(family: str, algorithm: str) -> frozenset[str]:
    """Every hyper-parameter a ``family`` ``algorithm`` job accepts (``seed`` is the spec's)."""
    config_cls = _config_class(family, algorithm)
    names = {f.name for f in fields(config_cls)} - {"seed"}
    return frozenset(names) | _JOB_OPTIONS[(family, algorithm)]


def parse_hyperparameters(
    family: str, algorithm: str, raw: Mapping[str, object], *, seed: int = 0
) -> Hyperparameters:
    """Check ``raw`` for a ``family`` ``algorithm`` job; raises :class:`HyperparameterError`.

    Unknown keys, values of the wrong type and values out of range are refused with the key
    named; numbers are taken as JSON gives them (an int where a float is expected is fine,
    a bool or a string is not).
    """
    config_cls = _config_class(family, algorithm)
    known = known_keys(family, algorithm)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise HyperparameterError(
            unknown[0],
            f"unknown hyperparameter(s) for {config_cls.__name__}: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})",
        )
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    for f in fields(config_cls):
        if f.name in raw and f.name != "seed":
            values[f.name] = _typed(f.name, hints[f.name], raw[f.name])
    try:
        config = config_cls(**values, seed=seed)
    except HyperparameterError:
        raise
    except (TypeError, ValueError) as exc:
        raise HyperparameterError(None, f"invalid hyperparameters: {exc}") from None
    return Hyperparameters(config=config, options=_job_options(raw))


def _config_class(family: str, algorithm: str) -> type[TrainerConfig]:
    if family not in FAMILIES:
        raise HyperparameterError(None, f"unknown model family {family!r}; known: tiny, hf")
    if algorithm not in ALGORITHMS:
        raise HyperparameterError(
            None, f"unknown algorithm {algorithm!r} (expected one of {', '.join(ALGORITHMS)})"
        )
    return CONFIGS[(family, algorithm)]


def _typed(key: str, hint: object, value: object) -> Any:
    """``value`` as the field's type, or a :class:`HyperparameterError` naming ``key``."""
    if hint is bool:
        if not isinstance(value, bool):
            raise HyperparameterError(key, f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise HyperparameterError(key, f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise HyperparameterError(key, f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise HyperparameterError(key, f"{key} must be a finite number, got {value!r}")
        return float(value)
    # tuple[str, ...]: lora_target_modules. A loop's profile holds scalars, so "q_proj,v_proj".
    items = [part.strip() for part in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) and i for i in items):
        raise HyperparameterError(key, f"{key} must be a list of module names, got {value!r}")
    return tuple(items)


def _job_options(raw: Mapping[str, object]) -> JobOptions:
    threads = raw.get("threads")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise HyperparameterError("threads", "threads must be a positive integer")
    augment = raw.get("augment_fraction", 0.0)
    if (
        isinstance(augment, bool)
        or not isinstance(augment, int | float)
        or not 0.0 <= float(augment) <= 1.0
    ):
        raise HyperparameterError("augment_fraction", "augment_fraction must be a number in [0, 1]")
    model = raw.get("model")
    if model is not None and not isinstance(model, Mapping):
        raise HyperparameterError("model", "model must be an object of GPTConfig fields")
    return JobOptions(threads=threads, augment_fraction=float(augment), model=model)
