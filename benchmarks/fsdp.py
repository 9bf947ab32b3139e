"""The same fine-tuning as one process and sharded over ranks with FSDP2 (``sharding: fsdp``).

    python benchmarks/fsdp.py --model-dir DIR --device cuda   # SmolLM2-135M, 2 ranks
    python benchmarks/fsdp.py --quick                         # tiny random Llama, CPU: smoke

Runs the real train job (``python -m services.training.job``) twice on one spec: once as
one process (``sharding: none``), once as ``--ranks`` torchrun processes on this machine
with ``sharding: fsdp``, full fine-tuning by default (every weight, its gradient and its
AdamW state are what sharding divides; ``--lora`` trains an adapter). SFT, so the two runs
see the same batches and their weights can be compared. Ranks beyond the machine's GPUs
share them (two ranks on one GPU: their collectives go over gloo, NCCL refusing two ranks on
one device); on the CPU they talk over gloo.

Ends with one JSON line: per arm the job's wall seconds, train tokens/s, each rank's peak
memory (metrics.json's ``peak_memory``: CUDA's max allocated, or the process's peak RSS on
CPU), the checkpoint id; ``max_weight_difference`` (the largest difference of a weight
between the arms' checkpoints: sharding changes no result beyond float summation order),
``peak_memory_ratio`` (the sharded arm's largest rank over the single process), the device,
threads and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.drift import shared_machine_figures, smollm2_arguments

REPO = Path(__file__).resolve().parents[1]


def prepare(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path]:
    """The base checkpoint (SmolLM2, or with ``--quick`` the tests' tiny random Llama) and a
    task file of toolcalc v1 tasks."""
    from services.environments import write_task_file
    from services.environments.toolcalc import ToolcalcEnvironment

    tasks = workdir / "tasks.jsonl"
    write_task_file(
        tasks, ToolcalcEnvironment().generate_tasks(32, seed=args.seed, api_version="v1")
    )
    if args.quick:
        from tests.services.training.hf_support import build_tiny_llama

        base = workdir / "tiny-llama"
        if not (base / "manifest.json").is_file():
            build_tiny_llama(base)
        return base, tasks
    from services.training.hf.smollm2 import smollm2_checkpoint

    base = args.model_dir or workdir / "smollm2"
    smollm2_checkpoint(base)
    return base, tasks


def job_spec(
    args: argparse.Namespace, root: Path, base: Path, tasks: Path, *, sharding: str
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    spec = {
        "schema": "ratchet.job/v1",
        "kind": "train",
        "run_id": f"fsdp-{sharding}",
        "seed": args.seed,
        "device": args.device,
        "algorithm": "sft",
        "environment": "toolcalc",
        "dataset": str(tasks),
        "base_checkpoint": str(base),
        "output_dir": str(root / "out"),
        "hyperparameters": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "micro_batch": 1,
            "lr": 1e-4,
            "warmup": 0,
            "log_every": 0,
            "lora": args.lora,
            "sharding": sharding,
            "threads": args.threads,
        },
    }
    path = root / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def run_arm(args: argparse.Namespace, spec: Path, ranks: int) -> dict[str, Any]:
    """One job run (``ranks`` > 1: under torchrun); its metrics.json and wall seconds."""
    job = ["-m", "services.training.job", "--spec", str(spec)]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command = [sys.executable, *(launcher if ranks > 1 else []), *job]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the job failed ({done.returncode}): {done.stderr[-3000:]}")
    metrics: dict[str, Any] = json.loads((spec.parent / "out" / "metrics.json").read_text())
    return {**metrics, "process_wall_s": round(wall, 2)}


def max_weight_difference(a: Path, b: Path) -> float:
    """The largest difference of one weight between two hf checkpoints' safetensors."""
    from safetensors.torch import load_file

    def weights(root: Path) -> dict[str, Any]:
        tensors: dict[str, Any] = {}
        for file in sorted(root.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        return tensors

    left, right = weights(a), weights(b)
    if set(left) != set(right):
        raise SystemExit("the arms' checkpoints hold different weights")
    return max(float((left[k].float() - right[k].float()).abs().max()) for k in left)


def arm_figures(metrics: dict[str, Any]) -> dict[str, Any]:
    return {
        "world_size": metrics["world_size"],
        "sharding": metrics["sharding"],
        "wall_s": metrics["wall_s"],
        "process_wall_s": metrics["process_wall_s"],
        "train_tokens_per_s": metrics["train_tokens_per_s"],
        "peak_memory": metrics["peak_memory"],
        "checkpoint_id": metrics["checkpoint_id"],
        "final_loss": metrics["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    smollm2_arguments(parser)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--lora", action="store_true", help="train a LoRA adapter, not every weight"
    )
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch_size, args.device, args.threads = 2, 4, "cpu", 1
    load_start = os.getloadavg()
    workdir = Path(args.workdir or "/tmp/ratchet-fsdp-bench")
    base, tasks = prepare(args, workdir)
    single = run_arm(args, job_spec(args, workdir / "single", base, tasks, sharding="none"), 1)
    sharded = run_arm(
        args, job_spec(args, workdir / "sharded", base, tasks, sharding="fsdp"), args.ranks
    )
    single_peak = max(single["peak_memory"]["bytes"])
    figures = {
        "benchmark": "fsdp",
        "model": "tiny-llama" if args.quick else "SmolLM2-135M",
        "training": "lora" if args.lora else "full",
        "device": single["device"],
        "ranks": args.ranks,
        "steps": args.steps,
        "arms": {"single": arm_figures(single), "sharded": arm_figures(sharded)},
        "max_weight_difference": max_weight_difference(
            workdir / "single" / "out" / "checkpoint", workdir / "sharded" / "out" / "checkpoint"
        ),
        "peak_memory_ratio": round(max(sharded["peak_memory"]["bytes"]) / single_peak, 3),
        **shared_machine_figures(args.threads, load_start),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
