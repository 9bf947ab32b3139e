"""Batched multi-turn rollouts of text transcripts, with the token record training needs.

:func:`run_episodes` steps many episodes in lockstep: each round it asks the model for the
next turn of every unfinished episode in one batched ``generate`` call, then lets the
environment apply each turn. Episode ``i`` at round ``r`` samples with seed
``derive_seed(seeds[i], r)``, so its tokens do not depend on which other episodes share the
batch (see :mod:`services.training.rng`). For every model turn it records the prompt ids
(the transcript so far) and the completion ids (the turn and its closing newline when the
stop byte was sampled): :func:`services.training.family.pack_turns` joins them into the
sequence a loss trains on, the agent's tokens as the only targets.

Any model with a byte tokenizer and a ``generate(prompts, max_new_tokens=, temperature=,
seed=[...])`` that returns text runs through it (:class:`TextGenerator`). The tiny GPT itself
rolls out through the inference engine (:func:`services.inference.rollout.run_text_episodes`,
the same token record); this loop is the path for text generators the engine cannot run:
scripted policies that override ``TinyModel.generate`` and families with their own sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.environments.base import Environment, Episode, TaskSpec
from services.training.family import TokenTurn
from services.training.rng import derive_seed
from services.training.tokenizer import ByteTokenizer


class TextGenerator(Protocol):
    """What :func:`run_episodes` needs from a model: a byte tokenizer and batched sampling."""

    tokenizer: ByteTokenizer

    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: Sequence[int],
    ) -> list[str]: ...


@dataclass
class TextRollout:
    """One episode with the token record of its agent turns."""

    episode: Episode
    turns: list[TokenTurn] = field(default_factory=list)


@dataclass(frozen=True)
class RolloutStats:
    generated_tokens: int
    prompt_tokens: int
    rounds: int


def run_episodes(
    env: Environment,
    tasks: Sequence[TaskSpec],
    model: TextGenerator,
    *,
    seeds: Sequence[int],
    max_turns: int,
    max_new_tokens: int,
    temperature: float,
    context_limit: int,
) -> tuple[list[TextRollout], RolloutStats]:
    """Roll out one episode per task (tasks may repeat, e.g. a GRPO group) in lockstep;
    an episode whose next turn would not fit ``context_limit`` tokens ends there."""
    if len(seeds) != len(tasks):
        raise ValueError("need one seed per task")
    tokenizer = model.tokenizer
    rollouts = [TextRollout(env.start(task, max_turns=max_turns)) for task in tasks]
    episodes = [r.episode for r in rollouts]
    generated = prompt_tokens = rounds = 0
    while True:
        active: list[int] = []
        prompts: list[str] = []
        prompt_ids: list[list[int]] = []
        for i, episode in enumerate(episodes):
            if episode.done:
                continue
            transcript = episode.transcript()
            ids = tokenizer.encode(transcript)
            if len(ids) + max_new_tokens > context_limit:
                episode.done, episode.end_reason = True, "context_limit"
                continue
            active.append(i)
            prompts.append(transcript)
            prompt_ids.append(ids)
        if not active:
            break
        outputs = model.generate(
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=[derive_seed(seeds[i], rounds) for i in active],
        )
        for i, ids, text in zip(active, prompt_ids, outputs, strict=True):
            completion = tokenizer.encode(text)
            truncated = len(completion) >= max_new_tokens
            env.step(tasks[i], episodes[i], text)
            episodes[i].agent_turns[-1].truncated = truncated
            if not truncated:
                completion.append(tokenizer.stop_id)
            rollouts[i].turns.append((ids, completion))
            generated += len(completion)
            prompt_tokens += len(ids)
        rounds += 1
    return rollouts, RolloutStats(generated, prompt_tokens, rounds)


def episode_tokens(episode: Episode, tokenizer: ByteTokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of the episode up to its last generated token, and which tokens were generated."""
    ids = tokenizer.encode(episode.prompt)
    mask = [False] * len(ids)
    for turn in episode.turns:
        prefix = episode.agent_prefix if turn.role == "agent" else episode.env_prefix
        for piece, trainable in (
            (prefix, False),
            (turn.text, turn.role == "agent"),
            ("\n", turn.role == "agent" and not turn.truncated),
        ):
            piece_ids = tokenizer.encode(piece)
            ids.extend(piece_ids)
            mask.extend([trainable] * len(piece_ids))
    # The environment's reply to the last agent turn is never a target: drop it, which also
    # keeps the sequence within the context the rollout checked before each turn.
    end = max((i + 1 for i, m in enumerate(mask) if m), default=len(ids))
    return ids[:end], mask[:end]
