"""Task-queue names and every workflow/activity Input/Result dataclass.

One dataclass in, one dataclass out (STYLE habit 1), so fields can be added with defaults
without breaking running histories. Payloads are ids and URIs, never rows or files.
This module imports the standard library, temporalio's converter hook, the policy classes
(pydantic models in ``services.loop.policies``) and the base classes of curation's results
(``services.curation.results``); no database, no torch: workflows import it
inside ``imports_passed_through`` and the api imports it to start and signal workflows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

from services.curation.policy import CurationPolicy
from services.curation.results import CurationCounts, DatasetFiles
from services.loop.policies import (
    RECORDED,
    GatePolicy,
    JobOverride,
    ServingTarget,
    TrainingProfile,
    TriggerPolicy,
)

# The job contract's spec builders (re-exported for the workflows): standard library only.
from services.training.jobspec import eval_job_document as eval_job_document
from services.training.jobspec import train_job_document as train_job_document
from workflows.payload import PolicyPayload, policy_payload

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
class CurateResult(CurationCounts):
    """A curate workflow's batches, their counts summed."""


@dataclass
class CurateBatchInput:
    loop: str
    batch_size: int = CURATION_BATCH_SIZE


@dataclass
class CurateBatchResult(CurationCounts):
    """One batch's counts; ``more``: the batch was full, so traces may be left to curate."""

    more: bool = False


@dataclass
class SnapshotInput:
    loop: str
    cycle: int


@dataclass
class SnapshotResult(DatasetFiles):
    """The dataset ``snapshot_dataset`` froze (or found already frozen) for a cycle."""


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


@policy_payload()
@dataclass
class ProbeInput:
    """Probe the champion on the loop's unprobed train tasks (``ProbeWorkflow``)."""

    loop: str
    cycle: int
    environment: str
    champion_checkpoint_id: str
    champion_uri: str
    attempts: int = 8
    profile: TrainingProfile = field(default_factory=TrainingProfile)


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
    # The longest the job may run, from its first start (kept across attempts): past it the
    # job is stopped and the run fails, so a job adopted by a retry cannot outlive its bound.
    deadline_s: float | None = None


def job_override(override: JobOverride | None) -> tuple[str | None, list[str] | None]:
    """The image and command of a profile's ``train_job`` or ``eval_job``, if set."""
    if override is None:
        return None, None
    return override.image, list(override.command) if override.command else None


class CycleJobStage(Protocol):
    """A stage input that runs a job of its cycle (``TrainInput``, ``EvaluateInput``,
    ``ProbeInput``): the loop, the cycle, its environment and the loop's training profile."""

    loop: str
    cycle: int
    environment: str
    profile: TrainingProfile


def cycle_job(
    stage: CycleJobStage,
    kind: str,
    run_id: str,
    job_spec: dict[str, Any],
    *,
    base_checkpoint_id: str | None,
    dataset_id: int | None = None,
) -> RunJobInput:
    """A job of a cycle's stage as the loop's profile runs it: training takes
    ``accelerators`` and the ``train_job`` override, eval and probe jobs ``eval_accelerators``
    and the ``eval_job`` override."""
    profile = stage.profile
    training = kind == "train"
    image, command = job_override(profile.train_job if training else profile.eval_job)
    accelerators = profile.accelerators if training else profile.eval_accelerators
    return RunJobInput(
        run_id=run_id,
        loop=stage.loop,
        kind=kind,
        job_spec=job_spec,
        cycle=stage.cycle,
        dataset_id=dataset_id,
        base_checkpoint_id=base_checkpoint_id,
        accelerators=accelerators,
        job_image=image,
        job_command=command,
    )


def cycle_eval_job_spec(
    stage: CycleJobStage,
    run_id: str,
    *,
    checkpoint_uri: str,
    task_uri: str,
    samples: int,
    temperature: float,
) -> dict[str, object]:
    """The eval job's spec (an evaluation, or a probe) for one checkpoint on one task file.

    The seed is the cycle: every checkpoint of a cycle is sampled with the same random numbers.
    """
    return eval_job_document(
        run_id=run_id,
        environment=stage.environment,
        checkpoint=uri_path(checkpoint_uri),
        dataset=uri_path(task_uri),
        samples=samples,
        seed=stage.cycle,
        device=stage.profile.device,
        temperature=temperature,
    )


@dataclass
class RunJobResult:
    run_id: str
    status: str  # "succeeded" | "failed" | "cancelled" | "lost"
    output_uri: str
    metrics: dict[str, Any] = field(default_factory=dict)
    compute_seconds: float = 0.0
    cost_usd: float = 0.0
    error: str | None = None


class JobOutcome(TypedDict):
    """How a job ended, as every stage result that ran one reports it (``TrainResult``,
    ``ProbeResult``): ``StageResult(..., **job_outcome(job))``."""

    status: str
    compute_seconds: float
    cost_usd: float
    error: str | None


def job_outcome(job: RunJobResult) -> JobOutcome:
    return JobOutcome(
        status=job.status,
        compute_seconds=job.compute_seconds,
        cost_usd=job.cost_usd,
        error=job.error,
    )


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

    # The last cycle started: ``cycle`` in workflow code; the field keeps the name that
    # running histories store.
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


class _LoopConfigPayload(PolicyPayload):
    """``LoopConfig`` as an activity result: its policies as nested JSON objects.

    Temporal's default converter builds a dataclass from the keys it declares and drops the
    rest, so it cannot read the flat payload ``load_loop_config`` wrote before the policies
    were nested (committed histories hold it, and so do running workflows). This converter
    reads both shapes, and writes the flat keys next to the nested ones so a worker of the
    previous release, during a rolling deploy, still reads what a new activity wrote.
    """

    def to_transfer_type(self, value: LoopConfig) -> dict[str, Any]:
        return {**_flat_keys(value), **value.to_payload()}

    def from_transfer_type(self, value: dict[str, Any], type_hint: type[Any]) -> LoopConfig:
        return LoopConfig.from_payload(value)


@policy_payload(_LoopConfigPayload)
@dataclass
class LoopConfig:
    """A loop's row as workflow code needs it, every policy parsed, defaulted and typed.

    Each policy is the class the admin API validates it with (``services.loop.policies``,
    ``services.curation.policy``), named as its column of ``loops``.
    """

    loop: str
    loop_id: int
    status: str
    environment: str
    executor: str
    champion_checkpoint_id: str | None
    champion_uri: str | None
    training_profile: TrainingProfile = field(default_factory=TrainingProfile)
    serving_target: ServingTarget = field(default_factory=ServingTarget)
    trigger_policy: TriggerPolicy = field(default_factory=TriggerPolicy)
    gate_policy: GatePolicy = field(default_factory=GatePolicy)
    curation_policy: CurationPolicy = field(default_factory=CurationPolicy)
    budget_usd: float | None = None
    spent_usd: float = 0.0
    # The loop's highest cycle number in Postgres: a restarted workflow continues after it.
    last_cycle_number: int = 0

    def to_payload(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in _SCALAR_FIELDS},
            "training_profile": self.training_profile.model_dump(mode="json"),
            "serving_target": self.serving_target.model_dump(mode="json"),
            "trigger_policy": self.trigger_policy.model_dump(mode="json"),
            "gate_policy": self.gate_policy.model_dump(mode="json"),
            "curation_policy": self.curation_policy.to_json(),
        }

    @classmethod
    def from_payload(cls, raw: dict[str, Any]) -> LoopConfig:
        """Either shape: nested policies (``gate_policy`` present) or the older flat keys."""
        nested = "gate_policy" in raw
        return cls(
            **{name: raw[name] for name in _SCALAR_FIELDS if name in raw},
            training_profile=TrainingProfile.model_validate(
                raw.get("training_profile") or {}, context=RECORDED
            ),
            serving_target=ServingTarget.model_validate(
                raw.get("serving_target") or {}, context=RECORDED
            ),
            trigger_policy=(
                TriggerPolicy.model_validate(raw["trigger_policy"], context=RECORDED)
                if nested
                else _flat_trigger_policy(raw)
            ),
            gate_policy=(
                GatePolicy.model_validate(raw["gate_policy"], context=RECORDED)
                if nested
                else _flat_gate_policy(raw)
            ),
            curation_policy=(
                CurationPolicy.from_json(raw.get("curation_policy"))
                if nested
                else CurationPolicy(
                    difficulty_filter=raw.get("difficulty_filter", False),
                    probe_attempts=raw.get("probe_attempts", 8),
                )
            ),
        )


# The fields that are plain JSON values in both shapes of the payload.
_SCALAR_FIELDS = (
    "loop",
    "loop_id",
    "status",
    "environment",
    "executor",
    "champion_checkpoint_id",
    "champion_uri",
    "budget_usd",
    "spent_usd",
    "last_cycle_number",
)


# The flat payload's policy keys, as (flat key, policy field). The flat payload's defaults
# (eval_temperature 0, min_discordant_pairs 0) are those of the release that wrote it.
_FLAT_TRIGGER = (
    ("min_new_tasks", "min_new_tasks"),
    ("max_interval_s", "max_interval_s"),
    ("check_interval_s", "check_interval_s"),
    ("drift_enabled", "drift_enabled"),
)
_FLAT_GATE = (
    ("gate_mode", "mode"),
    ("confidence", "confidence"),
    ("min_improvement_points", "min_improvement_points"),
    ("regression_tolerance_points", "regression_tolerance_points"),
    ("canary_seconds", "canary_seconds"),
    ("canary_check_interval_s", "canary_check_interval_s"),
    ("canary_min_traces", "canary_min_traces"),
    ("canary_max_drop_points", "canary_max_drop_points"),
    ("eval_samples", "eval_samples"),
    ("eval_temperature", "eval_temperature"),
    ("min_discordant_pairs", "min_discordant_pairs"),
)
_FLAT_GATE_DEFAULTS = {"eval_temperature": 0.0, "min_discordant_pairs": 0}


def _flat_trigger_policy(raw: dict[str, Any]) -> TriggerPolicy:
    # Constructed, not validated: the recorded values are what the workflow acted on.
    return TriggerPolicy.model_construct(**{name: raw[key] for key, name in _FLAT_TRIGGER})


def _flat_gate_policy(raw: dict[str, Any]) -> GatePolicy:
    values: dict[str, Any] = {
        name: raw.get(key, _FLAT_GATE_DEFAULTS.get(key)) for key, name in _FLAT_GATE
    }
    return GatePolicy.model_construct(**values)


def _flat_keys(config: LoopConfig) -> dict[str, Any]:
    """The flat payload of the previous release (drop once no worker older than this runs)."""
    trigger, gate = config.trigger_policy, config.gate_policy
    return {
        **{key: getattr(trigger, name) for key, name in _FLAT_TRIGGER},
        **{key: getattr(gate, name) for key, name in _FLAT_GATE},
        "difficulty_filter": config.curation_policy.difficulty_filter,
        "probe_attempts": config.curation_policy.probe_attempts,
    }


@dataclass
class StartCycleInput:
    loop: str
    # The cycle (``cycle`` in workflow code; the field keeps the name histories store).
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


@policy_payload()
@dataclass
class TrainInput:
    loop: str
    cycle: int
    dataset_id: int
    train_uri: str
    base_checkpoint_id: str | None
    base_checkpoint_uri: str | None
    environment: str
    profile: TrainingProfile


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


@policy_payload()
@dataclass
class PromoteInput:
    loop: str
    cycle: int
    promotion_id: int
    candidate_checkpoint_id: str
    candidate_uri: str
    previous_checkpoint_id: str | None
    previous_uri: str | None
    serving_target: ServingTarget
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


@policy_payload()
@dataclass
class DeployInput:
    loop: str
    serving_target: ServingTarget
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
    # Proof of delivery: "verified: ..." or why not ("not verified: no probe set").
    delivery: str = ""


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
    # Traces of the window not counted: their response ids are not signed for their version.
    unattested: int = 0


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


@policy_payload()
@dataclass
class RollbackPlan:
    """What an operator rollback undoes: the last held promotion and the champion before it
    (``promotion_id`` None: nothing to roll back, ``reason`` says why)."""

    promotion_id: int | None
    reason: str = ""
    checkpoint_id: str | None = None
    checkpoint_uri: str | None = None
    serving_target: ServingTarget = field(default_factory=ServingTarget)


@dataclass
class FinishRollbackInput:
    """How the rollback's deploy ended: ``error`` None when the previous champion serves."""

    loop: str
    reason: str
    promotion_id: int
    checkpoint_id: str
    error: str | None = None


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
SERVING_LEDGER_SCHEDULE_ID = "ratchet-serving-ledger"
SERVING_LEDGER_WORKFLOW_ID = "serving-ledger/sample"


@dataclass
class ServingLedgerInput:
    """One sample of every serving loop's model server counters into its open tenure."""

    max_loops: int = 1000


@dataclass
class ServingLedgerResult:
    sampled: int = 0  # loops whose server's counters were read and added
    unreadable: int = 0  # loops whose server could not be read (logged; the next sample)


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
