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
threads and the load average.
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


def run_arm(args: argparse.Namespace, sequences: list[TokenSequence], *, shared: bool) -> Any:
    """One SFT from the base model's fresh adapter; its counters and wall seconds."""
    shared_prefix.MIN_SHARED_TOKENS = MIN_SHARED if shared else PLAIN
    config = HFSFTConfig(steps=args.steps, batch_size=8, micro_batch=4, lr=1e-3, log_every=0)
    torch.manual_seed(0)
    model = HFFamily().load(args.model_dir, device=torch.device("cpu"), training=config)
    started = time.perf_counter()
    counters = train_sft(model, sequences, config, ctx=init_distributed("cpu"))
    return counters, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    smollm2_arguments(parser)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.pairs = 2, 1
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    args.model_dir = args.model_dir or Path(args.workdir or "/tmp") / "smollm2"
    smollm2_checkpoint(args.model_dir)
    env = ToolcalcEnvironment()
    tasks = env.generate_tasks(48, seed=args.seed + 1, api_version="v1")
    loaded = HFFamily().load(args.model_dir, device=torch.device("cpu"), training=HFSFTConfig())
    sequences = loaded.demonstrations(
        env, tasks, DemonstrationOptions(seed=args.seed, recovery_fraction=0.5)
    )
    del loaded
    arms: dict[str, list[float]] = {"plain": [], "shared": []}
    tokens_per_s: dict[str, list[float]] = {"plain": [], "shared": []}
    loss_difference = 0.0
    for pair in range(args.pairs):
        losses = {}
        for arm in ("plain", "shared"):
            counters, wall = run_arm(args, sequences, shared=arm == "shared")
            arms[arm].append(round(wall, 2))
            tokens_per_s[arm].append(counters.train_tokens / wall)
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
        "pairs": args.pairs,
        "sequences": len(sequences),
        "plain_s": medians["plain"],
        "shared_s": medians["shared"],
        "plain_runs_s": arms["plain"],
        "shared_runs_s": arms["shared"],
        "plain_train_tokens_per_s": round(statistics.median(tokens_per_s["plain"]), 1),
        "shared_train_tokens_per_s": round(statistics.median(tokens_per_s["shared"]), 1),
        "speedup": round(medians["plain"] / medians["shared"], 2),
        "max_loss_difference": loss_difference,
        **shared_machine_figures(args.threads, load_start),
    }
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
