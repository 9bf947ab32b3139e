"""The ``tiny`` family behind :class:`services.training.family.Family`: the byte-level GPT of
:mod:`services.training.tiny.model`, every weight trainable, over text transcripts.

A tiny model is built from scratch for SFT (``hyperparameters.model`` is its
:class:`GPTConfig`) or loaded from a checkpoint; rollouts go through the inference engine
(:class:`services.inference.tiny.TinyEngine`) within the model's context length.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from services.environments.base import Environment, Episode, TaskSpec
from services.inference.rollout import (
    EpisodeStream,
    RolloutSettings,
    TextRollout,
    run_text_episodes,
)
from services.inference.tiny import TinyEngine
from services.inference.utilisation import ModelShape, TimeSplit, round_utilisation
from services.training.checkpoint import Manifest, save_checkpoint
from services.training.device import autocast
from services.training.family import (
    DemonstrationOptions,
    EpisodeFeed,
    PackedBatch,
    Rollouts,
    TokenEpisode,
    TokenSequence,
)
from services.training.tiny.model import (
    GPT,
    GPTConfig,
    TinyModel,
    token_logprobs,
)
from services.training.tiny.rollout import episode_tokens
from services.training.tokenizer import ByteTokenizer


class TinyFamily:
    """The registry's ``tiny`` entry."""

    name = "tiny"
    eval_defaults: Mapping[str, int] = {}

    def load(
        self,
        path: Path,
        *,
        device: torch.device,
        base_dir: Path | None = None,
        training: object | None = None,
    ) -> TinyFamilyModel:
        """A verified tiny checkpoint; every weight is trainable, whatever ``training`` is."""
        loaded = TinyModel.load(path, device="cpu")
        return TinyFamilyModel(
            loaded.model,
            device=device,
            checkpoint_id=loaded.checkpoint_id,
            tokenizer=loaded.tokenizer,
        )

    def create(
        self, shape: Mapping[str, object] | None, *, seed: int, device: torch.device
    ) -> TinyFamilyModel:
        """A fresh GPT of ``shape`` (GPTConfig fields), initialised from ``seed``."""
        try:
            config = GPTConfig(**dict(shape or {}))  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid hyperparameters.model: {exc}") from None
        torch.manual_seed(seed)
        return TinyFamilyModel(GPT(config), device=device, checkpoint_id=None)


class TinyFamilyModel:
    """A tiny GPT as a family model: text rollouts, log-probs, demonstrations, save."""

    family = "tiny"
    pad_id = 0

    def __init__(
        self,
        net: GPT,
        *,
        device: torch.device,
        checkpoint_id: str | None,
        tokenizer: ByteTokenizer | None = None,
    ):
        self.net = net.to(device)
        self.device = device
        self.checkpoint_id = checkpoint_id
        self.tokenizer = tokenizer or ByteTokenizer()

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.net.named_parameters())

    def model_shape(self) -> ModelShape:
        """What a position costs the tiny GPT (every weight trains)."""
        return ModelShape.of(self.net)

    def train(self, mode: bool = True) -> None:
        self.net.train(mode)

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
        """Through the inference engine (rows join and leave a running batch; a GRPO
        group's shared prompt and each episode's earlier turns are prefilled once), the path
        serving shares. The engine is made per call, so its prefix cache never outlives the
        weights it was computed under."""
        was_training = self.net.training
        sampler = TinyModel(self.net, tokenizer=self.tokenizer, device=self.device)  # eval mode
        try:
            settings = RolloutSettings(max_turns, max_new_tokens, temperature, max_rows=max_rows)
            return engine_rollouts(sampler, env, tasks, seeds=seeds, settings=settings, feed=feed)
        finally:
            self.net.train(was_training)

    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        # Right padding needs no attention mask: a causal model never lets a real token
        # see the padding after it, and padded targets are outside batch.target.
        with autocast(self.device):
            return token_logprobs(self.net, batch.ids)  # (N, T-1)

    def demonstrations(
        self, env: Environment, tasks: Sequence[TaskSpec], options: DemonstrationOptions
    ) -> list[TokenSequence]:
        episodes = env.demonstrations(
            tasks, seed=options.seed, augment_fraction=options.augment_fraction
        )
        return demonstration_sequences(
            episodes, self.tokenizer, max_seq_len=self.net.config.max_seq_len
        )

    def save(self, out_dir: Path, *, parent: str | None, metadata: dict[str, object]) -> Manifest:
        return save_checkpoint(
            self.net,
            self.net.config,
            out_dir,
            parent=parent,
            tokenizer=self.tokenizer,
            metadata=dict(metadata),
        )


def demonstration_sequences(
    episodes: Sequence[Episode], tokenizer: ByteTokenizer, *, max_seq_len: int
) -> list[TokenSequence]:
    """Token ids + agent-token masks of demonstrations; one longer than the context is an error."""
    sequences = []
    for episode in episodes:
        ids, mask = episode_tokens(episode, tokenizer)
        if len(ids) > max_seq_len:
            raise ValueError(
                f"demonstration of task {episode.task_id[:12]} has {len(ids)} tokens, "
                f"more than max_seq_len={max_seq_len}"
            )
        sequences.append((ids, mask))
    return sequences


def engine_rollouts(
    model: TinyModel,
    env: Environment,
    tasks: Sequence[TaskSpec],
    *,
    seeds: Sequence[int],
    settings: RolloutSettings,
    feed: EpisodeFeed | None = None,
) -> Rollouts:
    """One verified episode per task, episode ``i`` sampled from ``seeds[i]``, and
    ``feed``'s as rows free, through a :class:`TinyEngine` over ``model``; token for token
    what :meth:`TinyModel.rollouts` (its own ``generate``) gives."""
    key = f"checkpoint:{model.checkpoint_id}" if model.checkpoint_id else "memory"
    split, started = TimeSplit(), time.perf_counter()
    episodes: dict[int, TokenEpisode] = {}

    def ended(i: int, rollout: TextRollout) -> None:
        with split.part("tool_calls"):  # the verifier
            reward = env.verify(rollout.task, rollout.episode)
        episodes[i] = TokenEpisode(
            task=rollout.task,
            turns=[(t.prompt_ids, t.completion_ids) for t in rollout.turns],
            reward=reward,
            end_reason=rollout.episode.end_reason,
            answer=rollout.episode.final_answer,
        )
        if feed is not None:
            feed.episode_ended(i, episodes[i])

    rollouts, stats = run_text_episodes(
        TinyEngine(model, key),
        env,
        tasks,
        seeds=seeds,
        settings=settings,
        split=split,
        stream=EpisodeStream(None if feed is None else feed.next_episode, ended),
    )
    ordered = [episodes[i] for i in range(len(rollouts))]
    turns = [turn for episode in ordered for turn in episode.turns]
    utilisation = round_utilisation(model.model, turns, split, time.perf_counter() - started)
    return Rollouts(ordered, stats.generated_tokens, stats.prompt_tokens, utilisation=utilisation)
