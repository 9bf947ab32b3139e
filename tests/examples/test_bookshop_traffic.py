"""The bookshop's traffic generator: deterministic, valid ``ratchet.trace/v1``, every tool
result what the tool answers, the failures production shows, a tool change midway, and
every trace a replay task whose sandbox gives back what was recorded."""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import datetime
from typing import Any

import pytest

from services.environments.base import Rejection
from services.environments.replay.env import ReplayEnvironment
from services.ingest.schema import TraceV1
from tests.examples.support import example_module

bookshop = example_module("bookshop")
traffic_module = example_module("traffic")
tickets = example_module("tickets")


@pytest.fixture(scope="module")
def traffic() -> Any:
    return traffic_module.generate(seed=0, count=1000)


def _calls(trace: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Each tool call of the trace with its recorded result."""
    results = {m["tool_call_id"]: m["content"] for m in trace["messages"] if m["role"] == "tool"}
    return [
        (call, results[call["id"]])
        for message in trace["messages"]
        for call in message.get("tool_calls") or ()
    ]


def _answer(trace: dict[str, Any]) -> str:
    return str(trace["messages"][-1]["content"])


def _scenario(trace: dict[str, Any]) -> str:
    return str(trace["metadata"]["scenario"])


def test_the_same_seed_gives_the_same_traffic_and_another_seed_another() -> None:
    first = traffic_module.generate(seed=7, count=120)
    again = traffic_module.generate(seed=7, count=120)
    other = traffic_module.generate(seed=8, count=120)
    assert json.dumps(first.traces) == json.dumps(again.traces)
    assert first.feedback == again.feedback
    assert [t["messages"][1] for t in first.traces] != [t["messages"][1] for t in other.traces]


def test_a_month_of_valid_traces_with_every_kind_of_failure(traffic: Any) -> None:
    assert len(traffic.traces) == 1000
    for trace in traffic.traces:
        TraceV1.model_validate(trace)  # what the webhook accepts
    assert len({t["external_id"] for t in traffic.traces}) == 1000
    kinds = Counter(_scenario(t) for t in traffic.traces)
    for scenario in (
        "ok",
        "paraphrase",
        "missing_call",
        "wrong_id",
        "wrong_format",
        "wrong_fact",
        "old_shape",
        "recovered",
    ):
        assert kinds[scenario] >= 10, kinds
    assert Counter(t["metadata"]["ticket"] for t in traffic.traces).keys() == set(tickets.KINDS)
    # Distinct customers' orders: no order is asked about twice.
    asked = [re.findall(r"PT-\d{5}", t["messages"][1]["content"]) for t in traffic.traces]
    order_ids = [ids[0] for ids in asked if ids]
    assert len(order_ids) > 600 and len(order_ids) == len(set(order_ids))


def test_every_recorded_result_is_what_the_tool_answers(traffic: Any) -> None:
    shop = bookshop.Shop(0)
    for trace in traffic.traces:
        for call, result in _calls(trace):
            api = trace["metadata"]["tool_api"]
            assert shop.call(api, call["name"], call["arguments"]) == result


def test_the_tools_change_midway_and_old_calls_fail_with_the_usage_error(traffic: Any) -> None:
    change = traffic.change_at
    for trace in traffic.traces:
        after = datetime.fromisoformat(trace["started_at"]) >= change
        assert trace["metadata"]["tool_api"] == ("v2" if after else "v1")
        assert trace["tools"] == bookshop.TOOLS["v2" if after else "v1"]
    usage = "error: track_parcel is missing required argument(s) carrier"
    old_shape = [t for t in traffic.traces if _scenario(t) == "old_shape"]
    assert old_shape and all(any(result == usage for _, result in _calls(t)) for t in old_shape)
    recovered = [t for t in traffic.traces if _scenario(t) == "recovered"]
    for trace in recovered:
        tracks = [call["arguments"] for call, _ in _calls(trace) if call["name"] == "track_parcel"]
        assert [sorted(a) for a in tracks] == [["tracking_id"], ["carrier", "tracking_id"]]
    after = [t for t in traffic.traces if t["metadata"]["tool_api"] == "v2"]
    tracking = [t for t in after if "track_parcel" in t["metadata"]["needed_tools"]]
    failed = sum(not t["outcome"]["success"] for t in tracking)
    assert failed / len(tracking) > 0.5  # what the loop must learn


def test_answers_state_their_facts_as_the_scenario_says(traffic: Any) -> None:
    """Successes state every fact of the shop's reference (a paraphrase in other words);
    a wrong fact, a missing call or a wrong argument leaves one out."""
    by_id = {t["external_id"]: t for t in traffic.traces}
    corrections = {f["external_id"]: f.get("correction") for f in traffic.feedback}
    for external_id, trace in by_id.items():
        reference = trace.get("reference_answer") or corrections.get(external_id)
        if reference is None:  # a success judged by its rating only
            assert trace["outcome"]["success"]
            continue
        answer, scenario = _answer(trace), _scenario(trace)
        facts = _facts(trace, reference)
        if scenario in ("ok", "recovered"):
            assert answer == reference
        elif scenario == "paraphrase":
            assert answer != reference and all(fact in answer for fact in facts)
        else:
            assert not all(fact in answer for fact in facts), (scenario, answer, reference)


_FACT = r"(?:PT|RF)-\d{5}|\d{4}-\d{2}-\d{2}|\d+\.\d{2} EUR|\d+ copies|'[^']+'|DHL|UPS|GLS|DPD"


def _facts(trace: dict[str, Any], reference: str) -> list[str]:
    """The reference's ids, dates, amounts, counts and quoted titles."""
    found = re.findall(_FACT, reference)
    assert found, (trace["external_id"], reference)
    return found


def test_conversations_are_short_demonstrations(traffic: Any) -> None:
    for trace in traffic.traces:
        calls = len(_calls(trace))
        if _scenario(trace) == "ok":
            assert 1 <= calls <= 3
            assert [c["name"] for c, _ in _calls(trace)] == trace["metadata"]["needed_tools"]
        assert calls <= 4
        assert len(_answer(trace)) < 120
        assert len(trace["messages"][1]["content"]) < 200
    assert len(bookshop.SYSTEM_PROMPT) < 80


def test_references_or_feedback_score_every_trace(traffic: Any) -> None:
    rated = {f["external_id"]: f for f in traffic.feedback}
    for trace in traffic.traces:
        verdict = rated.get(trace["external_id"])
        assert trace.get("reference_answer") or verdict is not None
        if verdict is not None:
            assert verdict["score"] == (1.0 if trace["outcome"]["success"] else 0.0)
            assert ("correction" in verdict) is (not trace["outcome"]["success"])
    with_reference = sum(bool(t.get("reference_answer")) for t in traffic.traces)
    assert 0.6 < with_reference / len(traffic.traces) < 0.9


def test_every_trace_is_a_replay_task_whose_sandbox_replays_it(traffic: Any) -> None:
    env = ReplayEnvironment()
    rated = {f["external_id"]: f for f in traffic.feedback}
    for trace in traffic.traces[::7]:
        feedback = rated.get(trace["external_id"])
        context = {"policy": {}, "feedback": _feedback_context(feedback)}
        task = env.task_from_trace({**trace, "ratchet": context})
        assert not isinstance(task, Rejection), task
        assert "Pageturner" in task.prompt
        for call, result in _calls(trace):
            assert env.tool_result(task, call["name"], call["arguments"]) == result
        if (
            trace["metadata"]["tool_api"] == "v2"
            and "track_parcel" in trace["metadata"]["needed_tools"]
        ):
            old = env.tool_result(task, "track_parcel", {"tracking_id": "TR-10000"})
            assert old == "error: track_parcel is missing required argument(s) carrier"


def _feedback_context(feedback: dict[str, Any] | None) -> dict[str, Any] | None:
    if feedback is None:
        return None
    return {key: value for key, value in feedback.items() if key != "external_id"}


def test_the_generator_writes_its_files_and_refuses_bad_arguments(tmp_path: Any) -> None:
    assert traffic_module.main(["--out", str(tmp_path), "--count", "40", "--seed", "3"]) == 0
    lines = (tmp_path / "traces.jsonl").read_text().splitlines()
    assert len(lines) == 40
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["traces"] == 40 and manifest["seed"] == 3
    assert manifest["tools_command"].endswith("mcp_server.py --seed 3")
    feedback = (tmp_path / "feedback.jsonl").read_text().splitlines()
    assert len(feedback) == manifest["feedback"]
    with pytest.raises(SystemExit):
        traffic_module.main(["--out", str(tmp_path / "x"), "--count", "0"])
    with pytest.raises(ValueError, match="change_at"):
        traffic_module.generate(count=10, change_at=1.5)


def test_a_ticket_is_about_an_order_that_existed_that_day(traffic: Any) -> None:
    """An order is placed before its ticket, and delivered or lost by then, or expected
    after it: what the customer could ask that day."""
    checked = 0
    for trace in traffic.traces:
        day = trace["started_at"][:10]
        for call, result in _calls(trace):
            found = json.loads(result) if result.startswith("{") else {}
            if call["name"] == "find_order" and "placed_on" in found:
                assert found["placed_on"] < day
            if call["name"] == "track_parcel" and "status" in found:
                if found["status"] == "in transit":
                    assert found["expected"] >= day
                else:
                    assert found.get("delivered_on", found.get("lost_since")) <= day
                checked += 1
    assert checked > 200
