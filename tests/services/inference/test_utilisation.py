"""Model FLOPs utilisation: the work a pass needed (each shared prefix once, no padding),
its FLOPs by the stated formula, the peak measured in the process, the time split of a
round, and the engine's results unchanged by being measured."""

from __future__ import annotations

import torch

from services.environments.toolcalc import ToolcalcEnvironment
from services.inference.engine import ActiveBatch, GenerationResult
from services.inference.rollout import RolloutSettings, run_chat_episodes
from services.inference.utilisation import (
    TIME_PARTS,
    ModelShape,
    PassFigures,
    TimeSplit,
    Utilisation,
    Work,
    forward_flops,
    matmul_peak_gflops,
    micro_batch_work,
    needed_work,
    rollout_work,
    sequence_work,
    training_figures,
    training_flops,
)
from services.training.counters import RunCounters
from tests.services.inference.test_engine import chat_prompts, hf_engine, request

SHAPE = ModelShape(
    linear_params=1000,
    head_params=100,
    layers=2,
    attention_width=8,
    hidden=4,
    intermediate=16,
    dtype=torch.float32,
    device=torch.device("cpu"),
)


def test_a_shared_prefix_counts_once_and_every_position_pairs_with_the_ones_before_it() -> None:
    # [1, 2, 3] and [1, 2, 4] share two positions; [5] shares nothing; [] is nothing.
    work = needed_work([[1, 2, 4], [5], [1, 2, 3], []], projected=7)
    assert work == Work(tokens=3 + 1 + 1, pairs=(1 + 2 + 3) + 3 + 1, projected=7)
    # The same sequence twice is one sequence's work; order never matters.
    assert needed_work([[1, 2], [1, 2]], projected=0) == needed_work([[1, 2]], projected=0)


def test_a_rounds_later_turns_and_a_groups_rows_are_counted_once() -> None:
    turn_1 = ([1, 2, 3], [7, 8])  # prompt, sampled (8 is the end-of-turn token: never fed)
    turn_2 = ([1, 2, 3, 7, 8, 9], [4])  # the episode's next turn extends the first
    twin = ([1, 2, 3], [5])  # a group's second row: the same prompt
    work = rollout_work([turn_1, turn_2, twin])
    # fed: [1,2,3,7], [1,2,3,7,8,9], [1,2,3]: the trie holds 1,2,3,7,8,9
    assert work.tokens == 6
    assert work.pairs == 1 + 2 + 3 + 4 + 5 + 6
    assert work.projected == 2 + 1 + 1


def test_training_work_counts_targets_through_the_head_and_micro_batches_apart() -> None:
    a = ([1, 2, 3, 4], [False, False, True, True])
    b = ([1, 2, 3, 5], [True, False, True, True])  # a first id is never a target
    assert sequence_work([a, b]) == Work(tokens=5, pairs=10 + 4, projected=4)
    work, passes = micro_batch_work([a, b], 1)
    assert passes == 2
    assert work == Work(tokens=8, pairs=20, projected=4)


def test_flops_follow_the_stated_formula() -> None:
    work = Work(tokens=10, pairs=30, projected=3)
    attention = 4 * 2 * 8 * 30
    assert forward_flops(SHAPE, work) == 2 * 1000 * 10 + 2 * 100 * 3 + attention
    # training: forward + inputs' gradients + weights' gradients (3x), attention 3x
    assert training_flops(SHAPE, work) == 3 * (2 * 1000 * 10 + 2 * 100 * 3) + 3 * attention
    frozen = ModelShape(**{**SHAPE.__dict__, "frozen_weights": True})
    assert training_flops(frozen, work) == 2 * (2 * 1000 * 10 + 2 * 100 * 3) + 3 * attention


def test_a_llamas_shape_is_read_off_its_layers_and_a_lora_adapter_adds_nothing() -> None:
    from peft import LoraConfig, get_peft_model

    engine = hf_engine()
    config = engine.model.config
    shape = ModelShape.of(engine.model)
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = (
        config.hidden_size
        * head_dim
        * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
        + 3 * config.hidden_size * config.intermediate_size
    )
    assert shape.linear_params == config.num_hidden_layers * per_layer
    assert shape.head_params == config.vocab_size * config.hidden_size
    assert shape.attention_width == config.num_attention_heads * head_dim
    assert (shape.hidden, shape.intermediate) == (config.hidden_size, config.intermediate_size)
    lora = get_peft_model(engine.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapted = ModelShape.of(lora, frozen_weights=True)
    assert adapted.linear_params == shape.linear_params
    assert adapted.head_params == shape.head_params
    assert adapted.frozen_weights


def test_the_peak_is_measured_in_the_process_and_kept_per_token_count() -> None:
    first = matmul_peak_gflops(SHAPE, 64)
    assert first > 0
    assert matmul_peak_gflops(SHAPE, 64) == first  # measured once per token count
    figures = PassFigures(flops=first * 1e9, seconds=2.0, peak_gflops=first, peak_tokens=64)
    assert figures.mfu == 0.5


def test_the_time_split_leaves_scheduling_the_rest_of_the_wall_time() -> None:
    split = TimeSplit()
    split.add("forward", 1.5)
    split.add("tokenizer", 0.25)
    report = split.report(3.0)
    assert list(report) == [p for p in TIME_PARTS if p != "scheduling"] + ["scheduling"]
    assert report["forward"] == 1.5
    assert report["scheduling"] == 3.0 - 1.75


def test_a_runs_totals_add_rounds_measured_at_different_peaks_and_survive_a_resume() -> None:
    totals = Utilisation()
    totals.add("rollout", PassFigures(flops=50e9, seconds=1.0, peak_gflops=100, peak_tokens=8))
    totals.add("rollout", PassFigures(flops=150e9, seconds=1.0, peak_gflops=300, peak_tokens=64))
    totals.add("train", None)  # a model without a shape: nothing counted
    assert totals.mfu("rollout") == 0.5
    assert totals.peak_gflops("rollout") == 200.0
    assert totals.mfu("train") is None
    counters = RunCounters(utilisation=totals)
    again = RunCounters.from_dict(counters.to_dict())
    assert again.utilisation == totals
    assert again.metrics()["rollout_mfu"] == 0.5


def test_a_measured_batch_counts_its_calls_and_answers_as_an_unmeasured_one() -> None:
    engine = hf_engine()
    prompts = chat_prompts(engine, 4)

    def run(split: TimeSplit | None) -> list[GenerationResult]:
        engine.prefix_cache.clear()
        batch: ActiveBatch[int] = ActiveBatch(engine, split=split)
        batch.join([(request(p, 5, temperature=1.0, seed=i), i) for i, p in enumerate(prompts)])
        results: dict[int, GenerationResult] = {}
        while len(results) < len(prompts):
            results.update(batch.step())
        return [results[i] for i in range(len(prompts))]

    split = TimeSplit()
    measured, plain = run(split), run(None)
    assert [r.sampled_ids for r in measured] == [r.sampled_ids for r in plain]
    assert [r.logprobs for r in measured] == [r.logprobs for r in plain]
    calls = split.calls
    assert calls.prefill_rows == len(prompts)
    assert calls.decode_calls >= 1
    assert calls.decode_rows >= calls.decode_calls
    assert split.seconds["forward"] > 0 and split.seconds["sampling"] > 0


def test_a_chat_round_reports_where_its_time_went() -> None:
    engine = hf_engine()
    env = ToolcalcEnvironment()
    tasks = env.generate_tasks(3, seed=2, api_version="v1")
    split = TimeSplit()
    rollouts, stats = run_chat_episodes(
        engine,
        env,
        tasks,
        seeds=[1, 2, 3],
        settings=RolloutSettings(max_turns=2, max_new_tokens=6, temperature=1.0),
        split=split,
    )
    assert split.seconds["tokenizer"] > 0  # every turn's prompt is rendered
    assert split.seconds["tool_calls"] > 0  # every finished turn steps its episode
    report = split.report(wall_s=sum(split.seconds.values()) + 0.5)
    assert report["scheduling"] == 0.5
    turns = [(t.prompt_ids, t.completion_ids) for r in rollouts for t in r.turns]
    assert rollout_work(turns).projected == stats.generated_tokens


def test_training_figures_need_a_shape_and_count_scoring_passes_forward_only() -> None:
    class Shaped:
        def model_shape(self) -> ModelShape:
            return SHAPE

    work = Work(tokens=100, pairs=1000, projected=10)
    assert training_figures(object(), work, 1, 1.0) is None
    figures = training_figures(Shaped(), work, 2, 1.0, scored=work)
    assert figures is not None
    assert figures.flops == training_flops(SHAPE, work) + forward_flops(SHAPE, work)
    assert figures.peak_tokens == 100  # (100 trained + 100 scored) over 2 passes
