"""Payloads of LoopWorkflow: its input, state, result, signals and status query, and the
loop's configuration as workflow code reads it (``LoopConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.curation.policy import CurationPolicy
from services.loop.policies import (
    RECORDED,
    GatePolicy,
    ServingTarget,
    TrainingProfile,
    TriggerPolicy,
)
from workflows.payload import PolicyPayload, policy_payload


@dataclass
class BootstrapSignal:
    """Bootstrap a first champion from the loop's successful traces (``ratchet loop
    bootstrap``): the base model to train over (None: the training profile's), whether a
    loop that has a champion bootstraps anyway, who asked and why."""

    by: str = "operator"
    reason: str = ""
    force: bool = False
    base_checkpoint_id: str | None = None


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
    # A bootstrap asked for and not yet started, and how many curated traces the automatic
    # bootstrap's last look saw (it looks again only when that number moved).
    bootstrap: BootstrapSignal | None = None
    bootstrap_curated_seen: int = -1


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
    # While the loop waits for a trigger: when its next check (which curates first) is due,
    # ISO 8601 UTC. Added later: a worker without it answers without the field.
    next_check_at: str | None = None


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
