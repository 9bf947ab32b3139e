"""Run a policy on a task set and keep one result per task, so comparisons can be paired.

Every task is rolled out ``samples`` times (greedy when ``temperature`` is 0, the default,
which makes one sample the whole story). A task *passes* when a majority of its samples
pass (with one sample: when it passes); the pass rate is passed tasks / tasks with a
Wilson interval. The mean over all samples is reported too as ``sample_pass_rate``. Each
row keeps ``samples`` and ``sample_passes``, from which the loop estimates every task's
pass@1 (``services.evaluation.results.pass_at_1``): the number the gate and the held-out
points use, since a majority vote over samples is not what one request to the served model
gets.

Every model family goes through the same function and gives the same per-task results:
the model's :meth:`~services.training.family.FamilyModel.rollouts` (tiny: text
transcripts; hf: chat conversations with tools, scored by the environment's chat
verifier). Sample ``s`` of task ``t`` draws from ``derive_seed(seed, t, s)`` alone, so a
sampled evaluation is reproducible whatever the batch size.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.chat.text import valid_text
from services.environments.base import Environment, Reward, TaskSpec
from services.evaluation.results import mean_pass_at_k, reported_ks
from services.evaluation.stats import wilson_interval
from services.training.family import RolloutModel, TokenEpisode
from services.training.keep import EpisodeKeeper
from services.training.rng import derive_seed


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
        """The row as ``results.jsonl`` holds it: the answer is model text, made storable
        (services.chat.text)."""
        row = asdict(self)
        if self.answer is not None:
            row["answer"] = valid_text(self.answer)
        return row


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
            "pass_at_k": self.pass_at_k(),
            "generated_tokens": self.generated_tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
        }

    def pass_at_k(self) -> dict[str, float]:
        """pass@k for k in 1, 2, 4, ..., samples (unbiased, Chen et al. 2021): pass@k above
        pass@1 is what sampling still reaches and RL can turn into pass@1."""
        rows = [r.to_dict() for r in self.results]
        samples = min((r.samples for r in self.results), default=1)
        values = {k: mean_pass_at_k(rows, k) for k in reported_ks(samples)}
        return {str(k): round(v, 6) for k, v in values.items() if v is not None}

    def passes(self) -> dict[str, bool]:
        """task_id -> passed, the input of a paired comparison."""
        return {r.task_id: r.passed for r in self.results}


@dataclass(frozen=True)
class EvaluationSettings:
    """How an evaluation samples and reports: ``samples`` episodes per task (greedy at
    ``temperature`` 0, each sample drawn from ``derive_seed(seed, task, sample)``), their
    turn and token budgets, ``batch_size`` episodes decoding at once, and the ``confidence``
    of the pass rate's Wilson interval."""

    samples: int = 1
    temperature: float = 0.0
    seed: int = 0
    max_turns: int = 5
    max_new_tokens: int = 24
    batch_size: int = 256
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError("samples must be >= 1")


def evaluate(
    policy: RolloutModel,
    env: Environment,
    tasks: Sequence[TaskSpec],
    settings: EvaluationSettings = EvaluationSettings(),
    *,
    keeper: EpisodeKeeper | None = None,
) -> EvaluationResult:
    """Roll ``policy`` out on every task ``settings.samples`` times and verify each episode;
    ``keeper`` (a probe's) is handed every episode."""
    if not tasks:
        raise ValueError("cannot evaluate on an empty task set")
    started = time.monotonic()
    samples = settings.samples
    jobs = [(t, s) for t in range(len(tasks)) for s in range(samples)]
    # One call for every episode, at most batch_size decoding at once: an episode that ends
    # makes room for the next at once, where fixed chunks would wait for their longest one.
    rollouts = policy.rollouts(
        env,
        [tasks[t] for t, _ in jobs],
        seeds=[derive_seed(settings.seed, t, s) for t, s in jobs],
        max_turns=settings.max_turns,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        max_rows=settings.batch_size,
    )
    if keeper is not None:
        keeper.add(rollouts.episodes)
    outcomes: dict[int, list[_Outcome]] = {t: [] for t in range(len(tasks))}
    for (t, _), episode in zip(jobs, rollouts.episodes, strict=True):
        outcomes[t].append(_outcome(episode))
    results = [_task_result(tasks[t], outcomes[t]) for t in range(len(tasks))]
    passed = sum(r.passed for r in results)
    low, high = wilson_interval(passed, len(results), settings.confidence)
    sample_passes = sum(r.sample_passes for r in results)
    return EvaluationResult(
        results=results,
        n=len(results),
        passed=passed,
        pass_rate=passed / len(results),
        ci_low=low,
        ci_high=high,
        confidence=settings.confidence,
        sample_pass_rate=sample_passes / (len(results) * samples),
        generated_tokens=rollouts.generated_tokens,
        wall_s=time.monotonic() - started,
    )


def _outcome(episode: TokenEpisode) -> _Outcome:
    return _Outcome(episode.reward, episode.model_turns, episode.end_reason, episode.answer)


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
