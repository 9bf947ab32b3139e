"""When another engine sampled the rollouts: measure how far it disagrees with the trainer,
correct for it, and stop when it is no longer a rounding matter.

With the remote backend (:mod:`services.inference.remote`: vLLM in a cluster, another
``ratchet serve``) the log-probs the sampler reports for the ids it drew are not the
trainer's for the same ids: other kernels, another precision, batch-dependent reductions,
and at worst other weights (a stale adapter on the shared volume, a load that went wrong).
Training on such samples as if they were on-policy biases the gradient (Yao et al., 2025,
"Your efficient RL framework secretly brings you off-policy RL training"). Per sampled
token, with ``r = π_trainer(id) / π_sampler(id)`` (both at temperature 1, the raw log-probs
vLLM and the local engine report):

- :func:`token_mismatch` summarises a batch: the mean K3 estimate of KL(sampler ‖ trainer),
  ``r - 1 - log r`` (the samples are the sampler's, so this is the direction it estimates,
  unbiased and never negative), and the largest ``r``. Dense models in bf16 sit near 1e-3;
  another adapter is orders of magnitude above.
- :func:`tis_weights` is truncated importance sampling: ``min(r, cap)``, detached, the
  per-token weight of GRPO's policy term (deviation 7 of :mod:`services.training.grpo`), as
  TRL's ``vllm_importance_sampling_correction`` computes it.
- :class:`MismatchGuard` is the stop: a mean K3 over ``mismatch_threshold`` fails the job,
  before the batch trains, with a reason that names the version the sampler served; every
  batch it saw is a row of metrics.json's ``sampler_mismatch``.
- :class:`MismatchWatch` does the same for rft and dpo, which sample through the model and
  never score what they sampled against the sampler: it wraps the model and scores each
  remote batch under the current weights as soon as it is sampled (one more forward pass
  over the batch, no gradients).

Rollouts the trainer's own engine sampled (``Rollouts.sampler`` None) are left alone: that
engine runs the trainer's weights in the trainer's process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.environments.base import Environment, TaskSpec
from services.inference.utilisation import ModelShape, shape_of
from services.training.checkpoint import Manifest
from services.training.config import HFGRPOConfig, MismatchOptions
from services.training.distributed import DistContext, is_sharded
from services.training.family import (
    DemonstrationOptions,
    EpisodeFeed,
    FamilyModel,
    PackedBatch,
    Rollouts,
    SampledBy,
    TokenSequence,
    idle_passes,
    micro_batches,
)


class SamplerMismatch(RuntimeError):
    """The sampler's log-probs are too far from the trainer's to train on; the message
    names the step, the measured mismatch and the version the sampler served."""


@dataclass(frozen=True)
class MismatchStats:
    """Sums over a batch's sampled tokens: how many, their K3 terms, how many ratios were
    above the cap, and the largest ratio."""

    tokens: float = 0.0
    k3_sum: float = 0.0
    truncated: float = 0.0
    max_ratio: float = 0.0

    @property
    def k3(self) -> float:
        """The mean per-token K3 estimate of KL(sampler ‖ trainer)."""
        return self.k3_sum / self.tokens if self.tokens else 0.0

    @property
    def truncated_fraction(self) -> float:
        return self.truncated / self.tokens if self.tokens else 0.0

    def __add__(self, other: MismatchStats) -> MismatchStats:
        return MismatchStats(
            self.tokens + other.tokens,
            self.k3_sum + other.k3_sum,
            self.truncated + other.truncated,
            max(self.max_ratio, other.max_ratio),
        )

    def over_ranks(self, ctx: DistContext) -> MismatchStats:
        """The sums over every rank's share of the batch (each rank scored its own)."""
        tokens, k3_sum, truncated = ctx.all_reduce_sum([self.tokens, self.k3_sum, self.truncated])
        return MismatchStats(tokens, k3_sum, truncated, ctx.all_reduce_max([self.max_ratio])[0])


def token_mismatch(
    trainer_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float | None = None,
) -> MismatchStats:
    """The sums of :class:`MismatchStats` over the masked tokens; all three are (N, T)."""
    keep = mask.to(torch.bool)  # (N, T)
    log_ratio = (trainer_logp.detach() - sampler_logp.detach()).to(torch.float64)  # (N, T)
    ratio = torch.exp(log_ratio)  # (N, T)
    k3 = ratio - 1.0 - log_ratio  # (N, T), >= 0
    tokens = int(keep.sum())
    if tokens == 0:
        return MismatchStats()
    truncated = float((keep & (ratio > cap)).sum()) if cap is not None else 0.0
    return MismatchStats(
        tokens=float(tokens),
        k3_sum=float(k3[keep].sum()),
        truncated=truncated,
        max_ratio=float(ratio[keep].max()),
    )


def tis_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(π_trainer / π_sampler, cap)`` of the sampled
    tokens, without gradient: (N, T) from (N, T) log-probs."""
    return torch.clamp(torch.exp(old_logp.detach() - sampler_logp), max=cap).detach()


@dataclass(frozen=True)
class SamplerCorrection:
    """What a trainer does about rollouts another engine sampled: the stop's threshold and
    GRPO's TIS cap."""

    threshold: float
    tis_cap: float


def correction_of(config: object) -> SamplerCorrection:
    """A trainer config's ``mismatch_threshold`` and ``tis_cap`` (an hf config's), their
    defaults for a config without them (a family that never samples remotely)."""
    threshold = (
        config.mismatch_threshold
        if isinstance(config, MismatchOptions)
        else MismatchOptions().mismatch_threshold
    )
    cap = config.tis_cap if isinstance(config, HFGRPOConfig) else HFGRPOConfig().tis_cap
    return SamplerCorrection(threshold=threshold, tis_cap=cap)


@dataclass
class MismatchGuard:
    """Records each remote batch's mismatch and stops the job past ``threshold``."""

    threshold: float
    rows: list[dict[str, Any]] = field(default_factory=list)

    def check(
        self, stats: MismatchStats, *, where: str, sampler: SampledBy, truncated: bool = False
    ) -> dict[str, Any]:
        """Record ``stats`` (summed over every rank, so every rank decides alike) as a row
        (with the share of tokens above the TIS cap when ``truncated``: GRPO's) and return
        it; :class:`SamplerMismatch` when its mean K3 is over the threshold."""
        row: dict[str, Any] = {
            "where": where,
            "tokens": int(stats.tokens),
            "k3": stats.k3,
            "max_ratio": stats.max_ratio,
            "served": served_version(sampler),
        }
        if truncated:
            row["truncated_fraction"] = stats.truncated_fraction
        self.rows.append(row)
        if stats.tokens and (stats.k3 > self.threshold or not math.isfinite(stats.k3)):
            raise SamplerMismatch(
                f"sampler mismatch at {where}: mean K3 {stats.k3:.3g} over "
                f"{int(stats.tokens)} tokens is above mismatch_threshold {self.threshold:g} "
                f"(largest ratio {stats.max_ratio:.3g}); {sampler.describe()}"
            )
        return row


def served_version(sampler: SampledBy) -> str:
    """The version the sampler says it served, else the checkpoint the job sent it, else
    the name it decoded with."""
    if sampler.served_versions:
        return ",".join(sampler.served_versions)
    return sampler.published_id or sampler.served_name


class MismatchWatch:
    """A :class:`FamilyModel` that checks every batch another engine samples for it (rft
    and dpo sample through :meth:`rollouts` and train on what they keep); the rest is the
    wrapped model's."""

    def __init__(
        self, model: FamilyModel, guard: MismatchGuard, ctx: DistContext, *, micro_batch: int
    ) -> None:
        self.model = model
        self.guard = guard
        self.ctx = ctx
        self.micro_batch = micro_batch
        self.family = model.family
        self.pad_id = model.pad_id
        self.device = model.device
        self.checkpoint_id = model.checkpoint_id
        self.sharded = is_sharded(model)
        self.calls = 0

    def model_shape(self) -> ModelShape:
        """The wrapped model's: without it rft's and dpo's training passes, which run
        through this watch, report no ``train_mfu`` (seed 1 of the foreign-agent benchmark's
        rft job did not)."""
        shape = shape_of(self.model)
        if shape is None:
            raise TypeError(f"{type(self.model).__name__} cannot say its shape")
        return shape

    def rollouts(
        self,
        env: Environment,
        tasks: Sequence[TaskSpec],
        *,
        seeds: Sequence[int],
        max_turns: int,
        max_new_tokens: int,
        temperature: float,
        max_rows: int | None = None,
        feed: EpisodeFeed | None = None,
    ) -> Rollouts:
        rollouts = self.model.rollouts(
            env,
            tasks,
            seeds=seeds,
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            max_rows=max_rows,
            feed=feed,
        )
        self.calls += 1
        if rollouts.sampler is not None:
            stats = self._score(rollouts)
            # Every rank sampled the same episodes (rft and dpo sample every task on every
            # rank): the largest of each figure is the batch's, and every rank stops alike.
            k3, max_ratio = self.ctx.all_reduce_max([stats.k3, stats.max_ratio])
            agreed = MismatchStats(stats.tokens, k3 * stats.tokens, 0.0, max_ratio)
            self.guard.check(agreed, where=f"rollouts {self.calls}", sampler=rollouts.sampler)
        return rollouts

    def _score(self, rollouts: Rollouts) -> MismatchStats:
        """The mismatch of every sampled token under the current weights, scored in the
        mode the trainer sampled in (rft, dpo: eval)."""
        sequences: list[TokenSequence] = []
        values: list[list[float]] = []
        for episode in rollouts.episodes:
            laid = episode.sampler_sequences
            if laid is not None:
                sequences.extend(episode.sequences)
                values.extend(laid)
        return score_mismatch(
            self.model, sequences, values, ctx=self.ctx, micro_batch=self.micro_batch
        )

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self.model.trainable_parameters()

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        return self.model.logprobs(batch)

    def demonstrations(
        self, env: Environment, tasks: Sequence[TaskSpec], options: DemonstrationOptions
    ) -> list[TokenSequence]:
        return self.model.demonstrations(env, tasks, options)

    def save(self, out_dir: Path, *, parent: str | None, metadata: dict[str, object]) -> Manifest:
        return self.model.save(out_dir, parent=parent, metadata=metadata)


@torch.no_grad()
def score_mismatch(
    model: FamilyModel,
    sequences: Sequence[TokenSequence],
    values: Sequence[Sequence[float]],
    *,
    ctx: DistContext,
    micro_batch: int,
    cap: float | None = None,
) -> MismatchStats:
    """The mismatch of the target tokens of ``sequences`` under the current weights with the
    sampler's log-probs ``values`` (laid out as the sequences), in micro-batches; this
    rank's sums. A sharded model's ranks run as many passes each (idle ones)."""
    batches = micro_batches(model, sequences, micro_batch, values)
    if is_sharded(model):
        idle_passes(model, ctx.most(len(batches)) - len(batches), backward=False)
    total = MismatchStats()
    for batch in batches:
        assert batch.sampler_logp is not None  # collated with the sampler's values
        total = total + token_mismatch(
            model.logprobs(batch), batch.sampler_logp, batch.target, cap=cap
        )
    return total
