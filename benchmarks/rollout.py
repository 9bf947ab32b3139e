"""One GRPO step's rollouts on SmolLM2: the inference engine against ``transformers.generate``.

The same drifted toolcalc tasks (``--tasks`` lookup tasks of the drifted API x ``--samples``
per task, multi-turn with tool results, T=1) are rolled out twice in one run:

1. through today's ``transformers.generate`` path (``services.training.hf.rollout``: every
   round re-renders and re-prefills every conversation, left-padded, ``DynamicCache``);
2. through the engine (``services.inference.rollout.run_chat_episodes``: the shared system
   text and tool list and each GRPO group's prompt prefilled once, each episode's earlier
   turns kept, a preallocated cache, rows joining as episodes need their next turn);

then both again while a ``ratchet serve`` process on the same machine answers chat requests
(unless ``--no-colocated``), the cores divided between the two as Ratchet divides them
(``services.cores.ThreadBudget``: on 2 cores one thread each). The engine's prefill rate
is read against a plain matmul on the same threads: prefill work is the waste this
measures, not the kernels.

Usage: ``python benchmarks/rollout.py [--quick] [--threads 2] [--tasks 16] [--samples 4]
[--profile]``. Ends with one JSON line: episodes_per_s, generated_tokens_per_s,
prefill_tokens_computed, prefill_tokens_cached, generate_s, engine_s, speedup_vs_generate,
speedup_colocated, prefill_gflops, matmul_gflops, prefill_vs_matmul, the engine round's
rollout_mfu, peak_gflops, model_gflops, time_split and forward_calls
(``services/inference/utilisation.py``), with ``--profile`` the operators' shares of one
more engine run's CPU time under ``torch.profiler`` (profile), and the machine's load.

Each measurement is ``--repeats`` pairs (generate, then engine, interleaved so a slow spell
of the machine hits both): the seconds reported are the medians, every pair's seconds are
listed beside them (``*_runs``), and a speedup is median over median. A 2-core VM shares its
memory bandwidth with its neighbours; one pair is not a figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.drift import shared_machine_figures, smollm2_arguments
from benchmarks.engine_round import (
    profiled_round,
    rollout_tasks,
    through_engine,
    utilisation_figures,
)
from benchmarks.support import free_port
from services.cores import thread_budget, thread_env
from services.environments.base import TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.inference.engine import ActiveBatch, GenerationRequest, SamplingParams
from services.inference.hf import HFEngine
from services.serving.base import ServingUnavailable
from services.serving.client import ModelServerClient
from services.serving.local import wait_until_serving
from services.training.hf.model import HFModel
from services.training.hf.rollout import run_chat_episodes as generate_chat_episodes
from services.training.hf.smollm2 import MODEL_NAME, smollm2_checkpoint
from services.training.rng import derive_seed

logger = logging.getLogger("benchmarks.rollout")
ROOT = Path(__file__).resolve().parents[1]

FULL = {"tasks": 16, "samples": 4, "max_turns": 4, "max_new_tokens": 40, "repeats": 3}
QUICK = {"tasks": 2, "samples": 2, "max_turns": 2, "max_new_tokens": 8, "repeats": 1}


def through_generate(
    policy: HFModel, env: ToolcalcEnvironment, tasks: list[TaskSpec], args: argparse.Namespace
) -> tuple[float, int]:
    """Today's path: seconds, generated tokens."""
    started = time.perf_counter()
    _, stats = generate_chat_episodes(
        env,
        tasks,
        policy,
        seeds=[derive_seed(args.seed, i) for i in range(len(tasks))],
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    return time.perf_counter() - started, stats.generated_tokens


def prefill_gflops(engine: HFEngine, prompt: list[int], repeats: int) -> float:
    """GFLOP/s of the engine prefilling ``prompt`` with nothing cached (2 x params x tokens
    for the weights, plus attention's two (T x T) products per layer)."""
    engine.prefix_cache.clear()
    config = engine.model.config
    params = sum(p.numel() for n, p in engine.model.named_parameters() if "embed" not in n)
    attention = 4 * config.num_hidden_layers * config.hidden_size * len(prompt) ** 2 / 2
    flops = 2 * params * len(prompt) + attention
    best = float("inf")
    for _ in range(repeats):
        engine.prefix_cache.clear()
        batch: ActiveBatch[int] = ActiveBatch(engine)
        started = time.perf_counter()
        batch.join([(GenerationRequest(prompt, SamplingParams(max_tokens=1)), 0)])
        best = min(best, time.perf_counter() - started)
    return flops / best / 1e9


def matmul_gflops(rows: int, hidden: int, inner: int, repeats: int) -> float:
    """GFLOP/s of the prefill's biggest matmul shape (tokens x hidden @ hidden x MLP)."""
    a, b = torch.randn(rows, hidden), torch.randn(hidden, inner)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - started) / 10)
    return 2 * rows * hidden * inner / best / 1e9


@contextmanager
def colocated_server(
    checkpoint: Path, args: argparse.Namespace, log: Path, threads: int
) -> Iterator[None]:
    """A ``ratchet serve`` process on ``checkpoint`` on ``threads`` threads, answering chat
    requests from one client thread for as long as the block runs."""
    port = free_port()
    command = [
        sys.executable, "-m", "services", "serve", "--checkpoint", str(checkpoint),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--threads", str(threads),
    ]  # fmt: skip
    env = {
        **os.environ,
        **thread_env(threads),
        "PYTHONPATH": str(ROOT),
        "RATCHET_LOG_LEVEL": "WARNING",
    }
    with log.open("ab") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    done = threading.Event()
    answered = [0]

    def load() -> None:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "What is 17 times 23?"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        with httpx.Client(timeout=600) as client:
            while not done.is_set():
                if client.post(f"{url}/v1/chat/completions", json=body).is_success:
                    answered[0] += 1

    try:
        with ModelServerClient(url) as client:
            try:
                wait_until_serving(process, client, timeout_s=600)
            except ServingUnavailable as exc:
                raise RuntimeError(f"ratchet serve: {exc}: {log.read_text()[-2000:]}") from None
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        yield
        done.set()
        loader.join(600)
        logger.info("the co-located server answered %d requests", answered[0])
    finally:
        done.set()
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def paired_runs(
    repeats: int, generate: Callable[[], float], engine: Callable[[], float]
) -> dict[str, list[float]]:
    """``repeats`` interleaved (generate, engine) timings, in seconds."""
    runs: dict[str, list[float]] = {"generate": [], "engine": []}
    for _ in range(repeats):
        runs["generate"].append(generate())
        runs["engine"].append(engine())
    return runs


def summary(runs: dict[str, list[float]], suffix: str = "") -> dict[str, Any]:
    """Medians, every run, and median over median."""
    generate, engine = (statistics.median(runs[k]) for k in ("generate", "engine"))
    return {
        f"generate{suffix}_s": round(generate, 2),
        f"engine{suffix}_s": round(engine, 2),
        f"generate{suffix}_s_runs": [round(x, 2) for x in runs["generate"]],
        f"engine{suffix}_s_runs": [round(x, 2) for x in runs["engine"]],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ratchet-rollout-"))
    base_dir = args.model_dir or work / "smollm2"
    manifest = smollm2_checkpoint(base_dir)
    policy = HFModel.load(base_dir, device="cpu")
    engine = HFEngine(policy.model, policy.tokenizer, path=base_dir, version=manifest.checkpoint_id)
    env = ToolcalcEnvironment()
    tasks = rollout_tasks(env, args)
    logger.info("%d episodes (%d tasks x %d samples)", len(tasks), args.tasks, args.samples)

    counted: dict[str, Any] = {}  # the last run's counts: every run's are the same

    def generate() -> float:
        seconds, counted["generate_tokens"] = through_generate(policy, env, tasks, args)
        return seconds

    def on_engine() -> float:
        counted["engine"] = through_engine(engine, env, tasks, args)
        return float(counted["engine"].seconds)

    figures: dict[str, Any] = summary(paired_runs(args.repeats, generate, on_engine))
    generate_tokens, last = counted["generate_tokens"], counted["engine"]
    stats = last.stats
    generate_s, engine_s = figures["generate_s"], figures["engine_s"]
    logger.info("generate %.1f s, engine %.1f s (medians)", generate_s, engine_s)
    figures |= {
        "model": MODEL_NAME,
        "episodes": len(tasks),
        "turns": stats.turns,
        "repeats": args.repeats,
        "generate_generated_tokens": generate_tokens,
        "episodes_per_s": round(len(tasks) / engine_s, 3),
        "generated_tokens_per_s": round(stats.generated_tokens / engine_s, 1),
        "prefill_tokens_computed": stats.prefill_tokens_computed,
        "prefill_tokens_cached": stats.prefill_tokens_cached,
        "speedup_vs_generate": round(generate_s / engine_s, 2),
        **utilisation_figures(last.utilisation),
    }

    episode = env.chat_start(tasks[0], max_turns=1)
    prompt = engine.render(episode.messages, episode.tools)
    config = policy.model.config
    repeats = 1 if args.quick else 3
    prefill = prefill_gflops(engine, prompt, repeats)
    matmul = matmul_gflops(len(prompt), config.hidden_size, config.intermediate_size, repeats)
    figures |= {
        "prefill_gflops": round(prefill, 1),
        "matmul_gflops": round(matmul, 1),
        "prefill_vs_matmul": round(prefill / matmul, 3),
        "prompt_tokens": len(prompt),
    }

    if args.profile:
        figures["profile"], table = profiled_round(engine, env, tasks, args)
        logger.info("one more engine run under torch.profiler:\n%s", table)

    if args.colocated:
        # As Ratchet runs a job beside its model server: the usable cores divided between
        # them (services.cores.ThreadBudget), not both on every core.
        budget = thread_budget(args.threads)
        torch.set_num_threads(budget.job)
        with colocated_server(base_dir, args, work / "serve.log", budget.server):
            colocated = summary(
                paired_runs(
                    args.repeats,
                    lambda: through_generate(policy, env, tasks, args)[0],
                    lambda: through_engine(engine, env, tasks, args).seconds,
                ),
                "_colocated",
            )
        torch.set_num_threads(args.threads)
        figures |= colocated | {
            "speedup_colocated": round(
                colocated["generate_colocated_s"] / colocated["engine_colocated_s"], 2
            ),
            "colocated_threads": {"rollouts": budget.job, "server": budget.server},
        }
    figures |= shared_machine_figures(args.threads, load_start)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    smollm2_arguments(parser)
    parser.add_argument("--drift", choices=("v2", "v3"), default="v3")
    parser.add_argument("--tasks", type=int, default=None, help="drifted tasks (default 16)")
    parser.add_argument("--samples", type=int, default=None, help="per task: a GRPO group")
    parser.add_argument("--max-turns", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed pairs per measurement (default 3)"
    )
    parser.add_argument(
        "--max-rows", type=int, default=None, help="rows the engine decodes at once (default 64)"
    )
    parser.add_argument(
        "--no-colocated",
        dest="colocated",
        action="store_false",
        help="skip the second measurement beside a ratchet serve process",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed runs, one more engine run under torch.profiler: its operators' "
        "shares of the CPU time (key profile) and the profiler's table on stderr",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per co-located request
    print(json.dumps(run(args), sort_keys=True))


if __name__ == "__main__":
    main()
