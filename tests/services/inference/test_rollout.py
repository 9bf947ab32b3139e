"""Episodes through the engine equal today's rollouts token for token, keep their KV between
turns, and return each turn's prompt ids, completion ids and log-probs; the model server
reports the prompt tokens it reused as OpenAI's ``cached_tokens``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.evaluator import EvaluationSettings, evaluate
from services.inference.hf import HFEngine
from services.inference.rollout import (
    EpisodeStream,
    RolloutSettings,
    run_chat_episodes,
    run_text_episodes,
)
from services.inference.tiny import TinyEngine
from services.serving.base import CheckpointRef
from services.training.family import family_for
from services.training.hf.model import HFModel
from services.training.hf.rollout import run_chat_episodes as generate_chat_episodes
from services.training.tiny.model import TinyModel
from services.training.tiny.rollout import run_episodes
from tests.services.modelserver.conftest import LISTING, TOOLCALC_TOOLS, demo_task, path_of

ENV = ToolcalcEnvironment()


def test_chat_episodes_equal_the_transformers_generate_path(
    tool_calling_llama: CheckpointRef,
) -> None:
    policy = HFModel.load(path_of(tool_calling_llama), device="cpu")
    engine = HFEngine(policy.model, policy.tokenizer, path="memory", version="v0")
    tasks = [t for t in ENV.generate_tasks(3, seed=2, api_version="v2") for _ in range(2)]
    options: dict[str, Any] = {"max_turns": 3, "max_new_tokens": 6, "temperature": 0.0}
    old, _ = generate_chat_episodes(ENV, tasks, policy, seeds=list(range(len(tasks))), **options)
    settings = RolloutSettings(**options)
    new, stats = run_chat_episodes(
        engine, ENV, tasks, seeds=list(range(len(tasks))), settings=settings
    )
    for before, after in zip(old, new, strict=True):
        assert after.episode.completions == before.episode.completions
        assert after.episode.end_reason == before.episode.end_reason
        assert [(t.prompt_ids, t.completion_ids) for t in after.turns] == before.turns
    assert max(len(r.turns) for r in new) == 3  # multi-turn: it calls a tool every turn
    for rollout in new:
        for turn in rollout.turns:
            assert len(turn.logprobs) == len(turn.completion_ids)
            assert all(lp <= 0.0 for lp in turn.logprobs)
        # Every later turn reused the episode's earlier turns: only what was added is prefilled.
        for earlier, later in zip(rollout.turns, rollout.turns[1:], strict=False):
            fed = len(earlier.prompt_ids) + len(earlier.completion_ids) - 1
            assert later.cached_tokens >= fed - engine.prefix_cache.block_tokens
    assert stats.prefill_tokens_cached > stats.prefill_tokens_computed
    assert stats.prompt_tokens == sum(len(t.prompt_ids) for r in new for t in r.turns)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_text_episodes_equal_the_tiny_familys_rollouts(
    tool_calling_tiny: CheckpointRef, temperature: float
) -> None:
    policy = TinyModel.load(path_of(tool_calling_tiny), device="cpu")
    engine = TinyEngine(policy, "memory")
    tasks = [demo_task()] * 3 + ENV.generate_tasks(3, seed=1, api_version="v1")
    seeds = [7 * i + 3 for i in range(len(tasks))]
    options: dict[str, Any] = {"max_turns": 4, "max_new_tokens": 16, "temperature": temperature}
    old, old_stats = run_episodes(
        ENV, tasks, policy, seeds=seeds, context_limit=policy.model.config.max_seq_len, **options
    )
    settings = RolloutSettings(**options, max_rows=4)
    new, stats = run_text_episodes(engine, ENV, tasks, seeds=seeds, settings=settings)
    assert [r.episode.transcript() for r in new] == [e.episode.transcript() for e in old]
    assert stats.generated_tokens == old_stats.generated_tokens
    if temperature == 0.0:
        assert ENV.verify(tasks[0], new[0].episode).passed  # the demo task, in several turns
        assert len(new[0].turns) == len(new[0].episode.agent_turns) > 1


def test_episodes_taken_from_a_stream_as_rows_free_sample_what_they_sample_given_at_once(
    tool_calling_tiny: CheckpointRef,
) -> None:
    """A rollout that takes its episodes from a stream takes the next one as a row frees
    (never more than ``max_rows`` running), says each one's end once, waits on a source that
    has none now while episodes still run, and samples what the same episodes sample handed
    over at once: each is seeded on its own."""
    policy = TinyModel.load(path_of(tool_calling_tiny), device="cpu")
    tasks = [demo_task()] * 2 + ENV.generate_tasks(4, seed=9, api_version="v1")
    seeds = [11 * i + 1 for i in range(len(tasks))]
    settings = RolloutSettings(max_turns=3, max_new_tokens=10, temperature=1.0, max_rows=2)
    given, given_stats = run_text_episodes(
        TinyEngine(policy, "memory"), ENV, tasks, seeds=seeds, settings=settings
    )

    def streamed(most_running: int) -> tuple[list[Any], list[int], list[int]]:
        queue = list(zip(tasks, seeds, strict=True))
        ended: list[int] = []
        running_when_taken: list[int] = []

        def more() -> tuple[Any, int] | None:
            running = len(running_when_taken) - len(ended)
            if not queue or running >= most_running:
                return None  # none now: one more once an episode has ended
            running_when_taken.append(running)
            return queue.pop(0)

        stream = EpisodeStream(more, lambda i, _: ended.append(i))
        rollouts, stats = run_text_episodes(
            TinyEngine(policy, "memory"), ENV, [], seeds=[], settings=settings, stream=stream
        )
        assert stats.generated_tokens == given_stats.generated_tokens
        return rollouts, ended, running_when_taken

    for most_running in (2, 1):
        rollouts, ended, running_when_taken = streamed(most_running)
        assert [r.episode.transcript() for r in rollouts] == [r.episode.transcript() for r in given]
        assert [r.task for r in rollouts] == tasks
        assert sorted(ended) == list(range(len(tasks)))  # each said once
        assert max(running_when_taken) == min(most_running, 2) - 1


@pytest.mark.parametrize(("cache_bytes", "max_rows"), [(0, 2), (256 * 1024 * 1024, 2), (0, 64)])
def test_greedy_tiny_episodes_through_the_engine_are_token_identical_to_generate(
    tool_calling_tiny: CheckpointRef, cache_bytes: int, max_rows: int
) -> None:
    """Every turn's prompt and completion ids equal the old generate path's, with rows
    joining and leaving (more episodes than rows, turns of different lengths), with and
    without prefix hits (a GRPO-like group of one task, and a cache of 0 bytes)."""
    policy = TinyModel.load(path_of(tool_calling_tiny), device="cpu")
    engine = TinyEngine(policy, "memory", prefix_cache_bytes=cache_bytes)
    tasks = [demo_task()] * 3 + ENV.generate_tasks(4, seed=5, api_version="v1")
    seeds = list(range(len(tasks)))
    options: dict[str, Any] = {"max_turns": 4, "max_new_tokens": 12, "temperature": 0.0}
    old, old_stats = run_episodes(
        ENV, tasks, policy, seeds=seeds, context_limit=policy.model.config.max_seq_len, **options
    )
    settings = RolloutSettings(**options, max_rows=max_rows)
    new, stats = run_text_episodes(engine, ENV, tasks, seeds=seeds, settings=settings)
    assert [[(t.prompt_ids, t.completion_ids) for t in r.turns] for r in new] == [
        r.turns for r in old
    ]
    assert [r.episode.end_reason for r in new] == [r.episode.end_reason for r in old]
    assert (stats.generated_tokens, stats.prompt_tokens) == (
        old_stats.generated_tokens,
        old_stats.prompt_tokens,
    )
    assert len({len(r.turns) for r in new}) > 1  # episodes leave at different turns
    if cache_bytes:
        assert stats.prefill_tokens_cached > 0
    else:
        assert stats.prefill_tokens_cached == 0


def test_tiny_family_rollouts_go_through_the_engine(tool_calling_tiny: CheckpointRef) -> None:
    """The tiny family rolls out on the engine and scores what the generate path
    (``TinyModel.rollouts``) scores; a subclass that scripts ``generate`` still rolls out
    through it."""
    policy = TinyModel.load(path_of(tool_calling_tiny), device="cpu")
    family_model = family_for("tiny").load(path_of(tool_calling_tiny), device=torch.device("cpu"))
    tasks = [demo_task()] * 2 + ENV.generate_tasks(2, seed=5, api_version="v1")
    options: dict[str, Any] = {"max_turns": 4, "max_new_tokens": 12, "temperature": 0.0}
    seen: list[str] = []
    caches: list[str] = []  # the kind of cache each forward pass of the GPT wrote to
    hook = family_model.net.register_forward_pre_hook(
        lambda _, args: caches.append(type(args[3]).__name__) if len(args) > 3 else None
    )
    try:
        rollouts = family_model.rollouts(ENV, tasks, seeds=[0, 1, 2, 3], **options)
    finally:
        hook.remove()
    assert caches and set(caches) == {"_Columns"}  # the engine's buffers, never generate's
    old, _ = run_episodes(
        ENV,
        tasks,
        policy,
        seeds=[0, 1, 2, 3],
        context_limit=policy.model.config.max_seq_len,
        **options,
    )
    assert [e.turns for e in rollouts.episodes] == [r.turns for r in old]
    assert [e.reward for e in rollouts.episodes] == [
        ENV.verify(t, r.episode) for t, r in zip(tasks, old, strict=True)
    ]
    assert rollouts.episodes[0].reward.passed

    class Scripted(TinyModel):
        def generate(self, prompts: Any, **_: Any) -> list[str]:
            seen.extend(prompts)
            return ["ans 0"] * len(prompts)

    scripted = Scripted(policy.model).rollouts(ENV, tasks[:1], seeds=[0], **options)
    assert seen and scripted.episodes[0].answer == "0"


def test_an_evaluation_keeps_its_batch_full_and_scores_what_one_big_batch_scores(
    tool_calling_tiny: CheckpointRef,
) -> None:
    """Evaluation hands the engine every episode at once, ``batch_size`` of them decoding:
    an episode that ends makes room for the next (no chunk waits for its longest episode),
    and the results are those of a batch holding every row, the lockstep path's too."""
    family_model = family_for("tiny").load(path_of(tool_calling_tiny), device=torch.device("cpu"))
    tasks = [demo_task()] * 2 + ENV.generate_tasks(5, seed=8, api_version="v1")
    options: dict[str, Any] = {"max_turns": 3, "max_new_tokens": 10, "samples": 2}

    def settings(batch_size: int) -> EvaluationSettings:
        return EvaluationSettings(batch_size=batch_size, temperature=1.0, **options)

    calls: list[tuple[int, int | None]] = []
    inner = family_model.rollouts

    def counted(env: Any, episodes: Any, **kwargs: Any) -> Any:
        calls.append((len(episodes), kwargs.get("max_rows")))
        return inner(env, episodes, **kwargs)

    family_model.rollouts = counted  # type: ignore[method-assign]
    narrow = evaluate(family_model, ENV, tasks, settings(batch_size=3))
    assert calls == [(14, 3)]
    wide = evaluate(family_model, ENV, tasks, settings(batch_size=64))
    lockstep = evaluate(
        TinyModel.load(path_of(tool_calling_tiny), device="cpu"), ENV, tasks, settings(batch_size=4)
    )
    for other in (wide, lockstep):
        assert [r.to_dict() for r in narrow.results] == [r.to_dict() for r in other.results]
        assert narrow.generated_tokens == other.generated_tokens
    with pytest.raises(ValueError, match="max_rows"):
        evaluate(family_model, ENV, tasks, EvaluationSettings(batch_size=0))


def test_bad_rollout_arguments_are_refused(tool_calling_tiny: CheckpointRef) -> None:
    engine = TinyEngine(TinyModel.load(path_of(tool_calling_tiny), device="cpu"), "memory")
    tasks = [demo_task()]
    base: dict[str, Any] = {"max_turns": 2, "max_new_tokens": 4, "temperature": 0.0}
    with pytest.raises(ValueError, match="one seed per task"):
        run_text_episodes(engine, ENV, tasks, seeds=[], settings=RolloutSettings(**base))
    changes: list[tuple[dict[str, Any], str]] = [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_rows": 0}, "max_rows"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens"),
    ]
    for change, message in changes:
        with pytest.raises(ValueError, match=message):
            run_text_episodes(
                engine, ENV, tasks, seeds=[0], settings=RolloutSettings(**{**base, **change})
            )


def test_the_model_server_reports_cached_prompt_tokens(
    serve: Any, tool_calling_tiny: CheckpointRef
) -> None:
    server = serve(tool_calling_tiny, name="agent")
    body = {
        "model": "agent",
        "messages": [{"role": "system", "content": LISTING}, {"role": "user", "content": "$pear"}],
        "tools": TOOLCALC_TOOLS,
        "temperature": 0,
    }
    before = _cached_prompt_tokens(httpx.get(f"{server.url}/metrics").text)
    first = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()
    second = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    assert second["choices"] == first["choices"] or (
        [c["message"]["tool_calls"][0]["function"] for c in second["choices"]]
        == [c["message"]["tool_calls"][0]["function"] for c in first["choices"]]
    )
    after = _cached_prompt_tokens(httpx.get(f"{server.url}/metrics").text)
    assert after - before == cached  # the process's counter: other tests may have counted too


def test_a_rollout_leaves_nothing_pinned(tool_calling_tiny: CheckpointRef) -> None:
    engine = TinyEngine(TinyModel.load(path_of(tool_calling_tiny), device="cpu"), "memory")
    run_text_episodes(
        engine,
        ENV,
        [demo_task()] * 2,
        seeds=[1, 2],
        settings=RolloutSettings(max_turns=3, max_new_tokens=12, temperature=0.0),
    )
    assert all(block.pins == 0 for block in engine.prefix_cache._lru.values())
    assert engine.prefix_cache.bytes > 0  # what is not pinned stays cached for the next round


def test_hf_evaluation_through_the_engine_scores_as_the_generate_path(
    tool_calling_llama: CheckpointRef,
) -> None:

    policy = HFModel.load(path_of(tool_calling_llama), device="cpu")
    tasks = ENV.generate_tasks(4, seed=6, api_version="v1")
    options: dict[str, Any] = {"max_turns": 2, "max_new_tokens": 6, "temperature": 0.0}
    result = evaluate(policy, ENV, tasks, EvaluationSettings(batch_size=3, **options))
    before, _ = generate_chat_episodes(ENV, tasks, policy, seeds=[0] * len(tasks), **options)
    rewards = [ENV.chat_verify(t, r.episode) for t, r in zip(tasks, before, strict=True)]
    assert [r.passed for r in result.results] == [w.passed for w in rewards]
    assert [r.reward for r in result.results] == [w.total for w in rewards]
    assert [r.turns for r in result.results] == [r.episode.assistant_turns for r in before]
    assert result.generated_tokens == sum(len(c) for r in before for _, c in r.turns)


def _cached_prompt_tokens(exposition: str) -> float:
    """The cached prompt tokens of every version the server counted."""
    from services.modelserver.usage import parse_usage

    return sum(usage.cached_prompt_tokens for usage in parse_usage(exposition).values())
