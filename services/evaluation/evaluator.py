"""Run a policy on a task set and keep one result per task, so comparisons can be paired.

Every task is rolled out ``samples`` times (greedy when ``temperature`` is 0, the default,
which makes one sample the whole story). A task *passes* when a majority of its samples
pass (with one sample: when it passes); the pass rate is passed tasks / tasks with a
Wilson interval. The mean over all samples is reported too as ``sample_pass_rate``. Each
row keeps ``samples`` and ``sample_passes``, from which the loop estimates every task's
pass@1 (``services.evaluation.results.pass_at_1``): the number the gate and the held-out
points use, since a majority vote over samples is not what one request to the served model
gets.

Both model families go through the one inference engine (:mod:`services.inference`): a
tiny :class:`TinyModel` rolls out text transcripts (:func:`run_text_episodes`), an
:class:`HFModel` rolls out chat conversations with tools (:func:`run_chat_episodes`),
scored by the environment's chat verifier. Sample ``s`` of task ``t`` draws with seed
``derive_seed(seed, t, s)`` and the engine's counter-based sampler, so an evaluation is
reproducible whatever ``batch_size`` (the rows decoding at once) is; the prefix cache
computes the system text and tool list every task starts with once. A scripted tiny policy
(one that overrides ``generate``: a replay in a test) runs through its own ``generate``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from services.environments.base import Environment, Episode, Reward, TaskSpec
from services.environments.chat import ChatEnvironment, as_chat_environment
from services.evaluation.stats import wilson_interval
from services.inference.hf import HFEngine
from services.inference.rollout import (
    ChatRollout,
    run_chat_episodes,
    run_text_episodes,
)
from services.inference.tiny import TinyEngine
from services.training.model import TinyModel
from services.training.rng import derive_seed
from services.training.rollout import run_episodes

if TYPE_CHECKING:
    from services.training.hf.model import HFModel


@dataclass(frozen=True)
class _Outcome:
    """One sample of one task, whichever family produced it."""

    reward: Reward
    turns: int
    end_reason: str | None
    answer: str | None


@dataclass(frozen=True)
class TaskResult:
    """One task's outcome: pass/fail, reward (mean over samples), rubric, turns used."""

    task_id: str
    passed: bool
    reward: float
    components: dict[str, float]
    turns: int
    samples: int = 1
    sample_passes: int = 0
    end_reason: str | None = None
    answer: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EvaluationResult:
    results: list[TaskResult]
    n: int
    passed: int
    pass_rate: float
    ci_low: float
    ci_high: float
    confidence: float
    sample_pass_rate: float
    generated_tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def metrics(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "passed": self.passed,
            "pass_rate": self.pass_rate,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "confidence": self.confidence,
            "sample_pass_rate": self.sample_pass_rate,
            "generated_tokens": self.generated_tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
        }

    def passes(self) -> dict[str, bool]:
        """task_id -> passed, the input of a paired comparison."""
        return {r.task_id: r.passed for r in self.results}


def evaluate(
    policy: TinyModel | HFModel,
    env: Environment,
    tasks: Sequence[TaskSpec],
    *,
    samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    max_turns: int = 5,
    max_new_tokens: int = 24,
    batch_size: int = 256,
    confidence: float = 0.95,
) -> EvaluationResult:
    """Roll ``policy`` out on every task ``samples`` times and verify each episode."""
    if samples < 1:
        raise ValueError("samples must be >= 1")
    if not tasks:
        raise ValueError("cannot evaluate on an empty task set")
    started = time.monotonic()
    jobs = [(t, s) for t in range(len(tasks)) for s in range(samples)]
    job_tasks = [tasks[t] for t, _ in jobs]
    seeds = [derive_seed(seed, t, s) for t, s in jobs]
    options: dict[str, Any] = {
        "seeds": seeds,
        "max_turns": max_turns,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "max_rows": batch_size,
    }
    if isinstance(policy, TinyModel) and type(policy).generate is not TinyModel.generate:
        # A scripted policy (a replay in a test or a demo) answers through its own
        # ``generate``, not its weights: the engine cannot run it, its generate can.
        del options["max_rows"]
        played, played_stats = run_episodes(env, job_tasks, policy, **options)
        sampled = [_text_outcome(env, task, ep) for task, ep in zip(job_tasks, played, strict=True)]
        generated = played_stats.generated_tokens
    elif isinstance(policy, TinyModel):
        episodes, stats = run_text_episodes(
            TinyEngine(policy, policy_path(policy)), env, job_tasks, **options
        )
        sampled = [
            _text_outcome(env, task, r.episode) for task, r in zip(job_tasks, episodes, strict=True)
        ]
        generated = stats.generated_tokens
    else:
        chat_env = as_chat_environment(env)
        engine = HFEngine(
            policy.model,
            policy.tokenizer,
            path=policy_path(policy),
            version=policy.checkpoint_id or "",
        )
        chats, stats = run_chat_episodes(engine, chat_env, job_tasks, **options)
        sampled = [
            _chat_outcome(chat_env, task, r) for task, r in zip(job_tasks, chats, strict=True)
        ]
        generated = stats.generated_tokens
    outcomes: dict[int, list[_Outcome]] = {t: [] for t in range(len(tasks))}
    for (t, _), outcome in zip(jobs, sampled, strict=True):
        outcomes[t].append(outcome)
    results = [_task_result(tasks[t], outcomes[t]) for t in range(len(tasks))]
    passed = sum(r.passed for r in results)
    low, high = wilson_interval(passed, len(results), confidence)
    sample_passes = sum(r.sample_passes for r in results)
    return EvaluationResult(
        results=results,
        n=len(results),
        passed=passed,
        pass_rate=passed / len(results),
        ci_low=low,
        ci_high=high,
        confidence=confidence,
        sample_pass_rate=sample_passes / (len(results) * samples),
        generated_tokens=generated,
        wall_s=time.monotonic() - started,
    )


def policy_path(policy: TinyModel | HFModel) -> str:
    """What the engine calls the policy (its checkpoint id; policies in memory have none)."""
    checkpoint = policy.checkpoint_id
    return f"checkpoint:{checkpoint}" if checkpoint else "memory"


def _text_outcome(env: Environment, task: TaskSpec, ep: Episode) -> _Outcome:
    return _Outcome(env.verify(task, ep), len(ep.agent_turns), ep.end_reason, ep.final_answer)


def _chat_outcome(env: ChatEnvironment, task: TaskSpec, rollout: ChatRollout) -> _Outcome:
    ep = rollout.episode
    reward = env.chat_verify(task, ep)
    return _Outcome(reward, ep.assistant_turns, ep.end_reason, ep.final_answer)


def _task_result(task: TaskSpec, outcomes: list[_Outcome]) -> TaskResult:
    rewards = [outcome.reward for outcome in outcomes]
    n = len(rewards)
    keys = rewards[0].components.keys()
    first = outcomes[0]
    sample_passes = sum(r.passed for r in rewards)
    return TaskResult(
        task_id=task.task_id,
        passed=sample_passes * 2 > n,
        reward=sum(r.total for r in rewards) / n,
        components={k: sum(r.components[k] for r in rewards) / n for k in keys},
        turns=first.turns,
        samples=n,
        sample_passes=sample_passes,
        end_reason=first.end_reason,
        answer=first.answer,
    )
