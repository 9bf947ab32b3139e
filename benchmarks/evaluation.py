"""Evaluation of SmolLM2 on the real-model benchmark's two held-out sets, this tree against another.

The 80 tasks (``--tasks`` v1 tasks and as many drifted ones, the sets of
``benchmarks/real_model.py``) are evaluated greedily, multi-turn with tool results, with
the real-model benchmark's settings (4 turns, 40 new tokens a turn, batches of 32),
through :func:`services.evaluation.evaluator.evaluate` of this tree; with
``--baseline-root`` (a checkout of an earlier commit, e.g. ``git worktree add
/tmp/c95 c95affd``) the same evaluation runs again in a subprocess on that tree's code, one
after the other, never at once. Pass rates must agree (greedy decoding of the same model);
the speedup is the baseline's seconds over this tree's.

Usage: ``python benchmarks/evaluation.py [--quick] [--threads 2] [--baseline-root DIR]``.
Ends with one JSON line: eval_s, episodes, pass_rate_v1, pass_rate_drifted,
generated_tokens_per_s, and with a baseline: baseline_eval_s, baseline pass rates,
speedup_vs_baseline and same_pass_rates; and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

FULL = {"tasks": 40, "max_turns": 4, "max_new_tokens": 40, "batch_size": 32}
QUICK = {"tasks": 3, "max_turns": 2, "max_new_tokens": 8, "batch_size": 32}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate with the code under ``args.code_root`` (imported here, after the path is set)."""
    sys.path.insert(0, str(args.code_root))
    import torch

    from services.environments.toolcalc import ToolcalcEnvironment
    from services.evaluation import evaluator
    from services.training.hf.model import HFModel
    from services.training.hf.smollm2 import smollm2_checkpoint

    try:
        from benchmarks.drift import drift_task_sets
    except ImportError:  # a baseline tree from before benchmarks/drift.py
        from benchmarks.support import drift_task_sets  # type: ignore[attr-defined,no-redef]

    torch.set_num_threads(args.threads)
    settings = {**(QUICK if args.quick else FULL), "batch_size": args.batch_size}
    smollm2_checkpoint(args.model_dir)
    policy = HFModel.load(args.model_dir, device="cpu")
    env = ToolcalcEnvironment()
    sets = drift_task_sets(
        env, args.drift, sft=1, grpo=1, evaluation=settings["tasks"], seed=args.seed
    )
    figures: dict[str, Any] = {"episodes": 0, "generated_tokens": 0}
    started = time.perf_counter()
    for name, tasks in (("v1", sets.eval_v1), ("drifted", sets.eval_drifted)):
        result = _evaluate(
            evaluator,
            (policy, env, tasks),
            seed=args.seed,
            max_turns=settings["max_turns"],
            max_new_tokens=settings["max_new_tokens"],
            batch_size=settings["batch_size"],
        )
        figures[f"pass_rate_{name}"] = round(result.pass_rate, 4)
        figures["episodes"] += len(tasks)
        figures["generated_tokens"] += result.generated_tokens
    figures["eval_s"] = round(time.perf_counter() - started, 2)
    return figures


def _evaluate(evaluator: ModuleType, call: tuple[Any, ...], **options: Any) -> Any:
    """``evaluator.evaluate(*call)`` with ``options`` as its ``EvaluationSettings``, or as
    keywords on a baseline tree from before that class (this script runs on both)."""
    settings_type = getattr(evaluator, "EvaluationSettings", None)
    if settings_type is None:
        return evaluator.evaluate(*call, **options)
    return evaluator.evaluate(*call, settings_type(**options))


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_start = os.getloadavg()
    figures = measure(args)
    if figures["generated_tokens"]:
        figures["generated_tokens_per_s"] = round(
            figures["generated_tokens"] / figures["eval_s"], 1
        )
    if args.baseline_root is not None:
        baseline = _measure_in(args.baseline_root, args)
        figures |= {
            "baseline_root": str(args.baseline_root),
            "baseline_commit": _commit(args.baseline_root),
            "baseline_eval_s": baseline["eval_s"],
            "baseline_pass_rate_v1": baseline["pass_rate_v1"],
            "baseline_pass_rate_drifted": baseline["pass_rate_drifted"],
            "speedup_vs_baseline": round(baseline["eval_s"] / figures["eval_s"], 2),
            "same_pass_rates": all(
                baseline[k] == figures[k] for k in ("pass_rate_v1", "pass_rate_drifted")
            ),
        }
    figures |= {
        "commit": _commit(ROOT),
        "threads": args.threads,
        "batch_size": args.batch_size,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    return figures


def _measure_in(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """This script's measurement on ``root``'s code, in a process of its own."""
    command = [sys.executable, str(Path(__file__).resolve()), "--measure-only"]
    command += ["--code-root", str(root), "--model-dir", str(args.model_dir)]
    command += ["--threads", str(args.threads), "--seed", str(args.seed), "--drift", args.drift]
    command += ["--batch-size", str(args.batch_size)]
    command += ["--quick"] if args.quick else []
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the baseline run on {root} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _commit(root: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drift", choices=("v2", "v3"), default="v3")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=FULL["batch_size"],
        help="episodes decoding at once, in both trees (default 32, the real-model benchmark's)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path.home() / ".cache" / "ratchet" / "smollm2",
        help="where the converted SmolLM2 checkpoint is cached (converted on first use)",
    )
    parser.add_argument(
        "--baseline-root", type=Path, default=None, help="a checkout to measure against"
    )
    parser.add_argument("--code-root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args)))
        return
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
