"""Continuous batching: rows join a running batch between steps and leave when they finish,
and no row's tokens depend on when it joined or what else was decoding."""

from __future__ import annotations

import threading
import time

import pytest

from services.inference.engine import ActiveBatch, Engine, GenerationRequest, SamplingParams
from services.inference.hf import HFEngine
from services.inference.tiny import TinyEngine
from services.modelserver.scheduler import BatchScheduler
from services.serving.base import CheckpointRef
from tests.services.modelserver.conftest import path_of


def request(
    prompt: list[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    adapter: str | None = None,
) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    return GenerationRequest(list(prompt), sampling, adapter=adapter)


def alone(engine: Engine, row: GenerationRequest) -> list[int]:
    batch: ActiveBatch[int] = ActiveBatch(engine)
    batch.join([(row, 0)])
    while True:
        for _, result in batch.step():
            return result.token_ids


def staggered(
    engine: Engine, rows: list[GenerationRequest], joins_at: list[int]
) -> list[list[int]]:
    """Decode ``rows`` in one batch, row i joining before step ``joins_at[i]``."""
    batch: ActiveBatch[int] = ActiveBatch(engine)
    results: dict[int, list[int]] = {}
    step = 0
    while len(results) < len(rows):
        joining = [(rows[i], i) for i, at in enumerate(joins_at) if at == step]
        batch.join(joining)
        for index, result in batch.step():
            results[index] = result.token_ids
        step += 1
    return [results[i] for i in range(len(rows))]


@pytest.fixture
def tiny(checkpoints: list[CheckpointRef]) -> TinyEngine:
    return TinyEngine.load(path_of(checkpoints[0]), device="cpu")


@pytest.fixture(scope="module")
def llama(llama_with_adapters: list[CheckpointRef]) -> HFEngine:
    base, first, second = llama_with_adapters
    engine = HFEngine.load(path_of(base), device="cpu")
    engine.load_adapter("a1", path_of(first))
    engine.load_adapter("a2", path_of(second))
    return engine


def prompts(engine: Engine, count: int) -> list[list[int]]:
    from services.chat.protocol import ChatMessage

    return [
        engine.render([ChatMessage(role="user", content="q" * (1 + 3 * i) + str(i))], [])
        for i in range(count)
    ]


def test_rows_joining_a_running_tiny_batch_get_the_tokens_they_get_alone(
    tiny: TinyEngine,
) -> None:
    texts = prompts(tiny, 5)
    rows = [
        request(texts[0], 20),
        request(texts[1], 6, temperature=1.0, seed=7),
        request(texts[2], 15, temperature=0.8, seed=3),
        request(texts[3], 4),
        request(texts[4], 12, temperature=1.2, seed=11),
    ]
    expected = [alone(tiny, row) for row in rows]
    assert staggered(tiny, rows, [0, 0, 2, 5, 9]) == expected
    assert staggered(tiny, rows, [3, 0, 1, 1, 0]) == expected


def test_rows_joining_a_running_hf_batch_keep_their_adapters_and_tokens(llama: HFEngine) -> None:
    texts = prompts(llama, 6)
    adapters = [None, "a1", "a2", "a1", None, "a2"]
    rows = [
        request(texts[i], 5 + 3 * i, temperature=0.9 * (i % 2), seed=i, adapter=adapters[i])
        for i in range(6)
    ]
    expected = [alone(llama, row) for row in rows]
    got = staggered(llama, rows, [0, 1, 1, 4, 6, 10])
    for left, right in zip(got, expected, strict=True):
        # A left-padded batch changes float rounding, not the argmax on this model.
        assert left == right


def test_finished_rows_leave_and_the_cache_holds_only_live_rows(tiny: TinyEngine) -> None:
    text = prompts(tiny, 1)[0]
    batch: ActiveBatch[str] = ActiveBatch(tiny)
    batch.join([(request(text, 2), "short"), (request(text, 30), "long")])
    finished: list[str] = []
    steps = 0
    while not finished:
        finished += [tag for tag, _ in batch.step()]
        steps += 1
    assert finished == ["short"] and steps <= 2  # answered before the long row ends
    assert len(batch) == 1 and batch.rows() == ["long"]
    # Rows keep joining and leaving for many steps: the cache never outgrows its live rows.
    for round_ in range(12):
        batch.join([(request(text, 3), f"r{round_}")])
        for _ in range(3):
            batch.step()
        assert batch.cache_width() <= len(text) + 30 + 1


def test_a_request_arriving_during_a_long_decode_is_answered_before_it_ends(
    tiny: TinyEngine,
) -> None:
    text = prompts(tiny, 1)[0]
    scheduler = BatchScheduler(max_batch_rows=8)
    scheduler.start()
    try:
        long = scheduler.submit(tiny, request(text, 60))
        while scheduler.steps < 3:
            time.sleep(0.001)
        short = scheduler.submit(tiny, request(text, 3))
        short.result(30)
        assert not long.done()  # the short request did not wait for the batch to end
        assert long.result(30).finish_reason == "length"
        assert scheduler.batches == 2 and scheduler.row_steps > scheduler.steps
    finally:
        scheduler.stop()


def test_another_engines_rows_wait_for_the_batch_to_drain_and_are_not_overtaken(
    tiny: TinyEngine, checkpoints: list[CheckpointRef]
) -> None:
    other = TinyEngine.load(path_of(checkpoints[1]), device="cpu")
    text = prompts(tiny, 1)[0]
    scheduler = BatchScheduler(max_batch_rows=8)
    order: list[str] = []
    lock = threading.Lock()

    def record(name: str):  # type: ignore[no-untyped-def]
        def done(_future: object) -> None:
            with lock:
                order.append(name)

        return done

    scheduler.start()
    try:
        first = scheduler.submit(tiny, request(text, 20))
        first.add_done_callback(record("first"))
        while scheduler.steps < 2:
            time.sleep(0.001)
        swapped = scheduler.submit(other, request(text, 2))
        swapped.add_done_callback(record("other engine"))
        late = scheduler.submit(tiny, request(text, 2))
        late.add_done_callback(record("late"))
        for future in (first, swapped, late):
            future.result(30)
    finally:
        scheduler.stop()
    assert order == ["first", "other engine", "late"]


def test_a_model_with_sliding_window_layers_decodes_whole_batches() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from services.inference.hf import _plain_dynamic_cache

    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32}
    small |= {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    assert _plain_dynamic_cache(LlamaForCausalLM(LlamaConfig(**small)))
    assert not _plain_dynamic_cache(MistralForCausalLM(MistralConfig(sliding_window=8, **small)))
