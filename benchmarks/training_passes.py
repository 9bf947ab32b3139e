"""SFT steps on SmolLM2 with each shared prefix computed once, against the plain pass.

    python benchmarks/training_passes.py --model-dir DIR      # 10 steps, 2 pairs (~10 min)
    python benchmarks/training_passes.py --quick               # a smoke run

The same LoRA SFT from the same weights on the same demonstrations, twice per pair: once
as the trainers run it now (rows of a micro-batch that share a prefix score it once,
``services/training/hf/shared_prefix.py``), once with that turned off (every row computes
its whole sequence, as before). Pairs are interleaved (plain, shared, plain, shared, ...) so
a drift of the machine's speed reaches both arms. The demonstrations are the real-model
benchmark's champion's (v1 toolcalc chat, half of them recovering from a tool's usage error
first, docs/models.md), so ~330 of each ~400-token sequence is the system text and tools.

Ends with one JSON line: per arm the median wall seconds of the SFT and its train tokens/s
(tokens of the sequences trained on, the same count for both), every pair's seconds,
``speedup`` (plain over shared, medians), ``max_loss_difference`` (the largest difference
of a step's loss between the arms of a pair: the two compute the same loss to rounding),
``train_mfu`` / ``plain_train_mfu`` (the FLOPs the passes needed, each shared prefix once
and no padding, over the wall time and the matmul peak ``peak_gflops`` the same process
measured at the micro-batches' token count: ``services/inference/utilisation.py``), threads
and the load average. ``--device cuda`` runs both arms on a GPU (bf16 base, fp32 LoRA under
bf16 autocast, as a train job there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.drift import shared_machine_figures, smollm2_arguments
from services.environments.toolcalc import ToolcalcEnvironment
from services.training.config import HFSFTConfig
from services.training.distributed import init_distributed
from services.training.family import DemonstrationOptions, TokenSequence
from services.training.hf import shared_prefix
from services.training.hf.family import HFFamily
from services.training.hf.smollm2 import smollm2_checkpoint
from services.training.sft import train_sft

PLAIN = 10**9  # a shared prefix this long never happens: every row scores its whole sequence
MIN_SHARED = shared_prefix.MIN_SHARED_TOKENS


def champion_demonstrations(model_dir: Path, tasks: int, *, seed: int) -> list[TokenSequence]:
    """The real-model benchmark champion's demonstrations of ``tasks`` v1 tasks (half of them
    recovering from a tool's usage error first), tokenized by the model's template."""
    env = ToolcalcEnvironment()
    chosen = env.generate_tasks(tasks, seed=seed + 1, api_version="v1")
    loaded = HFFamily().load(model_dir, device=torch.device("cpu"), training=HFSFTConfig())
    return loaded.demonstrations(
        env, chosen, DemonstrationOptions(seed=seed, recovery_fraction=0.5)
    )


def run_arm(args: argparse.Namespace, sequences: list[TokenSequence], *, shared: bool) -> Any:
    """One SFT from the base model's fresh adapter; its counters and wall seconds."""
    shared_prefix.MIN_SHARED_TOKENS = MIN_SHARED if shared else PLAIN
    config = HFSFTConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batch=args.micro_batch,
        lr=1e-3,
        log_every=0,
    )
    torch.manual_seed(0)
    ctx = init_distributed(args.device)
    model = HFFamily().load(args.model_dir, device=ctx.device, training=config)
    started = time.perf_counter()
    counters = train_sft(model, sequences, config, ctx=ctx)
    return counters, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    smollm2_arguments(parser)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per SFT step")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per pass")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.pairs = 2, 1
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    args.model_dir = args.model_dir or Path(args.workdir or "/tmp") / "smollm2"
    smollm2_checkpoint(args.model_dir)
    sequences = champion_demonstrations(args.model_dir, 48, seed=args.seed)
    arms: dict[str, list[float]] = {"plain": [], "shared": []}
    tokens_per_s: dict[str, list[float]] = {"plain": [], "shared": []}
    mfu: dict[str, list[float]] = {"plain": [], "shared": []}
    peak: dict[str, list[float]] = {"plain": [], "shared": []}
    loss_difference = 0.0
    for pair in range(args.pairs):
        losses = {}
        for arm in ("plain", "shared"):
            counters, wall = run_arm(args, sequences, shared=arm == "shared")
            arms[arm].append(round(wall, 2))
            tokens_per_s[arm].append(counters.train_tokens / wall)
            mfu[arm].append(counters.utilisation.mfu("train") or 0.0)
            peak[arm].append(counters.utilisation.peak_gflops("train") or 0.0)
            losses[arm] = [row["loss"] for row in counters.history]
            print(f"pair {pair + 1} {arm}: {wall:.1f} s, loss {losses[arm][-1]:.4f}", flush=True)
        loss_difference = max(
            loss_difference,
            *(abs(a - b) for a, b in zip(losses["plain"], losses["shared"], strict=True)),
        )
    medians = {arm: statistics.median(walls) for arm, walls in arms.items()}
    figures = {
        "benchmark": "training_passes",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "micro_batch": args.micro_batch,
        "device": args.device,
        "pairs": args.pairs,
        "sequences": len(sequences),
        "plain_s": medians["plain"],
        "shared_s": medians["shared"],
        "plain_runs_s": arms["plain"],
        "shared_runs_s": arms["shared"],
        "plain_train_tokens_per_s": round(statistics.median(tokens_per_s["plain"]), 1),
        "shared_train_tokens_per_s": round(statistics.median(tokens_per_s["shared"]), 1),
        "speedup": round(medians["plain"] / medians["shared"], 2),
        # FLOPs the passes needed (each shared prefix once, no padding) over the matmul peak
        # measured at the micro-batches' token count: the same work for both arms
        "train_mfu": round(statistics.median(mfu["shared"]), 4),
        "plain_train_mfu": round(statistics.median(mfu["plain"]), 4),
        "peak_gflops": round(statistics.median(peak["shared"] + peak["plain"]), 1),
        "max_loss_difference": loss_difference,
        **shared_machine_figures(args.threads, load_start),
    }
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
