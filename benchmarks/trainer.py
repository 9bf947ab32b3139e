"""The reference trainer end to end on CPU: SFT champion on toolcalc v1, drift to v2, GRPO.

    python benchmarks/trainer.py            # the acceptance run (2 threads)
    python benchmarks/trainer.py --quick    # a minute-long smoke run with tiny settings

Steps, each timed and logged:

1. make the champion: SFT on demonstrations of v1 tasks as last month's traffic looked:
   a share (``--augment``) seen during v2's deprecation window, where the listing already
   shows v2's names but most agents still call the old ones (which still worked then);
2. evaluate it (greedy pass@1) on held-out v1 tasks and on held-out v2 tasks (tools renamed);
3. GRPO from the champion on <= 512 v2 tasks, with verifier rewards only (no demonstrations,
   ``sft_coef = 0``): the policy sees prompts and tool results, never answers;
4. evaluate the candidate on the same held-out v2 tasks and on the v1 tasks again
   (the v1-compatible regression suite), and compare it with the champion, paired.

Ends with one JSON line: v1_pass_champion, v2_pass_before, v2_pass_after,
v1_regression_drop_points, grpo_wall_s, rollout_tokens_per_s, train_tokens_per_s and more,
including the load average, since the machine may be shared; ``figures`` gives each pass rate
with its count and Wilson interval and each gain with the paired bootstrap's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.drift import (
    drift_recovery_figures,
    paired_on,
    shared_machine_figures,
    uncertainty_figures,
)
from services.environments.base import TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.evaluator import EvaluationResult, evaluate
from services.training.distributed import init_distributed
from services.training.family import FamilyModel, family_for
from services.training.grpo import GRPOConfig, train_grpo
from services.training.sft import SFTConfig, make_champion
from services.training.tiny.model import GPTConfig

logger = logging.getLogger("benchmarks.trainer")

MODEL = GPTConfig(max_seq_len=192, n_layer=4, n_head=4, d_model=96)
SFT = SFTConfig(steps=1000, batch_size=32, lr=3e-3, warmup=30, log_every=100)
SFT_TASKS = 4000
AUGMENT_FRACTION = 0.3
GRPO = GRPOConfig(
    steps=40,
    tasks_per_step=8,
    group_size=16,
    temperature=1.0,
    lr=3e-4,
    max_turns=4,
    max_new_tokens=16,
    checkpoint_every=0,
    log_every=1,
)
GRPO_TASKS = 512
EVAL_TASKS = 200


def held_out(
    env: ToolcalcEnvironment, version: str, n: int, seed: int, exclude: set[str]
) -> list[TaskSpec]:
    """``n`` tasks of ``version`` whose ids are not in ``exclude`` (train sets)."""
    candidates = env.generate_tasks(n * 2, seed=seed, api_version=version)
    tasks = [t for t in candidates if t.task_id not in exclude][:n]
    if len(tasks) < n:
        raise RuntimeError(f"only {len(tasks)} held-out {version} tasks")
    return tasks


@dataclass(frozen=True)
class HeldOut:
    """The held-out v1 and v2 sets that the champion and the candidate are both judged on."""

    env: ToolcalcEnvironment
    v1: list[TaskSpec]
    v2: list[TaskSpec]

    def score(
        self, role: str, checkpoint_dir: Path, trained: tuple[str, float]
    ) -> tuple[FamilyModel, EvaluationResult, EvaluationResult]:
        """Greedy pass@1 of the checkpoint loaded back from disk, as the gate would see it;
        ``trained`` is (algorithm, wall seconds), for the log line."""
        loaded = family_for("tiny").load(checkpoint_dir, device=torch.device("cpu"))
        v1 = evaluate(loaded, self.env, self.v1)
        v2 = evaluate(loaded, self.env, self.v2)
        logger.info(
            "%s %s: v1 %.3f, v2 %.3f (%s %.0fs)",
            role,
            (loaded.checkpoint_id or "")[:12],
            v1.pass_rate,
            v2.pass_rate,
            *trained,
        )
        return loaded, v1, v2


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    env = ToolcalcEnvironment()
    sft_cfg = SFTConfig(**{**SFT.to_dict(), "steps": args.sft_steps, "seed": args.seed})
    grpo_cfg = GRPOConfig(**{**GRPO.to_dict(), "steps": args.grpo_steps, "seed": args.seed})
    model_cfg = (
        MODEL if not args.quick else GPTConfig(max_seq_len=192, n_layer=2, n_head=2, d_model=32)
    )

    sft_tasks = env.generate_tasks(args.sft_tasks, seed=args.seed + 1, api_version="v1")
    grpo_tasks = env.generate_tasks(args.grpo_tasks, seed=args.seed + 2, api_version="v2")
    train_ids = {t.task_id for t in sft_tasks} | {t.task_id for t in grpo_tasks}
    eval_v1 = held_out(env, "v1", args.eval_tasks, args.seed + 3, train_ids)
    eval_v2 = held_out(env, "v2", args.eval_tasks, args.seed + 4, train_ids)
    held = HeldOut(env, eval_v1, eval_v2)
    ctx = init_distributed("cpu")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ratchet-bench-"))

    logger.info(
        "SFT champion: %d v1 tasks, %d steps, augment %.2f",
        len(sft_tasks),
        sft_cfg.steps,
        args.augment,
    )
    t0 = time.monotonic()
    manifest, sft_result = make_champion(
        env,
        work / "champion",
        tasks=sft_tasks,
        model_config=model_cfg,
        config=sft_cfg,
        augment_fraction=args.augment,
        ctx=ctx,
    )
    sft_wall = time.monotonic() - t0
    champion, v1_before, v2_before = held.score("champion", work / "champion", ("sft", sft_wall))

    logger.info(
        "GRPO on %d v2 tasks: %d steps x %d tasks x %d samples",
        len(grpo_tasks),
        grpo_cfg.steps,
        grpo_cfg.tasks_per_step,
        grpo_cfg.group_size,
    )
    t1 = time.monotonic()
    grpo = train_grpo(champion, env, grpo_tasks, grpo_cfg, ctx=ctx)
    grpo_wall = time.monotonic() - t1
    candidate_manifest = champion.save(
        work / "candidate", parent=manifest.checkpoint_id, metadata={}
    )
    _, v1_after, v2_after = held.score("candidate", work / "candidate", ("grpo", grpo_wall))

    paired = paired_on(eval_v2, v2_before, v2_after, seed=args.seed)
    c = grpo.counters
    return {
        "benchmark": "trainer",
        **drift_recovery_figures((v1_before, v2_before), (v1_after, v2_after)),
        "v2_mcnemar_p": paired.p_value,
        "v2_delta_ci": [paired.ci_low, paired.ci_high],
        "figures": uncertainty_figures(
            (eval_v1, v1_before, v1_after), (eval_v2, v2_before, v2_after), seed=args.seed
        ),
        "grpo_wall_s": round(grpo_wall, 1),
        "grpo_steps": c.steps_done,
        "grpo_tasks": len(grpo_tasks),
        "grpo_episodes": c.episodes,
        "rollout_tokens_per_s": c.rollout_tokens_per_s,
        "train_tokens_per_s": c.train_tokens_per_s,
        "filtered_zero_variance_groups": c.filtered_zero_variance_groups,
        "grpo_groups": c.groups,
        "sft_wall_s": round(sft_wall, 1),
        "sft_train_tokens_per_s": sft_result.train_tokens_per_s,
        "eval_tasks_per_set": len(eval_v1),
        "eval_tokens_per_s": round(v2_after.tokens_per_s, 1),
        "model_parameters": sum(p.numel() for _, p in champion.trainable_parameters()),
        **shared_machine_figures(args.threads, load_start),
        "champion_id": manifest.checkpoint_id,
        "candidate_id": candidate_manifest.checkpoint_id,
        "workdir": str(work),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=SFT.steps)
    parser.add_argument("--sft-tasks", type=int, default=SFT_TASKS)
    parser.add_argument("--augment", type=float, default=AUGMENT_FRACTION)
    parser.add_argument("--grpo-steps", type=int, default=GRPO.steps)
    parser.add_argument("--grpo-tasks", type=int, default=GRPO_TASKS)
    parser.add_argument("--eval-tasks", type=int, default=EVAL_TASKS)
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--quick", action="store_true", help="tiny settings: checks the pipeline only"
    )
    args = parser.parse_args()
    if args.grpo_tasks > 512:
        parser.error("the acceptance run trains on at most 512 v2 tasks")
    if args.quick:
        args.sft_steps, args.sft_tasks, args.grpo_steps, args.grpo_tasks, args.eval_tasks = (
            30,
            200,
            2,
            32,
            20,
        )
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    result = run(args)
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
