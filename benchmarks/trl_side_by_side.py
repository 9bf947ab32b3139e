"""TRL's trainers next to Ratchet's, on the same model, tasks, steps and hyper-parameters.

    pip install trl datasets        # not Ratchet dependencies; only this benchmark needs them
    python benchmarks/trl_side_by_side.py --model-dir DIR     # ~35 min on 2 idle cores
    python benchmarks/trl_side_by_side.py --quick             # a smoke run of both phases

Issue 13 asks for TRL's ``SFTTrainer``/``GRPOTrainer`` with peft unless Ratchet's own loop is
faster at equal reward. This measures both on SmolLM2-135M-Instruct (LoRA r=16 on
q/k/v/o_proj, fp32 on CPU):

1. **SFT**: the same tokenized toolcalc v1 demonstrations (assistant turns as targets) for
   the same steps, batch, lr schedule (warmup + cosine to 10%), AdamW betas, clipping.
   Ratchet's ``train_sft`` against ``SFTTrainer`` on a pre-tokenized dataset whose
   ``assistant_masks`` are Ratchet's target masks. Then both adapters are evaluated greedily
   on the same held-out v1 tasks.
2. **GRPO** from Ratchet's SFT adapter on drifted tasks (toolcalc v3, as
   ``benchmarks/real_model.py``): ``train_grpo`` against
   ``GRPOTrainer`` (DAPO loss, beta 0, clip 0.2, group-scaled rewards, constant lr) whose
   ``rollout_func`` runs Ratchet's multi-turn rollout with the trainer's own model, tool
   results masked out by ``env_mask``. TRL's built-in tool loop cannot be the rollout here:
   SmolLM2's chat template ignores ``tools=``, so TRL would prompt the model without the tool
   list (Ratchet renders it into the system message, see docs/models.md). Both candidates
   are then evaluated greedily on the same held-out v3 tasks that call the price lookup.

Ends with one JSON line: per phase and trainer the wall time, train tokens/s, final loss or
mean reward, and the held-out pass rate; plus the load average (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.drift import drift_task_sets, shared_machine_figures, smollm2_arguments
from services.environments.base import TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.evaluator import EvaluationSettings, evaluate
from services.training.config import HFGRPOConfig, HFSFTConfig
from services.training.distributed import init_distributed
from services.training.family import pack_turns
from services.training.grpo import train_grpo
from services.training.hf.checkpoint import LoadedHF, load_hf_checkpoint, save_lora_adapter
from services.training.hf.family import HFFamilyModel, lora_config, prepare_trainable
from services.training.hf.model import HFModel
from services.training.hf.rollout import demonstration_sequences, run_chat_episodes
from services.training.hf.smollm2 import MODEL_NAME, smollm2_checkpoint
from services.training.rng import derive_seed
from services.training.sft import train_sft

logger = logging.getLogger("benchmarks.trl_side_by_side")

DRIFT = "v3"  # the drift of benchmarks/real_model.py: the price lookup gains ``cur``

FULL = {
    "sft_tasks": 48,
    "sft": {"steps": 20, "batch_size": 8, "micro_batch": 4, "lr": 1e-3, "warmup": 5},
    "grpo_tasks": 32,
    "grpo": {
        "steps": 4,
        "tasks_per_step": 4,
        "group_size": 4,
        "max_turns": 4,
        "max_new_tokens": 40,
        "lr": 2e-4,
    },
    "eval_tasks": 24,
    "eval": {"max_turns": 4, "max_new_tokens": 40, "batch_size": 32},
}
QUICK = {  # the same run with fewer of everything: a smoke run of both phases
    "sft_tasks": 8,
    "sft": {**FULL["sft"], "steps": 2, "batch_size": 2, "micro_batch": 2, "warmup": 1},
    "grpo_tasks": 4,
    "grpo": {**FULL["grpo"], "steps": 1, "tasks_per_step": 1, "max_turns": 2, "max_new_tokens": 24},
    "eval_tasks": 2,
    "eval": {**FULL["eval"], "max_turns": 2, "max_new_tokens": 24},
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    settings = QUICK if args.quick else FULL
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ratchet-trl-"))
    base_dir = args.model_dir or work / "smollm2"
    base_manifest = smollm2_checkpoint(base_dir)
    env = ToolcalcEnvironment()
    task_sets = drift_task_sets(
        env,
        DRIFT,
        sft=settings["sft_tasks"],
        grpo=settings["grpo_tasks"],
        evaluation=settings["eval_tasks"],
        seed=args.seed,
    )
    eval_v1, eval_drifted, grpo_tasks = task_sets.eval_v1, task_sets.eval_drifted, task_sets.grpo
    sft_cfg = HFSFTConfig(**settings["sft"], seed=args.seed, log_every=0)
    grpo_cfg = HFGRPOConfig(**settings["grpo"], seed=args.seed, log_every=0)
    ctx = init_distributed("cpu")

    def fresh(path: Path, *, adapter: bool = False) -> LoadedHF:
        return load_hf_checkpoint(
            path,
            device="cpu",
            dtype=torch.float32,
            trainable_adapter=adapter,
            base_dir=base_dir if adapter else None,
        )

    def held_out_pass(model: Any, tokenizer: Any, tasks: list[TaskSpec]) -> float:
        policy = HFModel(model.merge_and_unload().eval(), tokenizer, device=ctx.device)
        return evaluate(
            policy, env, tasks, EvaluationSettings(seed=args.seed, **settings["eval"])
        ).pass_rate

    # 1. SFT
    loaded = fresh(base_dir)
    sequences = demonstration_sequences(
        env, task_sets.sft, HFModel(loaded.model, loaded.tokenizer, device=ctx.device)
    )
    model = prepare_trainable(loaded, sft_cfg)
    trainee = HFFamilyModel(model, loaded.tokenizer, device=ctx.device, loaded=loaded, lora=True)
    began = time.monotonic()
    ours = train_sft(trainee, sequences, sft_cfg, ctx=ctx)
    ours_sft_s = time.monotonic() - began
    champion_manifest = save_lora_adapter(
        model, work / "sft-ratchet", base=base_manifest, parent=base_manifest.checkpoint_id
    )
    ours_sft_pass = held_out_pass(model, loaded.tokenizer, eval_v1)
    logger.info("ratchet sft %.0fs, loss %.4f, v1 %.3f", ours_sft_s, ours.final_loss, ours_sft_pass)

    loaded = fresh(base_dir)
    trl_sft = _trl_sft(loaded, sequences, sft_cfg, work / "trl-sft", args.seed)
    trl_sft_pass = held_out_pass(trl_sft["model"], loaded.tokenizer, eval_v1)
    logger.info(
        "trl sft %.0fs, loss %.4f, v1 %.3f", trl_sft["wall_s"], trl_sft["final_loss"], trl_sft_pass
    )

    # 2. GRPO from Ratchet's SFT adapter
    champion_dir = work / "sft-ratchet"
    loaded = fresh(champion_dir, adapter=True)
    model = prepare_trainable(loaded, grpo_cfg)
    began = time.monotonic()
    trainee = HFFamilyModel(model, loaded.tokenizer, device=ctx.device, loaded=loaded, lora=True)
    ours_grpo = train_grpo(trainee, env, grpo_tasks, grpo_cfg, ctx=ctx).counters
    ours_grpo_s = time.monotonic() - began
    ours_rewards = [h["reward_mean"] for h in ours_grpo.history]
    ours_grpo_pass = held_out_pass(model, loaded.tokenizer, eval_drifted)
    logger.info(
        "ratchet grpo %.0fs, rewards %s, drifted %.3f", ours_grpo_s, ours_rewards, ours_grpo_pass
    )

    loaded = fresh(champion_dir, adapter=True)
    model = prepare_trainable(loaded, grpo_cfg)
    trl_grpo = _trl_grpo(model, loaded.tokenizer, env, grpo_tasks, grpo_cfg, work / "trl-grpo")
    trl_grpo_pass = held_out_pass(model, loaded.tokenizer, eval_drifted)
    logger.info(
        "trl grpo %.0fs, rewards %s, drifted %.3f",
        trl_grpo["wall_s"],
        trl_grpo["rewards"],
        trl_grpo_pass,
    )

    return {
        "benchmark": "trl_side_by_side",
        "model": MODEL_NAME,
        "quick": bool(args.quick),
        "champion_id": champion_manifest.checkpoint_id,
        "sft_steps": sft_cfg.steps,
        "sft_batch_size": sft_cfg.batch_size,
        "sft_ratchet_wall_s": round(ours_sft_s, 1),
        "sft_trl_wall_s": round(trl_sft["wall_s"], 1),
        "sft_ratchet_train_tokens_per_s": ours.train_tokens_per_s,
        "sft_trl_train_tokens_per_s": round(trl_sft["train_tokens_per_s"], 1),
        "sft_ratchet_final_loss": round(float(ours.final_loss or 0.0), 4),
        "sft_trl_final_loss": round(trl_sft["final_loss"], 4),
        "sft_ratchet_v1_pass": ours_sft_pass,
        "sft_trl_v1_pass": trl_sft_pass,
        "grpo_steps": grpo_cfg.steps,
        "grpo_episodes_per_step": grpo_cfg.tasks_per_step * grpo_cfg.group_size,
        "grpo_ratchet_wall_s": round(ours_grpo_s, 1),
        "grpo_trl_wall_s": round(trl_grpo["wall_s"], 1),
        "grpo_ratchet_rollout_s": round(ours_grpo.rollout_s, 1),
        "grpo_trl_rollout_s": round(trl_grpo["rollout_s"], 1),
        "grpo_ratchet_update_s": round(ours_grpo.train_s, 1),
        "grpo_trl_update_s": round(trl_grpo["wall_s"] - trl_grpo["rollout_s"], 1),
        "grpo_ratchet_mean_reward": round(sum(ours_rewards) / len(ours_rewards), 4),
        "grpo_trl_mean_reward": round(sum(trl_grpo["rewards"]) / len(trl_grpo["rewards"]), 4),
        "grpo_ratchet_drifted_pass": ours_grpo_pass,
        "grpo_trl_drifted_pass": trl_grpo_pass,
        "grpo_trl_unpacked_episodes": trl_grpo["unpacked"],
        "eval_tasks_per_set": len(eval_v1),
        **shared_machine_figures(args.threads, load_start),
        "workdir": str(work),
    }


def _trainer_args(config: HFSFTConfig | HFGRPOConfig, out: Path, seed: int) -> dict[str, Any]:
    """The TRL (transformers ``TrainingArguments``) spelling of Ratchet's optimiser settings."""
    return {
        "output_dir": str(out),
        "max_steps": config.steps,
        "learning_rate": config.lr,
        "warmup_steps": config.warmup,
        "lr_scheduler_type": "constant_with_warmup"
        if config.min_lr_ratio == 1.0
        else "cosine_with_min_lr",
        "lr_scheduler_kwargs": {}
        if config.min_lr_ratio == 1.0
        else {"min_lr_rate": config.min_lr_ratio},
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_epsilon": 1e-8,
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.grad_clip,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        # TRL's defaults are bf16 autocast and activation checkpointing; Ratchet's CPU path
        # runs neither, and the comparison is of the loops, not of those two switches
        "bf16": False,
        "gradient_checkpointing": False,
    }


def _trl_sft(
    loaded: LoadedHF,
    sequences: list[tuple[list[int], list[bool]]],
    config: HFSFTConfig,
    out: Path,
    seed: int,
) -> dict[str, Any]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    dataset = Dataset.from_dict(
        {
            "input_ids": [ids for ids, _ in sequences],
            "assistant_masks": [[int(m) for m in mask] for _, mask in sequences],
        }
    )
    args = SFTConfig(
        **_trainer_args(config, out, seed),
        per_device_train_batch_size=config.micro_batch,
        gradient_accumulation_steps=config.batch_size // config.micro_batch,
        max_length=None,
        packing=False,
        include_num_input_tokens_seen=True,  # padding included (Ratchet counts non-pad)
    )
    trainer = SFTTrainer(
        model=loaded.model,
        args=args,
        train_dataset=dataset,
        processing_class=loaded.tokenizer,
        peft_config=lora_config(config),
    )
    began = time.monotonic()
    trainer.train()
    wall = time.monotonic() - began
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tokens = float(trainer.state.num_input_tokens_seen or 0)
    return {
        "model": trainer.model,
        "wall_s": wall,
        "final_loss": float(losses[-1]) if losses else float("nan"),
        "train_tokens_per_s": tokens / wall if tokens and wall else 0.0,
    }


def _trl_grpo(
    model: Any,
    tokenizer: Any,
    env: ToolcalcEnvironment,
    tasks: list[TaskSpec],
    config: HFGRPOConfig,
    out: Path,
) -> dict[str, Any]:
    """TRL's GRPO update over Ratchet's multi-turn rollouts (see the module docstring)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    by_id = {t.task_id: t for t in tasks}
    episodes = config.tasks_per_step * config.group_size
    state = {"rollout_s": 0.0, "unpacked": 0}

    def rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
        # one episode per prompt entry: the sampler has already repeated each task G times
        began = time.monotonic()
        policy = HFModel(trainer.model, tokenizer, device=torch.device("cpu"))
        rollouts, _ = run_chat_episodes(
            env,
            [by_id[p] for p in prompts],
            policy,
            seeds=[
                derive_seed(config.seed, trainer.state.global_step, i) for i in range(len(prompts))
            ],
            max_turns=config.max_turns,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
        )
        prompt_ids, completion_ids, env_mask, rewards = [], [], [], []
        for task_id, item in zip(prompts, rollouts, strict=True):
            packed = pack_turns(item.turns)
            state["unpacked"] += len(packed) > 1
            ids, mask = packed[0]
            start = len(item.turns[0][0])
            prompt_ids.append(ids[:start])
            completion_ids.append(ids[start:])
            env_mask.append([int(m) for m in mask[start:]])
            rewards.append(env.chat_verify(by_id[task_id], item.episode).total)
        state["rollout_s"] += time.monotonic() - began
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids],
            "env_mask": env_mask,
            "task_reward": rewards,
        }

    def reward(completions: list[Any], task_reward: list[float], **_: Any) -> list[float]:
        return list(task_reward)

    args = GRPOConfig(
        **_trainer_args(config, out, config.seed),
        per_device_train_batch_size=episodes,
        gradient_accumulation_steps=1,
        num_generations=config.group_size,
        max_completion_length=2048,  # the rollout bounds each turn; this bounds nothing
        temperature=config.temperature,
        beta=config.kl_coef,
        epsilon=config.clip_eps,
        loss_type="dapo",
        scale_rewards="group",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [t.task_id for t in tasks]}),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    began = time.monotonic()
    trainer.train()
    wall = time.monotonic() - began
    rewards = [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
    return {
        "wall_s": wall,
        "rollout_s": state["rollout_s"],
        "rewards": rewards,
        "unpacked": state["unpacked"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    smollm2_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    result = run(args)
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
