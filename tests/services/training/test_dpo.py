"""DPO: the loss and its gradients equal a hand computation on a fixed pair (tiny family and
a tiny random hf model), episodes are scored on the model's own tokens only, pairs are a
success and a failure of one task, and a job trains on them (or says there were none)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.environments import write_task_file
from services.environments.base import Reward, TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.training.config import DPOConfig, HFDPOConfig
from services.training.dpo import (
    Pair,
    episode_logps,
    make_pairs,
    pairs_loss,
    reference_logps,
)
from services.training.family import (
    FamilyModel,
    TokenEpisode,
    TokenSequence,
    family_for,
    pack_turns,
)
from services.training.rft import SampledTasks
from services.training.tiny.family import TinyFamilyModel
from services.training.tiny.model import GPT, GPTConfig
from tests.services.training.conftest import read_metrics, run_train_job
from tests.services.training.hf_support import build_tiny_llama

BETA = 0.3

# A two-turn chosen episode: prompt, the model's call, a tool result (context), its answer.
# Its second prompt extends the first turn, so pack_turns merges them into one sequence.
CHOSEN_TURNS = [([5, 6, 7], [8, 9]), ([5, 6, 7, 8, 9, 10, 11], [12, 13, 14])]
REJECTED_TURNS = [([5, 6, 7], [15, 16, 17, 18])]


def fixed_pair() -> Pair:
    return Pair(chosen=pack_turns(CHOSEN_TURNS), rejected=pack_turns(REJECTED_TURNS))


def hand_logp(
    forward: Callable[[torch.Tensor], torch.Tensor], sequence: TokenSequence
) -> torch.Tensor:
    """log p of the masked tokens of one unpadded sequence, straight from the network's logits."""
    ids, mask = sequence
    logits = forward(torch.tensor([ids]))[0]  # (T, V)
    logp = torch.log_softmax(logits.float(), dim=-1)
    total = torch.zeros(())
    for position in range(1, len(ids)):
        if mask[position]:
            total = total + logp[position - 1, ids[position]]
    return total


def check_against_hand(model: FamilyModel, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Reference = the weights now; then move the weights and compare loss and gradients."""
    pair = fixed_pair()
    reference = reference_logps(model, [pair], micro_batch=4)  # (1, 2)
    with torch.no_grad():
        ref_c = sum(hand_logp(forward, s) for s in pair.chosen)
        ref_r = sum(hand_logp(forward, s) for s in pair.rejected)
    assert reference[0].tolist() == pytest.approx([float(ref_c), float(ref_r)], abs=1e-4)
    params = [p for _, p in model.trainable_parameters()]
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in params:
            param.add_(0.05 * torch.randn(param.shape, generator=generator))

    loss, margins = pairs_loss(model, [pair], reference, beta=BETA, normalizer=1.0)
    loss.backward()
    ours = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for param in params:
        param.grad = None

    chosen = sum(hand_logp(forward, s) for s in pair.chosen)
    rejected = sum(hand_logp(forward, s) for s in pair.rejected)
    assert isinstance(chosen, torch.Tensor) and isinstance(rejected, torch.Tensor)
    z = BETA * ((chosen - float(ref_c)) - (rejected - float(ref_r)))
    hand = torch.log1p(torch.exp(-z))  # -log sigmoid(z)
    hand.backward()
    assert float(margins[0]) == pytest.approx(float(z.detach()), abs=1e-5)
    assert float(loss) == pytest.approx(float(hand), abs=1e-5)
    assert float(loss) == pytest.approx(math.log1p(math.exp(-float(z.detach()))), abs=1e-5)
    moved = 0
    for param, grad in zip(params, ours, strict=True):
        expected = param.grad if param.grad is not None else torch.zeros_like(param)
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4)
        moved += int(bool(expected.abs().sum() > 0))
    assert moved > 0


def tiny_model() -> TinyFamilyModel:
    torch.manual_seed(0)
    net = GPT(GPTConfig(max_seq_len=32, n_layer=1, n_head=2, d_model=16))
    return TinyFamilyModel(net, device=torch.device("cpu"), checkpoint_id=None)


def test_dpo_loss_and_gradients_equal_a_hand_computation_tiny() -> None:
    model = tiny_model()
    model.train()
    check_against_hand(model, model.net)


def test_dpo_loss_and_gradients_equal_a_hand_computation_hf(tmp_path: Path) -> None:
    build_tiny_llama(tmp_path / "llama")
    config = HFDPOConfig(lora_r=4, lora_alpha=8)
    model = family_for("hf").load(tmp_path / "llama", device=torch.device("cpu"), training=config)
    model.train()
    module = model.module  # type: ignore[attr-defined]
    check_against_hand(model, lambda ids: module(input_ids=ids).logits)


def test_episodes_are_scored_on_the_model_tokens_only() -> None:
    model = tiny_model()
    (sequence,) = pack_turns(CHOSEN_TURNS)
    ids, mask = sequence
    # the prompt (5, 6, 7) and the tool result (10, 11) are context, never scored
    assert [t for t, m in zip(ids, mask, strict=True) if m] == [8, 9, 12, 13, 14]
    with torch.no_grad():
        score = episode_logps(model, [[sequence], pack_turns(REJECTED_TURNS)])
        every = token_logps(model, ids)  # log p(ids[t] | ids[:t]) for t >= 1
    assert float(score[0]) == pytest.approx(sum(every[t - 1] for t in (3, 4, 7, 8, 9)), abs=1e-5)
    assert float(score[0]) != pytest.approx(sum(every), abs=1e-3)


def token_logps(model: TinyFamilyModel, ids: list[int]) -> list[float]:
    logits = model.net(torch.tensor([ids[:-1]]))[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)]


def episode(task: TaskSpec, completion: list[int], *, passed: bool) -> TokenEpisode:
    reward = Reward(components={}, total=float(passed), passed=passed)
    return TokenEpisode(
        task=task, turns=[([1], completion)], reward=reward, end_reason=None, answer=None
    )


def test_pairs_are_a_success_and_a_failure_of_one_task() -> None:
    env = ToolcalcEnvironment()
    mixed, solved, failed = env.generate_tasks(3, seed=3, api_version="v1")
    mixed = dataclasses.replace(mixed, metadata={"ratchet": {"weight": 4}})
    sampled = SampledTasks(
        groups=[
            [
                episode(mixed, [completion], passed=passed)
                for completion, passed in ((2, True), (3, False), (4, True), (5, False), (6, False))
            ],
            [episode(solved, [7], passed=True), episode(solved, [8], passed=True)],
            [episode(failed, [9], passed=False), episode(failed, [10], passed=False)],
        ],
        generated_tokens=0,
        wall_s=0.0,
    )
    pairs, weights = make_pairs(sampled, [mixed, solved, failed], pairs_per_task=4)
    assert [(p.chosen[0][0][-1], p.rejected[0][0][-1]) for p in pairs] == [(2, 3), (4, 5)]
    assert weights == [2.0, 2.0]
    capped, _ = make_pairs(sampled, [mixed, solved, failed], pairs_per_task=1)
    assert len(capped) == 1


def test_a_dpo_job_trains_on_pairs_and_one_without_pairs_says_so(
    capable_champion: Path, tmp_path: Path
) -> None:
    env = ToolcalcEnvironment()
    dataset = tmp_path / "tasks.jsonl"
    write_task_file(dataset, env.generate_tasks(6, seed=31, api_version="v1"))
    hyper = {"samples_per_task": 4, "max_new_tokens": 48, "temperature": 1.5, "steps": 3}
    code = run_train_job(
        tmp_path / "pairs",
        algorithm="dpo",
        environment="toolcalc",
        dataset=dataset,
        base_checkpoint=capable_champion,
        hyperparameters={**hyper, "log_every": 0, "batch_size": 4},
    )
    assert code == 0
    metrics = read_metrics(tmp_path / "pairs")
    assert metrics["algorithm"] == "dpo" and metrics["episodes"] == 24
    assert metrics["pairs"] > 0 and metrics["trained"] is True and metrics["steps"] == 3
    assert math.isfinite(metrics["final_loss"]) and metrics["train_tokens"] > 0
    # the ledger prices each: sampling, the champion's scores of the pairs, the steps
    assert set(metrics["phases"]) == {"rollout", "scoring", "update", "sync"}

    drifted = tmp_path / "v3.jsonl"
    write_task_file(drifted, env.generate_tasks(3, seed=32, api_version="v3"))
    code = run_train_job(
        tmp_path / "none",
        algorithm="dpo",
        environment="toolcalc",
        dataset=drifted,
        base_checkpoint=capable_champion,
        hyperparameters={**hyper, "samples_per_task": 2, "log_every": 0},
    )
    assert code == 0
    metrics = read_metrics(tmp_path / "none")
    assert (metrics["pairs"], metrics["trained"], metrics["steps"]) == (0, False, 0)


def test_dpo_needs_two_samples_per_task() -> None:
    with pytest.raises(ValueError, match=r"samples_per_task must be >= 2.*a success and a failure"):
        DPOConfig(samples_per_task=1)
