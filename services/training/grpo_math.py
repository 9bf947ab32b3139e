"""GRPO's pure functions (services.training.grpo is the trainer and says which variant
and every deviation): the task draw of a step, group-relative advantages, and the clipped
surrogate with its k3 KL term and the truncated importance weights of tokens another
engine sampled. Each has exact-value tests (tests/services/training/test_grpo.py,
test_mismatch.py); the trainer re-exports them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.environments.base import TaskSpec
from services.training.rng import derive_seed


def task_weights(tasks: Sequence[TaskSpec]) -> list[float] | None:
    """Each task's dedup weight from its lineage metadata; None when all weigh the same."""
    weights = []
    for task in tasks:
        lineage = task.metadata.get("ratchet") if isinstance(task.metadata, dict) else None
        weight = lineage.get("weight", 1) if isinstance(lineage, dict) else 1
        valid = isinstance(weight, int | float) and not isinstance(weight, bool) and weight > 0
        weights.append(float(weight) if valid else 1.0)
    return None if len(set(weights)) <= 1 else weights


def task_order(
    step: int, batch: int, n_tasks: int, seed: int, weights: Sequence[float] | None = None
) -> list[int]:
    """Dataset indices of step ``step``'s global batch.

    Without ``weights``: epoch-wise shuffles, seeded per epoch. With them: a draw with
    replacement proportional to weight, seeded per step.
    """
    if weights is not None:
        if len(weights) != n_tasks:
            raise ValueError("need one weight per task")
        generator = torch.Generator().manual_seed(derive_seed(seed, 0xE90C, 0x5EED, step))
        drawn = torch.multinomial(
            torch.tensor(weights, dtype=torch.float64), batch, replacement=True, generator=generator
        )
        return [int(i) for i in drawn.tolist()]
    indices = []
    for position in range(step * batch, (step + 1) * batch):
        epoch, offset = divmod(position, n_tasks)
        generator = torch.Generator().manual_seed(derive_seed(seed, 0xE90C, epoch))
        indices.append(int(torch.randperm(n_tasks, generator=generator)[offset]))
    return indices


def group_advantages(
    rewards: torch.Tensor, *, eps: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages and which groups carry signal.

    ``rewards`` is (groups, G). Returns advantages (groups, G) equal to
    ``(r - mean) / (std + eps)`` with the unbiased std (as TRL), zero for zero-variance
    groups, and a boolean (groups,) mask of the groups with any variance.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError("rewards must be (groups, G) with G >= 2")
    rewards = rewards.to(torch.float64)
    mean = rewards.mean(dim=1, keepdim=True)  # (groups, 1)
    std = rewards.std(dim=1, keepdim=True)  # (groups, 1), unbiased
    keep = (rewards.max(dim=1).values - rewards.min(dim=1).values) > 1e-9  # (groups,)
    advantages = (rewards - mean) / (std + eps)  # (groups, G)
    advantages = torch.where(keep[:, None], advantages, torch.zeros_like(advantages))
    return advantages.to(torch.float32), keep


def grouped_advantages(
    rewards: torch.Tensor, sizes: Sequence[int], *, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`group_advantages` of consecutive groups of ``sizes``: per-episode advantages
    (E,) and whether its group is kept (E,); a group of fewer than two episodes carries no
    signal. Groups of one size are scored as one (groups, G) matrix, as without adaptive
    sampling."""
    if sizes and len(set(sizes)) == 1 and sizes[0] >= 2:
        advantages, keep = group_advantages(rewards.view(len(sizes), sizes[0]), eps=eps)
        return advantages.view(-1), keep.repeat_interleave(sizes[0])
    adv_parts: list[torch.Tensor] = []
    keep_parts: list[torch.Tensor] = []
    begin = 0
    for size in sizes:
        group = rewards[begin : begin + size]
        if size >= 2:
            advantages, keep = group_advantages(group.view(1, size), eps=eps)
            adv_parts.append(advantages.view(-1))
            keep_parts.append(keep.repeat_interleave(size))
        else:
            adv_parts.append(torch.zeros(size))
            keep_parts.append(torch.zeros(size, dtype=torch.bool))
        begin += size
    if not adv_parts:
        return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    return torch.cat(adv_parts), torch.cat(keep_parts)


@dataclass(frozen=True)
class KLPenalty:
    """The k3 KL penalty to a reference policy: its log-probs (N, T) and its weight."""

    ref_logp: torch.Tensor
    coef: float


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    kl: KLPenalty | None = None,
    normalizer: float | None = None,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (+ k3 KL) summed over masked tokens / ``normalizer``.

    ``logp``, ``old_logp`` and ``mask`` are (N, T); ``advantages`` is (N,). ``normalizer``
    defaults to the number of masked tokens. ``importance`` (N, T), the truncated importance
    weights of tokens another engine sampled (:func:`services.training.mismatch.
    tis_weights`, deviation 7), weighs each token's surrogate, not its KL term.
    """
    mask_f = mask.to(logp.dtype)  # (N, T)
    ratio = torch.exp(logp - old_logp)  # (N, T)
    adv = advantages.to(logp.dtype)[:, None]  # (N, 1)
    unclipped = ratio * adv  # (N, T)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv  # (N, T)
    per_token = -torch.minimum(unclipped, clipped)  # (N, T)
    if importance is not None:
        per_token = per_token * importance.detach().to(logp.dtype)  # (N, T)
    kl_mean = 0.0
    if kl is not None and kl.coef > 0.0:
        delta = kl.ref_logp - logp  # (N, T)
        k3 = torch.exp(delta) - delta - 1.0  # (N, T), k3 estimator, >= 0
        per_token = per_token + kl.coef * k3
        kl_mean = float((k3.detach() * mask_f).sum() / mask_f.sum().clamp(min=1.0))
    denom = float(normalizer) if normalizer is not None else float(mask_f.sum().clamp(min=1.0))
    loss = (per_token * mask_f).sum() / denom
    clip_frac = float(
        ((unclipped != clipped).to(logp.dtype) * mask_f).sum() / mask_f.sum().clamp(min=1.0)
    )
    return loss, {"clip_fraction": clip_frac, "kl": kl_mean}
