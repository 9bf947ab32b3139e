"""The loop's StrEnums are their stored strings, and list what the database allows."""

from __future__ import annotations

import base64
import enum
import json
import re
from pathlib import Path

import pytest

from services.db.models import Base
from services.loop.states import (
    CycleOutcome,
    CycleStage,
    Decision,
    LoopLifecycle,
    PromotionStatus,
    RunStatus,
)


def allowed(table: str, column: str) -> set[str]:
    """The values a check constraint ``<column> IN (...)`` of a table allows."""
    for constraint in Base.metadata.tables[table].constraints:
        text = str(getattr(constraint, "sqltext", ""))
        if text.startswith(f"{column} IN"):
            return set(re.findall(r"'([^']+)'", text))
    raise AssertionError(f"no check constraint on {table}.{column}")


@pytest.mark.parametrize(
    ("states", "table", "column"),
    [
        (LoopLifecycle, "loops", "status"),
        (RunStatus, "runs", "status"),
        (Decision, "promotions", "decision"),
        (PromotionStatus, "promotions", "status"),
    ],
)
def test_each_enum_lists_exactly_what_its_column_allows(
    states: type[enum.StrEnum], table: str, column: str
) -> None:
    assert {state.value for state in states} == allowed(table, column)


def test_a_member_is_its_stored_string() -> None:
    assert CycleOutcome.PROMOTED == "promoted"
    assert f"{CycleStage.AWAITING_APPROVAL}" == "awaiting_approval"
    assert RunStatus("succeeded") is RunStatus.SUCCEEDED
    assert {"held": 1}[PromotionStatus.HELD] == 1


def test_a_run_ends_in_a_terminal_status_only() -> None:
    assert {status for status in RunStatus if status.terminal} == {
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
        RunStatus.LOST,
    }


def test_an_unknown_word_is_refused() -> None:
    with pytest.raises(ValueError, match="'finished' is not a valid RunStatus"):
        RunStatus("finished")


HISTORIES = Path(__file__).parents[2] / "workflows" / "histories"
# (activity, input field) -> the enum its value belongs to
ACTIVITY_FIELDS: dict[tuple[str, str], type[enum.StrEnum]] = {
    ("set_cycle_stage", "stage"): CycleStage,
    ("close_cycle", "outcome"): CycleOutcome,
    ("record_decision", "decision"): Decision,
    ("update_promotion", "status"): PromotionStatus,
}
SEARCH_ATTRIBUTES: dict[str, type[enum.StrEnum]] = {
    "RatchetStage": CycleStage,
    "RatchetOutcome": CycleOutcome,
}


def history_values() -> list[tuple[type[enum.StrEnum], str]]:
    """Every stage, outcome, decision and promotion status the committed histories carry,
    in activity inputs and search attributes."""
    found: list[tuple[type[enum.StrEnum], str]] = []
    for path in sorted(HISTORIES.glob("*.json")):
        for event in json.loads(path.read_text())["events"]:
            scheduled = event.get("activityTaskScheduledEventAttributes")
            if scheduled is not None:
                name = scheduled["activityType"]["name"]
                for payload in scheduled.get("input", {}).get("payloads", []):
                    data = json.loads(base64.b64decode(payload["data"]))
                    for (activity, key), states in ACTIVITY_FIELDS.items():
                        if name == activity and isinstance(data, dict) and key in data:
                            found.append((states, data[key]))
            upsert = event.get("upsertWorkflowSearchAttributesEventAttributes")
            if upsert is not None:
                for key, value in upsert["searchAttributes"]["indexedFields"].items():
                    if key in SEARCH_ATTRIBUTES:
                        found.append(
                            (SEARCH_ATTRIBUTES[key], json.loads(base64.b64decode(value["data"])))
                        )
    return found


def test_every_value_the_committed_histories_carry_is_a_member() -> None:
    """Workflows that adopt the enums send the same words their histories recorded."""
    found = history_values()
    assert {states for states, _ in found} == {
        *ACTIVITY_FIELDS.values(),
        *SEARCH_ATTRIBUTES.values(),
    }
    unknown = [(states.__name__, value) for states, value in found if value not in set(states)]
    assert unknown == []
