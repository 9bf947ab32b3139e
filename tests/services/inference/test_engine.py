"""The one engine: greedy tokens equal ``transformers.generate`` (and the tiny family's own
generate) with rows joining and leaving, with and without prefix hits; sampled log-probs
equal a full recompute; prefixes never cross adapters; a small cache budget changes what is
computed, never what is answered; an episode's later turns reuse its earlier ones."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.chat.protocol import ChatMessage
from services.environments.toolcalc import ToolcalcEnvironment
from services.inference.engine import (
    ActiveBatch,
    Engine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from services.inference.forward import BatchForward, ForwardCall
from services.inference.hf import HFEngine
from services.inference.prefix_cache import PrefixCache, Session
from services.inference.tiny import TinyEngine
from services.serving.base import CheckpointRef
from services.training.tiny.model import GPT, GPTConfig, TinyModel, generate_ids
from services.training.tokenizer import ByteTokenizer
from tests.services.modelserver.conftest import path_of
from tests.services.training.hf_support import build_tokenizer, tiny_llama_config


def hf_engine(prefix_cache_bytes: int = 256 * 1024 * 1024, seed: int = 0) -> HFEngine:
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, max_position_embeddings=2048)).eval()
    return HFEngine(
        model, tokenizer, path="memory", version="v0", prefix_cache_bytes=prefix_cache_bytes
    )


def tiny_engine(prefix_cache_bytes: int = 256 * 1024 * 1024) -> TinyEngine:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=256)).eval()
    tiny = TinyModel(model, tokenizer=ByteTokenizer(), device=torch.device("cpu"))
    return TinyEngine(tiny, "memory", prefix_cache_bytes=prefix_cache_bytes)


def chat_prompts(engine: Engine, count: int) -> list[list[int]]:
    """Toolcalc chat prompts: the same system text and tool list, then each task's question."""
    env = ToolcalcEnvironment()
    prompts = []
    for task in env.generate_tasks(count, seed=3, api_version="v2"):
        episode = env.chat_start(task, max_turns=3)
        prompts.append(engine.render(episode.messages, episode.tools))
    return prompts


def request(
    prompt: list[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    adapter: str | None = None,
    session: Session | None = None,
) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    return GenerationRequest(list(prompt), sampling, adapter=adapter, session=session)


def staggered(
    engine: Engine, rows: list[GenerationRequest], joins_at: list[int]
) -> list[GenerationResult]:
    """Decode ``rows`` in one batch, row i joining before step ``joins_at[i]``."""
    batch: ActiveBatch[int] = ActiveBatch(engine)
    results: dict[int, GenerationResult] = {}
    step = 0
    while len(results) < len(rows):
        batch.join([(rows[i], i) for i, at in enumerate(joins_at) if at == step])
        for index, result in batch.step():
            results[index] = result
        step += 1
    return [results[i] for i in range(len(rows))]


def shared_length(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt has in common."""
    return next(i for i, column in enumerate(zip(*prompts, strict=False)) if len(set(column)) > 1)


def hf_generate(engine: HFEngine, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``transformers.generate``'s greedy continuation of one prompt (its stop token kept)."""
    output = engine.model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(engine.eos_ids),
        pad_token_id=engine.tokenizer.pad_token_id,
    )
    new = output[0, len(prompt) :].tolist()
    end = next((i for i, t in enumerate(new) if t in engine.eos_ids), None)
    return new if end is None else new[: end + 1]


BUDGETS = [9, 4, 12, 6, 3, 10]
JOINS = [0, 0, 1, 3, 3, 7]


@pytest.mark.parametrize("cache_bytes", [0, 256 * 1024 * 1024], ids=["no-cache", "cache"])
def test_hf_greedy_rows_equal_transformers_generate(cache_bytes: int) -> None:
    engine = hf_engine(cache_bytes)
    prompts = chat_prompts(engine, 5)
    prompts.append(prompts[0])  # a repeated prompt: a whole-prompt hit
    expected = [hf_generate(engine, p, n) for p, n in zip(prompts, BUDGETS, strict=True)]
    for _ in range(2):  # the second pass finds every prompt cached
        rows = [request(p, n) for p, n in zip(prompts, BUDGETS, strict=True)]
        results = staggered(engine, rows, JOINS)
        assert [r.sampled_ids for r in results] == expected
    hits = [r.cached_tokens for r in results]
    if cache_bytes:
        block = engine.prefix_cache.block_tokens
        assert all(hit >= len(p) - block for hit, p in zip(hits, prompts, strict=True))
    else:
        assert hits == [0] * len(prompts) and len(engine.prefix_cache) == 0


def test_a_long_budget_grows_the_buffers_and_keeps_its_tokens() -> None:
    engine = hf_engine()
    engine.eos_ids = frozenset()  # decode the whole budget
    prompts = chat_prompts(engine, 2)
    results = staggered(engine, [request(prompts[0], 300), request(prompts[1], 20)], [0, 5])
    assert len(results[0].sampled_ids) == 300
    assert [r.sampled_ids for r in results] == [
        hf_generate(engine, prompts[0], 300),
        hf_generate(engine, prompts[1], 20),
    ]


def test_the_shared_system_prompt_is_computed_once() -> None:
    engine = hf_engine()
    prompts = chat_prompts(engine, 4)
    shared = shared_length(prompts)
    assert shared > 2 * engine.prefix_cache.block_tokens  # the tool list is long
    results = staggered(engine, [request(p, 3) for p in prompts], [0, 0, 0, 0])
    assert results[0].cached_tokens == 0
    block = engine.prefix_cache.block_tokens
    assert all(r.cached_tokens >= shared // block * block for r in results[1:])
    assert all(r.cached_tokens < len(p) for r, p in zip(results, prompts, strict=True))


def test_rows_joining_together_are_prefilled_in_a_few_batched_calls() -> None:
    engine = hf_engine()
    prompts = chat_prompts(engine, 4)
    prompts = [p for p in prompts for _ in range(3)]  # groups of three rows with one prompt
    expected = [hf_generate(engine, p, 4) for p in prompts]
    calls: list[int] = []
    forward = engine.forward

    def counting(adapters: Any) -> BatchForward:
        inner = forward(adapters)

        def prefill(call: ForwardCall) -> torch.Tensor:
            calls.append(call.ids.shape[0])
            return inner.prefill(call)

        return BatchForward(prefill=prefill, step=inner.step)

    engine.forward = counting  # type: ignore[method-assign]
    results = staggered(engine, [request(p, 4) for p in prompts], [0] * len(prompts))
    assert [r.sampled_ids for r in results] == expected
    # the shared system text once, then each group's own question once, then the rest
    assert len(calls) == 3 and sum(calls) == len(prompts)
    block = engine.prefix_cache.block_tokens
    followers = [(r, p) for i, (r, p) in enumerate(zip(results, prompts, strict=True)) if i % 3]
    assert all(r.cached_tokens >= len(p) - block for r, p in followers)  # whole-prompt hits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiny_rows_equal_the_tiny_familys_generate(temperature: float) -> None:
    engine = tiny_engine()
    tokenizer = engine.tiny_model.tokenizer
    prefix = "tools: #add(a,b) &mul(a,b) @get(item)\n"
    prompts = [tokenizer.encode(f"{prefix}user: ${i * 7}+{i}\n> ") for i in range(6)]
    seeds = [11 * i + 1 for i in range(6)]
    expected = [
        generate_ids(
            engine.tiny_model.model,
            [p],
            max_new_tokens=n,
            temperature=temperature,
            seeds=[s],
            stop_id=tokenizer.stop_id,
            device=engine.device,
        )[0]
        for p, n, s in zip(prompts, BUDGETS, seeds, strict=True)
    ]
    for _ in range(2):
        rows = [
            request(p, n, temperature=temperature, seed=s)
            for p, n, s in zip(prompts, BUDGETS, seeds, strict=True)
        ]
        results = staggered(engine, rows, JOINS)
        assert [r.token_ids for r in results] == expected
    assert all(r.cached_tokens > 0 for r in results)


def full_logprobs(engine: HFEngine, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].double()  # (T, V)
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # (N, V)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_logprobs_equal_a_full_recompute() -> None:
    engine = hf_engine()
    prompts = chat_prompts(engine, 3)
    rows = [request(p, 12, temperature=1.0, seed=i) for i, p in enumerate([*prompts, prompts[0]])]
    for result, row in zip(staggered(engine, rows, [0, 1, 2, 2]), rows, strict=True):
        assert len(result.logprobs) == len(result.sampled_ids) > 0
        expected = full_logprobs(engine, row.prompt_ids, result.sampled_ids)
        assert result.logprobs == pytest.approx(expected, abs=1e-4)


def test_an_episodes_next_turn_prefills_only_what_was_added() -> None:
    engine = hf_engine()
    fresh = hf_engine(0)
    prompt = chat_prompts(engine, 1)[0]
    session = Session()
    first = staggered(engine, [request(prompt, 8, session=session)], [0])[0]
    # The environment answers: the next prompt is the conversation so far plus its reply.
    reply = engine.tokenizer.encode("<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n")
    following = prompt + first.sampled_ids + reply
    second = staggered(engine, [request(following, 8, session=session)], [0])[0]
    fed = len(prompt) + len(first.sampled_ids) - 1  # the last sampled token was never fed
    assert second.cached_tokens == fed
    assert second.sampled_ids == staggered(fresh, [request(following, 8)], [0])[0].sampled_ids
    session.close()
    assert all(block.pins == 0 for block in engine.prefix_cache._lru.values())


def test_eviction_under_a_small_budget_keeps_answers_identical() -> None:
    big = hf_engine()
    prompts = chat_prompts(big, 6)
    rows = [request(p, 6, temperature=0.7, seed=i) for i, p in enumerate(prompts * 2)]
    joins = [0, 0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7]
    expected = [r.sampled_ids for r in staggered(big, rows, joins)]
    # Room for the shared system prompt's blocks and 3 more: the tasks' own blocks compete.
    block_bytes = big.prefix_cache.bytes // len(big.prefix_cache)
    shared = shared_length(prompts)
    small = hf_engine(block_bytes * (shared // big.prefix_cache.block_tokens + 3))
    assert [r.sampled_ids for r in staggered(small, rows, joins)] == expected
    cache = small.prefix_cache
    assert cache.evictions > 0 and 0 < cache.bytes <= cache.budget_bytes


def test_pinned_blocks_outlive_the_budget_and_unpinned_go_first() -> None:
    cache = PrefixCache(4 * 64, block_tokens=2)  # 4 blocks of 64 bytes

    def read(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, 1, end - start, 4), torch.zeros(1, 1, end - start, 4)

    session = Session()
    cache.hold(session, cache.insert("one", [1, 2, 3, 4], read))
    cache.insert("one", [9, 9, 9, 9, 9, 9], read)  # needs 3 blocks: only 2 fit beside the pins
    assert [len(b.tokens) for b in cache.lookup("one", [1, 2, 3, 4, 5], 5)] == [2, 2]
    assert len(cache.lookup("one", [9, 9, 9, 9, 9, 9, 9], 7)) == 2
    assert cache.lookup("two", [1, 2, 3, 4, 5], 5) == []  # another namespace sees nothing
    session.close()
    cache.insert("one", [7, 7, 7, 7, 7, 7, 7, 7], read)
    assert cache.bytes <= cache.budget_bytes
    assert cache.lookup("one", [1, 2, 3, 4, 5], 5) == []  # unpinned, oldest: evicted


def engine_with_two_adapters(checkpoints: list[CheckpointRef]) -> HFEngine:
    """The base of ``llama_with_adapters`` with its two adapters resident as "one" and "two"."""
    base, first, second = checkpoints
    engine = HFEngine.load(path_of(base), device="cpu")
    engine.load_adapter("one", path_of(first))
    engine.load_adapter("two", path_of(second))
    return engine


def test_a_prefix_cached_under_one_adapter_is_never_used_for_another(
    llama_with_adapters: list[CheckpointRef],
) -> None:
    base, first, second = llama_with_adapters
    engine = engine_with_two_adapters(llama_with_adapters)
    prompt = engine.render([ChatMessage(role="user", content="pear " * 20)], [])
    alone: dict[Any, list[int]] = {}
    for adapter in ("one", "two", None):
        clean = HFEngine.load(path_of(base), device="cpu")
        if adapter is not None:
            clean.load_adapter(adapter, path_of(first if adapter == "one" else second))
        alone[adapter] = staggered(clean, [request(prompt, 8, adapter=adapter)], [0])[0].sampled_ids
    assert alone["one"] != alone["two"]

    def run(adapter: str | None) -> GenerationResult:
        return staggered(engine, [request(prompt, 8, adapter=adapter)], [0])[0]

    assert run("one").cached_tokens == 0
    assert run("one").cached_tokens > 0  # cached under one, for one
    for adapter in ("two", None):
        result = run(adapter)
        assert result.cached_tokens == 0 and result.sampled_ids == alone[adapter]
    engine.unload_adapter("one")
    engine.load_adapter("one", path_of(second))  # reloaded: its old prefixes are not its any more
    reloaded = run("one")
    assert reloaded.cached_tokens == 0 and reloaded.sampled_ids == alone["two"]


def test_bad_cache_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixCache(block_tokens=0)


def test_a_live_lora_model_decodes_and_forgets_its_prefixes_when_its_weights_change() -> None:
    """Training's case: the engine over the peft model being trained, stepped in place."""
    from peft import LoraConfig, get_peft_model

    base = hf_engine()
    model = get_peft_model(base.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    engine = HFEngine(model, base.tokenizer, path="memory", version="v0")
    prompt = chat_prompts(engine, 1)[0]
    row = request(prompt, 8, temperature=1.0, seed=5)
    first = staggered(engine, [row], [0])[0]
    assert staggered(engine, [row], [0])[0].cached_tokens > 0
    with torch.no_grad():  # an optimizer step
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    engine.weights_changed()
    after = staggered(engine, [row], [0])[0]
    assert after.cached_tokens == 0
    ids = torch.tensor([prompt + after.sampled_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    expected = logp.gather(1, torch.tensor(after.sampled_ids)[:, None])[:, 0].tolist()
    assert after.logprobs == pytest.approx(expected, abs=1e-4)
    assert after.sampled_ids != first.sampled_ids or after.logprobs != first.logprobs
