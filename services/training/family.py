"""The model-family interface every trainer and the evaluator work through, and its registry.

A *family* is a kind of checkpoint (``tiny``: the byte-level GPT of
:mod:`services.training.tiny`; ``hf``: any transformers causal LM of
:mod:`services.training.hf`). The trainers (:mod:`services.training.grpo`,
:mod:`services.training.sft`) are written once over two small protocols:

- :class:`Family` — what the registry holds: load a checkpoint for inference or with its
  trainable setup (every weight, or a LoRA adapter for hf), or build a fresh model.
- :class:`FamilyModel` — a loaded model: **token rollouts** (one episode per task, with the
  exact prompt and completion ids of every model turn and the environment's reward),
  **per-token log-probs** of a packed batch under the current weights, demonstrations as
  token sequences, and saving a checkpoint with its manifest.

Everything between those calls — advantages, the loss, the KL to the starting weights
(:class:`StartingWeights`: the trainable weights are swapped, so no second model lives in
memory), optimizer, DDP, resume points — is the trainer's, identical for every family.

Rollouts take one seed per episode and return token ids, never text to re-tokenize, so an
inference engine (prefix cache, KV kept across turns, a remote server) can replace a
family's generation path behind :meth:`FamilyModel.rollouts` without touching a trainer.

The registry maps a family name to where its implementation lives, imported on first use:
a tiny job never imports transformers. :func:`register_family` adds one (tests plug a toy
family in with one entry).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from services.environments.base import Environment, Reward, TaskSpec
from services.inference.utilisation import Utilisation
from services.training.checkpoint import Manifest

TokenTurn = tuple[list[int], list[int]]  # (prompt ids the model saw, completion ids it sampled)
TokenSequence = tuple[list[int], list[bool]]  # (ids, which ids are training targets)


@dataclass(frozen=True)
class TokenEpisode:
    """One rolled-out episode as training and evaluation need it."""

    task: TaskSpec
    turns: list[TokenTurn]  # every model turn, in order (end-of-turn token included if sampled)
    reward: Reward
    end_reason: str | None
    answer: str | None
    # per turn, the sampler's log-prob of each completion id (temperature 1), where the
    # engine that sampled reported them
    sampler_logprobs: list[list[float]] | None = None

    @property
    def model_turns(self) -> int:
        return len(self.turns)

    @property
    def sequences(self) -> list[TokenSequence]:
        """The episode as training sequences (completions are the only targets)."""
        return pack_turns(self.turns)

    @property
    def sampler_sequences(self) -> list[list[float]] | None:
        """The sampler's log-probs laid out as :attr:`sequences`: one value per id, the
        log-prob of that id on a target position, 0 elsewhere; None without them."""
        if self.sampler_logprobs is None:
            return None
        return pack_turn_values(self.turns, self.sampler_logprobs)

    def sampled_values(self) -> list[list[float]]:
        """:attr:`sampler_sequences` of an episode another engine sampled, which must
        carry them (ValueError: scoring it as the sampler's would be scoring zeros)."""
        laid = self.sampler_sequences
        if laid is None:
            raise ValueError("rollouts another engine sampled must carry its log-probs")
        return laid


@dataclass(frozen=True)
class SampledBy:
    """The engine that sampled a batch of rollouts when it is not the trainer's own: its
    URL, the name the job asked it to decode with, the checkpoint id of the weights the job
    published for it (None: its served base model), and the versions the server said
    answered (``ratchet serve``'s ``X-Ratchet-Model-Version``; vLLM says none)."""

    url: str
    served_name: str
    published_id: str | None = None
    served_versions: tuple[str, ...] = ()

    def describe(self) -> str:
        """The adapter version the sampler served, in words, for a stop reason."""
        served = ", ".join(v[:12] for v in self.served_versions)
        asked = f"checkpoint {self.published_id[:12]}" if self.published_id else "its base model"
        if served:
            return (
                f"{self.url} served version {served} as {self.served_name!r} (the job sent {asked})"
            )
        return f"{self.url} served {self.served_name!r} (the job sent {asked})"


@dataclass(frozen=True)
class Rollouts:
    """A batch of episodes and what generating them cost; ``sampler`` names the engine that
    sampled them when it is another than the trainer's own (the remote backend);
    ``utilisation``: the FLOPs they needed against the machine's peak, and where the time went
    (empty when not measured)."""

    episodes: list[TokenEpisode]
    generated_tokens: int
    prompt_tokens: int
    sampler: SampledBy | None = None
    utilisation: Utilisation = field(default_factory=Utilisation)


@dataclass(frozen=True)
class DemonstrationOptions:
    """How an SFT job asks a family for demonstrations (each family reads its own knob)."""

    seed: int = 0
    augment_fraction: float = 0.0  # tiny: share of demonstrations with a drifted tool API
    recovery_fraction: float = 0.0  # hf: share that recover from a tool's usage error first


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded sequences: ids (N, T), attention (N, T), targets (N, T-1), and where
    another engine sampled them, its log-probs of the targets (N, T-1)."""

    ids: torch.Tensor  # (N, T)
    attention: torch.Tensor  # (N, T), 1 on real tokens
    target: torch.Tensor  # (N, T-1) bool, aligned with ids[:, 1:]
    sampler_logp: torch.Tensor | None = None  # (N, T-1) float32, 0 off the targets

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens in the batch: what a forward pass processed."""
        return int(self.attention.sum())


class RolloutModel(Protocol):
    """What evaluation needs of a model: verified episodes of tasks."""

    device: torch.device
    checkpoint_id: str | None

    def rollouts(
        self,
        env: Environment,
        tasks: Sequence[TaskSpec],
        *,
        seeds: Sequence[int],
        max_turns: int,
        max_new_tokens: int,
        temperature: float,
        max_rows: int | None = None,
    ) -> Rollouts:
        """One verified episode per task (tasks may repeat: a GRPO group). Episode ``i``
        samples from ``seeds[i]`` alone, whatever else shares its batch. At most
        ``max_rows`` episodes decode at once (None: the family's default); the others join
        as those end, so one long episode never holds a batch of finished ones."""
        ...


class EpisodeFeed(Protocol):
    """Episodes a rollout call takes while it runs (rft's and dpo's rounds): a row that frees
    takes the feed's next episode, so rows stay busy until the feed has none, and the feed
    hears each episode's outcome as it ends, so it can choose the next from the outcomes so
    far (a task with enough successes is sampled no more)."""

    def next_episode(self) -> tuple[TaskSpec, int] | None:
        """The next episode's task and seed; None when none is due now (one may be due once
        a running episode has ended)."""
        ...

    def episode_ended(self, index: int, episode: TokenEpisode) -> None:
        """Episode ``index`` of the call (its place in :attr:`Rollouts.episodes`) ended,
        verified."""
        ...


class FamilyModel(RolloutModel, Protocol):
    """A loaded model of some family, for rollouts, scoring and (if loaded so) training."""

    family: str
    pad_id: int

    def rollouts(
        self,
        env: Environment,
        tasks: Sequence[TaskSpec],
        *,
        seeds: Sequence[int],
        max_turns: int,
        max_new_tokens: int,
        temperature: float,
        max_rows: int | None = None,
        feed: EpisodeFeed | None = None,
    ) -> Rollouts:
        """:meth:`RolloutModel.rollouts`, and with ``feed`` the episodes it gives as rows
        free, after ``tasks``' (in the order taken), each told to it as it ends."""
        ...

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The weights an optimizer updates, by name (all of them, or a LoRA adapter's)."""
        ...

    def train(self, mode: bool = True) -> None:
        """Put the network in training (or evaluation) mode."""
        ...

    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """log p(ids[:, t+1] | ids[:, :t+1]) under the current weights: (N, T-1), float32,
        with gradients; positions outside ``batch.target`` may be 0."""
        ...

    def demonstrations(
        self, env: Environment, tasks: Sequence[TaskSpec], options: DemonstrationOptions
    ) -> list[TokenSequence]:
        """The environment's solved episodes of ``tasks`` as training sequences."""
        ...

    def save(self, out_dir: Path, *, parent: str | None, metadata: dict[str, object]) -> Manifest:
        """Write the model as a checkpoint (manifest included); the trainable part for LoRA."""
        ...


class Family(Protocol):
    """A model family: how its checkpoints load and how its fresh models are built."""

    name: str
    # evaluation defaults where the family differs (hf chat turns are longer, batches smaller)
    eval_defaults: Mapping[str, int]

    def load(
        self,
        path: Path,
        *,
        device: torch.device,
        base_dir: Path | None = None,
        training: object | None = None,
    ) -> FamilyModel:
        """Verify and load a checkpoint. ``training`` (the trainer's config) asks for its
        trainable setup; None loads for inference."""
        ...

    def create(
        self, shape: Mapping[str, object] | None, *, seed: int, device: torch.device
    ) -> FamilyModel:
        """A fresh model of ``shape`` (ValueError where the family never trains from scratch)."""
        ...


class StartingWeights:
    """A model's trainable weights as they are now, kept to score batches under them later
    (GRPO's KL anchor, a DPO reference): swapped in for the forward pass and back out, so
    only one copy of what is trained lives in memory, whatever the family."""

    def __init__(self, model: FamilyModel) -> None:
        self.params = [p for _, p in model.trainable_parameters()]
        self.values = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def logprobs(self, model: FamilyModel, batch: PackedBatch) -> torch.Tensor:
        """``model.logprobs(batch)`` under the kept weights: (N, T-1), no gradients."""
        current = [p.detach().clone() for p in self.params]
        for param, kept in zip(self.params, self.values, strict=True):
            param.copy_(kept)
        try:
            return model.logprobs(batch)
        finally:
            for param, value in zip(self.params, current, strict=True):
                param.copy_(value)


_REGISTRY: dict[str, str | Callable[[], Family]] = {
    "tiny": "services.training.tiny.family:TinyFamily",
    "hf": "services.training.hf.family:HFFamily",
}


def register_family(name: str, factory: Callable[[], Family]) -> None:
    """Add (or replace) a family: ``family_for(name)`` then returns ``factory()``."""
    _REGISTRY[name] = factory


def family_names() -> list[str]:
    return sorted(_REGISTRY)


def family_for(name: str) -> Family:
    """The family called ``name``; ValueError naming the known ones otherwise."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(family_names())}")
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        factory: Callable[[], Family] = getattr(importlib.import_module(module), attribute)
        return factory()
    return entry()


def pack_turns(turns: Sequence[TokenTurn]) -> list[TokenSequence]:
    """An episode's turns as (ids, target mask) sequences, merged where prefixes agree.

    When turn ``k+1``'s prompt starts with turn ``k``'s prompt and completion (text
    transcripts always; chat templates once the completion is the canonical call text),
    the two are one sequence with both completions as targets; otherwise a turn is its own
    sequence. Tool results and prompts are context, never targets.
    """
    return [(ids, mask) for ids, mask, _ in _pack(turns, None)]


def pack_turn_values(
    turns: Sequence[TokenTurn], values: Sequence[Sequence[float]]
) -> list[list[float]]:
    """Per-completion-token ``values`` (one list per turn) laid out as
    :func:`pack_turns`' sequences: the value on each completion position, 0 elsewhere."""
    if len(values) != len(turns) or any(
        len(v) != len(completion) for v, (_, completion) in zip(values, turns, strict=False)
    ):
        raise ValueError("need one value per completion token of every turn")
    return [laid for _, _, laid in _pack(turns, values)]


def _pack(
    turns: Sequence[TokenTurn], values: Sequence[Sequence[float]] | None
) -> list[tuple[list[int], list[bool], list[float]]]:
    """:func:`pack_turns` with each position's value beside it (0 off the completions)."""
    packed: list[tuple[list[int], list[bool], list[float]]] = []
    for index, (prompt, completion) in enumerate(turns):
        turn_values = list(values[index]) if values is not None else [0.0] * len(completion)
        if packed:
            ids, mask, laid = packed[-1]
            if len(prompt) >= len(ids) and prompt[: len(ids)] == ids:
                extra = prompt[len(ids) :]
                ids.extend(extra + completion)
                mask.extend([False] * len(extra) + [True] * len(completion))
                laid.extend([0.0] * len(extra) + turn_values)
                continue
        packed.append(
            (
                list(prompt) + list(completion),
                [False] * len(prompt) + [True] * len(completion),
                [0.0] * len(prompt) + turn_values,
            )
        )
    return packed


def collate(
    sequences: Sequence[TokenSequence],
    *,
    pad_id: int,
    device: torch.device,
    sampler: Sequence[Sequence[float]] | None = None,
) -> PackedBatch:
    """Right-pad ``sequences`` into one :class:`PackedBatch` on ``device``; ``sampler`` (one
    value per id of each sequence, :attr:`TokenEpisode.sampler_sequences`) becomes its
    ``sampler_logp``."""
    width = max(len(ids) for ids, _ in sequences)
    ids_t = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # (N, T)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)  # (N, T)
    target = torch.zeros((len(sequences), width), dtype=torch.bool)  # (N, T)
    for row, (ids, mask) in enumerate(sequences):
        ids_t[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, : len(ids)] = 1
        target[row, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    sampler_logp = None
    if sampler is not None:
        laid = torch.zeros((len(sequences), width), dtype=torch.float32)  # (N, T)
        for row, values in enumerate(sampler):
            laid[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        sampler_logp = laid[:, 1:].to(device)  # (N, T-1), aligned with target
    return PackedBatch(
        ids_t.to(device), attention.to(device), target[:, 1:].to(device), sampler_logp
    )


def idle_passes(model: FamilyModel, count: int, *, backward: bool) -> None:
    """``count`` forward passes (and backward, with ``backward``) that change nothing: a
    one-row batch with no target, its loss times zero. A sharded model's passes are
    collectives, so a rank with fewer micro-batches than the busiest runs these instead."""
    if count <= 0:
        return
    batch = collate(
        [([model.pad_id, model.pad_id], [False, False])], pad_id=model.pad_id, device=model.device
    )
    for _ in range(count):
        if backward:
            (model.logprobs(batch).sum() * 0.0).backward()
        else:
            with torch.no_grad():
                model.logprobs(batch)


def target_count(sequences: Sequence[TokenSequence]) -> int:
    """Target tokens of ``sequences`` (a first token is never predicted, so never a target)."""
    return sum(sum(mask[1:]) for _, mask in sequences)


def micro_batches(
    model: FamilyModel,
    sequences: Sequence[TokenSequence],
    micro_batch: int,
    sampler: Sequence[Sequence[float]] | None = None,
) -> list[PackedBatch]:
    """``sequences`` packed into micro-batches of ``micro_batch`` on the model's device (with
    another engine's log-probs laid out as them, when given)."""
    return [
        collate(
            sequences[begin : begin + micro_batch],
            pad_id=model.pad_id,
            device=model.device,
            sampler=sampler[begin : begin + micro_batch] if sampler is not None else None,
        )
        for begin in range(0, len(sequences), micro_batch)
    ]
