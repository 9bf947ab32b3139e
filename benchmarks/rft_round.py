"""An rft job's sampling round again, from a finished run: its LoRA adapter folded vs peft's path.

    python benchmarks/rft_round.py --run-dir RUN --tools CMD     # 12 tasks x 4, 2 pairs

``RUN`` is a finished (or failed) rft train run's directory, the one holding its
``spec.json`` (in a stack: ``<artifacts>/loops/<loop>/runs/<run id>``): its dataset and its
starting checkpoint, a LoRA adapter on its base, are loaded as the job loaded them, and the
first ``--tasks`` tasks are sampled ``--samples`` times each, as the job's first round
samples them (``services.training.rft.sample_episodes``: the same budget, seeds and
``rollout_batch``). A replay task's calls nobody recorded go to the stdio MCP server
``--tools`` (every tool it lists allow-listed, as ``benchmarks/foreign_agent.py`` runs its
stack); without it they get the sandbox's "no recorded result".

Two arms, interleaved in pairs so a drift of the machine's speed reaches both: ``folded``,
the trainer's rollouts as they run now (the adapter folded into copies of the weights it
adapts, ``services.training.hf.family.folded_adapter``), and ``peft``, the same rollouts
through peft's own per-layer LoRA path, as trainers rolled out before. Both must sample the
same tokens (``same_tokens``). Ends with one JSON line: per arm the median seconds, the
generated tokens/s, ``rollout_mfu`` (the FLOPs the round needed over the wall time and the
matmul peak the same run measured: ``services/inference/utilisation.py``), the time split
and the model calls' shapes, every run's figures, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.drift import shared_machine_figures
from benchmarks.foreign_loop import (
    HarnessError,
    eval_job_env,
    mcp_tool_names,
    tool_endpoint_config,
)
from services.environments.base import Environment, TaskSpec, read_task_file
from services.environments.registry import get_environment
from services.training.config import HFRFTConfig
from services.training.family import Rollouts
from services.training.hf.family import HFFamily, HFFamilyModel
from services.training.rft import sample_episodes

ARMS = ("peft", "folded")


class PeftPath:
    """A trainer's rollouts through peft's per-layer LoRA path (the adapter not folded)."""

    def __init__(self, model: HFFamilyModel) -> None:
        self.model = model

    def rollouts(self, env: Environment, tasks: Sequence[TaskSpec], **options: Any) -> Rollouts:
        self.model.module.eval()
        return self.model.chat.rollouts(env, tasks, **options)


def read_run(run_dir: Path) -> dict[str, Any]:
    """The run's job spec, refused with one line unless it is an hf rft train job's."""
    path = run_dir / "spec.json"
    if not path.is_file():
        raise HarnessError(f"{run_dir} has no spec.json: give a train run's directory")
    try:
        spec = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise HarnessError(f"{path} is not JSON: {exc}") from None
    if not isinstance(spec, dict) or spec.get("kind") != "train" or spec.get("algorithm") != "rft":
        raise HarnessError(f"{path} is not an rft train job's spec")
    for key in ("dataset", "base_checkpoint"):
        if not Path(str(spec.get(key))).exists():
            raise HarnessError(f"the run's {key} {spec.get(key)} is not on this machine")
    return spec


def use_tools(command: str | None) -> None:
    """Hand this process the domain's MCP server as a job gets it (the job contract's
    variables), every tool it lists allow-listed."""
    if not command:
        return
    argv = shlex.split(command)
    os.environ.update(eval_job_env(tool_endpoint_config(argv, mcp_tool_names(argv))))


def run_arm(
    arm: str, model: HFFamilyModel, env: Environment, tasks: list[TaskSpec], args: Any
) -> dict[str, Any]:
    """One round of one arm: its seconds, tokens, MFU, time split and the episodes' tokens."""
    plan = HFRFTConfig(
        samples_per_task=args.samples,
        rollout_batch=args.rollout_batch,
        max_turns=args.max_turns,
        enough_successes=args.enough_successes,
    )
    policy: Any = model if arm == "folded" else PeftPath(model)
    started = time.perf_counter()
    sampled = sample_episodes(
        policy,
        env,
        tasks,
        plan,
        seed=args.seed,
        enough_successes=plan.enough_successes,
        most_per_task=round(plan.unsolved_sample_factor * plan.samples_per_task),
    )
    wall = time.perf_counter() - started
    utilisation = sampled.utilisation
    return {
        "wall_s": round(wall, 2),
        "generated_tokens": sampled.generated_tokens,
        "tokens_per_s": round(sampled.generated_tokens / wall, 1),
        "rollout_mfu": round(utilisation.mfu("rollout") or 0.0, 4),
        "peak_gflops": round(utilisation.peak_gflops("rollout") or 0.0, 1),
        "time_split": {k: round(v, 2) for k, v in utilisation.time_split.items()},
        "forward_calls": dict(utilisation.calls),
        "episodes": [
            [turn for episode in group for turn in episode.turns] for group in sampled.groups
        ],
    }


def positive(text: str) -> int:
    """An argument that counts something: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--tools", default=None, help="the domain's stdio MCP server command")
    parser.add_argument("--tasks", type=positive, default=12)
    parser.add_argument("--samples", type=positive, default=4, help="episodes of each task")
    parser.add_argument("--rollout-batch", type=positive, default=48)
    parser.add_argument("--max-turns", type=positive, default=4)
    parser.add_argument("--enough-successes", type=int, default=2, help="as the run's rft")
    parser.add_argument("--pairs", type=positive, default=2)
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args()
    try:
        spec = read_run(args.run_dir)
        use_tools(args.tools)
    except HarnessError as exc:
        sys.exit(f"rft_round: {exc}")
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    tasks = read_task_file(Path(spec["dataset"]))[: args.tasks]
    env = get_environment(spec["environment"])
    model = HFFamily().load(
        Path(spec["base_checkpoint"]), device=torch.device("cpu"), training=HFRFTConfig()
    )
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for pair in range(args.pairs):
        for arm in ARMS:
            run = run_arm(arm, model, env, tasks, args)
            runs[arm].append(run)
            print(f"pair {pair + 1} {arm}: {run['wall_s']} s, mfu {run['rollout_mfu']}", flush=True)
    episodes = [run.pop("episodes") for arm in ARMS for run in runs[arm]]
    figures = {
        "benchmark": "rft_round",
        "run_dir": str(args.run_dir),
        "tasks": len(tasks),
        "samples_per_task": args.samples,
        "rollout_batch": args.rollout_batch,
        "pairs": args.pairs,
        "same_tokens": all(e == episodes[0] for e in episodes),
        **{
            f"{arm}_{key}": statistics.median(run[key] for run in runs[arm])
            for arm in ARMS
            for key in ("wall_s", "tokens_per_s", "rollout_mfu", "peak_gflops")
        },
        "speedup": round(
            statistics.median(r["wall_s"] for r in runs["peft"])
            / statistics.median(r["wall_s"] for r in runs["folded"]),
            3,
        ),
        "runs": runs,
        **shared_machine_figures(args.threads, load_start),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
