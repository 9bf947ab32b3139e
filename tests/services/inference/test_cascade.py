"""Cascade attention: the shared prefix read once gives the same attention as reading it per
row; the engine promises shared columns only where every row holds the same keys bit for bit
(not across adapters, not past the blocks rows copied or stored), and decoding with the
cascade answers what decoding without it answers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

import services.inference.hf as hf_module
from services.inference.cascade import (
    MIN_ROWS,
    MIN_SHARED_COLUMNS,
    cascade_attention,
    worth_cascading,
)
from services.inference.engine import GenerationResult
from services.inference.forward import BatchForward, ForwardCall
from services.inference.hf import HFEngine
from services.serving.base import CheckpointRef
from tests.services.inference.test_engine import (
    chat_prompts,
    engine_with_two_adapters,
    hf_engine,
    hf_generate,
    request,
    staggered,
)


def additive_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, 1, 1, W): row b sees columns [0, lengths[b])."""
    visible = torch.arange(width)[None, :] < lengths[:, None]
    mask = torch.zeros(visible.shape)
    return mask.masked_fill_(~visible, torch.finfo(torch.float32).min)[:, None, None]


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)], ids=["grouped", "multi-head"])
def test_the_cascade_equals_attention_over_every_rows_own_copy(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    rows, dim, width, shared = 9, 16, 120, 80
    keys, values = torch.randn(rows, kv_heads, width, dim), torch.randn(rows, kv_heads, width, dim)
    keys[:, :, :shared], values[:, :, :shared] = keys[:1, :, :shared], values[:1, :, :shared]
    query = torch.randn(rows, heads, 1, dim)
    lengths = torch.randint(shared + 1, width + 1, (rows,))
    mask = additive_mask(lengths, width)
    expected = scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=0.3, enable_gqa=heads != kv_heads
    )
    got = cascade_attention(query, keys, values, mask, shared=shared, scale=0.3)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_only_long_shared_decode_steps_of_many_fp32_rows_cascade() -> None:
    decode = torch.zeros(MIN_ROWS, 4, 1, 8)
    assert worth_cascading(decode, MIN_SHARED_COLUMNS)
    assert not worth_cascading(decode, MIN_SHARED_COLUMNS - 1)
    assert not worth_cascading(torch.zeros(MIN_ROWS - 1, 4, 1, 8), MIN_SHARED_COLUMNS)
    assert not worth_cascading(torch.zeros(MIN_ROWS, 4, 2, 8), MIN_SHARED_COLUMNS)  # prefill
    assert not worth_cascading(decode.bfloat16(), MIN_SHARED_COLUMNS)


def watch_shared(engine: HFEngine) -> list[int]:
    """The ``shared`` of every decode call the engine gets."""
    seen: list[int] = []
    forward = engine.forward

    def watching(adapters: Any) -> BatchForward:
        inner = forward(adapters)

        def step(call: ForwardCall) -> torch.Tensor:
            seen.append(call.shared)
            return inner.step(call)

        return BatchForward(prefill=inner.prefill, step=step)

    engine.forward = watching  # type: ignore[method-assign]
    return seen


def count_cascades(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = hf_module.cascade_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs["shared"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_module, "cascade_attention", counting)
    return calls


def test_greedy_rows_decoding_over_a_shared_prefix_equal_transformers_generate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = hf_engine()
    prompts = [p for p in chat_prompts(engine, 4) for _ in range(3)]  # GRPO-like groups
    budgets = [4 + i % 5 for i in range(len(prompts))]  # rows leave at different steps
    expected = [hf_generate(engine, p, n) for p, n in zip(prompts, budgets, strict=True)]
    seen, cascaded = watch_shared(engine), count_cascades(monkeypatch)
    joins = [0] * 10 + [2, 2]  # two rows join a running batch
    rows = [request(p, n) for p, n in zip(prompts, budgets, strict=True)]
    results = staggered(engine, rows, joins)
    assert [r.sampled_ids for r in results] == expected
    block = engine.prefix_cache.block_tokens
    common = next(i for i, c in enumerate(zip(*prompts, strict=False)) if len(set(c)) > 1)
    assert max(seen) == common // block * block  # whole blocks of the system text, no more
    assert cascaded and set(cascaded) <= set(seen) - {0}


def test_sampled_rows_and_their_logprobs_are_the_same_with_and_without_the_cascade() -> None:
    def run(cascade: bool) -> list[GenerationResult]:
        engine = hf_engine()
        engine._cascades = cascade
        prompts = [p for p in chat_prompts(engine, 5) for _ in range(2)]
        rows = [request(p, 6, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
        return staggered(engine, rows, [0] * len(rows))

    plain, cascaded = run(False), run(True)
    assert [r.sampled_ids for r in cascaded] == [r.sampled_ids for r in plain]
    for with_it, without in zip(cascaded, plain, strict=True):
        torch.testing.assert_close(with_it.logprobs, without.logprobs, atol=1e-4, rtol=0)


def test_rows_of_different_adapters_share_no_columns(
    llama_with_adapters: list[CheckpointRef],
) -> None:
    engine = engine_with_two_adapters(llama_with_adapters)
    prompt = chat_prompts(engine, 1)[0]
    seen = watch_shared(engine)
    staggered(engine, [request(prompt, 3, adapter=a) for a in ("one", "two") * 5], [0] * 10)
    assert seen and set(seen) == {0}
    seen.clear()
    staggered(engine, [request(prompt, 3, adapter="one") for _ in range(10)], [0] * 10)
    assert min(seen) > 0  # one adapter: its rows share the prompt's blocks
