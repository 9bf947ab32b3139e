"""benchmarks/foreign_agent.py's pure parts: the traffic read (and its refusals), the
hold-out by cluster that never lets a cluster cross, the held-out sets, the figures of a step
on known inputs, the needed-calls share, the bar, the plans' policies as the loop's own
validators read them, the jobs' counters summed; and the command's prepare-only run and
refusals. The loop itself runs in tests/e2e/test_foreign_agent_loop.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.foreign_agent import _step_figures
from benchmarks.foreign_loop import (
    HarnessError,
    Scored,
    checked_endpoint,
    live_tool_calls,
    tool_endpoint_config,
    unanswerable_calls,
)
from benchmarks.foreign_plan import BAR, QUICK, TOOL_ENDPOINT, LoopPlan
from benchmarks.foreign_traffic import (
    Traffic,
    TrafficError,
    bar,
    calls_made,
    conversation_prompt,
    example_traffic,
    heldout_sets,
    hold_out_by_cluster,
    needed_calls_share,
    read_traffic,
    step_figures,
    write_heldout_files,
)
from services.curation.policy import CurationPolicy
from services.curation.similarity import jaccard_many, signature, stack
from services.environments.base import read_task_file
from services.environments.replay.records import read_store_file
from services.evaluation.stats import wilson_interval
from services.loop.policies import parse_policies
from services.training.config import parse_hyperparameters

REPO = Path(__file__).resolve().parents[2]
SETTINGS = CurationPolicy.from_json({}).replay_settings()


@pytest.fixture(scope="module")
def month(tmp_path_factory: pytest.TempPathFactory) -> Traffic:
    return example_traffic(tmp_path_factory.mktemp("month"), seed=2, count=400)


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- the traffic -------------------------------------------------------------------------


def test_the_example_traffic_reads_back_as_any_domain_does(month: Traffic) -> None:
    assert len(month.traces) == 400
    assert month.change_at == datetime(2026, 11, 16, 8, tzinfo=UTC)
    assert month.tools_command is not None and month.tools_command[-2:] == ["--seed", "2"]
    assert month.feedback and all("external_id" not in f for f in month.feedback.values())
    assert {t["external_id"] for t in month.traces} >= set(month.feedback)


def test_bad_traffic_is_refused_with_the_line_and_the_field(month: Traffic, tmp_path: Path) -> None:
    good = month.traces[:3]
    not_json = tmp_path / "bad.jsonl"
    not_json.write_text(json.dumps(good[0]) + "\n{oops\n")
    with pytest.raises(TrafficError, match=r"line 2: not JSON"):
        read_traffic(not_json)
    wrong = _write(tmp_path / "wrong.jsonl", [good[0], {**good[1], "messages": []}])
    with pytest.raises(TrafficError, match=r"trace 2: messages: .*webhook refuses"):
        read_traffic(wrong)
    twice = _write(tmp_path / "twice.jsonl", [good[0], good[0]])
    with pytest.raises(TrafficError, match="trace 2: external_id repeats"):
        read_traffic(twice)
    with pytest.raises(TrafficError, match="holds no trace"):
        read_traffic(_write(tmp_path / "empty.jsonl", []))
    traces = _write(tmp_path / "traces.jsonl", good)
    ext = good[0]["external_id"]
    for rows, message in (
        ([{"external_id": "nobody", "score": 1.0}], "names no trace"),
        ([{"external_id": ext, "comment": "meh"}], "needs a score, a label or a correction"),
        ([{"external_id": ext, "score": 1.0, "stars": 5}], r"unknown field\(s\) \['stars'\]"),
    ):
        with pytest.raises(TrafficError, match=message):
            read_traffic(traces, _write(tmp_path / "feedback.jsonl", rows))


# -- the hold-out ------------------------------------------------------------------------


def _near_duplicates(month: Traffic) -> list[dict[str, Any]]:
    """The month plus, for 30 of its traces, a copy asked in nearly the same words: each
    pair must land in one cluster, on one side."""
    copies = []
    for trace in month.traces[:30]:
        copy = json.loads(json.dumps(trace))
        copy["external_id"] += "-again"
        copy["messages"][1]["content"] += " Thanks again."
        copies.append(copy)
    return [*month.traces, *copies]


def test_a_cluster_never_spans_the_posted_and_the_held_out(month: Traffic) -> None:
    traces = _near_duplicates(month)
    hold = hold_out_by_cluster(traces, share=0.3, seed=0)
    assert len(hold.posted) + len(hold.heldout) == len(traces)
    side = {t["external_id"]: "posted" for t in hold.posted}
    side |= {t["external_id"]: "heldout" for t in hold.heldout}
    members: dict[str, set[str]] = {}
    for external_id, cluster in hold.cluster_of.items():
        members.setdefault(cluster, set()).add(side[external_id])
    assert all(len(sides) == 1 for sides in members.values())
    for trace in traces[:30]:  # each near-duplicate pair is one cluster
        assert (
            hold.cluster_of[trace["external_id"]]
            == hold.cluster_of[trace["external_id"] + "-again"]
        )
    # Curation's notion of alike: no held-out prompt is as similar as the cluster threshold
    # to any posted one, so curation could never put the two in one cluster.
    held = stack(signature(conversation_prompt(t)) for t in hold.heldout)
    for trace in hold.posted:
        sims = jaccard_many(signature(conversation_prompt(trace)), held)
        assert float(np.max(sims)) < 0.8
    assert 0.2 < len(hold.heldout) / len(traces) < 0.4


def test_the_seed_picks_the_clusters_and_the_same_seed_the_same(month: Traffic) -> None:
    first = hold_out_by_cluster(month.traces, share=0.25, seed=1)
    again = hold_out_by_cluster(month.traces, share=0.25, seed=1)
    other = hold_out_by_cluster(month.traces, share=0.25, seed=2)
    assert first.heldout == again.heldout
    assert first.heldout_clusters != other.heldout_clusters
    with pytest.raises(ValueError, match="between 0 and 1"):
        hold_out_by_cluster(month.traces, share=1.0, seed=1)


def test_the_held_out_sets_are_failures_after_the_change_and_a_sample_of_all(
    month: Traffic, tmp_path: Path
) -> None:
    hold = hold_out_by_cluster(month.traces, share=0.3, seed=0)
    sets = heldout_sets(hold, month, policy_settings=SETTINGS, traffic_sample=40, seed=0)
    assert sets.rejected == {}
    by_prompt = {conversation_prompt(t): t for t in hold.heldout}
    assert sets.failures
    for task in sets.failures:
        trace = by_prompt[task.prompt]
        assert datetime.fromisoformat(trace["started_at"]) >= month.change_at  # type: ignore[operator]
        verdict = month.feedback.get(trace["external_id"])
        failed = verdict["score"] < 0.5 if verdict else not trace["outcome"]["success"]
        assert failed
    assert len(sets.traffic) == 40
    eras = {by_prompt[t.prompt]["metadata"]["tool_api"] for t in sets.traffic}
    assert eras == {"v1", "v2"}  # the frozen sample spans the change
    assert all(sets.needed_tools[t.task_id] for t in sets.traffic)

    files = write_heldout_files(sets, hold.posted, tmp_path)
    failures = read_task_file(files.failures)
    assert [t.task_id for t in failures] == [t.task_id for t in sets.failures]
    assert {t.metadata["ratchet"]["tool_store"] for t in failures} == {str(files.tool_store)}
    store = read_store_file(files.tool_store)
    # The store holds what the posted traces recorded, and only that: a held-out order's
    # lookup is answered by its task's own record or by the domain's tools, never leaked.
    posted_orders = {
        c["arguments"].get("order_id")
        for t in hold.posted
        for m in t["messages"]
        for c in m.get("tool_calls") or ()
    }
    stored_orders = {json.loads(key[2]).get("order_id") for key in store if key[0] == "find_order"}
    assert stored_orders <= posted_orders


def test_without_a_change_every_held_out_failure_is_a_failure_task(month: Traffic) -> None:
    hold = hold_out_by_cluster(month.traces, share=0.3, seed=0)
    timeless = Traffic(month.traces, month.feedback, None, None)
    always = heldout_sets(hold, timeless, policy_settings=SETTINGS, traffic_sample=10, seed=0)
    after = heldout_sets(hold, month, policy_settings=SETTINGS, traffic_sample=10, seed=0)
    assert len(always.failures) > len(after.failures) > 0


# -- the figures -------------------------------------------------------------------------


def test_a_step_on_known_pairs() -> None:
    """30 tasks: 10 both pass, 4 neither, 15 only after, 1 only before."""
    before = {f"t{i}": 1.0 for i in range(10)} | {f"t{i}": 0.0 for i in range(10, 30)}
    before["t29"] = 1.0
    after = {f"t{i}": 1.0 for i in range(10)} | {f"t{i}": 0.0 for i in range(10, 14)}
    after |= {f"t{i}": 1.0 for i in range(14, 29)} | {"t29": 0.0}
    figures = step_figures(before, after, seed=0)
    assert figures["n"] == 30
    assert figures["improved"] == 15 and figures["regressed"] == 1
    assert figures["gain_points"] == pytest.approx(100 * 14 / 30, abs=0.01)
    assert figures["p_gain"] == pytest.approx(17 / 2**16)  # P(X >= 15), X ~ Bin(16, 1/2)
    assert figures["p_loss"] == pytest.approx(1 - 1 / 2**16)  # P(X >= 1)
    assert figures["significant_gain"] and not figures["significant_loss"]
    assert figures["before"]["rate"] == pytest.approx(11 / 30, abs=1e-4)
    low, high = wilson_interval(25, 30)
    assert figures["after"]["wilson95"] == [round(low, 4), round(high, 4)]
    ci_low, ci_high = figures["ci95_points"]
    assert ci_low < figures["gain_points"] < ci_high and ci_low > 0
    assert step_figures(before, after, seed=0) == figures  # the bootstrap is seeded


def test_a_loss_is_significant_the_other_way_and_sides_must_match() -> None:
    before = {f"t{i}": 1.0 for i in range(12)}
    after = dict(before) | {f"t{i}": 0.0 for i in range(8)}
    figures = step_figures(before, after)
    assert figures["gain_points"] == pytest.approx(-100 * 8 / 12, abs=0.01)
    assert figures["significant_loss"] and not figures["significant_gain"]
    assert figures["p_loss"] == pytest.approx(1 / 2**8)
    with pytest.raises(ValueError, match="one side only"):
        step_figures(before, {"t0": 1.0})


def test_the_needed_calls_share_reads_the_episodes_tool_calls() -> None:
    call = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'
    both = call.format("find_order") + " ... " + call.format("track_parcel")
    assert calls_made(both, ["find_order", "track_parcel"]) == {"find_order", "track_parcel"}
    assert calls_made('<tool_call>{"name": <function-name>}</tool_call>', ["x"]) == set()
    needed = {"a": ["find_order", "track_parcel"], "b": ["check_stock"]}
    episodes = [
        {"task_id": "a", "passed": True, "text": both},
        {"task_id": "a", "passed": True, "text": call.format("find_order")},  # a lucky guess
        {"task_id": "b", "passed": False, "text": ""},  # failures do not count
        {"task_id": "c", "passed": True, "text": ""},  # nothing known of what c needs
    ]
    share = needed_calls_share(episodes, needed)
    assert share == {"passing_episodes": 2, "made_every_needed_call": 1, "share": 0.5}
    assert needed_calls_share([], needed)["share"] is None


def test_the_bar() -> None:
    figures = {
        "heldout_tasks": 60,
        "cycle_gain_points": 16.7,
        "cycle_significant": True,
        "traffic_loss_significant": False,
        "traffic_delta_points": -1.0,
        "loop_wall_s": 3400.0,
    }
    assert bar(figures)["met"] is True
    for key, value in (
        ("heldout_tasks", 49),
        ("cycle_gain_points", 14.9),
        ("cycle_significant", False),
        ("traffic_loss_significant", True),
        ("traffic_delta_points", -2.5),
        ("loop_wall_s", 3700.0),
    ):
        assert bar({**figures, key: value})["met"] is False, key
    # A bootstrap that was not promoted runs no cycle: its keys are None, the bar not met.
    no_cycle = {
        **figures,
        "cycle_gain_points": None,
        "cycle_significant": None,
        "traffic_loss_significant": None,
        "traffic_delta_points": None,
    }
    checks = bar(no_cycle)
    assert checks["heldout_tasks"] and checks["hour"] and not checks["met"]
    assert not checks["traffic_no_significant_loss"] and not checks["cycle_gain"]


def _scored(scores: dict[str, float]) -> Scored:
    return Scored(scores, [], {}, 0.0)


def test_the_steps_and_a_step_whose_models_were_not_all_evaluated() -> None:
    failures = {f"f{i}": 0.0 for i in range(20)}
    traffic = {f"t{i}": 1.0 for i in range(10)}
    scored = {
        ("base", "failures"): _scored(failures),
        ("base", "traffic"): _scored({k: 0.0 for k in traffic}),
        ("champion", "failures"): _scored(failures | {f"f{i}": 1.0 for i in range(4)}),
        ("champion", "traffic"): _scored(traffic),
    }
    figures = _step_figures(scored, seed=0)
    assert figures["steps"]["cycle"] is None and figures["cycle_gain_points"] is None
    assert figures["bootstrap_gain_points"] == pytest.approx(100.0)
    assert figures["bootstrap_failures_gain_points"] == pytest.approx(20.0)
    scored["candidate", "failures"] = _scored(failures | {f"f{i}": 1.0 for i in range(14)})
    scored["candidate", "traffic"] = _scored(traffic | {"t0": 0.0})
    figures = _step_figures(scored, seed=0)
    cycle = figures["steps"]["cycle"]
    assert cycle["failures"]["improved"] == 10 and cycle["failures"]["n"] == 20
    assert figures["cycle_gain_points"] == pytest.approx(50.0)
    assert figures["cycle_significant"] is True
    assert figures["cycle_ci95"] == cycle["failures"]["ci95_points"]
    assert figures["traffic_delta_points"] == pytest.approx(-10.0)
    assert figures["traffic_loss_significant"] is False


# -- the loop's plan -----------------------------------------------------------------------


@pytest.mark.parametrize("plan", [BAR, QUICK], ids=["bar", "quick"])
def test_the_plans_are_loops_the_api_accepts(plan: LoopPlan) -> None:
    """Every policy of both sizes passes the validators ``POST /v1/loops`` runs, and the
    bootstrap's and rft's hyperparameters the hf trainers' own checks."""
    policies = plan.policies("ab" * 32, device="cpu")
    trigger, gate, profile, _ = parse_policies(
        policies["trigger_policy"],
        policies["gate_policy"],
        policies["training_profile"],
        policies["serving_target"],
    )
    curation = CurationPolicy.from_json(policies["curation_policy"])
    assert curation.tool_endpoint == TOOL_ENDPOINT
    assert profile.family == "hf" and profile.algorithm == "rft"
    assert profile.base_checkpoint == "ab" * 32
    parse_hyperparameters("hf", "rft", profile.hyperparameters)
    parse_hyperparameters("hf", "sft", profile.bootstrap.hyperparameters)
    assert gate.eval_samples == 1 and gate.eval_temperature == 0.0
    # The benchmark starts each cycle itself: nothing else may.
    assert trigger.min_new_tasks > 10_000 and not trigger.drift_enabled
    # The benchmark's evaluations are the gate's: greedy, the evaluator's hf budgets.
    assert plan is QUICK or plan.eval_settings == {
        "max_turns": 5,
        "max_new_tokens": 48,
        "batch_size": 32,
    }


def test_the_bar_plan_is_sized_for_the_bookshop() -> None:
    """The sizes docs/models.md and the module docstring budget for: an auto gate, each
    bookshop turn fits the token budget, the rft waves are one sample of every task."""
    assert BAR.gate["mode"] == "auto" and QUICK.gate["mode"] == "manual"
    assert BAR.rft["rollout_batch"] == BAR.curation["max_train_tasks"]
    assert BAR.rft["max_new_tokens"] >= 48 and BAR.rft["max_turns"] >= 4
    sft_sequences = BAR.bootstrap["steps"] * BAR.bootstrap["batch_size"]
    assert sft_sequences <= BAR.max_demonstrations  # each demonstration seen about once
    overrides = BAR.with_overrides({"samples_per_task": 16}, {"steps": 60})
    assert overrides.rft["samples_per_task"] == 16 and overrides.rft["iterations"] == 2
    assert overrides.bootstrap["steps"] == 60 and BAR.bootstrap["steps"] == 40


def test_the_quickstarts_bookshop_loop_is_the_benchmarks_plan() -> None:
    """docs/quickstart.md section 7 runs the benchmark's path by hand: its loop file holds
    the plan's policies (the benchmark's own triggers aside: it starts its cycles itself),
    and the api's validators accept it."""
    import re

    import yaml

    text = (REPO / "docs" / "quickstart.md").read_text()
    section = text[text.index("## 7.") :]
    [loop_file] = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    checkpoint = "cd" * 32
    document = yaml.safe_load(loop_file.replace("CHECKPOINT_ID", checkpoint))
    plan = BAR.policies(checkpoint, device="auto")
    plan["training_profile"].pop("device")
    plan["curation_policy"].pop("tool_endpoint")  # the doc's optional last step adds it
    assert document["serving_target"] == plan["serving_target"]
    assert document["training_profile"] == plan["training_profile"]
    assert document["gate_policy"] == plan["gate_policy"]
    assert document["curation_policy"] == plan["curation_policy"]
    parse_policies(
        document["trigger_policy"],
        document["gate_policy"],
        document["training_profile"],
        document["serving_target"],
    )
    CurationPolicy.from_json(document["curation_policy"])


def test_the_tool_endpoint_is_the_settings_shape() -> None:
    config = tool_endpoint_config(["python", "tools.py", "--seed", "3"], ["b", "a"])
    checked_endpoint(config)
    assert config["kind"] == "mcp" and config["tools"] == ["a", "b"]
    with pytest.raises(HarnessError, match="refused by the settings"):
        checked_endpoint({**config, "requests_per_minute": 10**6})
    with pytest.raises(HarnessError, match="refused by the settings"):
        checked_endpoint({**config, "tools": []})


def test_the_jobs_counters_add_up() -> None:
    jobs = [
        {
            "unanswerable_calls": {
                "t1": {"calls": 3, "episodes": 4, "episodes_unanswered": 2},
                "t2": {"calls": 1, "episodes": 1, "episodes_unanswered": 1},
            },
            "tool_endpoints": {TOOL_ENDPOINT: {"calls": 5, "answered": 4, "failed": 1}},
        },
        {"unanswerable_calls": {}, "tool_endpoints": {"other": {"calls": 9}}},
        {"kind": "train"},
    ]
    assert unanswerable_calls(jobs) == {"calls": 4, "episodes_unanswered": 3, "tasks": 2}
    assert live_tool_calls(jobs) == {"calls": 5, "answered": 4, "failed": 1}
    assert unanswerable_calls([]) == {"calls": 0, "episodes_unanswered": 0, "tasks": 0}


# -- the command -------------------------------------------------------------------------


def _command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "foreign_agent.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_prepare_only_prints_the_held_out_sets_as_its_last_line(tmp_path: Path) -> None:
    done = _command("--prepare-only", "--count", "200", "--workdir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["traces"] == 200
    assert figures["posted_traces"] + figures["heldout_traces"] == 200
    assert figures["heldout_tasks"] > 0 and figures["heldout_traffic_tasks"] > 0
    assert len(read_task_file(Path(figures["files"]["failures"]))) == figures["heldout_tasks"]
    assert figures["change_at"] == "2026-11-16T08:00:00+00:00"
    assert not math.isnan(figures["wall_s"])


def test_the_command_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    alone = _command("--feedback", str(tmp_path / "f.jsonl"))
    assert alone.returncode == 2 and "give it too" in alone.stderr
    no_tools = _command("--traces", str(tmp_path / "t.jsonl"))
    assert no_tools.returncode == 2 and "--tools is required" in no_tools.stderr
    no_model = _command("--model-dir", str(tmp_path))
    assert no_model.returncode == 2 and "not a checkpoint directory" in no_model.stderr
    absent = _command("--traces", str(tmp_path / "t.jsonl"), "--prepare-only")
    assert absent.returncode == 2
    assert absent.stderr.strip().splitlines() == [
        f"foreign_agent: cannot read {tmp_path / 't.jsonl'}: "
        f"[Errno 2] No such file or directory: '{tmp_path / 't.jsonl'}'"
    ]
