"""Episodes through the engine: many episodes stepped by an environment, as a batch.

This is how training rollouts and evaluation run a policy: every episode's next turn is a
row of one :class:`~services.inference.engine.ActiveBatch`. A row that finishes is applied
to its episode at once (the environment answers its tool calls) and the episode's next turn
joins the running batch at the next step, while the other rows keep decoding: no episode
waits for the slowest row of a round. Each episode holds a
:class:`~services.inference.prefix_cache.Session`, so a later turn prefills only what the
environment added (the tool result and the new turn's header), and the rows of a GRPO group
(one task repeated) and every prompt's shared system text and tool list are prefilled once.

Episode ``i``'s turn ``r`` samples with seed ``derive_seed(seeds[i], r)`` and counter-based
noise (:mod:`services.training.rng`), so its tokens depend neither on which other episodes
share the batch nor on when it joined; greedy (``temperature == 0``) episodes are the
model's argmax continuations, token for token.

Every turn comes back as :class:`TurnTokens`: the exact prompt ids the model saw, the ids it
sampled (the end-of-turn token included when sampled) and each sampled id's log-probability
under the model (temperature 1), which training scores without re-tokenizing anything.

- :func:`run_chat_episodes`: chat episodes (messages and tools, the template of the
  engine's family) of a :class:`~services.environments.chat.ChatEnvironment`.
- :func:`run_text_episodes`: the tiny family's text transcripts of an
  :class:`~services.environments.base.Environment`.

Both take a :class:`RolloutSettings`: the budgets and sampling every episode shares.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from services.environments.base import Environment, Episode, TaskSpec
from services.environments.chat import ChatEnvironment, ChatEpisode
from services.inference.engine import (
    ActiveBatch,
    Engine,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from services.inference.prefix_cache import Session
from services.inference.remote import RemoteBatch, RemoteEngine
from services.inference.tiny import TinyEngine
from services.inference.utilisation import TimeSplit
from services.training.rng import derive_seed

DEFAULT_MAX_ROWS = 64  # rows decoding at once on a CPU
# On a GPU a decode step costs about the same for 64 rows as for a thousand (it reads the
# weights once either way), so up to this many of a call's episodes decode at once; more
# would hold tens of GB of keys and values (SmolLM2: 22.5 KB a position in bf16).
CUDA_MAX_ROWS = 1024


@dataclass(frozen=True)
class TurnTokens:
    """One assistant turn as the model saw and produced it."""

    prompt_ids: list[int]
    completion_ids: list[int]  # every sampled id, the end-of-turn token included if sampled
    logprobs: list[float]  # log p(completion_ids[k] | prompt, completion_ids[:k]), T=1
    truncated: bool  # the turn hit its token budget before an end-of-turn token
    cached_tokens: int  # prompt tokens whose keys/values were reused, not computed


@dataclass
class ChatRollout:
    episode: ChatEpisode
    turns: list[TurnTokens] = field(default_factory=list)


@dataclass
class TextRollout:
    episode: Episode
    turns: list[TurnTokens] = field(default_factory=list)


@dataclass(frozen=True)
class RolloutStats:
    episodes: int
    turns: int
    generated_tokens: int
    prompt_tokens: int  # prompt tokens of every turn, as the model saw them
    prefill_tokens_cached: int  # of those, reused from the prefix cache
    prefill_tokens_computed: int  # of those, run through the model


@dataclass(frozen=True)
class RolloutSettings:
    """How every episode of a rollout is decoded: the turn and token budgets, the sampling,
    and how many rows decode at once (None: :data:`DEFAULT_MAX_ROWS`)."""

    max_turns: int
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    def rows(self, device: torch.device) -> int:
        """How many rows decode at once on ``device``."""
        if self.max_rows is not None:
            return self.max_rows
        return CUDA_MAX_ROWS if device.type == "cuda" else DEFAULT_MAX_ROWS


def run_chat_episodes(
    engine: Engine | RemoteEngine,
    env: ChatEnvironment,
    tasks: Sequence[TaskSpec],
    *,
    seeds: Sequence[int],
    settings: RolloutSettings,
    adapter: str | None = None,
    max_prompt_tokens: int = 2048,
    split: TimeSplit | None = None,
) -> tuple[list[ChatRollout], RolloutStats]:
    """Roll out one chat episode per task (tasks may repeat, e.g. a GRPO group) on
    ``engine`` under ``adapter`` (None: the base model); one seed per episode. A
    :class:`~services.inference.remote.RemoteEngine` decodes every turn on its server.

    An episode whose next prompt plus ``settings.max_new_tokens`` would pass
    ``max_prompt_tokens`` (or the model's context) ends with ``end_reason ==
    "context_limit"``. ``split``, when given, gets the seconds of the model calls, the
    sampling, the environment's steps (``tool_calls``) and the template (``tokenizer``)."""
    _check_seeds(tasks, seeds)
    max_new_tokens = settings.max_new_tokens
    rollouts = [ChatRollout(env.chat_start(task, max_turns=settings.max_turns)) for task in tasks]
    limit = min(max_prompt_tokens, engine.context_length())
    timed = split or TimeSplit()

    def prompt(i: int) -> list[int] | None:
        episode = rollouts[i].episode
        if episode.done:
            return None
        with timed.part("tokenizer"):
            ids = engine.render(episode.messages, episode.tools)
        if len(ids) + max_new_tokens > limit:
            episode.done, episode.end_reason = True, "context_limit"
            return None
        return ids

    def apply(i: int, request: GenerationRequest, result: GenerationResult) -> None:
        rollout = rollouts[i]
        truncated = result.finish_reason == FinishReason.LENGTH
        with timed.part("tokenizer"):
            text = engine.decode_text(result.token_ids)
        with timed.part("tool_calls"):
            env.chat_step(tasks[i], rollout.episode, text, truncated=truncated)
        rollout.turns.append(_turn(request, result))

    stats = _drive(
        engine,
        len(tasks),
        prompt,
        apply,
        _sampling(seeds, settings),
        adapter=adapter,
        max_rows=settings.rows(_device(engine)),
        split=split,
    )
    return rollouts, stats


def _device(engine: Engine | RemoteEngine) -> torch.device:
    """Where the rows decode: a remote server's rows are its requests, as many as a CPU's."""
    return torch.device("cpu") if isinstance(engine, RemoteEngine) else engine.device


def run_text_episodes(
    engine: TinyEngine,
    env: Environment,
    tasks: Sequence[TaskSpec],
    *,
    seeds: Sequence[int],
    settings: RolloutSettings,
    split: TimeSplit | None = None,
) -> tuple[list[TextRollout], RolloutStats]:
    """Roll out one text episode per task with the tiny family (its transcripts are its
    protocol, see :mod:`services.environments.base`); one seed per episode. ``split`` as
    :func:`run_chat_episodes`'."""
    _check_seeds(tasks, seeds)
    max_new_tokens = settings.max_new_tokens
    tokenizer = engine.tiny_model.tokenizer
    limit = engine.context_length()
    rollouts = [TextRollout(env.start(task, max_turns=settings.max_turns)) for task in tasks]
    timed = split or TimeSplit()

    def prompt(i: int) -> list[int] | None:
        episode = rollouts[i].episode
        if episode.done:
            return None
        with timed.part("tokenizer"):
            ids = tokenizer.encode(episode.transcript())
        if len(ids) + max_new_tokens > limit:
            episode.done, episode.end_reason = True, "context_limit"
            return None
        return ids

    def apply(i: int, request: GenerationRequest, result: GenerationResult) -> None:
        rollout = rollouts[i]
        with timed.part("tokenizer"):
            text = tokenizer.decode(result.token_ids)
        with timed.part("tool_calls"):
            env.step(tasks[i], rollout.episode, text)
        rollout.episode.agent_turns[-1].truncated = result.finish_reason == FinishReason.LENGTH
        rollout.turns.append(_turn(request, result))

    stats = _drive(
        engine,
        len(tasks),
        prompt,
        apply,
        _sampling(seeds, settings),
        adapter=None,
        max_rows=settings.rows(engine.device),
        split=split,
    )
    return rollouts, stats


def _check_seeds(tasks: Sequence[TaskSpec], seeds: Sequence[int]) -> None:
    if len(seeds) != len(tasks):
        raise ValueError(f"need one seed per task: {len(seeds)} seeds for {len(tasks)} tasks")


def _sampling(
    seeds: Sequence[int], settings: RolloutSettings
) -> Callable[[int, int], SamplingParams]:
    def sampling(i: int, turn: int) -> SamplingParams:
        seed = derive_seed(seeds[i], turn)
        return SamplingParams(
            settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            seed=seed,
        )

    return sampling


def _turn(request: GenerationRequest, result: GenerationResult) -> TurnTokens:
    return TurnTokens(
        prompt_ids=list(request.prompt_ids),
        completion_ids=list(result.sampled_ids),
        logprobs=list(result.logprobs),
        truncated=result.finish_reason == FinishReason.LENGTH,
        cached_tokens=result.cached_tokens,
    )


def _drive(
    engine: Engine | RemoteEngine,
    episodes: int,
    prompt: Callable[[int], list[int] | None],
    apply: Callable[[int, GenerationRequest, GenerationResult], None],
    sampling: Callable[[int, int], SamplingParams],
    *,
    adapter: str | None,
    max_rows: int,
    split: TimeSplit | None = None,
) -> RolloutStats:
    """Decode every episode's turns until each episode's ``prompt`` says it is over."""
    sessions = [Session() for _ in range(episodes)]
    turns = [0] * episodes
    waiting = deque(range(episodes))  # episodes whose next turn has not joined yet
    running: dict[int, GenerationRequest] = {}
    batch: ActiveBatch[int] | RemoteBatch[int] = (
        engine.open_batch()
        if isinstance(engine, RemoteEngine)
        else ActiveBatch(engine, split=split)
    )
    generated = prompt_tokens = cached = 0
    try:
        while waiting or running:
            joining: list[tuple[GenerationRequest, int]] = []
            while waiting and len(running) < max_rows:
                i = waiting.popleft()
                ids = prompt(i)
                if ids is None:
                    sessions[i].close()
                    continue
                request = GenerationRequest(
                    ids, sampling(i, turns[i]), adapter=adapter, session=sessions[i]
                )
                running[i] = request
                joining.append((request, i))
            batch.join(joining)
            for i, result in batch.step():
                request = running.pop(i)
                apply(i, request, result)
                generated += len(result.sampled_ids)
                prompt_tokens += result.prompt_tokens
                cached += result.cached_tokens
                turns[i] += 1
                waiting.append(i)
    finally:
        for session in sessions:
            session.close()
    return RolloutStats(
        episodes=episodes,
        turns=sum(turns),
        generated_tokens=generated,
        prompt_tokens=prompt_tokens,
        prefill_tokens_cached=cached,
        prefill_tokens_computed=prompt_tokens - cached,
    )
