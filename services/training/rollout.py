"""Batched multi-turn rollouts and the token view of an episode that training needs.

:func:`run_episodes` steps many episodes in lockstep: each round it asks the policy for the
next turn of every unfinished episode in one batched ``generate`` call, then lets the
environment apply each turn. Episode ``i`` at round ``r`` samples with seed
``derive_seed(seeds[i], r)``, so its tokens do not depend on which other episodes share the
batch (see :mod:`services.training.rng`).

:func:`episode_tokens` turns an episode back into token ids plus a mask of the tokens the
policy produced (agent turn text and its closing newline), the only ones a loss may touch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.environments.base import Environment, Episode, TaskSpec
from services.training.model import TinyModel
from services.training.rng import derive_seed
from services.training.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class RolloutStats:
    generated_tokens: int
    rounds: int


def run_episodes(
    env: Environment,
    tasks: Sequence[TaskSpec],
    policy: TinyModel,
    *,
    seeds: Sequence[int],
    max_turns: int,
    max_new_tokens: int,
    temperature: float,
) -> tuple[list[Episode], RolloutStats]:
    """Roll out one episode per task (tasks may repeat, e.g. a GRPO group) in lockstep."""
    if len(seeds) != len(tasks):
        raise ValueError("need one seed per task")
    tokenizer = policy.tokenizer
    limit = policy.model.config.max_seq_len
    episodes = [env.start(task, max_turns=max_turns) for task in tasks]
    generated = 0
    rounds = 0
    while True:
        active: list[int] = []
        prompts: list[str] = []
        for i, episode in enumerate(episodes):
            if episode.done:
                continue
            transcript = episode.transcript()
            if len(tokenizer.encode(transcript)) + max_new_tokens > limit:
                episode.done, episode.end_reason = True, "context_limit"
                continue
            active.append(i)
            prompts.append(transcript)
        if not active:
            break
        outputs = policy.generate(
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=[derive_seed(seeds[i], rounds) for i in active],
        )
        for i, text in zip(active, outputs, strict=True):
            n_tokens = len(tokenizer.encode(text))
            env.step(tasks[i], episodes[i], text)
            agent_turn = episodes[i].agent_turns[-1]
            agent_turn.truncated = n_tokens >= max_new_tokens
            generated += n_tokens + (0 if agent_turn.truncated else 1)
        rounds += 1
    return episodes, RolloutStats(generated_tokens=generated, rounds=rounds)


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


def collate(
    sequences: Sequence[tuple[list[int], list[bool]]], *, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to a batch: ids (N, T) and a target mask (N, T-1) aligned with ``ids[:, 1:]``."""
    width = max(len(ids) for ids, _ in sequences)
    ids_t = torch.zeros(len(sequences), width, dtype=torch.long)  # (N, T)
    mask_t = torch.zeros(len(sequences), width, dtype=torch.bool)  # (N, T)
    for row, (ids, mask) in enumerate(sequences):
        ids_t[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask_t[row, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    return ids_t.to(device), mask_t[:, 1:].to(device)  # (N, T), (N, T-1)
