"""The sampler-mismatch arithmetic with exact values: the per-token K3 estimate and the
largest ratio, the truncated importance weights and how GRPO's policy loss takes them, the
sampler's log-probs laid out as training sequences, and the stop's row and reason."""

from __future__ import annotations

import math

import pytest
import torch

from services.inference.utilisation import shape_of
from services.training.config import HFDPOConfig, HFGRPOConfig, HFRFTConfig, HFSFTConfig
from services.training.distributed import init_distributed
from services.training.family import SampledBy, collate, pack_turn_values, pack_turns
from services.training.grpo import policy_loss
from services.training.mismatch import (
    MismatchGuard,
    MismatchStats,
    MismatchWatch,
    SamplerMismatch,
    correction_of,
    tis_weights,
    token_mismatch,
)
from services.training.tiny.family import TinyFamily


def test_token_mismatch_exact_values() -> None:
    f64 = torch.float64
    trainer = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.6, 0.1]], dtype=f64))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.05], [0.3, 0.2, 0.7]], dtype=f64))
    mask = torch.tensor([[True, True, False], [True, True, False]])
    stats = token_mismatch(trainer, sampler, mask, cap=2.0)
    ratios = [2.0, 0.5, 1.0, 3.0]  # trainer / sampler on the four masked tokens
    k3 = [r - 1 - math.log(r) for r in ratios]
    assert stats.tokens == 4
    assert stats.k3 == pytest.approx(sum(k3) / 4, abs=1e-9)
    assert stats.max_ratio == pytest.approx(3.0, abs=1e-9)  # not the unmasked 0.9 / 0.05
    assert stats.truncated == 1  # only 3.0 is above the cap (2.0 is not)
    assert stats.truncated_fraction == pytest.approx(0.25)
    assert token_mismatch(trainer, sampler, torch.zeros_like(mask)) == MismatchStats()


def test_stats_add_and_agree_exactly() -> None:
    a = MismatchStats(tokens=2, k3_sum=0.5, truncated=1, max_ratio=1.5)
    b = MismatchStats(tokens=6, k3_sum=0.1, truncated=0, max_ratio=3.0)
    total = a + b
    assert (total.tokens, total.k3_sum, total.truncated, total.max_ratio) == (8, 0.6, 1, 3.0)
    assert total.k3 == pytest.approx(0.075)
    assert MismatchStats().k3 == 0.0


def test_tis_weights_are_the_capped_ratio_without_gradient() -> None:
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]])).requires_grad_(True)
    sampler = torch.log(torch.tensor([[0.1, 0.4, 0.9]]))
    weights = tis_weights(old, sampler, 2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 1.0]]))  # 5.0 capped at 2
    assert not weights.requires_grad


def test_policy_loss_weighs_each_tokens_surrogate_by_its_importance_exactly() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.2, 0.4, 0.1]]))
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([1.0, -2.0])
    importance = torch.tensor([[2.0, 0.5, 7.0], [1.0, 0.25, 7.0]])
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.9], [0.2, 0.4, 0.1]]))
    loss, info = policy_loss(
        logp, logp.detach(), adv, mask, clip_eps=0.2, normalizer=8.0, importance=importance
    )
    # ratio 1 everywhere: each token's surrogate is -A, weighted; the unmasked 7.0 is unseen
    expected = -(2.0 * 1 + 0.5 * 1 + 1.0 * -2 + 0.25 * -2) / 8.0
    assert float(loss) == pytest.approx(expected, abs=1e-7)
    assert info["clip_fraction"] == 0.0
    # the KL term is not weighted (as TRL's vllm_importance_sampling_correction)
    from services.training.grpo import KLPenalty

    with_kl, info = policy_loss(
        logp,
        logp.detach(),
        adv,
        mask,
        clip_eps=0.2,
        normalizer=8.0,
        importance=importance,
        kl=KLPenalty(ref, 0.5),
    )
    k3 = 0.5 - math.log(0.5) - 1.0  # ref/logp = 0.5 on the first token, 1 on the others
    assert float(with_kl) == pytest.approx(expected + 0.5 * k3 / 8.0, abs=1e-7)


def test_the_samplers_log_probs_are_laid_out_as_the_training_sequences() -> None:
    # turn 2's prompt extends turn 1's prompt and completion: one sequence, both targets
    turns = [([1, 2], [3, 4]), ([1, 2, 3, 4, 9], [5]), ([7], [8, 6])]
    values = [[-0.1, -0.2], [-0.3], [-0.4, -0.5]]
    sequences = pack_turns(turns)
    laid = pack_turn_values(turns, values)
    assert sequences == [
        ([1, 2, 3, 4, 9, 5], [False, False, True, True, False, True]),
        ([7, 8, 6], [False, True, True]),
    ]
    assert laid == [[0.0, 0.0, -0.1, -0.2, 0.0, -0.3], [0.0, -0.4, -0.5]]
    batch = collate(sequences, pad_id=0, device=torch.device("cpu"), sampler=laid)
    assert batch.sampler_logp is not None
    torch.testing.assert_close(
        batch.sampler_logp,
        torch.tensor([[0.0, -0.1, -0.2, 0.0, -0.3], [-0.4, -0.5, 0.0, 0.0, 0.0]]),
    )
    assert batch.sampler_logp[batch.target].tolist() == pytest.approx(
        [-0.1, -0.2, -0.3, -0.4, -0.5]
    )
    with pytest.raises(ValueError, match="one value per completion token"):
        pack_turn_values(turns, [[-0.1], [-0.3], [-0.4, -0.5]])


def test_the_guard_records_each_batch_and_stops_past_the_threshold_naming_the_version() -> None:
    guard = MismatchGuard(threshold=1e-2)
    sampler = SampledBy(
        url="http://vllm:8000",
        served_name="ratchet-rollout-1",
        published_id="a" * 64,
        served_versions=("b" * 64,),
    )
    row = guard.check(
        MismatchStats(100, 0.5, 3, 1.2), where="step 1", sampler=sampler, truncated=True
    )
    assert row == {
        "where": "step 1",
        "tokens": 100,
        "k3": 0.005,
        "max_ratio": 1.2,
        "served": "b" * 64,
        "truncated_fraction": 0.03,
    }
    with pytest.raises(SamplerMismatch) as stopped:
        guard.check(MismatchStats(10, 2.0, 0, 9.0), where="step 2", sampler=sampler)
    message = str(stopped.value)
    assert message.startswith("sampler mismatch at step 2: mean K3 0.2 over 10 tokens")
    assert "mismatch_threshold 0.01" in message
    assert f"served version {'b' * 12} as 'ratchet-rollout-1'" in message
    assert f"the job sent checkpoint {'a' * 12}" in message
    assert [r["where"] for r in guard.rows] == ["step 1", "step 2"]
    # vLLM names no version: the row names the checkpoint the job sent
    vllm = SampledBy(url="http://vllm:8000", served_name="ratchet-rollout-2", published_id="c" * 64)
    assert guard.check(MismatchStats(), where="step 3", sampler=vllm)["served"] == "c" * 64


def test_the_options_reach_the_configs_that_sample_and_no_other() -> None:
    assert correction_of(HFGRPOConfig(tis_cap=3.0, mismatch_threshold=0.5)).tis_cap == 3.0
    assert correction_of(HFGRPOConfig()).threshold == 1e-2
    assert HFRFTConfig().mismatch_threshold == HFDPOConfig().mismatch_threshold == 1e-2
    assert not hasattr(HFSFTConfig(), "mismatch_threshold")  # sft samples nothing
    assert not hasattr(HFRFTConfig(), "tis_cap")  # truncated IS weighs a policy gradient


def test_the_watch_says_the_shape_of_the_model_it_wraps() -> None:
    """rft and dpo train through the watch: their training passes' MFU needs the shape."""
    model = TinyFamily().create(None, seed=0, device=torch.device("cpu"))
    watch = MismatchWatch(model, MismatchGuard(0.01), init_distributed("cpu"), micro_batch=2)
    assert shape_of(watch) == shape_of(model) is not None
