"""Optimizer and learning-rate schedule shared by SFT and GRPO."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch


def make_optimizer(
    params: Sequence[torch.nn.Parameter], *, lr: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW over the trainable ``params`` of any family; weight decay only on matrices
    (not biases or norms)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def cosine_lr(step: int, *, total: int, base: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to ``base``, then cosine decay to ``base * min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class TrainingDiverged(RuntimeError):
    """The loss or gradient became NaN or infinite: the weights can no longer be trusted."""


def clip_and_check(
    model: torch.nn.Module | Iterable[torch.nn.Parameter], *, max_norm: float, step: int, lr: float
) -> float:
    """Clip the gradient norm and refuse to step on a non-finite one.

    One NaN in an update poisons every weight, and a checkpoint full of NaN would still be
    evaluated and compared. Stopping here turns a broken learning rate or loss into a failed
    run with a reason, before the optimizer writes the damage into the weights.
    """
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    norm = float(torch.nn.utils.clip_grad_norm_(list(params), max_norm))
    if not math.isfinite(norm):
        raise TrainingDiverged(
            f"training diverged at step {step + 1}: gradient norm is {norm} "
            f"(learning rate {lr:g}; lower it or check the data)"
        )
    return norm


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class ScheduledConfig(Protocol):
    """The fields of a trainer config that set its learning-rate schedule."""

    @property
    def steps(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def warmup(self) -> int: ...
    @property
    def min_lr_ratio(self) -> float: ...


def schedule_lr(optimizer: torch.optim.Optimizer, step: int, config: ScheduledConfig) -> float:
    """Set ``step``'s learning rate from ``config``'s schedule; returns it for the clip check."""
    lr = cosine_lr(
        step,
        total=config.steps,
        base=config.lr,
        warmup=config.warmup,
        min_ratio=config.min_lr_ratio,
    )
    set_lr(optimizer, lr)
    return lr
