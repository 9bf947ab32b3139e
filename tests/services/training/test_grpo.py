"""GRPO: exact values of the pure functions, and a smoke test of one real step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.environments.base import Episode, Reward, TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.training.distributed import init_distributed
from services.training.grpo import (
    GRPOConfig,
    KLPenalty,
    group_advantages,
    policy_loss,
    task_order,
    task_weights,
    train_grpo,
)
from services.training.tiny.family import TinyFamilyModel
from services.training.tiny.model import GPT, GPTConfig

TINY = GPTConfig(max_seq_len=160, n_layer=1, n_head=2, d_model=16)


def test_group_advantages_exact() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 1.0, 0.0]])
    advantages, keep = group_advantages(rewards, eps=0.0)
    # group 0: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    assert advantages[0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-7)
    # group 1: no variance -> filtered, zero advantage
    assert advantages[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    # group 2: mean 0.5, unbiased std sqrt(4 * 0.25 / 3)
    s = math.sqrt(1 / 3)
    assert advantages[2].tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s], abs=1e-6)
    assert keep.tolist() == [True, False, True]


def test_group_advantages_eps_and_shape_check() -> None:
    advantages, _ = group_advantages(torch.tensor([[1.0, 0.0]]), eps=0.1)
    std = math.sqrt(0.5)
    assert advantages[0].tolist() == pytest.approx(
        [0.5 / (std + 0.1), -0.5 / (std + 0.1)], abs=1e-6
    )
    with pytest.raises(ValueError, match="groups, G"):
        group_advantages(torch.tensor([1.0, 0.0]))


def test_policy_loss_exact_values() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.2, 0.4, 0.1]]))
    old = torch.log(torch.tensor([[0.25, 0.25, 0.9], [0.4, 0.4, 0.1]]))
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([1.0, -2.0])
    loss, info = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    # ratios: row0 [2.0, 1.0], row1 [0.5, 1.0]
    # row0 (A=+1): min(2*1, 1.2*1) = 1.2 ; min(1, 1) = 1
    # row1 (A=-2): min(0.5*-2, 0.8*-2) = -1.6 ; min(-2, -2) = -2
    expected = -(1.2 + 1.0 - 1.6 - 2.0) / 4
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert info["clip_fraction"] == pytest.approx(0.5)
    # a global normalizer (data-parallel) replaces the local token count
    loss_global, _ = policy_loss(logp, old, adv, mask, clip_eps=0.2, normalizer=8.0)
    assert float(loss_global) == pytest.approx(expected * 4 / 8, abs=1e-6)


def test_policy_loss_kl_term_exact() -> None:
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    mask = torch.tensor([[True]])
    loss, info = policy_loss(
        logp, logp.clone(), torch.tensor([0.0]), mask, clip_eps=0.2, kl=KLPenalty(ref, 0.1)
    )
    kl = 0.5 - math.log(0.5) - 1.0  # exp(ref - logp) - (ref - logp) - 1 with ref/logp = 0.5
    assert info["kl"] == pytest.approx(kl, abs=1e-6)
    assert float(loss) == pytest.approx(0.1 * kl, abs=1e-6)


def test_policy_loss_gradient_direction() -> None:
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_(True)
    loss, _ = policy_loss(
        logp, logp.detach(), torch.tensor([1.0]), torch.tensor([[True]]), clip_eps=0.2
    )
    loss.backward()
    assert (
        logp.grad is not None and float(logp.grad) < 0
    )  # descending raises a positive-advantage token


def test_task_order_is_a_pure_function_covering_the_dataset() -> None:
    first = [task_order(s, 4, 10, seed=1) for s in range(5)]
    assert first == [task_order(s, 4, 10, seed=1) for s in range(5)]
    flat = [i for step in first for i in step]
    assert sorted(flat[:10]) == list(range(10))  # epoch 0 is a permutation
    assert sorted(flat[10:20]) == list(range(10))


def test_dedup_weights_drive_the_task_draw() -> None:
    """A task folded from 9 traces is drawn about 9 times as often as one seen once."""
    tasks = ToolcalcEnvironment().generate_tasks(3, seed=5, api_version="v2")
    weighted = [
        TaskSpec.from_json({**t.to_dict(), "metadata": {"ratchet": {"weight": w}}})
        for t, w in zip(tasks, [9, 1, 1], strict=True)
    ]
    weights = task_weights(weighted)
    assert weights == [9.0, 1.0, 1.0]
    assert task_weights(tasks) is None  # no lineage: every task weighs the same
    draws = [i for s in range(400) for i in task_order(s, 4, 3, seed=2, weights=weights)]
    assert draws == [i for s in range(400) for i in task_order(s, 4, 3, seed=2, weights=weights)]
    share = draws.count(0) / len(draws)
    assert 0.75 < share < 0.88  # 9 / 11 = 0.82
    with pytest.raises(ValueError, match="one weight per task"):
        task_order(0, 4, 3, seed=2, weights=[1.0])


class VariedRewardEnv(ToolcalcEnvironment):
    """toolcalc with a reward that varies even for an untrained policy (random bytes)."""

    def verify(self, task: TaskSpec, episode: Episode) -> Reward:
        text = "".join(t.text for t in episode.agent_turns)
        total = (len(set(text)) % 5) / 4
        return Reward(components={"distinct": total}, total=total, passed=total == 1.0)


def test_every_parameter_changes_after_one_step(tmp_path: Path) -> None:
    env = VariedRewardEnv()
    tasks = env.generate_tasks(8, seed=0, api_version="v1")
    torch.manual_seed(0)
    model = GPT(TINY)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = GRPOConfig(
        steps=1, tasks_per_step=4, group_size=4, max_new_tokens=12, max_turns=2, lr=1e-2, seed=0
    )
    trainee = TinyFamilyModel(model, device=torch.device("cpu"), checkpoint_id=None)
    result = train_grpo(trainee, env, tasks, config, ctx=init_distributed("cpu"))
    assert result.counters.steps_done == 1
    assert result.counters.groups == 4
    assert result.counters.filtered_zero_variance_groups < 4
    assert result.counters.rollout_tokens > 0 and result.counters.train_tokens > 0
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unchanged == []


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="temperature"):
        GRPOConfig(temperature=0.0)


def test_adaptive_allocation_gives_none_to_solved_tasks_and_keeps_the_budget() -> None:
    from services.training.adaptive import adaptive_allocation

    # probe of 2: solved, between, unsolved, solved; 16 episodes in all, 8 left after the probe
    extra = adaptive_allocation([2, 1, 0, 2], probe=2, budget=16, unsolved_rate=0.5)
    assert extra == [0, 5, 3, 0]  # quotas 16/3 and 8/3; the larger remainder gets the last one
    assert 2 * 4 + sum(extra) == 16
    assert adaptive_allocation([2, 1, 0], probe=2, budget=12, unsolved_rate=0.0) == [0, 6, 0]
    assert adaptive_allocation([2, 2], probe=2, budget=8, unsolved_rate=1.0) == [0, 0]
    assert adaptive_allocation([0, 0, 1], probe=2, budget=6, unsolved_rate=1.0) == [0, 0, 0]
    for passes in ([0, 1, 2, 3], [3, 3, 0, 0], [1, 1, 1, 1], [0, 0, 0, 3]):
        extra = adaptive_allocation(passes, probe=3, budget=4 * 7, unsolved_rate=0.3)
        assert 3 * 4 + sum(extra) <= 4 * 7
        assert all(e == 0 for p, e in zip(passes, extra, strict=True) if p == 3)


def test_adaptive_grpo_samples_no_more_of_solved_tasks_within_the_budget(
    capable_champion: Path,
) -> None:
    from services.training.config import RFTConfig
    from services.training.family import family_for
    from tests.services.training.test_rft import Recording

    env = ToolcalcEnvironment()
    tasks = env.generate_tasks(2, seed=31, api_version="v1") + env.generate_tasks(
        2, seed=32, api_version="v3"
    )
    inner = family_for("tiny").load(
        capable_champion, device=torch.device("cpu"), training=RFTConfig()
    )
    model = Recording(inner)
    config = GRPOConfig(
        steps=1,
        tasks_per_step=4,
        group_size=4,
        max_new_tokens=48,
        temperature=0.3,
        adaptive_sampling=True,
        adaptive_probe=2,
        adaptive_unsolved_rate=0.5,
        checkpoint_every=0,
        log_every=0,
    )
    result = train_grpo(model, env, tasks, config, ctx=init_distributed("cpu"))
    probe = model.sampled[: 4 * 2]
    by_task: dict[str, list[bool]] = {}
    for episode in model.sampled:
        by_task.setdefault(episode.task.task_id, []).append(episode.reward.passed)
    probed = {
        t.task_id: [e.reward.passed for e in probe if e.task.task_id == t.task_id] for t in tasks
    }
    solved = [task_id for task_id, passed in probed.items() if all(passed)]
    assert solved, "a v1 task should pass its whole probe for this test to mean anything"
    for task_id in solved:
        assert len(by_task[task_id]) == 2
    assert any(len(passed) > 2 for passed in by_task.values())
    assert len(model.sampled) <= 4 * 4 == 16
    assert result.counters.episodes == len(model.sampled)
