"""Model FLOPs utilisation: the FLOPs the work needed against what this machine can do, and
where a rollout round's time went.

The figure is measured against the machine, not against a slower peer: a rollout or a
training pass that runs 5x faster than ``transformers.generate`` may still leave most of
the hardware idle. So every rollout round and every training run reports

- **the FLOPs the work needed** (:class:`Work`, :func:`forward_flops`,
  :func:`training_flops`): every position of every sequence counted once however many rows
  share it (a trie over the sequences: the system text and tool list every prompt starts
  with, a GRPO group's prompt, an episode's earlier turns), no padding; per position
  2 x the weights it is multiplied by (every linear layer but the output head), the output
  head only where logits were taken (the sampled positions; a training pass's targets),
  and attention's ``q.k`` and weighted sum of ``v`` over the positions before it. A
  training pass adds the backward: 2 x more through weights that stay frozen (the inputs'
  gradients), 2 x more where the weights train (their own gradients; a LoRA adapter's are
  negligible and not counted), and twice the forward attention;
- **the peak** (:func:`matmul_peak_gflops`): the GFLOP/s a plain matmul of the model's MLP
  shape, ``(tokens x hidden) @ (hidden x intermediate)``, reaches in the same process, on
  the same threads, device and dtype, at the token count the work's forward calls had
  (a decode step's rows; a micro-batch's tokens);
- **MFU** = FLOPs needed / (wall seconds x peak): the share of the machine the work used,
  everything the caller waited for counted (model calls, sampling, Python between them,
  tool calls, the tokenizer);
- **the time split** of a round (:class:`TimeSplit`): ``forward`` (model calls, on CUDA
  until their logits reach the host), ``sampling`` (next tokens, log-probs),
  ``tool_calls`` (the environment stepping an episode: tool calls and verifiers),
  ``tokenizer`` (chat templates, encoding, decoding) and ``scheduling`` (the rest: Python
  between those, the engine's bookkeeping, the prefix cache), with the shapes of the model
  calls (:class:`CallShapes`: rows and tokens per call, padding).

Torch and the standard library only: the train and eval jobs report it (``metrics.json``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

TIME_PARTS = ("forward", "sampling", "scheduling", "tool_calls", "tokenizer")
MEASURED_PARTS = tuple(part for part in TIME_PARTS if part != "scheduling")


@dataclass(frozen=True)
class ModelShape:
    """What one position costs a model: the weights it multiplies, the output head, the
    attention width, and the MLP shape the peak is measured at."""

    linear_params: int  # weights of every linear layer but the output head
    head_params: int  # the output head (vocabulary x hidden)
    layers: int
    attention_width: int  # query heads x head size: one layer's q.k per (query, key) pair
    hidden: int
    intermediate: int  # the MLP's inner width
    dtype: torch.dtype
    device: torch.device
    frozen_weights: bool = False  # LoRA: the base's weights get no gradient of their own

    @classmethod
    def of(cls, module: torch.nn.Module, *, frozen_weights: bool = False) -> ModelShape:
        """The shape of a transformers causal LM (a peft model too) or the tiny GPT, read off
        its linear layers and its config."""
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(f"{type(module).__name__} has no config to read its shape from")
        text = (
            config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        )
        head = _output_head(module)
        linear = sum(
            int(m.weight.numel())
            for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head and "lora_" not in name
        )
        layers = int(_first(text, "num_hidden_layers", "n_layer"))
        hidden = int(_first(text, "hidden_size", "d_model"))
        heads = int(_first(text, "num_attention_heads", "n_head"))
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        intermediate = getattr(text, "intermediate_size", None) or hidden * int(
            getattr(text, "mlp_ratio", 4)
        )
        weight = next(module.parameters())
        return cls(
            linear_params=linear,
            head_params=int(head.weight.numel()) if head is not None else 0,
            layers=layers,
            attention_width=heads * head_dim,
            hidden=hidden,
            intermediate=int(intermediate),
            dtype=weight.dtype,
            device=weight.device,
            frozen_weights=frozen_weights,
        )


@runtime_checkable
class Measured(Protocol):
    """A family model that can say its :class:`ModelShape` (the trainers' figures need it;
    a model without one reports no MFU)."""

    def model_shape(self) -> ModelShape: ...


def shape_of(model: object) -> ModelShape | None:
    """``model``'s shape, or None for a model that cannot say it."""
    return model.model_shape() if isinstance(model, Measured) else None


def _output_head(module: torch.nn.Module) -> Any:
    get: Any = getattr(module, "get_output_embeddings", None)
    head: Any = get() if callable(get) else getattr(module, "head", None)
    return head if isinstance(head, torch.nn.Module) and hasattr(head, "weight") else None


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"the model's config has none of {', '.join(names)}")


@dataclass(frozen=True)
class Work:
    """Positions a pass computes: through the layers (``tokens``), through the output head
    (``projected``), and the (query, key) pairs attention scores (``pairs``)."""

    tokens: int = 0
    pairs: int = 0
    projected: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.tokens + other.tokens, self.pairs + other.pairs, self.projected + other.projected
        )

    def __mul__(self, times: int) -> Work:
        return Work(self.tokens * times, self.pairs * times, self.projected * times)


def needed_work(sequences: Sequence[Sequence[int]], projected: int) -> Work:
    """The work a set of sequences needs with every shared prefix computed once: the
    positions of the trie the sequences make (sorted, each adds what follows its longest
    common prefix with the one before it), the pairs of each position with the ones before
    it, and ``projected`` positions through the output head."""
    tokens = pairs = 0
    previous: Sequence[int] = ()
    for row in sorted(list(s) for s in sequences if len(s)):
        common = _common_length(previous, row)
        length = len(row)
        tokens += length - common
        pairs += (length * (length + 1) - common * (common + 1)) // 2
        previous = row
    return Work(tokens, pairs, projected)


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def forward_flops(shape: ModelShape, work: Work) -> float:
    """FLOPs of a forward pass over ``work``."""
    return float(
        2 * shape.linear_params * work.tokens
        + 2 * shape.head_params * work.projected
        + 4 * shape.layers * shape.attention_width * work.pairs
    )


def training_flops(shape: ModelShape, work: Work) -> float:
    """FLOPs of a forward and backward pass over ``work``: the weights' part 2x the
    forward's (inputs' gradients) or 3x where the weights train, attention's 3x."""
    weights = 2 if shape.frozen_weights else 3
    linear = 2 * shape.linear_params * work.tokens + 2 * shape.head_params * work.projected
    return float(weights * linear + 3 * 4 * shape.layers * shape.attention_width * work.pairs)


def rollout_work(turns: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Work:
    """What a round of turns (prompt ids, sampled ids) needed: every prompt and every
    sampled token but the last of its turn fed once (an episode's next turn starts with its
    earlier ones, a group's rows with one prompt), one output-head row per sampled token."""
    fed = [[*prompt, *sampled[:-1]] for prompt, sampled in turns]
    return needed_work(fed, projected=sum(len(sampled) for _, sampled in turns))


def sequence_work(sequences: Sequence[tuple[Sequence[int], Sequence[bool]]]) -> Work:
    """What one training pass over ``sequences`` (ids, which ids are targets) needs: the
    positions of their trie, the output head at every target (a first id is never one)."""
    targets = sum(sum(1 for t in mask[1:] if t) for _, mask in sequences)
    return needed_work([ids for ids, _ in sequences], projected=targets)


def micro_batch_work(
    sequences: Sequence[tuple[Sequence[int], Sequence[bool]]], micro_batch: int
) -> tuple[Work, int]:
    """:func:`sequence_work` of ``sequences`` in micro-batches of ``micro_batch`` (each its
    own forward pass), summed, and the number of passes."""
    work, passes = Work(), 0
    for begin in range(0, len(sequences), micro_batch):
        work = work + sequence_work(sequences[begin : begin + micro_batch])
        passes += 1
    return work, passes


# The peak ---------------------------------------------------------------------------------


def matmul_peak_gflops(shape: ModelShape, tokens: int) -> float:
    """GFLOP/s of ``(tokens x hidden) @ (hidden x intermediate)`` in the model's dtype on its
    device and this process's threads (measured once per token count, rounded to two
    significant digits, and thread count)."""
    rounded = _two_digits(max(1, tokens))
    return _peak(
        shape.hidden,
        shape.intermediate,
        rounded,
        shape.dtype,
        shape.device,
        torch.get_num_threads(),
    )


def _two_digits(n: int) -> int:
    scale = 10 ** max(0, len(str(n)) - 2)
    return max(1, round(n / scale) * scale)


@functools.lru_cache(maxsize=256)
def _peak(
    hidden: int, inner: int, tokens: int, dtype: torch.dtype, device: torch.device, threads: int
) -> float:
    a = torch.randn(tokens, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, inner, dtype=dtype, device=device)
    flops = 2.0 * tokens * hidden * inner
    _sync(device)
    torch.mm(a, b)  # warm-up: the first call allocates and picks its kernel
    _sync(device)
    started = time.perf_counter()
    torch.mm(a, b)
    _sync(device)
    once = max(time.perf_counter() - started, 1e-7)
    repeats = max(1, min(10_000, int(0.01 / once)))  # ~10 ms a timing
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        _sync(device)
        best = min(best, (time.perf_counter() - started) / repeats)
    return flops / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The time split and the calls' shapes ------------------------------------------------------


@dataclass
class CallShapes:
    """The model calls of a round: prefill calls (rows joining), decode steps (one token a
    row), the rows and tokens they ran (padding included) and the pads among them."""

    prefill_calls: int = 0
    prefill_rows: int = 0
    prefill_tokens: int = 0
    prefill_pads: int = 0
    decode_calls: int = 0
    decode_rows: int = 0

    def add(self, other: CallShapes) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    @property
    def calls(self) -> int:
        return self.prefill_calls + self.decode_calls

    @property
    def tokens_per_call(self) -> float:
        """Positions a model call ran, on average: the token count the peak is measured at."""
        return (self.prefill_tokens + self.decode_rows) / self.calls if self.calls else 0.0

    def report(self) -> dict[str, float]:
        return {
            **asdict(self),
            "rows_per_decode_call": round(self.decode_rows / max(1, self.decode_calls), 1),
            "tokens_per_prefill_call": round(self.prefill_tokens / max(1, self.prefill_calls), 1),
            "tokens_per_call": round(self.tokens_per_call, 1),
        }


@dataclass
class TimeSplit:
    """Seconds per part of a round (:data:`TIME_PARTS`); ``scheduling`` is what the wall
    time leaves when the measured parts are taken out."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEASURED_PARTS, 0.0))
    calls: CallShapes = field(default_factory=CallShapes)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def report(self, wall_s: float) -> dict[str, float]:
        """The parts' seconds, ``scheduling`` the wall's rest."""
        measured = {name: round(self.seconds[name], 4) for name in MEASURED_PARTS}
        rest = max(0.0, wall_s - sum(self.seconds.values()))
        return {**measured, "scheduling": round(rest, 4)}


# One pass's figures, and a run's totals ----------------------------------------------------


@dataclass(frozen=True)
class PassFigures:
    """One rollout round or training run: the FLOPs it needed, its wall seconds, and the
    peak measured at its token count."""

    flops: float
    seconds: float
    peak_gflops: float
    peak_tokens: int

    @property
    def mfu(self) -> float:
        capacity = self.seconds * self.peak_gflops * 1e9
        return self.flops / capacity if capacity > 0 else 0.0


def pass_figures(flops: float, seconds: float, shape: ModelShape, tokens: float) -> PassFigures:
    """:class:`PassFigures` of work measured against the peak at ``tokens`` per call."""
    peak_tokens = max(1, round(tokens))
    return PassFigures(flops, seconds, matmul_peak_gflops(shape, peak_tokens), peak_tokens)


def training_figures(
    model: object,
    work: Work,
    passes: int,
    seconds: float,
    *,
    scored: Work | None = None,
) -> PassFigures | None:
    """The figures of a run's training passes: forward and backward over ``work`` in
    ``passes`` model calls, forward only over ``scored`` (GRPO's old and reference
    log-probs), in ``seconds``; None for a model without a shape."""
    shape = shape_of(model)
    if shape is None or passes == 0 or seconds <= 0:
        return None
    scored = scored or Work()
    flops = training_flops(shape, work) + forward_flops(shape, scored)
    return pass_figures(flops, seconds, shape, (work.tokens + scored.tokens) / passes)


class StepShape(Protocol):
    """What a policy-gradient step's passes depend on: its micro-batch and its epochs."""

    @property
    def micro_batch(self) -> int: ...

    @property
    def ppo_epochs(self) -> int: ...


def policy_step_figures(
    model: object,
    sequences: Sequence[tuple[Sequence[int], Sequence[bool]]],
    demos: Sequence[tuple[Sequence[int], Sequence[bool]]],
    config: StepShape,
    scorings: int,
    seconds: float,
) -> PassFigures | None:
    """A GRPO step's training passes against the machine's peak: ``ppo_epochs`` forward and
    backward passes over the kept episodes and the SFT term's demonstrations, and
    ``scorings`` forward-only passes over the episodes (the old log-probs when there is more
    than one epoch, the reference's for the KL term)."""
    policy, passes = micro_batch_work(sequences, config.micro_batch)
    demo_work, demo_passes = micro_batch_work(demos, config.micro_batch)
    work = (policy + demo_work) * config.ppo_epochs
    total_passes = (passes + demo_passes) * config.ppo_epochs + passes * scorings
    return training_figures(model, work, total_passes, seconds, scored=policy * scorings)


def round_utilisation(
    module: torch.nn.Module,
    turns: Sequence[tuple[Sequence[int], Sequence[int]]],
    split: TimeSplit,
    wall_s: float,
) -> Utilisation:
    """A rollout round's figures: the FLOPs its ``turns`` (prompt ids, sampled ids) needed on
    ``module`` over ``wall_s`` and the peak at its calls' token count, and its time split."""
    shape = ModelShape.of(module)
    flops = forward_flops(shape, rollout_work(turns))
    utilisation = Utilisation()
    utilisation.add("rollout", pass_figures(flops, wall_s, shape, split.calls.tokens_per_call))
    utilisation.add_split(split.report(wall_s), split.calls.report())
    return utilisation


@dataclass
class Utilisation:
    """A run's totals per pass (``rollout``, ``train``): FLOPs needed, wall seconds, and what
    the peak could have done in those seconds (so rounds measured at different token counts
    add up), with the rollouts' time split and call shapes summed."""

    flops: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    capacity: dict[str, float] = field(default_factory=dict)  # sum of seconds x peak FLOP/s
    time_split: dict[str, float] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, figures: PassFigures | None) -> None:
        """Count one pass of ``kind`` (None: not measured, nothing to count)."""
        if figures is None:
            return
        self.flops[kind] = self.flops.get(kind, 0.0) + figures.flops
        self.seconds[kind] = self.seconds.get(kind, 0.0) + figures.seconds
        capacity = figures.seconds * figures.peak_gflops * 1e9
        self.capacity[kind] = self.capacity.get(kind, 0.0) + capacity

    def merge(self, other: Utilisation) -> None:
        """Add ``other``'s totals (another round, a run inside this one) to these."""
        for mine, theirs in (
            (self.flops, other.flops),
            (self.seconds, other.seconds),
            (self.capacity, other.capacity),
        ):
            for kind, value in theirs.items():
                mine[kind] = mine.get(kind, 0.0) + value
        self.add_split(other.time_split, other.calls)

    def add_split(self, split: dict[str, float], calls: dict[str, float]) -> None:
        for name, value in split.items():
            self.time_split[name] = round(self.time_split.get(name, 0.0) + value, 4)
        for name, value in calls.items():
            if not name.endswith("_call"):  # the per-call means are recomputed in report()
                self.calls[name] = self.calls.get(name, 0.0) + value

    def mfu(self, kind: str) -> float | None:
        capacity = self.capacity.get(kind, 0.0)
        return round(self.flops[kind] / capacity, 4) if capacity > 0 else None

    def peak_gflops(self, kind: str) -> float | None:
        seconds = self.seconds.get(kind, 0.0)
        return round(self.capacity[kind] / seconds / 1e9, 1) if seconds > 0 else None

    def report(self) -> dict[str, Any]:
        """The ``metrics.json`` keys: ``rollout_mfu``, ``train_mfu``, ``peak_gflops`` (the
        peak of each pass, averaged over its seconds), ``time_split`` (the rollouts')."""
        calls = CallShapes(**{k: int(v) for k, v in self.calls.items()})
        return {
            "rollout_mfu": self.mfu("rollout"),
            "train_mfu": self.mfu("train"),
            "peak_gflops": {kind: self.peak_gflops(kind) for kind in sorted(self.seconds)},
            "model_gflops": {kind: round(self.flops[kind] / 1e9, 1) for kind in sorted(self.flops)},
            "time_split": dict(self.time_split),
            "forward_calls": calls.report() if calls.calls else {},
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Utilisation:
        return cls(**{k: dict(v) for k, v in data.items() if k in cls.__dataclass_fields__})
