"""SFT and GRPO for hf models, LoRA by default (full fine-tuning as an option).

Ratchet's own loops, not TRL's trainers; why (and the measurements behind it) is in
docs/models.md. In short: the episodes are multi-turn tool conversations stepped by an
environment between generations, and the loss must touch exactly the tokens the model
sampled (per turn, with the prompt it saw), which is the rollout record of
:mod:`services.training.hf.rollout`. The update math is the tiny family's, shared from
:mod:`services.training.grpo` (``group_advantages``, ``policy_loss``) so both families
optimise the same objective:

- **SFT**: token-level cross-entropy on the assistant turns of the environment's solved
  conversations (never on system, user or tool tokens), summed over the global batch and
  divided by its target-token count; batches drawn with replacement, seeded per step.
- **GRPO** (DeepSeekMath's, as TRL's ``GRPOTrainer`` with ``num_iterations=1``): per task a
  group of ``group_size`` sampled episodes, group-normalised rubric rewards as advantages,
  zero-variance groups filtered and counted, DAPO token-level normalisation, optional k3 KL
  to the starting model (``kl_coef``; the starting adapter's weights are swapped in to
  compute it, so LoRA needs no second model in memory).

LoRA: a full champion gets a fresh adapter (``lora_r``, ``lora_alpha``,
``lora_target_modules``); an adapter champion is trained further (its own rank and
targets), so the result is again an adapter on the same full base. ``lora: false`` trains
every weight (an adapter champion is merged into its base first).

Data parallel under ``torchrun``: each rank takes its share of the global batch (tasks for
GRPO, sequences for SFT), losses are divided by the global token count and gradients are
summed with ``all_reduce`` (see :mod:`services.training.distributed`). CUDA runs under bf16
autocast with fp32 trainable weights; CPU runs fp32.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from services.environments.base import TaskSpec
from services.environments.chat import ChatEnvironment
from services.training.config import HFGRPOConfig, HFSFTConfig, LoRAOptions
from services.training.counters import RunCounters
from services.training.device import autocast
from services.training.distributed import DistContext
from services.training.grpo import (
    group_advantages,
    grpo_step_stats,
    log_grpo_step,
    policy_loss,
    task_order,
)
from services.training.hf.checkpoint import LoadedHF
from services.training.hf.model import HFModel
from services.training.hf.rollout import pack_turns, run_chat_episodes
from services.training.optim import clip_and_check, schedule_lr
from services.training.rng import derive_seed
from services.training.sft import sft_steps

logger = logging.getLogger(__name__)

Sequences = list[tuple[list[int], list[bool]]]


def run_metrics(result: RunCounters) -> dict[str, Any]:
    """An hf run's metrics.json figures: the shared totals and how the last step ended."""
    last = result.history[-1] if result.history else {}
    return {
        **result.metrics(),
        "final_loss": result.final_loss,
        "final_reward": last.get("reward_mean"),
        "final_pass_rate": last.get("pass_rate"),
    }


def prepare_trainable(loaded: LoadedHF, options: LoRAOptions) -> Any:
    """The model to optimise: a (new or continued) LoRA adapter, or every weight."""
    from peft import PeftModel, get_peft_model

    model = loaded.model
    if isinstance(model, PeftModel):
        if options.lora:
            for name, param in model.named_parameters():
                param.requires_grad = "lora_" in name
            return model
        model = model.merge_and_unload()
    if not options.lora:
        model.requires_grad_(True)
        return model
    try:
        return get_peft_model(model, lora_config(options))
    except ValueError as exc:  # e.g. target modules the architecture does not have
        raise ValueError(f"cannot attach LoRA: {exc}") from None


def lora_config(options: LoRAOptions) -> Any:
    """A new adapter's peft config (also what benchmarks hand TRL, so both train the same)."""
    from peft import LoraConfig

    return LoraConfig(
        r=options.lora_r,
        lora_alpha=options.lora_alpha,
        lora_dropout=options.lora_dropout,
        target_modules=list(options.lora_target_modules),
        task_type="CAUSAL_LM",
        bias="none",
    )


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _collate(
    sequences: Sequence[tuple[list[int], list[bool]]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (N, T), attention mask (N, T) and target mask (N, T-1)."""
    width = max(len(ids) for ids, _ in sequences)
    ids_t = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # (N, T)
    attn = torch.zeros((len(sequences), width), dtype=torch.long)  # (N, T)
    target = torch.zeros((len(sequences), width), dtype=torch.bool)  # (N, T)
    for row, (ids, mask) in enumerate(sequences):
        ids_t[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attn[row, : len(ids)] = 1
        target[row, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    return ids_t.to(device), attn.to(device), target[:, 1:].to(device)


def sequence_logprobs(
    model: Any, ids: torch.Tensor, attention: torch.Tensor, target: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probability of each next token: (N, T-1) for ids (N, T).

    With ``target`` (N, T-1), only the positions some row trains on are projected through
    the output head (``logits_to_keep``): chat prompts are mostly system text and tools, so
    this skips most of the (positions x vocabulary) logits; other positions come back 0.
    """
    n, width = ids.shape
    if target is None or not bool(target.any()):
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # (N, T-1, V)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (N, T-1, V)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (N, T-1)
    keep = target.any(dim=0).nonzero().squeeze(-1)  # (K,) positions p predicting token p+1
    logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=keep).logits  # (N, K, V)
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, K, V)
    picked = logp.gather(-1, ids[:, keep + 1, None]).squeeze(-1)  # (N, K)
    out = torch.zeros((n, width - 1), dtype=picked.dtype, device=ids.device)  # (N, T-1)
    out[:, keep] = picked
    return out


def _trainable_and_optimizer(
    model: Any, config: HFSFTConfig | HFGRPOConfig, ctx: DistContext
) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """What both hf trainers start from: the trainable weights, the same on every rank (rank
    0's), and their AdamW (the tiny family's betas and eps)."""
    params = trainable_parameters(model)
    _broadcast(ctx, params)
    optimizer = torch.optim.AdamW(
        params, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=config.weight_decay
    )
    return params, optimizer


def demonstration_sequences(
    env: ChatEnvironment,
    tasks: Sequence[TaskSpec],
    policy: HFModel,
    *,
    recovery_fraction: float = 0.0,
    seed: int = 0,
) -> Sequences:
    """Token sequences of the solved conversations, assistant turns (and end-of-turn) targets.

    A seeded share ``recovery_fraction`` of them recover from a slip first (a call missing
    an argument, answered by the tool's usage error): under an API change, a champion that
    has seen errors followed varies its calls, where one that never saw an error repeats
    its call (measured in docs/models.md, run 4).
    """
    if not 0.0 <= recovery_fraction <= 1.0:
        raise ValueError("recovery_fraction must be in [0, 1]")
    end_of_turn = policy.end_of_turn_id
    sequences: Sequences = []
    rng = random.Random(f"hf/demonstrations/{seed}")
    for task in tasks:
        slip = rng.random() < recovery_fraction
        pairs = env.chat_demonstration(task, recover_from_slip=slip)
        tools = env.chat_start(task, max_turns=1).tools
        turns = []
        for messages, text in pairs:
            prompt = policy.encode(policy.render([m.to_openai() for m in messages], tools))
            turns.append((prompt, [*policy.encode(text), end_of_turn]))
        sequences.extend(pack_turns(turns))
    return sequences


def train_sft_hf(
    model: Any,
    sequences: Sequences,
    config: HFSFTConfig,
    *,
    pad_id: int,
    ctx: DistContext,
) -> RunCounters:
    """Train ``model``'s trainable weights on ``sequences`` for ``config.steps`` steps."""
    device = ctx.device
    model.train()
    params, optimizer = _trainable_and_optimizer(model, config, ctx)

    def chunk_loss(chunk: Sequences, normalizer: float) -> tuple[torch.Tensor, int]:
        ids, attention, target = _collate(chunk, pad_id, device)
        with autocast(device):
            logp = sequence_logprobs(model, ids, attention, target)  # (n, T-1)
        return -(logp * target).sum() / normalizer, int(attention.sum())

    result = sft_steps(
        sequences,
        config,
        ctx=ctx,
        optimizer=optimizer,
        trainable=_ParamView(params),
        chunk_loss=chunk_loss,
        micro_batch=config.micro_batch,
        log=logger,
    )
    model.eval()
    return result


def train_grpo_hf(
    model: Any,
    tokenizer: Any,
    env: ChatEnvironment,
    tasks: Sequence[TaskSpec],
    config: HFGRPOConfig,
    *,
    ctx: DistContext,
) -> RunCounters:
    """GRPO on ``tasks``, in place (see the module docstring for the variant)."""
    if not tasks:
        raise ValueError("GRPO needs at least one task")
    device = ctx.device
    params, optimizer = _trainable_and_optimizer(model, config, ctx)
    reference = [p.detach().clone() for p in params] if config.kl_coef > 0 else None
    policy = HFModel(model, tokenizer, device=device)
    pad_id = int(tokenizer.pad_token_id)
    result = RunCounters()
    for step in range(config.steps):
        stats = _grpo_step(
            step,
            model,
            policy,
            env,
            tasks,
            config,
            optimizer,
            params,
            reference,
            pad_id,
            ctx,
            result,
        )
        result.history.append(stats)
        result.steps_done = step + 1
        if ctx.is_main and config.log_every and (step + 1) % config.log_every == 0:
            log_grpo_step(logger, step, config.steps, stats)
    totals = ctx.all_reduce_sum(
        [float(result.train_tokens), float(result.rollout_tokens), float(result.episodes)]
    )
    result.train_tokens, result.rollout_tokens, result.episodes = (int(v) for v in totals)
    model.eval()
    return result


def _grpo_step(
    step: int,
    model: Any,
    policy: HFModel,
    env: ChatEnvironment,
    tasks: Sequence[TaskSpec],
    config: HFGRPOConfig,
    optimizer: Any,
    params: list[torch.nn.Parameter],
    reference: list[torch.Tensor] | None,
    pad_id: int,
    ctx: DistContext,
    result: RunCounters,
) -> dict[str, float]:
    device = ctx.device
    order = task_order(step, config.tasks_per_step, len(tasks), config.seed)
    mine = ctx.shard(len(order))
    group_tasks = [tasks[order[j]] for j in mine for _ in range(config.group_size)]
    model.eval()
    began = time.monotonic()
    rollouts, stats = run_chat_episodes(
        env,
        group_tasks,
        policy,
        seed=derive_seed(config.seed, step, ctx.rank),
        max_turns=config.max_turns,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
    )
    result.rollout_s += time.monotonic() - began
    result.rollout_tokens += stats.generated_tokens
    result.episodes += len(rollouts)
    rewards_list = [
        env.chat_verify(t, r.episode) for t, r in zip(group_tasks, rollouts, strict=True)
    ]
    n_groups = len(mine)
    totals = torch.tensor([r.total for r in rewards_list], dtype=torch.float32)
    passes = [r.passed for r in rewards_list]
    sequences: Sequences = []
    advantages: list[float] = []
    kept_groups = 0
    if n_groups:
        adv, keep = group_advantages(totals.view(n_groups, config.group_size), eps=config.adv_eps)
        kept_groups = int(keep.sum())
        for index, rollout in enumerate(rollouts):
            g = index // config.group_size
            if not bool(keep[g]) or not rollout.turns:
                continue
            for sequence in pack_turns(rollout.turns):
                sequences.append(sequence)
                advantages.append(float(adv.view(-1)[index]))
    local_tokens = float(sum(sum(mask[1:]) for _, mask in sequences))
    reward_sum, pass_sum, count, global_tokens, kept_total, groups_total = ctx.all_reduce_sum(
        [
            float(totals.sum()),
            float(sum(passes)),
            float(len(passes)),
            local_tokens,
            float(kept_groups),
            float(n_groups),
        ]
    )
    result.groups += int(groups_total)
    result.filtered_zero_variance_groups += int(groups_total - kept_total)
    model.train()
    began = time.monotonic()
    optimizer.zero_grad(set_to_none=True)
    loss_value = kl_value = 0.0
    normalizer = max(global_tokens, 1.0)
    for begin in range(0, len(sequences), config.micro_batch):
        chunk = sequences[begin : begin + config.micro_batch]
        chunk_adv = torch.tensor(advantages[begin : begin + config.micro_batch], device=device)
        ids, attention, target = _collate(chunk, pad_id, device)
        ref_logp = None
        if reference is not None:
            ref_logp = _reference_logprobs(model, params, reference, ids, attention, target, device)
        with autocast(device):
            logp = sequence_logprobs(model, ids, attention, target)  # (n, T-1)
        loss, info = policy_loss(
            logp,
            logp.detach(),
            chunk_adv,
            target,
            clip_eps=config.clip_eps,
            ref_logp=ref_logp,
            kl_coef=config.kl_coef,
            normalizer=normalizer,
        )
        loss.backward()
        loss_value += float(loss.detach())
        kl_value += info["kl"] * len(chunk)
        result.train_tokens += int(attention.sum())
    _all_reduce_grads(ctx, params)
    lr = schedule_lr(optimizer, step, config)
    if global_tokens > 0:
        clip_and_check(_ParamView(params), max_norm=config.grad_clip, step=step, lr=lr)
        optimizer.step()
    result.train_s += time.monotonic() - began
    loss_total = ctx.all_reduce_sum([loss_value])[0]
    return grpo_step_stats(
        step,
        reward_sum=reward_sum,
        passes=pass_sum,
        episodes=count,
        groups=groups_total,
        groups_kept=kept_total,
        loss=loss_total,
        kl=kl_value / max(len(sequences), 1),
        target_tokens=global_tokens,
    )


@torch.no_grad()
def _reference_logprobs(
    model: Any,
    params: list[torch.nn.Parameter],
    reference: list[torch.Tensor],
    ids: torch.Tensor,
    attention: torch.Tensor,
    target: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """Log-probs under the starting weights, swapped in and out (no second model)."""
    current = [p.detach().clone() for p in params]
    for param, ref in zip(params, reference, strict=True):
        param.copy_(ref)
    try:
        with autocast(device):
            return sequence_logprobs(model, ids, attention, target)
    finally:
        for param, value in zip(params, current, strict=True):
            param.copy_(value)


class _ParamView(torch.nn.Module):
    """The trainable parameters as a module, for :func:`clip_and_check`."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self._params = params

    def parameters(self, recurse: bool = True) -> Any:
        return iter(self._params)


def _all_reduce_grads(ctx: DistContext, params: list[torch.nn.Parameter]) -> None:
    if ctx.distributed:
        ctx.all_reduce_grads(_ParamView(params))


def _broadcast(ctx: DistContext, params: list[torch.nn.Parameter]) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        for param in params:
            dist.broadcast(param.data, src=0)
