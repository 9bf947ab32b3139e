"""Payloads of EvaluateWorkflow and the activity that records an evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.loop.policies import (
    TrainingProfile,
)
from workflows.payload import policy_payload


@dataclass
class EvalTarget:
    """One checkpoint under evaluation and the role it plays (champion, candidate)."""

    role: str
    checkpoint_id: str
    checkpoint_uri: str


@policy_payload()
@dataclass
class EvaluateInput:
    loop: str
    cycle: int
    dataset_id: int
    environment: str
    task_sets: dict[str, str]  # task set name ("eval", "regression") -> task file URI
    targets: list[EvalTarget]
    samples: int = 1
    profile: TrainingProfile = field(default_factory=TrainingProfile)
    # Sampling temperature of the eval rollouts (0: greedy, and then one sample says it all).
    temperature: float = 0.0


@dataclass
class EvaluationSummary:
    evaluation_id: int
    role: str
    checkpoint_id: str
    task_set: str
    n: int
    passed: int
    pass_rate: float
    ci_low: float
    ci_high: float


@dataclass
class EvaluateResult:
    summaries: list[EvaluationSummary]
    compute_seconds: float = 0.0
    cost_usd: float = 0.0
    errors: list[str] = field(default_factory=list)


@dataclass
class RecordEvaluationInput:
    loop: str
    cycle: int
    dataset_id: int
    role: str
    checkpoint_id: str
    task_set: str
    run_id: str
    output_uri: str
