"""Every workflow and activity payload is typed: no ``Any`` or ``dict[str, Any]`` loop
configuration travels through a history, and every dataclass that holds a policy is read
and written by the one policy converter (workflows/payload.py)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any, get_args, get_type_hints

from pydantic import BaseModel

from services.loop.policies import ServingTarget, TrainingProfile
from workflows.activities.canary import CanaryActivities
from workflows.activities.curation import CurationActivities
from workflows.activities.cycle import CycleActivities
from workflows.activities.deploy import DeployActivities
from workflows.activities.estimate import EstimateActivities
from workflows.activities.gate import GateActivities
from workflows.activities.jobs import JobActivities
from workflows.activities.retention import RetentionActivities
from workflows.activities.serving_ledger import ServingLedgerActivities
from workflows.payload import dump_value, has_policy_payload, load_dataclass
from workflows.payloads.promote import DeployInput
from workflows.payloads.rollback import RollbackPlan
from workflows.payloads.train import TrainInput
from workflows.registry import WORKFLOWS

ACTIVITY_CLASSES = [
    CurationActivities,
    EstimateActivities,
    JobActivities,
    CycleActivities,
    GateActivities,
    DeployActivities,
    CanaryActivities,
    ServingLedgerActivities,
    RetentionActivities,
]

# The untyped fields allowed, each a measured output or a document with its own contract,
# never a loop's configuration.
ALLOWED_UNTYPED = {
    # The job contract's spec (ratchet.job/v1): services.training.jobspec writes it from the
    # typed profile and the job reads it; its keys are that module's, not the loop's.
    ("RunJobInput", "job_spec"),
    # What a job measured (loss, rewards, steps), as its metrics file reports it.
    ("RunJobResult", "metrics"),
    ("TrainResult", "metrics"),
    # The gate's statistics as computed (counts, intervals, p-values), stored as measured.
    ("GateResult", "statistics"),
    ("RecordDecisionInput", "statistics"),
    # Why the trigger fired (counts and rates at the time), recorded on the cycle.
    ("StartCycleInput", "trigger_detail"),
}


# The attributes temporalio's decorators set on a workflow's run, signal, query and update
# methods and on an activity method.
_HANDLER_MARKS = (
    "__temporal_workflow_run",
    "__temporal_signal_definition",
    "__temporal_query_definition",
    "__temporal_update_definition",
    "__temporal_activity_definition",
)


def _handler_types(cls: type) -> Iterator[Any]:
    """The parameter and return types of a class's workflow/activity/signal/query methods."""
    for _, member in inspect.getmembers(cls, inspect.isfunction):
        if any(hasattr(member, mark) for mark in _HANDLER_MARKS):
            yield from get_type_hints(member).values()


def _dataclasses_in(hint: Any, seen: set[type]) -> Iterator[type]:
    """Every dataclass reachable from a type hint, through fields, lists, unions."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if hint in seen:
            return
        seen.add(hint)
        yield hint
        for field_hint in get_type_hints(hint).values():
            yield from _dataclasses_in(field_hint, seen)
        return
    for arg in get_args(hint):
        yield from _dataclasses_in(arg, seen)


def _payload_classes() -> list[type]:
    seen: set[type] = set()
    found: list[type] = []
    for cls in [*WORKFLOWS, *ACTIVITY_CLASSES]:
        for hint in _handler_types(cls):
            found.extend(_dataclasses_in(hint, seen))
    return found


def _untyped(hint: Any) -> bool:
    """Whether a hint is or holds ``Any`` (``dict[str, Any]``, ``list[Any]``, ``Any | None``)."""
    if hint is Any:
        return True
    return any(_untyped(arg) for arg in get_args(hint))


def _holds_policy(hint: Any) -> bool:
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return True
    return any(_holds_policy(arg) for arg in get_args(hint))


def test_the_walk_reaches_the_payloads_of_every_stage() -> None:
    names = {cls.__name__ for cls in _payload_classes()}
    assert {"LoopInput", "TrainInput", "EvaluateInput", "ProbeInput", "PromoteInput"} <= names
    assert {"RunJobInput", "DeployInput", "RollbackPlan", "EstimateInput", "LoopConfig"} <= names


def test_no_payload_field_is_untyped_loop_configuration() -> None:
    untyped = [
        (cls.__name__, name)
        for cls in _payload_classes()
        for name, hint in get_type_hints(cls).items()
        if _untyped(hint) and (cls.__name__, name) not in ALLOWED_UNTYPED
    ]
    assert untyped == [], f"type these fields (or name why they may stay untyped): {untyped}"


def test_every_payload_holding_a_policy_uses_the_policy_converter() -> None:
    holding = [
        cls
        for cls in _payload_classes()
        if any(_holds_policy(hint) for hint in get_type_hints(cls).values())
    ]
    assert holding, "the walk found no payload holding a policy"
    unmarked = [cls.__name__ for cls in holding if not has_policy_payload(cls)]
    assert unmarked == []


def test_a_policy_payload_round_trips_typed_and_reads_the_older_dict_shape() -> None:
    profile = TrainingProfile(algorithm=["rft", "grpo"], accelerators=2, timeout_s=60)
    train = TrainInput("bot", 2, 5, "file:///t", None, None, "toolcalc", profile)
    dumped = dump_value(train)
    assert dumped["profile"]["algorithm"] == ["rft", "grpo"]
    assert load_dataclass(TrainInput, dumped) == train
    # The older payload: the profile as model_dump() wrote it into a dict field.
    older = {**dumped, "profile": profile.model_dump()}
    assert load_dataclass(TrainInput, older).profile == profile
    # A recorded serving target with a retired key still reads (as recorded), and a
    # rollback plan of "nothing to roll back" wrote an empty dict.
    deploy = load_dataclass(
        DeployInput,
        {
            "loop": "bot",
            "serving_target": {"kind": "local", "url": "http://x"},
            "checkpoint_id": "c",
            "checkpoint_uri": "file:///c",
        },
    )
    assert deploy.serving_target.retired_keys == ("url",)
    plan = load_dataclass(RollbackPlan, {"promotion_id": None, "serving_target": {}})
    assert plan.serving_target == ServingTarget()
