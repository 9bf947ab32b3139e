"""The trainers' hyper-parameters, defined once, and the one check of a loop's or job's values.

Standard library only, on purpose: the api checks a loop's training profile with this module
when the loop is created or changed (the api never imports torch), so a typo or an
out-of-range value is refused at the door instead of failing a train job hours later, after
curation. Every train job checks its spec with the same code again, because a job trusts
nothing it is handed.

Each algorithm has one config dataclass (:class:`GRPOConfig`, :class:`SFTConfig`) that its
one trainer (``grpo``, ``sft``) takes for every family; a family with other defaults or
fields of its own has a subclass (hf: :class:`HFGRPOConfig`, :class:`HFSFTConfig`, with
LoRA and ``recovery_fraction``). :data:`ALGORITHMS` is the registry: one :class:`Algorithm`
per name, with its config class per family (so a job or a loop profile refuses another
family's keys), the few keys a job reads besides that config (``threads``; for tiny SFT
``augment_fraction``; for a tiny model built from scratch ``model``), and the stage function
the train job runs. A bound a value must keep lives next to its field
(``field(metadata=_bounds(...))``), so the error names the key and the range.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

FAMILIES = ("tiny", "hf")
STAGE_SEPARATOR = "."  # a chain's hyperparameter "rft.steps" is the rft stage's alone
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# How an hf model is spread over a job's ranks: "none" (each rank holds the whole model,
# gradients summed: data parallel) or "fsdp" (weights, gradients and optimizer state sharded
# with torch's FSDP2, services.training.hf.fsdp).
SHARDINGS = ("none", "fsdp")


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
_PAIRS = "a pair needs a success and a failure of one task"
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
    # adaptive sampling: probe each task, then spend the rest of the step's episode budget
    # (tasks_per_step x group_size) on the tasks between 0 and 1 (unsolved ones at a rate)
    adaptive_sampling: bool = False
    adaptive_probe: int = field(default=2, metadata=_bounds(1))
    adaptive_unsolved_rate: float = field(default=0.25, metadata=_bounds(0, 1))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adaptive_probe > self.group_size:
            raise HyperparameterError(
                "adaptive_probe",
                f"adaptive_probe must be <= group_size ({self.group_size}), got "
                f"{self.adaptive_probe}: the probe is part of each task's share of the budget",
            )


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
    """How an hf model trains (hf only): an adapter rather than every weight, and how the
    model is spread over the job's ranks (``sharding``, one of :data:`SHARDINGS`)."""

    lora: bool = True
    lora_r: int = field(default=16, metadata=_bounds(1))
    lora_alpha: int = field(default=32, metadata=_bounds(1))
    lora_dropout: float = field(default=0.0, metadata=_bounds(0, 1, high_open=True))
    lora_target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS
    sharding: str = "none"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field in its range (``check_bounds``), at least one module to adapt, and a
        known sharding."""
        check_bounds(self)
        if not self.lora_target_modules or not all(
            isinstance(m, str) and m for m in self.lora_target_modules
        ):
            raise ValueError("lora_target_modules must be a non-empty list of module names")
        if self.sharding not in SHARDINGS:
            raise HyperparameterError(
                "sharding",
                f"sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}",
            )


@dataclass(frozen=True)
class MismatchOptions(_Checked):
    """How far the engine that sampled the rollouts (the remote backend: vLLM, another
    ``ratchet serve``) may disagree with the trainer's own log-probs of the same tokens
    before the job stops: the mean per-token K3 estimate of KL(sampler || trainer)
    (services.training.mismatch). 1e-2 suits dense models in bf16; a stale or wrong adapter
    is orders of magnitude above it."""

    mismatch_threshold: float = field(default=1e-2, metadata=_bounds(0, low_open=True))


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
class HFGRPOConfig(GRPOConfig, LoRAOptions, MismatchOptions):
    """:class:`GRPOConfig` for hf models (defaults sized for SmolLM2-135M on CPU), plus LoRA,
    sharding and the sampler-mismatch options; ``tis_cap`` caps the truncated importance
    weight of rollouts another engine sampled (services.training.grpo, deviation 7)."""

    steps: int = field(default=8, metadata=_bounds(0))
    tasks_per_step: int = field(default=4, metadata=_bounds(1))
    group_size: int = field(default=4, metadata=_bounds(2, why=_GROUP))
    max_new_tokens: int = field(default=40, metadata=_bounds(1))
    lr: float = field(default=2e-4, metadata=_bounds(0, low_open=True))
    micro_batch: int = field(default=4, metadata=_bounds(1))
    # an hf step takes minutes on CPU; a LoRA resume point is a few MB
    checkpoint_every: int = field(default=2, metadata=_bounds(0))
    # TRL's vllm_importance_sampling_cap default; a cap below 1 would down-weight tokens the
    # trainer likes more than the sampler did, which is not what the correction is for
    tis_cap: float = field(default=2.0, metadata=_bounds(1))


@dataclass(frozen=True)
class SamplingOptions(_Checked):
    """How rft and dpo sample their episodes from the starting weights: ``samples_per_task``
    per task, ``rollout_batch`` of them decoding at once (a round is one call to the family's
    rollouts, each row taking the round's next episode as it frees)."""

    samples_per_task: int = field(default=8, metadata=_bounds(1))
    temperature: float = field(default=1.0, metadata=_bounds(0, low_open=True))
    max_turns: int = field(default=4, metadata=_bounds(1))
    max_new_tokens: int = field(default=16, metadata=_bounds(1))
    rollout_batch: int = field(default=64, metadata=_bounds(1))


@dataclass(frozen=True)
class RFTConfig(SFTConfig, SamplingOptions):
    """Rejection-sampling fine-tuning: ``iterations`` rounds of sampling ``samples_per_task``
    episodes per task and ``steps`` SFT steps on the verified successes (the SFT fields are
    :class:`SFTConfig`'s, with defaults for a few hundred successes rather than a corpus).

    ``replay_fraction`` of each draw are replayed episodes, sampled once from the starting
    weights on each of at most ``replay_tasks`` replay tasks (a dataset's replay split, never
    its regression suite), the verified ones kept: greedily (``replay_temperature`` 0, one
    episode a task: what the gate evaluates and serving decodes) or ``replay_samples`` a task
    at ``replay_temperature``."""

    steps: int = field(default=100, metadata=_bounds(0))
    batch_size: int = field(default=16, metadata=_bounds(1))
    lr: float = field(default=1e-3, metadata=_bounds(0, low_open=True))
    warmup: int = field(default=5, metadata=_bounds(0))
    min_lr_ratio: float = field(default=0.1, metadata=_bounds(0, 1))
    iterations: int = field(default=1, metadata=_bounds(1))
    log_every: int = field(default=10, metadata=_bounds(0))
    # a task with this many successes in a round gets no more samples in it (0: never), and
    # what it leaves goes to tasks with no success yet, up to this factor x samples_per_task
    # episodes each (1: none; services.training.rft, "Enough successes")
    enough_successes: int = field(default=0, metadata=_bounds(0))
    unsolved_sample_factor: float = field(default=2.0, metadata=_bounds(1, 16))
    # Replay (services.training.rft): the starting weights' own verified episodes of tasks
    # they already solve, a share of every SFT draw, so what is learned does not erase them.
    replay_fraction: float = field(default=0.5, metadata=_bounds(0, 1, high_open=True))
    replay_tasks: int = field(default=32, metadata=_bounds(0))
    replay_samples: int = field(default=2, metadata=_bounds(1))
    # 0: greedy. The behaviour to keep is the greedy one the gate's regression suite checks;
    # sampled at T=1 a weak champion keeps little of it (the bookshop's SmolLM2 champion
    # kept 1 and 3 sequences of 28 and 32 replay episodes: half of every SFT draw was one
    # to three sequences; greedy, 2 of 14 episodes)
    replay_temperature: float = field(default=0.0, metadata=_bounds(0))

    @property
    def replay_samples_per_task(self) -> int:
        """Episodes the replay samples of each task: one when greedy (more would be the same
        episode again)."""
        return 1 if self.replay_temperature == 0 else self.replay_samples


@dataclass(frozen=True)
class DPOConfig(SamplingOptions):
    """DPO on success/failure pairs of one task (Rafailov et al., 2023), the starting weights
    as the frozen reference: ``beta`` scales the implicit reward, ``batch_size`` is pairs per
    step, at most ``pairs_per_task`` pairs per task."""

    samples_per_task: int = field(default=8, metadata=_bounds(2, why=_PAIRS))
    beta: float = field(default=0.1, metadata=_bounds(0, low_open=True))
    pairs_per_task: int = field(default=4, metadata=_bounds(1))
    steps: int = field(default=50, metadata=_bounds(0))
    batch_size: int = field(default=8, metadata=_bounds(1))
    micro_batch: int = field(default=16, metadata=_bounds(1))
    lr: float = field(default=5e-4, metadata=_bounds(0, low_open=True))
    warmup: int = field(default=0, metadata=_bounds(0))
    min_lr_ratio: float = field(default=1.0, metadata=_bounds(0, 1))
    weight_decay: float = field(default=0.0, metadata=_bounds(0))
    grad_clip: float = field(default=1.0, metadata=_bounds(0))
    seed: int = 0
    log_every: int = field(default=10, metadata=_bounds(0))


@dataclass(frozen=True)
class HFRFTConfig(RFTConfig, LoRAOptions, MismatchOptions):
    """:class:`RFTConfig` for hf models (SmolLM2-135M on CPU), plus LoRA, sharding and the
    sampler-mismatch threshold."""

    steps: int = field(default=30, metadata=_bounds(0))
    batch_size: int = field(default=8, metadata=_bounds(1))
    micro_batch: int = field(default=4, metadata=_bounds(1))
    weight_decay: float = field(default=0.0, metadata=_bounds(0))
    samples_per_task: int = field(default=4, metadata=_bounds(1))
    max_new_tokens: int = field(default=40, metadata=_bounds(1))
    rollout_batch: int = field(default=16, metadata=_bounds(1))


@dataclass(frozen=True)
class HFDPOConfig(DPOConfig, LoRAOptions, MismatchOptions):
    """:class:`DPOConfig` for hf models (SmolLM2-135M on CPU), plus LoRA and the
    sampler-mismatch threshold. DPO does not shard (its ranks may run different numbers of
    micro-batches of pairs, and FSDP's collectives need the same number on every rank)."""

    samples_per_task: int = field(default=4, metadata=_bounds(2, why=_PAIRS))
    steps: int = field(default=20, metadata=_bounds(0))
    batch_size: int = field(default=4, metadata=_bounds(1))
    micro_batch: int = field(default=4, metadata=_bounds(1))
    lr: float = field(default=2e-4, metadata=_bounds(0, low_open=True))
    max_new_tokens: int = field(default=40, metadata=_bounds(1))
    rollout_batch: int = field(default=16, metadata=_bounds(1))

    def validate(self) -> None:
        super().validate()
        if self.sharding != "none":
            raise HyperparameterError(
                "sharding",
                f"dpo does not shard (sharding {self.sharding!r}): its ranks may run different "
                "numbers of micro-batches, which FSDP's collectives cannot; use sharding 'none'",
            )


TrainerConfig = GRPOConfig | SFTConfig | DPOConfig  # the others are subclasses of these


@dataclass(frozen=True)
class JobOptions:
    """What a train job reads besides its trainer's config."""

    threads: int | None = None  # torch threads; None: torch's default
    augment_fraction: float = 0.0  # tiny SFT: share of demonstrations with a drifted tool API
    model: Mapping[str, Any] | None = None  # tiny, no base checkpoint: the GPTConfig to build


@dataclass(frozen=True)
class Algorithm:
    """One training algorithm as the registry knows it (docs/design.md, "Adding an algorithm").

    ``trainer`` is ``"module:function"``, the stage function a train job calls
    (:data:`services.training.stages.StageTrainer`): a name, not the function, because this
    module is the api's too and the api never imports torch; the job imports it.
    """

    configs: Mapping[str, type[TrainerConfig]]  # family → the trainer's config class
    job_options: Mapping[str, frozenset[str]]  # family → the job options it takes besides
    trainer: str
    from_scratch: bool = False  # may start without a base checkpoint (a fresh model)


_THREADS = frozenset({"threads"})

# Every algorithm a loop's profile or a train job may name, and a chain's stages.
ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(
        configs={"tiny": GRPOConfig, "hf": HFGRPOConfig},
        job_options={"tiny": frozenset({"threads", "model"}), "hf": _THREADS},
        trainer="services.training.stages:grpo_stage",
    ),
    "sft": Algorithm(
        configs={"tiny": SFTConfig, "hf": HFSFTConfig},
        job_options={"tiny": frozenset({"threads", "model", "augment_fraction"}), "hf": _THREADS},
        trainer="services.training.stages:sft_stage",
        from_scratch=True,
    ),
    "rft": Algorithm(
        configs={"tiny": RFTConfig, "hf": HFRFTConfig},
        job_options={"tiny": _THREADS, "hf": _THREADS},
        trainer="services.training.stages:rft_stage",
    ),
    "dpo": Algorithm(
        configs={"tiny": DPOConfig, "hf": HFDPOConfig},
        job_options={"tiny": _THREADS, "hf": _THREADS},
        trainer="services.training.stages:dpo_stage",
    ),
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
    return frozenset(names) | ALGORITHMS[algorithm].job_options[family]


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
    configs = ALGORITHMS[algorithm].configs
    if family not in configs:
        raise HyperparameterError(
            None,
            f"algorithm {algorithm!r} has no trainer for the {family} family "
            f"(it trains {', '.join(configs)})",
        )
    return configs[family]


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
    if hint is str:
        if not isinstance(value, str):
            raise HyperparameterError(key, f"{key} must be a string, got {value!r}")
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


def algorithm_chain(algorithm: object) -> tuple[str, ...]:
    """A profile's or spec's ``algorithm`` as its stages: ``"grpo"`` is one stage,
    ``["rft", "grpo"]`` two, run in order, each from the previous stage's weights."""
    names = [algorithm] if isinstance(algorithm, str) else algorithm
    if not isinstance(names, list | tuple) or not names:
        raise HyperparameterError(
            None, f"algorithm must be a name or a non-empty list of names, got {algorithm!r}"
        )
    for name in names:
        if name not in ALGORITHMS:
            raise HyperparameterError(
                None, f"unknown algorithm {name!r} (expected one of {', '.join(ALGORITHMS)})"
            )
    return tuple(names)


def stage_hyperparameters(
    family: str, stages: Sequence[str], raw: Mapping[str, object]
) -> list[dict[str, object]]:
    """``raw`` split over a chain's stages: ``"rft.steps"`` is every rft stage's alone, a
    plain key goes to every stage that knows it (``threads``, ``lr``) unless a stage's own
    key sets it, and a key no stage knows is refused with its name."""
    split: list[dict[str, object]] = [{} for _ in stages]
    # plain keys first, so that a stage's own key overrides them whatever the order
    ordered = sorted(raw.items(), key=lambda item: STAGE_SEPARATOR in item[0])
    for key, value in ordered:
        stage, dot, name = key.partition(STAGE_SEPARATOR)
        if dot:
            if stage not in stages:
                raise HyperparameterError(
                    key, f"{key}: {stage!r} is not a stage of the chain {list(stages)}"
                )
            targets = [i for i, s in enumerate(stages) if s == stage]
            if name not in known_keys(family, stage):
                raise HyperparameterError(
                    key,
                    f"unknown hyperparameter {name!r} for the {stage} stage "
                    f"(known: {', '.join(sorted(known_keys(family, stage)))})",
                )
        else:
            name = key
            targets = [i for i, s in enumerate(stages) if key in known_keys(family, s)]
            if not targets:
                raise HyperparameterError(
                    key, f"unknown hyperparameter {key!r}: no stage of {list(stages)} takes it"
                )
        for i in targets:
            split[i][name] = value
    return split


def parse_chain(
    family: str, algorithm: object, raw: Mapping[str, object], *, seed: int = 0
) -> list[Hyperparameters]:
    """Check a profile's or job's ``algorithm`` and ``hyperparameters``: one
    :class:`Hyperparameters` per stage. A single name takes its keys as
    :func:`parse_hyperparameters` does; a chain splits them (:func:`stage_hyperparameters`).
    An hf chain trains one adapter, so its stages must agree on the LoRA options (and on
    the sharding: the model is loaded and sharded once, for every stage)."""
    if isinstance(algorithm, str):
        return [parse_hyperparameters(family, algorithm, raw, seed=seed)]
    stages = algorithm_chain(algorithm)
    _config_class(family, stages[0])
    parsed = [
        parse_hyperparameters(family, stage, values, seed=seed)
        for stage, values in zip(stages, stage_hyperparameters(family, stages, raw), strict=True)
    ]
    first = parsed[0].config
    if isinstance(first, LoRAOptions):
        for other in parsed[1:]:
            for f in fields(LoRAOptions):
                if getattr(other.config, f.name) != getattr(first, f.name):
                    raise HyperparameterError(
                        f.name, f"{f.name} must be the same in every stage of an hf chain"
                    )
    return parsed
