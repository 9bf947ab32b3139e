"""The foreign-agent benchmark's loop, sized: the policies it creates the loop with.

Two sizes. :data:`BAR` is for issue 41's bar (SmolLM2-135M-Instruct, the whole loop with its
bootstrap in at most 60 minutes on 2 CPU cores); :data:`QUICK` is the smoke (a tiny model
from ``--model-dir``, every job a few seconds) that runs the same path in minutes. Each value
of :data:`BAR` is chosen for the bookshop's episodes and the 2-core budget, from figures
docs/models.md measured on a quiet machine; the arithmetic is in
``benchmarks/foreign_agent.py``'s docstring and docs/models.md ("A domain Ratchet did not
write"). What the figures say about the bookshop, measured with SmolLM2's tokenizer on the
default month's successes (the tokenizer only, no model run):

- a demonstration packs into one sequence of ~725 tokens (575-984): ~530 of prompt (the
  system text and the four tools' schemas are ~460 of them), ~90 of targets over 2-5 turns;
- an agent turn is at most 48 tokens (a three-argument call, or an answer naming an order,
  a refund id and an amount); a ticket needs 1-3 calls, so 4 turns hold every needed call
  and the answer (only a slip-then-recover success takes a 5th).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

TOOL_ENDPOINT = "domain-tools"  # the name the benchmark's stack lists the domain's server by


@dataclass(frozen=True)
class LoopPlan:
    """What the benchmark's loop is created with, apart from its base model and endpoint."""

    # curation_policy: the loop's own splits of the posted traffic, and the caps that bound
    # what each gate evaluation and the rft job costs.
    curation: dict[str, Any]
    # training_profile.bootstrap.hyperparameters (the hf SFT-LoRA job) and its cap on the
    # newest train-split successes it reads.
    bootstrap: dict[str, Any]
    max_demonstrations: int
    # training_profile.hyperparameters: rft with replay from the champion.
    rft: dict[str, Any]
    gate: dict[str, Any]
    trigger: dict[str, Any]
    # The benchmark's own evaluations: as the gate's (greedy, the evaluator's hf turn and
    # token budgets), so both measure the same episodes.
    eval_settings: dict[str, Any] = field(
        default_factory=lambda: {"max_turns": 5, "max_new_tokens": 48, "batch_size": 32}
    )

    def policies(self, base_checkpoint: str, *, device: str) -> dict[str, dict[str, Any]]:
        """The loop's five policies (``LoopPolicies``' fields) over ``base_checkpoint``."""
        return {
            "serving_target": {"kind": "none"},
            "training_profile": {
                "family": "hf",
                "algorithm": "rft",
                "device": device,
                "hyperparameters": dict(self.rft),
                "base_checkpoint": base_checkpoint,
                "bootstrap": {
                    "max_demonstrations": self.max_demonstrations,
                    "hyperparameters": dict(self.bootstrap),
                },
            },
            "gate_policy": dict(self.gate),
            "trigger_policy": dict(self.trigger),
            "curation_policy": {**self.curation, "tool_endpoint": TOOL_ENDPOINT},
        }

    def with_overrides(self, rft: dict[str, Any], bootstrap: dict[str, Any]) -> LoopPlan:
        """This plan with ``--hyper`` and ``--bootstrap-hyper`` applied."""
        return replace(self, rft={**self.rft, **rft}, bootstrap={**self.bootstrap, **bootstrap})


# The benchmark starts each cycle itself (``ratchet loop bootstrap``, then ``run-now``) and
# evaluates the champion between the two, so nothing else may start one: ``min_new_tasks``
# above any month's train tasks, no interval, no drift check.
BENCHMARK_TRIGGERS: dict[str, Any] = {
    "min_new_tasks": 1_000_000,
    "max_interval_s": 30 * 86_400,
    "check_interval_s": 2,
    "drift_enabled": False,
}

BAR = LoopPlan(
    curation={
        # Failures split by cluster: 10% held out (the bootstrap's and the gate's frozen
        # set, capped at 40 tasks, ~1 min an evaluation), 15% eval (the cycle's gate, capped
        # at 40), the rest train (~200 of a posted month's ~280 failures).
        "heldout_fraction": 0.10,
        "eval_fraction": 0.15,
        "heldout_max_tasks": 40,
        "max_eval_tasks": 40,
        # The successes curation samples (5%, the default) are the regression set the gate
        # checks and rft replays; 16 of them are enough for both.
        "max_regression_tasks": 16,
        # The rft job samples every train task: 48 of them (a weighted draw, production's
        # frequent failures likelier) x 8 samples is the round a 2-core budget affords.
        "max_train_tasks": 48,
    },
    # ~320 of the posted month's ~340 train-split successes, each seen about once: 40 steps
    # x 8 conversations of ~725 tokens, ~232k tokens, ~7.5 min at the ~500 train tokens/s
    # SFT-LoRA measured with 2 threads (60 x 8 toolcalc conversations of ~385 in 369 s).
    bootstrap={
        "steps": 40,
        "batch_size": 8,
        "micro_batch": 4,
        "lr": 1e-3,
        "warmup": 4,
        "lora_r": 16,
        "log_every": 10,
    },
    max_demonstrations=320,
    rft={
        # Round 1: 48 tasks x 8 samples = 384 episodes at T=1, 48 decoding at once, each row
        # taking the next episode as it frees (in waves: a sample of every task before any
        # task's next), so `enough_successes` stops a task at its 2nd success.
        # Round 2 samples from the improved weights and stops each task at 2 successes: far
        # fewer episodes. ~100 generated tokens an episode at ~80 tokens/s: ~8 min a full
        # round. 16 SFT steps of 8 a round (~3 min each).
        "samples_per_task": 8,
        "iterations": 2,
        "enough_successes": 2,
        "rollout_batch": 48,
        "max_turns": 4,
        "max_new_tokens": 48,
        "temperature": 1.0,
        "steps": 16,
        "batch_size": 8,
        "micro_batch": 4,
        "lr": 1e-3,
        # Replay: half of each SFT draw is the champion's own verified episodes of 16
        # regression tasks (one greedy episode each, ~20 s), so the traffic it already
        # served is kept.
        "replay_fraction": 0.5,
        "replay_tasks": 16,
        "replay_temperature": 0.0,
        "log_every": 4,
    },
    gate={
        "mode": "auto",
        "confidence": 0.95,
        "min_discordant_pairs": 5,
        # One greedy episode a task: the benchmark's own evaluations are greedy too, and a
        # sampled gate would cost 4 episodes a task (the default).
        "eval_samples": 1,
        "eval_temperature": 0.0,
        "canary_seconds": 0,
    },
    trigger=BENCHMARK_TRIGGERS,
)

# The smoke: the same path in minutes with a tiny model. A tiny random model never beats its
# base, so the gate is manual and the benchmark approves (it says so in its output): the
# cycle path runs whatever the gate would have said.
QUICK = LoopPlan(
    curation={
        "heldout_fraction": 0.2,
        "eval_fraction": 0.2,
        "heldout_max_tasks": 8,
        "max_eval_tasks": 8,
        "max_regression_tasks": 4,
        "max_train_tasks": 4,
    },
    bootstrap={"steps": 2, "batch_size": 2, "micro_batch": 2, "lora_r": 4, "log_every": 0},
    max_demonstrations=8,
    rft={
        "samples_per_task": 2,
        "iterations": 1,
        "rollout_batch": 8,
        "max_turns": 2,
        "max_new_tokens": 8,
        "steps": 1,
        "batch_size": 2,
        "micro_batch": 2,
        "replay_tasks": 2,
        "log_every": 0,
    },
    gate={**BAR.gate, "mode": "manual"},
    trigger=BENCHMARK_TRIGGERS,
    eval_settings={"max_turns": 2, "max_new_tokens": 8, "batch_size": 32},
)
