"""GRPO: group-relative policy optimisation with verifier rewards, for every model family.

The variant is GRPO as introduced in DeepSeekMath (Shao et al., 2024) and implemented in
TRL's ``GRPOTrainer``: for each task, sample a group of G episodes from the current policy,
score each with the environment's verifier, and use the group-normalised reward
``(r - mean(group)) / (std(group) + eps)`` as the advantage of every token the policy
produced in that episode; optimise the PPO clipped surrogate, optionally with a KL penalty
to the reference (starting) policy estimated with the k3 estimator
``exp(ref - logp) - (ref - logp) - 1``.

Deviations, each on purpose:

1. **Multi-turn episodes.** An episode is a whole tool-use conversation. Only tokens the
   policy generated (its turns and their closing newlines) enter the loss; the prompt and
   the tool results are context, never targets.
2. **Token-level normalisation** (as in DAPO, Yu et al., 2025): the loss is summed over all
   generated tokens of the global batch and divided by their count, instead of averaging
   per sequence first. Long and short episodes weigh by their tokens, and data-parallel
   ranks can split a batch without changing the update.
3. **Zero-variance groups are filtered and counted** (DAPO's observation): a group whose
   episodes all got the same reward has zero advantage and only dilutes the batch, so it
   is dropped rather than resampled (resampling would make step time unpredictable).
4. **Rubric rewards.** The reward is the verifier's rubric total (syntax, right tool, right
   answer), not only pass/fail, so a group where nobody passes can still learn from the
   episodes whose calls were well-formed.
5. **Optional SFT term** on the environment's reference solutions (demonstrations of the
   batch's tasks), weighted by ``sft_coef``; off by default.
6. **Old log-probabilities are recomputed** with the training forward pass before the
   first update instead of being taken from the sampler, so the ratio is exactly 1 on the
   first epoch; with ``ppo_epochs = 1`` clipping is therefore inactive and the update is
   the plain policy gradient, as in TRL's default ``num_iterations = 1``.
7. **Truncated importance sampling when another engine sampled** (Yao et al., 2025; TRL's
   ``vllm_importance_sampling_correction``). Rollouts from the remote backend (vLLM, another
   ``ratchet serve``) carry the sampler's log-probs, which are not the trainer's (kernels,
   precision, a stale adapter): the policy term of each sampled token is weighted by
   ``min(π_old / π_sampler, tis_cap)`` (detached, :func:`services.training.mismatch.
   tis_weights`), π_old being the trainer's log-prob under the weights that sampled; the KL
   term is not weighted, as in TRL. Each such step reports the mismatch (mean per-token K3
   of KL(sampler ‖ trainer), the largest ratio, the share of tokens above the cap) over
   every token sampled (those of filtered groups scored without gradient, the others from
   the update's own forward pass), and a mean K3 over ``mismatch_threshold`` stops the job
   before the step's update. The trainer's own rollouts are not weighted.

Written once over :class:`services.training.family.FamilyModel` (tiny and hf alike): the
family rolls episodes out and scores token batches; everything else is here. Where the two
per-family trainers this replaces disagreed, the behaviour kept is:

- **Dedup weights** drive the task draw for every family (the hf trainer ignored them).
- **Seeding** is counter-based per episode for every family, ``derive_seed(seed, step, j,
  g)`` (the hf trainer seeded one generator per rank and step, so its samples changed with
  the world size and the batch).
- **``ppo_epochs``** (with old log-probs frozen before the first epoch) and the **SFT
  term** are available to every family (the hf trainer had neither).
- **Resume points** (trainable weights + optimizer + counters, see
  :mod:`services.training.resume`) for every family (the hf trainer had none).
- **KL** is computed by swapping the starting trainable weights in (the hf way), not from
  a deep copy of the model (the tiny way): one copy of what is trained, for any family.
- **AdamW** decays matrices only, for every family (the hf trainer decayed norms too).
- **Training sequences are the sampled token ids** (``TokenEpisode.sequences``, turns
  joined where prefixes agree), never a re-tokenized transcript (the tiny trainer
  re-encoded its text: the same bytes, but an episode without a model turn was scored).
- ``kl`` and ``clip_fraction`` in the history are means over the step's micro-batches
  (the tiny trainer reported the last micro-batch's), and every family's history has
  ``target_tokens``.

Task sampling: a dataset task carries its dedup weight (``metadata.ratchet.weight``, the
traces folded into it). With equal weights every task is seen once per epoch (seeded
shuffles); with unequal ones each step draws its tasks with replacement in proportion to
weight, so a failure production hit twenty times is trained on as often as production saw it.

Determinism: the task order is a pure function of (seed, step), episode ``g`` of task ``j``
at step ``s`` samples with seed ``derive_seed(seed, s, j, g)`` (counter-based noise, see
:mod:`services.training.rng`), and a resume point stores the trainable weights, optimizer
and counters. A run resumed after a kill, or split over ranks, reproduces the single
uninterrupted run.

Sharded models (``sharding: fsdp``, :mod:`services.training.hf.fsdp`): their passes are
collectives, so a rank with fewer micro-batches than the busiest runs idle ones
(:func:`services.training.family.idle_passes`), every rank rolls out once per call even
with no task of its own, and every rank writes its own shard of a resume point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.environments.base import Environment, TaskSpec
from services.inference.utilisation import policy_step_figures
from services.training.adaptive import adaptive_rollouts, rollouts_of
from services.training.config import GRPOConfig
from services.training.counters import RunCounters
from services.training.distributed import DistContext, is_sharded
from services.training.family import (
    DemonstrationOptions,
    FamilyModel,
    PackedBatch,
    Rollouts,
    SampledBy,
    StartingWeights,
    TokenSequence,
    idle_passes,
    micro_batches,
    target_count,
)
from services.training.grpo_math import (
    KLPenalty,
    group_advantages,
    grouped_advantages,
    policy_loss,
    task_order,
    task_weights,
)
from services.training.keep import EpisodeKeeper
from services.training.mismatch import (
    MismatchGuard,
    MismatchStats,
    SamplerCorrection,
    correction_of,
    score_mismatch,
    tis_weights,
    token_mismatch,
)
from services.training.optim import clip_and_check, make_optimizer, schedule_lr
from services.training.phases import PhaseClock
from services.training.resume import latest_resume_point, load_resume_point, save_resume_point
from services.training.rng import derive_seed

# The pure functions live in services.training.grpo_math; their home for callers is here.
__all__ = [
    "GRPOResult",
    "KLPenalty",
    "group_advantages",
    "grpo_step_stats",
    "log_grpo_step",
    "policy_loss",
    "task_order",
    "task_weights",
    "train_grpo",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GRPOResult:
    counters: RunCounters
    resumed_from_step: int
    wall_s: float
    # each step's mismatch with the engine that sampled it (remote rollouts only)
    sampler_mismatch: list[dict[str, object]] = field(default_factory=list)

    @property
    def final_reward(self) -> float:
        tail = self.counters.history[-5:]
        return sum(h["reward_mean"] for h in tail) / len(tail) if tail else 0.0

    @property
    def final_pass_rate(self) -> float:
        tail = self.counters.history[-5:]
        return sum(h["pass_rate"] for h in tail) / len(tail) if tail else 0.0


def grpo_step_stats(
    step: int,
    *,
    reward_sum: float,
    passes: float,
    episodes: float,
    groups: float,
    groups_kept: float,
    loss: float,
    **extra: float,
) -> dict[str, float]:
    """One GRPO step's history row: the keys every family writes and ``log_grpo_step`` reads,
    plus the family's own (``extra``). The sums are over all ranks."""
    per_episode = max(episodes, 1.0)
    return {
        "step": float(step + 1),
        "reward_mean": reward_sum / per_episode,
        "pass_rate": passes / per_episode,
        "groups": groups,
        "groups_kept": groups_kept,
        "loss": loss,
        **extra,
    }


def log_grpo_step(log: logging.Logger, step: int, steps: int, stats: dict[str, float]) -> None:
    """One progress line per logged step, the same for every model family (on its logger)."""
    log.info(
        "grpo step %d/%d reward %.3f pass %.3f kept %d/%d groups loss %.4f",
        step + 1,
        steps,
        stats["reward_mean"],
        stats["pass_rate"],
        int(stats["groups_kept"]),
        int(stats["groups"]),
        stats["loss"],
    )


def train_grpo(
    model: FamilyModel,
    env: Environment,
    tasks: Sequence[TaskSpec],
    config: GRPOConfig,
    *,
    ctx: DistContext,
    state_dir: Path | None = None,
    keeper: EpisodeKeeper | None = None,
) -> GRPOResult:
    """Run GRPO on ``tasks``, in place; resumes from ``state_dir`` if it has a point.
    ``keeper`` is handed every episode sampled (the job keeps the verified ones)."""
    if not tasks:
        raise ValueError("GRPO needs at least one task")
    model.train()
    named = model.trainable_parameters()
    params = [p for _, p in named]
    optimizer = make_optimizer(params, lr=config.lr, weight_decay=config.weight_decay)
    ctx.broadcast_parameters(params)
    reference = StartingWeights(model) if config.kl_coef > 0 else None
    counters = RunCounters()
    resumed_from = 0
    point = latest_resume_point(state_dir) if state_dir is not None else None
    if point is not None:
        load_resume_point(point, params=named, optimizer=optimizer, ctx=ctx)
        counters = RunCounters.from_dict(point.counters)
        resumed_from = point.step
        logger.info("grpo resumed from step %d (%s)", point.step, point.path)
    weights = task_weights(tasks)
    clock = PhaseClock(model.device, counters.phase_s)
    correction = correction_of(config)  # for rollouts another engine samples (deviation 7)
    run = _Run(
        model,
        env,
        tasks,
        weights,
        config,
        optimizer,
        params,
        reference,
        ctx,
        counters,
        clock,
        keeper,
        correction,
        MismatchGuard(correction.threshold),
    )
    started = time.monotonic()
    for step in range(counters.steps_done, config.steps):
        stats = _grpo_step(step, run)
        counters.history.append(stats)
        counters.steps_done = step + 1
        if ctx.is_main and config.log_every and (step + 1) % config.log_every == 0:
            log_grpo_step(logger, step, config.steps, stats)
        if (
            state_dir is not None
            and config.checkpoint_every
            and (step + 1) % config.checkpoint_every == 0
        ):
            with clock.phase("sync"):
                save_resume_point(
                    state_dir,
                    step=step + 1,
                    params=named,
                    optimizer=optimizer,
                    counters=counters.to_dict(),
                    ctx=ctx,
                )
                ctx.barrier()
    model.train(False)
    return GRPOResult(
        counters=counters,
        resumed_from_step=resumed_from,
        wall_s=time.monotonic() - started,
        sampler_mismatch=run.guard.rows,
    )


@dataclass(frozen=True)
class _Run:
    """What every step of one GRPO run shares (the model, its optimizer, the counters)."""

    model: FamilyModel
    env: Environment
    tasks: Sequence[TaskSpec]
    weights: list[float] | None
    config: GRPOConfig
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    reference: StartingWeights | None
    ctx: DistContext
    counters: RunCounters
    clock: PhaseClock
    keeper: EpisodeKeeper | None
    correction: SamplerCorrection
    guard: MismatchGuard


@dataclass
class _Scored:
    """A step's kept episodes as training sequences with their advantages (and, when
    another engine sampled them, its log-probs laid out as the sequences), the SFT term's
    demonstrations, and the step's sums over all ranks."""

    sequences: list[TokenSequence]
    advantages: list[float]
    sampler_values: list[list[float]] | None
    sampler: SampledBy | None
    # the sampler mismatch of the episodes the step does not train on (filtered groups)
    filtered_mismatch: MismatchStats
    demos: list[TokenSequence]
    tokens: float
    demo_tokens: float
    kept_groups: float
    groups: float
    generated: float
    reward_sum: float
    pass_sum: float
    episodes: float


def _grpo_step(step: int, run: _Run) -> dict[str, float]:
    """One step: rollouts, group-relative advantages, the policy update(s), the counters."""
    config = run.config
    order = task_order(step, config.tasks_per_step, len(run.tasks), config.seed, run.weights)
    local = run.ctx.shard(config.tasks_per_step)
    t0 = time.monotonic()
    with run.clock.phase("rollout"):
        rollouts, sizes = _step_rollouts(step, run, order, local)
    if run.keeper is not None:
        run.keeper.add(rollouts.episodes)
    rollout_s = time.monotonic() - t0
    run.counters.utilisation.merge(rollouts.utilisation)
    t1 = time.monotonic()
    with run.clock.phase("scoring"):
        scored = _score(step, run, rollouts, sizes, [order[j] for j in local])
    update = _update(step, run, scored)
    train_s = time.monotonic() - t1
    trained_total = int(run.ctx.all_reduce_sum([float(update.trained)])[0])
    counters = run.counters
    if update.trained:
        scorings = int(run.config.ppo_epochs > 1) + int(run.reference is not None)
        shape = (run.model, scored.sequences, scored.demos, run.config, scorings, train_s)
        counters.utilisation.add("train", policy_step_figures(*shape))
    counters.rollout_tokens += int(scored.generated)
    counters.train_tokens += trained_total
    counters.rollout_s += rollout_s
    counters.train_s += train_s
    counters.episodes += int(scored.episodes)
    counters.groups += int(scored.groups)
    counters.filtered_zero_variance_groups += int(scored.groups - scored.kept_groups)
    mismatch: dict[str, float] = {}
    if update.mismatch is not None:
        mismatch = {
            "mismatch_k3": update.mismatch.k3,
            "mismatch_max_ratio": update.mismatch.max_ratio,
            "tis_truncated_fraction": update.mismatch.truncated_fraction,
        }
    return grpo_step_stats(
        step,
        reward_sum=scored.reward_sum,
        passes=scored.pass_sum,
        episodes=scored.episodes,
        groups=scored.groups,
        groups_kept=scored.kept_groups,
        loss=update.loss,
        clip_fraction=update.clip_fraction,
        kl=update.kl,
        target_tokens=scored.tokens,
        successes=scored.pass_sum,
        **mismatch,
    )


def _step_rollouts(
    step: int, run: _Run, order: Sequence[int], local: Sequence[int]
) -> tuple[Rollouts, list[int]]:
    """G episodes per local task, each with its own (step, task, sample) seed, and the group
    sizes (adaptive sampling: a probe of each task, then the budget's rest where it can
    teach)."""
    config = run.config
    G = config.group_size  # noqa: N806 - the paper's name
    if config.adaptive_sampling:
        return adaptive_rollouts(
            step, run.model, run.env, [run.tasks[i] for i in order], config, run.ctx
        )
    wanted = [(j, g) for j in local for g in range(G)]
    step_tasks = [run.tasks[i] for i in order]
    return rollouts_of(step, run.model, run.env, step_tasks, wanted, config), [G] * len(local)


def _score(
    step: int, run: _Run, rollouts: Rollouts, sizes: Sequence[int], local_tasks: Sequence[int]
) -> _Scored:
    """Group-relative advantages (groups without variance are dropped), the optional SFT
    term's demonstrations, and the step's sums over all ranks."""
    config, model = run.config, run.model
    rewards_list = [episode.reward for episode in rollouts.episodes]
    sequences: list[TokenSequence] = []
    seq_adv: list[float] = []
    # another engine's log-probs of what it sampled, laid out as the sequences (deviation 7)
    remote = rollouts.sampler is not None
    sampler_values: list[list[float]] | None = [] if remote else None
    filtered: tuple[list[TokenSequence], list[list[float]]] = ([], [])
    kept_local = 0
    if local_tasks:
        rewards = torch.tensor([r.total for r in rewards_list], dtype=torch.float32)
        advantages, keep = grouped_advantages(rewards, sizes, eps=config.adv_eps)
        kept_local = sum(bool(keep[sum(sizes[:i])]) for i, n in enumerate(sizes) if n)
        for index, episode in enumerate(rollouts.episodes):
            laid = episode.sampled_values() if remote else []
            if bool(keep[index]):
                sequences.extend(episode.sequences)
                seq_adv.extend([float(advantages[index])] * len(episode.sequences))
                if sampler_values is not None:
                    sampler_values.extend(laid)
            elif remote:
                filtered[0].extend(episode.sequences)
                filtered[1].extend(laid)
    filtered_mismatch = (
        score_mismatch(
            model,
            *filtered,
            ctx=run.ctx,
            micro_batch=config.micro_batch,
            cap=run.correction.tis_cap,
        )
        if run.ctx.any_rank(remote)
        else MismatchStats()
    )
    demos: list[TokenSequence] = []
    if config.sft_coef > 0 and local_tasks:
        demos = model.demonstrations(
            run.env,
            [run.tasks[i] for i in local_tasks],
            DemonstrationOptions(seed=derive_seed(config.seed, step)),
        )
    totals = run.ctx.all_reduce_sum(
        [
            float(target_count(sequences)),
            float(target_count(demos)),
            float(kept_local),
            float(len(local_tasks)),
            float(rollouts.generated_tokens),
            float(sum(r.total for r in rewards_list)),
            float(sum(r.passed for r in rewards_list)),
            float(len(rewards_list)),
        ]
    )
    return _Scored(
        sequences, seq_adv, sampler_values, rollouts.sampler, filtered_mismatch, demos, *totals
    )


@dataclass(frozen=True)
class _Update:
    """What a step's update did: the loss (summed over ranks), the mean clip fraction and
    KL, the tokens this rank trained on, and the sampler mismatch (remote rollouts)."""

    loss: float = 0.0
    clip_fraction: float = 0.0
    kl: float = 0.0
    trained: int = 0
    mismatch: MismatchStats | None = None


def _update(step: int, run: _Run, scored: _Scored) -> _Update:
    """The policy update(s) on the kept episodes (+ the optional SFT term). Before the first
    optimizer step, the mismatch with another engine that sampled them is checked: past the
    threshold the job stops and the weights are left as they were."""
    config, model, ctx = run.config, run.model, run.ctx
    lr = schedule_lr(run.optimizer, step, config)
    if scored.tokens <= 0 and scored.demo_tokens <= 0:
        return _Update(mismatch=_check_sampler(run, scored, MismatchStats(), step))
    batches = micro_batches(model, scored.sequences, config.micro_batch, scored.sampler_values)
    demo_batches = micro_batches(model, scored.demos, config.micro_batch)
    # a sharded model's passes are collectives: every rank runs as many as the busiest
    idle, demo_idle = (
        (ctx.most(len(batches)) - len(batches), ctx.most(len(demo_batches)) - len(demo_batches))
        if is_sharded(model)
        else (0, 0)
    )
    adv_t = torch.tensor(scored.advantages, dtype=torch.float32, device=model.device)  # (N,)
    with run.clock.phase("scoring"), torch.no_grad():
        old = [model.logprobs(b) for b in batches] if config.ppo_epochs > 1 else None
        ref = [run.reference.logprobs(model, b) for b in batches] if run.reference else None
        idle_passes(model, idle * ((old is not None) + (ref is not None)), backward=False)
    n_sequences = max(len(scored.sequences), 1)
    result, mismatch = _Update(), None
    with run.clock.phase("update"):
        for epoch in range(config.ppo_epochs):
            run.optimizer.zero_grad(set_to_none=True)
            passes = _policy_backward(run, scored, batches, adv_t, old, ref)
            idle_passes(model, idle, backward=True)
            loss_sum = passes.loss + _sft_backward(run, scored, demo_batches)
            idle_passes(model, demo_idle, backward=True)
            if epoch == 0:
                mismatch = _check_sampler(run, scored, passes.mismatch, step)
            ctx.all_reduce_grads(run.params)
            clip_and_check(run.params, max_norm=config.grad_clip, step=step, lr=lr)
            run.optimizer.step()
            result = _Update(
                loss=ctx.all_reduce_sum([loss_sum])[0],
                clip_fraction=passes.clip / n_sequences,
                kl=passes.kl / n_sequences,
                trained=result.trained
                + sum(b.tokens for b in batches)
                + sum(b.tokens for b in demo_batches),
                mismatch=mismatch,
            )
    return result


def _check_sampler(
    run: _Run, scored: _Scored, trained: MismatchStats, step: int
) -> MismatchStats | None:
    """The step's mismatch over every sampled token of every rank (``trained``: of those
    the step trains on, from its backward; the filtered ones were scored before it), None
    when the trainer's own engine sampled; checked against the threshold. Every rank takes
    part, so every rank stops alike."""
    ctx = run.ctx
    if not ctx.any_rank(scored.sampler is not None):
        return None
    total = (trained + scored.filtered_mismatch).over_ranks(ctx)
    sampler = scored.sampler or SampledBy(url="(this rank sampled nothing)", served_name="")
    run.guard.check(total, where=f"step {step + 1}", sampler=sampler, truncated=True)
    return total


@dataclass(frozen=True)
class _Passes:
    """Sums over one epoch's policy micro-batches."""

    loss: float
    clip: float
    kl: float
    mismatch: MismatchStats


def _policy_backward(
    run: _Run,
    scored: _Scored,
    batches: Sequence[PackedBatch],
    adv_t: torch.Tensor,
    old: Sequence[torch.Tensor] | None,
    ref: Sequence[torch.Tensor] | None,
) -> _Passes:
    """Backward of the clipped surrogate over every micro-batch: loss, clip and KL sums, and
    the mismatch of the sampled tokens with the sampler where another engine sampled them."""
    loss_sum = clip_sum = kl_sum = 0.0
    mismatch = MismatchStats()
    begin = 0
    for i, batch in enumerate(batches):
        rows = batch.ids.shape[0]
        logp = run.model.logprobs(batch)  # (n, T-1)
        old_logp = old[i] if old is not None else logp.detach()  # (n, T-1)
        importance = (
            tis_weights(old_logp, batch.sampler_logp, run.correction.tis_cap)
            if batch.sampler_logp is not None
            else None
        )
        loss, info = policy_loss(
            logp,
            old_logp,
            adv_t[begin : begin + rows],
            batch.target,
            clip_eps=run.config.clip_eps,
            kl=KLPenalty(ref[i], run.config.kl_coef) if ref is not None else None,
            normalizer=scored.tokens,
            importance=importance,
        )
        loss.backward()
        if batch.sampler_logp is not None:
            mismatch = mismatch + token_mismatch(
                old_logp, batch.sampler_logp, batch.target, cap=run.correction.tis_cap
            )
        loss_sum += float(loss.detach())
        clip_sum += info["clip_fraction"] * rows
        kl_sum += info["kl"] * rows
        begin += rows
    return _Passes(loss_sum, clip_sum, kl_sum, mismatch)


def _sft_backward(run: _Run, scored: _Scored, demo_batches: Sequence[PackedBatch]) -> float:
    """Backward of the SFT term on the demonstrations; its loss."""
    loss_sum = 0.0
    for batch in demo_batches:
        logp = run.model.logprobs(batch)  # (n, T-1)
        sft = -(logp * batch.target).sum() / max(scored.demo_tokens, 1.0) * run.config.sft_coef
        sft.backward()
        loss_sum += float(sft.detach())
    return loss_sum
