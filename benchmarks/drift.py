"""The SmolLM2 drift-recovery runs' shared parts: the task sets, the options, the paired
comparison and the figures every trainer benchmark prints alike.

Torch and the standard library only, as a train job: ``benchmarks/real_model.py`` runs on a
GPU node's image, which has no database packages (``benchmarks/support.py`` is the api and
database side).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.environments.base import Environment, TaskSpec
from services.evaluation.figures import paired_gain, rate
from services.evaluation.stats import PairedComparison, compare_paired

if TYPE_CHECKING:
    from services.evaluation.evaluator import EvaluationResult


def held_out(
    env: Environment,
    version: str,
    n: int,
    seed: int,
    exclude: set[str],
    *,
    keep: Callable[[TaskSpec], bool] | None = None,
) -> list[TaskSpec]:
    """``n`` tasks of API ``version`` that no training set in ``exclude`` holds (and that
    ``keep`` accepts)."""
    pool = env.generate_tasks(3 * n + len(exclude), seed=seed, api_version=version)
    return [t for t in pool if t.task_id not in exclude and (keep is None or keep(t))][:n]


# What each toolcalc drift changes that a real LM cannot read off the renamed tool list:
# v2 only renames (so every task counts), v3 adds the required ``cur`` to the price lookup,
# which only tasks with a ``$item`` call (half the generated families) meet.
DRIFT_CHANGED_OPS: dict[str, frozenset[str] | None] = {"v2": None, "v3": frozenset({"lookup"})}


def touched_by_drift(drift: str) -> Callable[[TaskSpec], bool]:
    """Whether solving a task calls a tool that ``drift`` changed (its held-out set)."""
    from services.environments.toolcalc import get_api
    from services.environments.toolcalc.tasks import solve

    changed, api = DRIFT_CHANGED_OPS[drift], get_api(drift)

    def touched(task: TaskSpec) -> bool:
        program = solve(str(task.verifier["params"]["request"]), api)
        return changed is None or any(op in changed for op, _ in program.calls)

    return touched


@dataclass(frozen=True)
class DriftTaskSets:
    """The task sets of a drift-recovery run on a real LM, disjoint by task id: v1
    demonstrations for the champion, drifted tasks that call the changed tool for GRPO, a
    held-out set of each API version, and v1 replay tasks (a loop's regression split: v1
    traffic the champion handled, none of it held out), which rft replays."""

    sft: list[TaskSpec]
    grpo: list[TaskSpec]
    eval_v1: list[TaskSpec]
    eval_drifted: list[TaskSpec]
    replay: list[TaskSpec]


def drift_task_sets(
    env: Environment,
    drift: str,
    *,
    sft: int,
    grpo: int,
    evaluation: int,
    seed: int,
    replay: int = 32,
) -> DriftTaskSets:
    """The sets every SmolLM2 benchmark trains and scores on, so their figures compare."""
    sft_tasks = env.generate_tasks(sft, seed=seed + 1, api_version="v1")
    touched = touched_by_drift(drift)
    grpo_pool = env.generate_tasks(3 * grpo, seed=seed + 2, api_version=drift)
    grpo_tasks = [t for t in grpo_pool if touched(t)][:grpo]
    seen = {t.task_id for t in sft_tasks} | {t.task_id for t in grpo_tasks}
    eval_v1 = held_out(env, "v1", evaluation, seed + 3, seen)
    eval_drifted = held_out(env, drift, evaluation, seed + 4, seen, keep=touched)
    scored = seen | {t.task_id for t in eval_v1 + eval_drifted}
    return DriftTaskSets(
        sft=sft_tasks,
        grpo=grpo_tasks,
        eval_v1=eval_v1,
        eval_drifted=eval_drifted,
        replay=held_out(env, "v1", replay, seed + 5, scored),
    )


def smollm2_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every SmolLM2 benchmark takes (a benchmark adds its own after them)."""
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the converted SmolLM2 checkpoint is cached (default: <workdir>/smollm2)",
    )


def paired_on(
    tasks: Sequence[TaskSpec], champion: EvaluationResult, candidate: EvaluationResult, *, seed: int
) -> PairedComparison:
    """Candidate against champion task by task on ``tasks``, at the gate's confidence."""
    ids = [t.task_id for t in tasks]
    return compare_paired(
        [champion.passes()[i] for i in ids],
        [candidate.passes()[i] for i in ids],
        confidence=0.95,
        seed=seed,
    )


def drift_recovery_figures(
    champion: tuple[EvaluationResult, EvaluationResult],
    candidate: tuple[EvaluationResult, EvaluationResult],
) -> dict[str, float]:
    """The headline figures of a drift-recovery run, named alike in every trainer benchmark:
    each model's (v1, v2) pass rates, the v1 regression and the v2 gain in points."""
    (v1_before, v2_before), (v1_after, v2_after) = champion, candidate
    return {
        "v1_pass_champion": v1_before.pass_rate,
        "v2_pass_before": v2_before.pass_rate,
        "v2_pass_after": v2_after.pass_rate,
        "v1_pass_after": v1_after.pass_rate,
        "v1_regression_drop_points": round(100.0 * (v1_before.pass_rate - v1_after.pass_rate), 2),
        "v2_gain_points": round(100.0 * (v2_after.pass_rate - v2_before.pass_rate), 2),
    }


ScoredSet = tuple[Sequence[TaskSpec], "EvaluationResult", "EvaluationResult"]


def uncertainty_figures(v1: ScoredSet, v2: ScoredSet, *, seed: int) -> dict[str, Any]:
    """Each model's pass rate on each held-out set with its count and Wilson interval, and
    the candidate's gain on each with the paired bootstrap's (services.evaluation.figures);
    a set is (its tasks, the champion's result, the candidate's)."""
    out: dict[str, Any] = {}
    for name, gain_key, (tasks, before, after) in (
        ("v1", "v1_change", v1),
        ("v2", "v2_gain", v2),
    ):
        ids = [t.task_id for t in tasks]
        old, new = ([float(result.passes()[i]) for i in ids] for result in (before, after))
        out[f"{name}_pass_champion"] = rate(sum(old), len(ids)).to_json()
        out[f"{name}_pass_candidate"] = rate(sum(new), len(ids)).to_json()
        gain = paired_gain(old, new, seed=seed) if ids else None
        out[gain_key] = gain.to_json() if gain is not None else None
    return out


def shared_machine_figures(
    threads: int | None, load_start: tuple[float, float, float]
) -> dict[str, Any]:
    """What the machine was doing around a run (threads used, CPUs, load average before and
    after), printed with every trainer benchmark's figures: machines here are shared, and a
    figure is read against its load."""
    return {
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
