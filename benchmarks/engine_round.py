"""One rollout round of the SmolLM2 benchmarks through the engine, measured against the
machine: the drifted lookup tasks, the round, and its utilisation figures.

Torch and the standard library only (as ``benchmarks/drift.py``), so a GPU node's image
without Ratchet's database and serving packages runs it: ``benchmarks/rollout.py`` (on the
2 cores, against ``transformers.generate``) and ``benchmarks/gpu_round.py`` (on CUDA) share
it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.drift import drift_task_sets
from services.environments.base import TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.inference.hf import HFEngine
from services.inference.rollout import RolloutSettings, RolloutStats, run_chat_episodes
from services.inference.utilisation import TimeSplit, Utilisation, round_utilisation
from services.training.rng import derive_seed


def rollout_tasks(env: ToolcalcEnvironment, args: argparse.Namespace) -> list[TaskSpec]:
    """GRPO's tasks of the SmolLM2 benchmarks (drifted lookups), each ``samples`` times."""
    sets = drift_task_sets(env, args.drift, sft=1, grpo=args.tasks, evaluation=1, seed=args.seed)
    return [task for task in sets.grpo for _ in range(args.samples)]


@dataclass(frozen=True)
class EngineRun:
    """One engine run: its seconds, its stats, and its utilisation (the FLOPs the round
    needed against the matmul peak measured at its calls' token count, the time split)."""

    seconds: float
    stats: RolloutStats
    utilisation: Utilisation


def through_engine(
    engine: HFEngine, env: ToolcalcEnvironment, tasks: list[TaskSpec], args: argparse.Namespace
) -> EngineRun:
    """The engine, from a cold prefix cache."""
    engine.prefix_cache.clear()
    split = TimeSplit()
    started = time.perf_counter()
    rollouts, stats = run_chat_episodes(
        engine,
        env,
        tasks,
        seeds=[derive_seed(args.seed, i) for i in range(len(tasks))],
        settings=RolloutSettings(
            args.max_turns, args.max_new_tokens, args.temperature, max_rows=args.max_rows
        ),
        split=split,
    )
    seconds = time.perf_counter() - started
    turns = [(turn.prompt_ids, turn.completion_ids) for r in rollouts for turn in r.turns]
    return EngineRun(seconds, stats, round_utilisation(engine.model, turns, split, seconds))


def utilisation_figures(utilisation: Utilisation) -> dict[str, Any]:
    """The engine run's MFU (the last run's: each run measures its own against the peak it
    measured), the peak, the model GFLOPs the round needed, its time split and calls."""
    report = utilisation.report()
    return {
        "rollout_mfu": report["rollout_mfu"],
        "peak_gflops": report["peak_gflops"]["rollout"],
        "model_gflops": report["model_gflops"]["rollout"],
        "time_split": report["time_split"],
        "forward_calls": report["forward_calls"],
    }


def profiled_round(
    engine: HFEngine, env: ToolcalcEnvironment, tasks: list[TaskSpec], args: argparse.Namespace
) -> tuple[dict[str, Any], str]:
    """One more engine run under ``torch.profiler`` (its overhead slows it: its seconds and
    MFU are not the benchmark's): the operators with the most CPU time of their own, as
    shares of the run's, and the profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run = through_engine(engine, env, tasks, args)
    averages = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in averages) or 1.0
    top = sorted(averages, key=lambda event: event.self_cpu_time_total, reverse=True)[:12]
    figures = {
        "profiled_s": round(run.seconds, 2),
        "self_cpu_share": {event.key: round(event.self_cpu_time_total / total, 4) for event in top},
    }
    return figures, averages.table(sort_by="self_cpu_time_total", row_limit=30)
