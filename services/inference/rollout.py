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

Both take a :class:`RolloutSettings`: the budgets and sampling every episode shares, and
may take more episodes while they run (an :class:`EpisodeStream`): a row that frees takes
the stream's next episode, so the batch stays full until the stream has none, where a caller
that handed over fixed lists would wait for each call's slowest episode before the next call
could start (measured in an rft job's round on SmolLM2: 274 of 363 decode steps ran 32 rows
or fewer of 48). The stream hears of each episode as it ends, so it can choose the next ones
from the outcomes so far.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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

EpisodeSource = Callable[[], "tuple[TaskSpec, int] | None"]
"""The next episode a running rollout takes when a row frees: its task and seed, or None
when none is due now (one may be due later, once a running episode has ended)."""


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
    task: TaskSpec
    episode: ChatEpisode
    turns: list[TurnTokens] = field(default_factory=list)


@dataclass
class TextRollout:
    task: TaskSpec
    episode: Episode
    turns: list[TurnTokens] = field(default_factory=list)


R = TypeVar("R", ChatRollout, TextRollout)


@dataclass(frozen=True)
class EpisodeStream(Generic[R]):
    """Episodes a rollout takes while it runs (``more``), and who hears of each as it ends
    (``ended(i, rollout)``, ``i`` its place in the result)."""

    more: EpisodeSource | None = None
    ended: Callable[[int, R], None] | None = None


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
    how many rows decode at once (None: :data:`DEFAULT_MAX_ROWS`) and the longest prompt a
    turn may have (None: the model's context)."""

    max_turns: int
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    max_rows: int | None = None
    max_prompt_tokens: int | None = 2048

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")
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
    split: TimeSplit | None = None,
    stream: EpisodeStream[ChatRollout] | None = None,
) -> tuple[list[ChatRollout], RolloutStats]:
    """Roll out one chat episode per task (tasks may repeat, e.g. a GRPO group) on
    ``engine`` under ``adapter`` (None: the base model); one seed per episode. A
    :class:`~services.inference.remote.RemoteEngine` decodes every turn on its server.

    ``stream.more`` supplies further episodes as rows free, after ``tasks``' (the result
    lists them in the order they were taken); ``stream.ended(i, rollout)`` is called as
    episode ``i`` ends.

    An episode whose next prompt plus ``settings.max_new_tokens`` would pass
    ``settings.max_prompt_tokens`` (or the model's context) ends with ``end_reason ==
    "context_limit"``. ``split``, when given, gets the seconds of the model calls, the
    sampling, the environment's steps (``tool_calls``) and the template (``tokenizer``)."""
    _check_seeds(tasks, seeds)
    max_new_tokens = settings.max_new_tokens

    def start(task: TaskSpec) -> ChatRollout:
        return ChatRollout(task, env.chat_start(task, max_turns=settings.max_turns))

    rollouts = [start(task) for task in tasks]
    every_seed = list(seeds)
    limit = min(settings.max_prompt_tokens or engine.context_length(), engine.context_length())
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
            env.chat_step(rollout.task, rollout.episode, text, truncated=truncated)
        rollout.turns.append(_turn(request, result))

    hooks = _Hooks(
        _taker(rollouts, every_seed, stream, start),
        prompt,
        apply,
        _sampling(every_seed, settings),
        _ender(rollouts, stream),
    )
    stats = _drive(
        engine,
        len(tasks),
        hooks,
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
    stream: EpisodeStream[TextRollout] | None = None,
) -> tuple[list[TextRollout], RolloutStats]:
    """Roll out one text episode per task with the tiny family (its transcripts are its
    protocol, see :mod:`services.environments.base`); one seed per episode, within the
    model's context. ``split`` and ``stream`` as :func:`run_chat_episodes`'."""
    _check_seeds(tasks, seeds)
    max_new_tokens = settings.max_new_tokens
    tokenizer = engine.tiny_model.tokenizer
    limit = engine.context_length()

    def start(task: TaskSpec) -> TextRollout:
        return TextRollout(task, env.start(task, max_turns=settings.max_turns))

    rollouts = [start(task) for task in tasks]
    every_seed = list(seeds)
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
            env.step(rollout.task, rollout.episode, text)
        rollout.episode.agent_turns[-1].truncated = result.finish_reason == FinishReason.LENGTH
        rollout.turns.append(_turn(request, result))

    hooks = _Hooks(
        _taker(rollouts, every_seed, stream, start),
        prompt,
        apply,
        _sampling(every_seed, settings),
        _ender(rollouts, stream),
    )
    stats = _drive(
        engine, len(tasks), hooks, adapter=None, max_rows=settings.rows(engine.device), split=split
    )
    return rollouts, stats


def _check_seeds(tasks: Sequence[TaskSpec], seeds: Sequence[int]) -> None:
    if len(seeds) != len(tasks):
        raise ValueError(f"need one seed per task: {len(seeds)} seeds for {len(tasks)} tasks")


def _taker(
    rollouts: list[R],
    seeds: list[int],
    stream: EpisodeStream[R] | None,
    start: Callable[[TaskSpec], R],
) -> Callable[[], bool]:
    """Take the stream's next episode into ``rollouts`` (and its seed into ``seeds``);
    whether there was one."""
    more = stream.more if stream is not None else None

    def take() -> bool:
        drawn = more() if more is not None else None
        if drawn is None:
            return False
        task, seed = drawn
        rollouts.append(start(task))
        seeds.append(seed)
        return True

    return take


def _ender(rollouts: Sequence[R], stream: EpisodeStream[R] | None) -> Callable[[int], None]:
    ended = stream.ended if stream is not None else None

    def end(i: int) -> None:
        if ended is not None:
            ended(i, rollouts[i])

    return end


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


@dataclass(frozen=True)
class _Hooks:
    """What :func:`_drive` asks of the episodes it decodes: another one (``take``, whether
    one was added), episode ``i``'s next prompt (None: it is over), what to do with a
    finished turn, turn ``r``'s sampling, and what to do when an episode is over."""

    take: Callable[[], bool]
    prompt: Callable[[int], list[int] | None]
    apply: Callable[[int, GenerationRequest, GenerationResult], None]
    sampling: Callable[[int, int], SamplingParams]
    ended: Callable[[int], None]


def _drive(
    engine: Engine | RemoteEngine,
    first: int,
    hooks: _Hooks,
    *,
    adapter: str | None,
    max_rows: int,
    split: TimeSplit | None = None,
) -> RolloutStats:
    """Decode episodes ``0 .. first - 1``, and those ``hooks.take`` adds (the next index
    each) as rows free, until every episode's prompt says it is over and none is added."""
    sessions = [Session() for _ in range(first)]
    turns = [0] * first
    waiting = deque(range(first))  # episodes whose next turn has not joined yet
    running: dict[int, GenerationRequest] = {}
    batch: ActiveBatch[int] | RemoteBatch[int] = (
        engine.open_batch()
        if isinstance(engine, RemoteEngine)
        else ActiveBatch(engine, split=split)
    )
    generated = prompt_tokens = cached = 0
    try:
        while True:
            joining: list[tuple[GenerationRequest, int]] = []
            while len(running) < max_rows:
                if waiting:
                    i = waiting.popleft()
                elif hooks.take():
                    i = len(sessions)
                    sessions.append(Session())
                    turns.append(0)
                else:
                    break
                ids = hooks.prompt(i)
                if ids is None:
                    sessions[i].close()
                    hooks.ended(i)
                    continue
                request = GenerationRequest(
                    ids, hooks.sampling(i, turns[i]), adapter=adapter, session=sessions[i]
                )
                running[i] = request
                joining.append((request, i))
            if not running:
                break
            batch.join(joining)
            for i, result in batch.step():
                request = running.pop(i)
                hooks.apply(i, request, result)
                generated += len(result.sampled_ids)
                prompt_tokens += result.prompt_tokens
                cached += result.cached_tokens
                turns[i] += 1
                waiting.append(i)
    finally:
        for session in sessions:
            session.close()
    return RolloutStats(
        episodes=len(sessions),
        turns=sum(turns),
        generated_tokens=generated,
        prompt_tokens=prompt_tokens,
        prefill_tokens_cached=cached,
        prefill_tokens_computed=prompt_tokens - cached,
    )
