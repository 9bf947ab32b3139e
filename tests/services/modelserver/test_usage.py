"""The serving ledger's counting: tokens (cached apart) and busy compute-seconds per served
version, through a real ``ratchet serve`` process under concurrent requests, read back with
the parser the worker uses (which also reads vLLM's own counter names)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.loop.ledger import ServingPrices, accrue, usd_per_mtok
from services.modelserver.usage import (
    WHOLE_SERVER,
    UsageUnavailable,
    VersionUsage,
    busy_shares,
    parse_usage,
    read_usage,
    usage_of,
)
from services.serving.base import CheckpointRef
from services.serving.targets import ServingTargets
from services.settings import ServingEndpoint, Settings
from tests.services.modelserver.conftest import (
    ServeProcess,
    ServerThread,
    path_of,
    write_checkpoint,
)

PROMPT = "count the tokens of this prompt, which is long enough to fill prefix blocks"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> list[CheckpointRef]:
    root = tmp_path_factory.mktemp("usage-artifacts")
    return [write_checkpoint(root / f"ckpt-{seed}", seed) for seed in range(2)]


def chat(url: str, model: str, salt: str) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{PROMPT} {salt}"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return dict(response.json())


def test_tokens_and_compute_are_counted_per_version_under_concurrent_requests(
    store: list[CheckpointRef], tmp_path: Path
) -> None:
    server = ServeProcess(path_of(store[0]), name="agent", log=tmp_path / "serve.log")
    try:
        loaded = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "other", "lora_path": str(path_of(store[1]))},
            timeout=120,
        )
        assert loaded.status_code == 200, loaded.text
        # Twelve requests at once, half to each version; each prompt is sent twice (the
        # second reuses the first's prefix blocks when it arrives after it was prefilled).
        jobs = [(model, str(i % 3)) for model in ("agent", "other") for i in range(6)]
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            answers = list(pool.map(lambda job: chat(server.url, *job), jobs))
        again = [chat(server.url, model, "0") for model in ("agent", "other")]
        usage = read_usage(server.url)
        # what the worker samples: the loop's serving target's endpoint, by name
        settings = Settings(
            serving_endpoints={"srv": ServingEndpoint(kind="openai", url=server.url)}
        )
        targets = ServingTargets(settings, start_local_server=False)
        sampled = targets.usage({"kind": "openai", "endpoint": "srv", "model": "agent"})
        with pytest.raises(UsageUnavailable, match="no serving endpoint named 'gone'"):
            targets.usage({"kind": "openai", "endpoint": "gone", "model": "agent"})
        assert targets.usage({"kind": "none"}) == {}
    finally:
        server.stop()

    for model, checkpoint in (("agent", store[0]), ("other", store[1])):
        mine = [a for (m, _), a in zip(jobs, answers, strict=True) if m == model]
        mine += [a for a in again if a["model"] == model]
        counted = usage[checkpoint.id]
        assert counted.prompt_tokens == sum(a["usage"]["prompt_tokens"] for a in mine)
        assert counted.completion_tokens == sum(a["usage"]["completion_tokens"] for a in mine)
        assert counted.cached_prompt_tokens == sum(
            a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in mine
        )
        assert counted.cached_prompt_tokens > 0  # the repeated prompt came from the cache
        assert counted.cached_prompt_tokens < counted.prompt_tokens
        assert counted.busy_seconds is not None and counted.busy_seconds > 0
    assert set(usage) == {store[0].id, store[1].id}
    assert sampled == usage


def test_usd_per_mtok_from_counted_tokens_and_compute() -> None:
    prices = ServingPrices(hour_usd=3.6, cached_token_weight=0.1)
    before = VersionUsage(1_000, 0, 1_000, 10.0)
    after = VersionUsage(401_000, 200_000, 101_000, 1_010.0)
    added = accrue(before, after, wall_seconds=5_000.0, prices=prices)
    assert (added.prompt_tokens, added.cached_prompt_tokens, added.completion_tokens) == (
        400_000,
        200_000,
        100_000,
    )
    assert added.busy_seconds == 1_000.0  # measured busy time, not the wall time
    assert added.cost_usd == pytest.approx(1.0)
    assert usd_per_mtok(added.cost_usd, 500_000) == pytest.approx(2.0)
    assert usd_per_mtok(0.0, 0) is None


def test_a_batch_is_shared_by_its_rows_weights() -> None:
    assert busy_shares(1.0, [("a", 3), ("b", 1)]) == {"a": 0.75, "b": 0.25}
    assert busy_shares(0.6, [("a", 1), ("a", 1), ("b", 1)]) == pytest.approx({"a": 0.4, "b": 0.2})
    assert busy_shares(1.0, [("a", 0), ("b", 0)]) == {"a": 0.5, "b": 0.5}
    assert busy_shares(0.0, [("a", 1)]) == {}


VLLM_METRICS = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1200.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 300.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 480.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 2.0
"""


def test_vllm_counters_are_read_by_their_own_names_as_the_whole_server() -> None:
    usage = parse_usage(VLLM_METRICS)
    assert usage == {WHOLE_SERVER: VersionUsage(1200.0, 480.0, 300.0, None)}
    assert usage_of(usage, "any-version") == usage[WHOLE_SERVER]
    # no busy time measured: the wall time served stands in for it
    prices = ServingPrices(hour_usd=3.6, cached_token_weight=0.1)
    previous = VersionUsage(200.0, 80.0, 100.0, None)
    added = accrue(previous, usage[WHOLE_SERVER], wall_seconds=60.0, prices=prices)
    assert (added.prompt_tokens, added.completion_tokens, added.busy_seconds) == (1000, 200, 60.0)


def test_a_page_without_usage_counters_reads_as_nothing_served() -> None:
    assert parse_usage("# nothing here\n") == {}
    assert usage_of({}, "v1") == VersionUsage()


def test_an_unreachable_server_is_unavailable_not_an_error() -> None:
    with pytest.raises(UsageUnavailable, match="metrics"):
        read_usage("http://127.0.0.1:9", timeout_s=2)


def test_rows_of_two_versions_in_one_batch_share_its_time_fairly(
    checkpoints: list[CheckpointRef],
) -> None:
    """Two rows alike but for their version (a base model and an adapter decode in one
    batch) decode in one batch: each version is counted the same busy time, and only its
    own rows' share."""
    from services.inference.engine import GenerationRequest, SamplingParams
    from services.inference.tiny import TinyEngine
    from services.metrics import REGISTRY
    from services.modelserver.scheduler import BatchScheduler

    engine = TinyEngine.load(path_of(checkpoints[0]), device="cpu")
    ids = list(b"share the batch fairly")  # byte-level token ids
    scheduler = BatchScheduler(max_batch_rows=4)
    rows = [
        GenerationRequest(list(ids), SamplingParams(max_tokens=8, temperature=0.0))
        for _ in range(2)
    ]
    # queued before the decode thread starts, so both are in its first batch
    futures = [
        scheduler.submit(engine, rows[0], version="fair-a"),
        scheduler.submit(engine, rows[1], version="fair-b"),
    ]
    scheduler.start()
    try:
        results = [future.result(timeout=120) for future in futures]
    finally:
        scheduler.stop()
    assert results[0].token_ids == results[1].token_ids  # alike, so they ran the same steps
    assert scheduler.batches == 1
    busy = [
        REGISTRY.get_sample_value("ratchet_serving_busy_seconds_total", {"version": v})
        for v in ("fair-a", "fair-b")
    ]
    assert busy[0] is not None and busy[0] > 0
    assert busy[1] == pytest.approx(busy[0], rel=1e-9)


def test_a_streamed_completion_is_counted_without_asking_for_usage(
    checkpoints: list[CheckpointRef], serve: Callable[..., ServerThread]
) -> None:
    server = serve(checkpoints[2], name="agent")
    version = checkpoints[2].id
    before = usage_of(read_usage(server.url), version)
    body = {
        "model": "agent",
        "messages": [{"role": "user", "content": "stream me"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    after = usage_of(read_usage(server.url), version)
    assert after.prompt_tokens > before.prompt_tokens
    assert after.completion_tokens > before.completion_tokens
    assert after.busy_seconds is not None and before.busy_seconds is not None
    assert after.busy_seconds > before.busy_seconds
