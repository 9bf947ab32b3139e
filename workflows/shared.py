"""Task-queue names and every workflow/activity Input/Result dataclass.

One dataclass in, one dataclass out (STYLE habit 1), so fields can be added with defaults
without breaking running histories. Payloads are ids and URIs, never rows or files.
This module imports only the standard library: workflows import it inside
``imports_passed_through`` and the api imports it to start and signal workflows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The job contract's spec builders (re-exported for the workflows): standard library only.
from services.training.jobspec import eval_job_document as eval_job_document
from services.training.jobspec import train_job_document as train_job_document

DEFAULT_TASK_QUEUE = "ratchet"


def loop_workflow_id(loop: str) -> str:
    return f"loop/{loop}"


def cycle_workflow_id(loop: str, cycle: int, stage: str) -> str:
    """Child workflow ids derive from the cycle, so a retried parent never duplicates work."""
    return f"loop/{loop}/cycle/{cycle}/{stage}"


def run_id_for(loop: str, cycle: int, kind: str, suffix: str = "") -> str:
    """Deterministic run ids: the same cycle stage always names the same job."""
    base = f"{loop}-c{cycle}-{kind}"
    return f"{base}-{suffix}" if suffix else base


# Curation -----------------------------------------------------------------------------------

# Traces per curate_batch. A batch's Postgres round trips (lock, lookups, COPYs) cost about
# the same for 500 traces as for 2,000, so bigger batches amortise them: on 2 idle cores
# 2,000 curates 100k traces at 2,878/s against 2,229/s for 500 (docs/curation.md).
CURATION_BATCH_SIZE = 2000


@dataclass
class CurateInput:
    loop: str
    batch_size: int = CURATION_BATCH_SIZE
    max_batches: int = 1000


@dataclass
class CurateResult:
    traces_seen: int = 0
    tasks_created: int = 0
    duplicates: int = 0
    rejected: int = 0
    skipped: int = 0
    new_train_tasks: int = 0


@dataclass
class CurateBatchInput:
    loop: str
    batch_size: int = CURATION_BATCH_SIZE


@dataclass
class CurateBatchResult:
    traces_seen: int = 0
    tasks_created: int = 0
    duplicates: int = 0
    rejected: int = 0
    skipped: int = 0
    new_train_tasks: int = 0
    more: bool = False


@dataclass
class SnapshotInput:
    loop: str
    cycle: int


@dataclass
class SnapshotResult:
    dataset_id: int
    content_hash: str
    train_count: int
    eval_count: int
    regression_count: int
    train_uri: str
    eval_uri: str
    regression_uri: str | None = None
    # The difficulty filter's counts over train candidates (``datasets.stats.difficulty``).
    difficulty: dict[str, int] = field(default_factory=dict)
    # The frozen held-out set (all curated traffic, never trained on): points gained.
    heldout_count: int = 0
    heldout_uri: str | None = None


@dataclass
class DriftInput:
    loop: str


@dataclass
class DriftResult:
    failure_rate: float
    window: int
    threshold: float
    drifted: bool
    model_version: str | None = None


@dataclass
class PendingWorkInput:
    loop: str


@dataclass
class PendingWorkResult:
    """What a trigger decision needs: curated-but-untrained tasks and uncurated traces."""

    new_train_tasks: int
    uncurated_traces: int


# Difficulty probe ---------------------------------------------------------------------------


@dataclass
class ProbeInput:
    """Probe the champion on the loop's unprobed train tasks (``ProbeWorkflow``)."""

    loop: str
    cycle: int
    environment: str
    champion_checkpoint_id: str
    champion_uri: str
    attempts: int = 8
    profile: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProbeResult:
    """What the probe did: ``skipped`` (nothing to probe), ``succeeded``, or the job's end."""

    status: str  # "skipped" | "succeeded" | "failed" | "cancelled" | "lost"
    run_id: str | None = None
    probed: int = 0
    recorded: int = 0
    too_easy: int = 0
    too_hard: int = 0
    kept: int = 0
    compute_seconds: float = 0.0
    cost_usd: float = 0.0
    error: str | None = None


@dataclass
class ExportProbeTasksInput:
    """Write the loop's unprobed train tasks to the probe run's task file."""

    loop: str
    run_id: str
    # Each probed task's pass rate travels through the workflow's history, so one probe
    # takes at most this many tasks (and never more than ``max_train_tasks``).
    max_tasks: int = 5_000


@dataclass
class ExportProbeTasksResult:
    task_uri: str | None  # None when no train task is unprobed
    count: int
    task_ids: list[int] = field(default_factory=list)


@dataclass
class ProbePassRatesInput:
    """Read a finished probe job's per-task results as pass rates of the exported tasks."""

    loop: str
    output_uri: str
    task_ids: list[int]


@dataclass
class ProbePassRatesResult:
    pass_rates: dict[int, float]
    too_easy: int = 0
    too_hard: int = 0
    kept: int = 0


@dataclass
class RecordProbesInput:
    loop: str
    pass_rates: dict[int, float]


@dataclass
class RecordProbesResult:
    updated: int


# Jobs ---------------------------------------------------------------------------------------


@dataclass
class RunJobInput:
    """Run one job to completion on the loop's executor (submit, or adopt if it exists)."""

    run_id: str
    loop: str
    kind: str  # "train" | "eval" | "probe"
    job_spec: dict[str, Any]
    cycle: int | None = None
    dataset_id: int | None = None
    base_checkpoint_id: str | None = None
    accelerators: int = 0
    poll_interval_s: float = 1.0
    # The loop's own job image and command (training_profile.train_job / eval_job), if any.
    job_image: str | None = None
    job_command: list[str] | None = None


def job_override(profile: dict[str, Any], key: str) -> tuple[str | None, list[str] | None]:
    """The image and command of ``profile[key]`` (``train_job`` or ``eval_job``), if set."""
    override = profile.get(key) or {}
    command = override.get("command")
    return override.get("image"), list(command) if command else None


@dataclass
class RunJobResult:
    run_id: str
    status: str  # "succeeded" | "failed" | "cancelled" | "lost"
    output_uri: str
    metrics: dict[str, Any] = field(default_factory=dict)
    compute_seconds: float = 0.0
    cost_usd: float = 0.0
    error: str | None = None


@dataclass
class CancelJobInput:
    run_id: str
    loop: str


@dataclass
class RegisterCheckpointInput:
    """Verify a job's checkpoint dir and copy it into the content-addressed store."""

    loop: str
    run_id: str
    checkpoint_dir_uri: str
    parent_checkpoint_id: str | None = None


@dataclass
class RegisterCheckpointResult:
    checkpoint_id: str
    uri: str
    size_bytes: int


# The loop -----------------------------------------------------------------------------------


@dataclass
class LoopState:
    """The small state carried through continue-as-new; everything else lives in Postgres."""

    cycle_number: int = 0
    paused: bool = False
    pause_reason: str | None = None
    run_now: bool = False
    rollback_reason: str | None = None
    last_cycle_ended_at: str | None = None
    last_outcome: str | None = None
    cycles_done: int = 0


@dataclass
class LoopInput:
    loop: str
    state: LoopState | None = None
    # Stop (complete) after this many cycles in total; None runs forever. For demos and tests.
    max_cycles: int | None = None
    # Continue-as-new after this many trigger checks in one run (history stays small).
    checks_per_run: int = 200


@dataclass
class LoopResult:
    loop: str
    cycles_done: int
    last_outcome: str | None


@dataclass
class PauseSignal:
    reason: str = "paused by operator"


@dataclass
class ResumeSignal:
    reason: str = "resumed by operator"


@dataclass
class RunNowSignal:
    reason: str = "run now requested by operator"


@dataclass
class ApprovalSignal:
    """approve / reject for a cycle waiting at a manual gate (cycle 0 means the current one)."""

    cycle: int = 0
    by: str = "operator"
    reason: str = ""


@dataclass
class RollbackSignal:
    reason: str = "rollback requested by operator"


@dataclass
class LoopStatus:
    loop: str
    stage: str
    cycle: int
    paused: bool
    pause_reason: str | None
    waiting_for: str | None
    last_outcome: str | None
    cycles_done: int


@dataclass
class LoopConfigInput:
    loop: str


@dataclass
class LoopConfig:
    """A loop's row as workflow code needs it, with every policy parsed and defaulted."""

    loop: str
    loop_id: int
    status: str
    environment: str
    executor: str
    champion_checkpoint_id: str | None
    champion_uri: str | None
    training_profile: dict[str, Any]
    serving_target: dict[str, Any]
    # trigger policy
    min_new_tasks: int
    max_interval_s: float
    check_interval_s: float
    drift_enabled: bool
    # gate policy
    gate_mode: str  # "auto" | "manual"
    confidence: float
    min_improvement_points: float
    regression_tolerance_points: float
    canary_seconds: float
    canary_check_interval_s: float
    canary_min_traces: int
    canary_max_drop_points: float
    eval_samples: int
    # budget
    budget_usd: float | None
    spent_usd: float
    # curation policy: the difficulty probe (opt-in; a probe job per cycle when on)
    difficulty_filter: bool = False
    probe_attempts: int = 8
    # gate policy: how eval samples are drawn, and how many tasks must tell models apart
    eval_temperature: float = 0.0
    min_discordant_pairs: int = 0
    # The loop's highest cycle number in Postgres: a restarted workflow continues after it.
    last_cycle_number: int = 0


@dataclass
class TriggerCheckInput:
    loop: str
    last_cycle_ended_at: str | None


@dataclass
class TriggerCheckResult:
    """Whether a cycle should start now, and why (min_new_tasks, max_interval, drift)."""

    trigger: str | None
    detail: dict[str, Any] = field(default_factory=dict)
    new_train_tasks: int = 0
    uncurated_traces: int = 0


@dataclass
class StartCycleInput:
    loop: str
    number: int
    trigger: str
    trigger_detail: dict[str, Any]
    workflow_id: str


@dataclass
class StartCycleResult:
    cycle_id: int
    champion_checkpoint_id: str | None
    champion_uri: str | None


@dataclass
class StageInput:
    loop: str
    cycle: int
    stage: str
    dataset_id: int | None = None
    candidate_checkpoint_id: str | None = None


@dataclass
class TrainInput:
    loop: str
    cycle: int
    dataset_id: int
    train_uri: str
    base_checkpoint_id: str | None
    base_checkpoint_uri: str | None
    environment: str
    profile: dict[str, Any]


@dataclass
class TrainResult:
    run_id: str
    status: str
    checkpoint_id: str | None = None
    checkpoint_uri: str | None = None
    compute_seconds: float = 0.0
    cost_usd: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class EvalTarget:
    """One checkpoint under evaluation and the role it plays (champion, candidate)."""

    role: str
    checkpoint_id: str
    checkpoint_uri: str


@dataclass
class EvaluateInput:
    loop: str
    cycle: int
    dataset_id: int
    environment: str
    task_sets: dict[str, str]  # task set name ("eval", "regression") -> task file URI
    targets: list[EvalTarget]
    samples: int = 1
    profile: dict[str, Any] = field(default_factory=dict)
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


@dataclass
class GateInput:
    loop: str
    cycle: int
    champion_checkpoint_id: str
    candidate_checkpoint_id: str
    confidence: float
    min_improvement_points: float
    regression_tolerance_points: float
    min_discordant_pairs: int = 0


@dataclass
class GateResult:
    decision: str  # "promote" | "reject"
    reason: str
    statistics: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecordDecisionInput:
    loop: str
    cycle: int
    decision: str
    reason: str
    statistics: dict[str, Any]
    candidate_checkpoint_id: str | None
    previous_checkpoint_id: str | None
    decided_by: str = "gate"


@dataclass
class RecordDecisionResult:
    promotion_id: int
    decision: str


@dataclass
class PromoteInput:
    loop: str
    cycle: int
    promotion_id: int
    candidate_checkpoint_id: str
    candidate_uri: str
    previous_checkpoint_id: str | None
    previous_uri: str | None
    serving_target: dict[str, Any]
    canary_seconds: float
    canary_check_interval_s: float
    canary_min_traces: int
    canary_max_drop_points: float


@dataclass
class PromoteResult:
    status: str  # "held" | "rolled_back" | "failed"
    reason: str
    live_before: float | None = None
    live_after: float | None = None
    # The canary's two samples as counted (the previous champion's traces up to the deploy,
    # the candidate's since): the live delta and its interval are computed from them.
    live_baseline: LiveStats | None = None
    live_canary: LiveStats | None = None


@dataclass
class DeployInput:
    loop: str
    serving_target: dict[str, Any]
    checkpoint_id: str
    checkpoint_uri: str
    # Set by PromoteWorkflow: the cycle whose candidate this is ("candidate"), or whose
    # champion is restored ("restore"). The activity refuses a checkpoint that would let the
    # serving model slip back (not the cycle's own candidate, or older than the champion).
    cycle: int | None = None
    purpose: str = "candidate"


@dataclass
class DeployResult:
    served_version: str
    deployed_at: str


@dataclass
class LiveStatsInput:
    loop: str
    model_version: str | None
    since: str | None = None
    until: str | None = None
    limit: int = 1000


@dataclass
class LiveStats:
    n: int
    successes: int
    success_rate: float | None
    ci_low: float | None = None
    ci_high: float | None = None


@dataclass
class PromotionStatusInput:
    loop: str
    promotion_id: int
    status: str
    reason: str | None = None
    set_champion: str | None = None
    timestamp_field: str | None = None


@dataclass
class RollbackInput:
    loop: str
    reason: str


@dataclass
class RollbackResult:
    rolled_back: bool
    reason: str
    checkpoint_id: str | None = None


@dataclass
class CloseCycleInput:
    loop: str
    cycle: int
    outcome: str
    detail: str
    points_gained: float | None = None
    candidate_checkpoint_id: str | None = None
    # ``points_gained`` is held-out points (the headline). The gate's points on the eval
    # set (new failures) and the canary's two live samples, from which the activity records
    # the live delta; every interval is computed there.
    gate_points: float | None = None
    live_baseline: LiveStats | None = None
    live_canary: LiveStats | None = None


@dataclass
class CloseCycleResult:
    cost_usd: float
    compute_seconds: float
    cumulative_cost_usd: float
    cumulative_points: float
    points_per_dollar: float | None
    budget_exhausted: bool


def uri_path(uri: str) -> str:
    """The filesystem path of a ``file://`` URI (job specs carry paths, payloads carry URIs)."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme == "file" else uri


# Retention (workflows/retention.py) -------------------------------------------------------

RETENTION_SCHEDULE_ID = "ratchet-retention"
RETENTION_WORKFLOW_ID = "retention/purge"


@dataclass
class RetentionInput:
    """One purge of raw trace bodies received more than ``retention_days`` ago."""

    retention_days: int
    batch_size: int = 1000


@dataclass
class RetentionResult:
    purged: int = 0
    cutoff: str = ""


@dataclass
class PurgeTraceBodiesInput:
    retention_days: int
    now: str  # ISO 8601, fixed by the workflow so retries use the same cutoff
    batch_size: int = 1000


@dataclass
class PurgeTraceBodiesResult:
    purged: int = 0
    cutoff: str = ""
