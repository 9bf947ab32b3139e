"""A realistic loop history, inserted through the ORM: what the dashboard tests look at.

The story of ``support-bot`` over three days: the champion serves well, a tool drift makes
it fail, cycle 1 trains a candidate that wins offline but regresses live and is rolled
back, cycle 2 (triggered by the drift) trains one that is promoted and holds, and cycle 3
is training now. ``quiet-loop`` has nothing yet. User-controlled text carries XSS attempts
and a trace body carries a secret, so the tests can check both never reach a page raw.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.artifacts import ArtifactStore
from services.db.models import (
    Checkpoint,
    Cycle,
    Dataset,
    DatasetTask,
    Evaluation,
    EvaluationResult,
    Loop,
    Promotion,
    Run,
    Task,
    TaskSource,
    Trace,
)

XSS_REASON = '<img src=x onerror="window.__xss=1">watch the canary'
XSS_PROMPT = "Convert the date <script>window.__xss=2</script> using the `fmt` tool"
XSS_SIGNATURE = '<b onmouseover="window.__xss=3">bad_arguments:date</b>'
XSS_LOG_LINE = "<script>window.__xss=4</script> step 12 loss=0.41"
TRACE_SECRET = "sk-live-0123456789abcdef"
LOOP = "support-bot"
QUIET_LOOP = "quiet-loop"


# Proof of delivery as the deploy activity records it (statistics.delivery.<purpose>).
VERIFIED_NOTE = "verified: 4 probes match on token ids and log-probs"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Story:
    """Names and ids the tests assert on."""

    loop: str
    quiet_loop: str
    base_checkpoint: str
    rolled_back_checkpoint: str
    champion_checkpoint: str
    cycle2_train_run: str
    cycle3_train_run: str
    outside_logs_run: str
    trace_count: int
    cycle2_dataset_id: int
    cycle2_task_count: int
    cycle2_trace_count: int
    cluster_ids: tuple[str, ...]
    start: dt.datetime


def _success_rate(hour: float) -> float:
    """The served model's true success rate over the story (hours since the start)."""
    if hour < 24:
        return 0.85  # healthy
    if hour < 30:
        return 0.40  # tool drift
    if hour < 32:
        return 0.25  # cycle 1's candidate regresses live
    if hour < 44:
        return 0.40  # rolled back to the base model
    return 0.90  # cycle 2's candidate holds


def _traces(loop: Loop, start: dt.datetime) -> list[Trace]:
    traces = []
    for i in range(72 * 4):  # one trace every 15 minutes for three days
        hour = i / 4
        rate = _success_rate(hour)
        success = (i * 7) % 20 < rate * 20
        at = start + dt.timedelta(hours=hour)
        body: dict[str, Any] = {
            "messages": [
                {"role": "user", "content": f"ticket {i}: my api key is {TRACE_SECRET}"},
                {"role": "assistant", "content": "<script>window.__xss=5</script>"},
            ],
            "outcome": {"success": success},
        }
        traces.append(
            Trace(
                loop_id=loop.id,
                external_id=f"tr-{i:04d}",
                model_version="base" if hour < 30 or 32 <= hour < 44 else "candidate",
                success=success,
                score=1.0 if success else 0.0,
                error_kind=None if success else "tool_not_found",
                body=body,
                size_bytes=400,
                started_at=at - dt.timedelta(seconds=20),
                ended_at=at,
                received_at=at,
            )
        )
    return traces


def _task(loop: Loop, cluster: str, index: int, split: str, signature: str, prompt: str) -> Task:
    spec = {
        "schema": "ratchet.task/v1",
        "task_id": _sha(f"{cluster}-{index}"),
        "environment": "toolcalc",
        "prompt": prompt,
        "tools": [{"name": "lookup_v2"}, {"name": "fmt"}],
        "verifier": {"reward_id": "exact_answer", "params": {"answer": str(index)}},
        "reference_answer": str(index),
        "metadata": {},
    }
    return Task(
        loop_id=loop.id,
        content_hash=_sha(f"{cluster}-{index}"),
        environment="toolcalc",
        spec=spec,
        cluster_id=cluster,
        split=split,
        failure_signature=signature,
        redactions={"api_key": 1},
    )


def _tasks(loop: Loop) -> list[Task]:
    tasks = []
    for i in range(16):
        split = "eval" if i % 8 >= 5 else "train"
        prompt = f"Look up order {1000 + i} and report its total. Key: [REDACTED:api_key]"
        tasks.append(_task(loop, "c-lookup-renamed", i, split, "tool_not_found:lookup", prompt))
    for i in range(10):
        split = "eval" if i >= 6 else "train"
        prompt = XSS_PROMPT if i == 9 else f"Format the date 2026-11-{10 + i:02d} as DD/MM/YYYY"
        tasks.append(_task(loop, "c-date-format", 100 + i, split, XSS_SIGNATURE, prompt))
    for i in range(6):
        split = "eval" if i >= 4 else "train"
        prompt = f"Add {i} and {i + 7} with the calc tool"
        tasks.append(_task(loop, "c-calc-args", 200 + i, split, "bad_arguments:calc", prompt))
    return tasks


def _checkpoint(
    loop: Loop, name: str, *, parent: str | None, run: str | None, at: dt.datetime
) -> Checkpoint:
    return Checkpoint(
        id=_sha(name),
        loop_id=loop.id,
        uri=f"file:///var/lib/ratchet/checkpoints/{_sha(name)}",
        parent_id=parent,
        run_id=run,
        format="ratchet-gpt/v1",
        size_bytes=12 * 1024 * 1024,
        sha256=_sha(name),
        manifest={"files": {"model.safetensors": _sha(name + "w")}},
        created_at=at,
    )


CYCLE_STAGES = ("curate", "snapshot", "train", "evaluate", "gate", "promote", "canary", "account")


def _timings(start: dt.datetime, boundaries: list[float | None]) -> dict[str, Any]:
    """The stage timings of a cycle whose stages ran one after another: ``boundaries`` are
    the hours (after ``start``) where one stage ended and the next began; a last ``None``
    leaves the stage it ends still running."""
    timings: dict[str, Any] = {}
    for stage, begin_h, end_h in zip(CYCLE_STAGES, boundaries, boundaries[1:], strict=False):
        assert begin_h is not None, "only the last stage may still be running"
        entry: dict[str, Any] = {"started_at": (start + dt.timedelta(hours=begin_h)).isoformat()}
        if end_h is not None:
            entry["ended_at"] = (start + dt.timedelta(hours=end_h)).isoformat()
        timings[stage] = entry
    return timings


def _run(
    loop: Loop,
    cycle: Cycle,
    kind: str,
    *,
    status: str,
    dataset: Dataset | None,
    base: str | None,
    at: dt.datetime,
    hours: float | None,
    cost: str,
    logs_uri: str | None,
) -> Run:
    return Run(
        id=f"{loop.name}-c{cycle.number}-{kind}",
        loop_id=loop.id,
        cycle_id=cycle.id,
        dataset_id=dataset.id if dataset else None,
        base_checkpoint_id=base,
        kind=kind,
        executor="local",
        spec={"steps": 200, "group_size": 8},
        handle={"pid": 4242},
        status=status,
        accelerators=0,
        compute_seconds=(hours or 0.5) * 3600,
        cost_usd=Decimal(cost),
        output_uri=f"file:///var/lib/ratchet/runs/{loop.name}-c{cycle.number}-{kind}",
        logs_uri=logs_uri,
        metrics={"train_tokens_per_second": 5120.5} if kind == "train" else {},
        submitted_at=at,
        started_at=at + dt.timedelta(seconds=5),
        ended_at=at + dt.timedelta(hours=hours) if hours is not None else None,
    )


def _evaluate(
    session: Session,
    loop: Loop,
    cycle: Cycle,
    run: Run,
    dataset: Dataset,
    checkpoint: str,
    eval_tasks: list[Task],
    passing: int,
    at: dt.datetime,
) -> None:
    evaluation = Evaluation(
        loop_id=loop.id,
        cycle_id=cycle.id,
        checkpoint_id=checkpoint,
        dataset_id=dataset.id,
        run_id=run.id,
        task_set="eval",
        n=len(eval_tasks),
        passed=passing,
        pass_rate=passing / len(eval_tasks),
        ci_low=0.0,
        ci_high=1.0,
        created_at=at,
    )
    session.add(evaluation)
    session.flush()
    for index, task in enumerate(eval_tasks):
        passed = index < passing
        session.add(
            EvaluationResult(
                evaluation_id=evaluation.id,
                task_id=task.id,
                passed=passed,
                reward=1.0 if passed else 0.0,
            )
        )


def _dataset(session: Session, loop: Loop, tag: str, tasks: list[Task], at: dt.datetime) -> Dataset:
    train = [t for t in tasks if t.split == "train"]
    evals = [t for t in tasks if t.split == "eval"]
    dataset = Dataset(
        loop_id=loop.id,
        content_hash=_sha(tag),
        train_count=len(train),
        eval_count=len(evals),
        train_uri=f"file:///var/lib/ratchet/datasets/{tag}/train.jsonl",
        eval_uri=f"file:///var/lib/ratchet/datasets/{tag}/eval.jsonl",
        created_at=at,
    )
    session.add(dataset)
    session.flush()
    for task in tasks:
        session.add(DatasetTask(dataset_id=dataset.id, task_id=task.id, split=task.split))
    return dataset


def write_log(path: Path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path.as_uri()


@dataclass(frozen=True)
class _Scene:
    """What every cycle of the story is written against."""

    session: Session
    loop: Loop
    name: str
    start: dt.datetime
    artifacts_dir: Path
    base: Checkpoint
    tasks: list[Task]

    @staticmethod
    def clock(start: dt.datetime) -> Callable[[float], dt.datetime]:
        """Hours since the story's start as a time."""
        return lambda hours: start + dt.timedelta(hours=hours)


def seed_story(
    session: Session, *, now: dt.datetime, artifacts_dir: Path, name: str = LOOP
) -> Story:
    """Insert the whole story under the loop ``name``; the caller commits.

    Logs are written where the worker keeps them: ``<artifacts>/loops/<loop>/runs/<run>/logs``.
    """
    start = now - dt.timedelta(hours=72)

    at = _Scene.clock(start)

    loop = Loop(
        name=name,
        environment="toolcalc",
        budget_usd=Decimal("25"),
        status_reason=XSS_REASON,
        gate_policy={"confidence": 0.95},
    )
    quiet = Loop(name=QUIET_LOOP, environment="toolcalc")
    session.add_all([loop, quiet])
    session.flush()

    base = _checkpoint(loop, "base", parent=None, run=None, at=at(-24))
    session.add(base)
    traces = _traces(loop, start)
    session.add_all(traces)
    tasks = _tasks(loop)
    session.add_all(tasks)
    session.flush()
    failed = [t for t in traces if not t.success and t.received_at >= at(24)]
    for index, task in enumerate(tasks):
        session.add(TaskSource(task_id=task.id, trace_id=failed[index % len(failed)].id))
        if index % 3 == 0:
            session.add(
                TaskSource(
                    task_id=task.id,
                    trace_id=failed[(index + 7) % len(failed)].id,
                    relation="duplicate",
                )
            )

    scene = _Scene(session, loop, name, start, artifacts_dir, base, tasks)
    ckpt1, r1e = _rolled_back_cycle(scene)
    ckpt2, r2, d2 = _promoted_cycle(scene)
    r3 = _training_cycle(scene, ckpt2)

    c2_tasks = len(tasks)
    c2_traces = len({s.trace_id for s in session.query(TaskSource).all()})
    return Story(
        loop=name,
        quiet_loop=quiet.name,
        base_checkpoint=base.id,
        rolled_back_checkpoint=ckpt1.id,
        champion_checkpoint=ckpt2.id,
        cycle2_train_run=r2.id,
        cycle3_train_run=r3.id,
        outside_logs_run=r1e.id,
        trace_count=len(traces),
        cycle2_dataset_id=d2.id,
        cycle2_task_count=c2_tasks,
        cycle2_trace_count=c2_traces,
        cluster_ids=("c-lookup-renamed", "c-date-format", "c-calc-args"),
        start=start,
    )


def _rolled_back_cycle(scene: _Scene) -> tuple[Checkpoint, Run]:
    """Cycle 1: wins offline, regresses live, rolled back."""
    session, loop, name = scene.session, scene.loop, scene.name
    base, tasks = scene.base, scene.tasks
    start, at = scene.start, _Scene.clock(scene.start)
    cycle1_tasks = [t for t in tasks if t.cluster_id != "c-calc-args"]
    d1 = _dataset(session, loop, "d1", cycle1_tasks, at(25.5))
    c1 = Cycle(
        loop_id=loop.id,
        number=1,
        trigger="min_new_tasks",
        stage="account",
        outcome="rolled_back",
        outcome_detail="live success fell from 40% to 25%",
        workflow_id=f"loop/{name}",
        dataset_id=d1.id,
        champion_checkpoint_id=base.id,
        stage_timings=_timings(start, [25, 25.5, 25.6, 28.5, 29.5, 29.6, 30, 32, 32.1]),
        compute_seconds=3.5 * 3600,
        cost_usd=Decimal("1.40"),
        points_gained=0.0,
        started_at=at(25),
        ended_at=at(32.1),
    )
    session.add(c1)
    session.flush()
    r1 = _run(
        loop,
        c1,
        "train",
        status="succeeded",
        dataset=d1,
        base=base.id,
        at=at(25.6),
        hours=2.9,
        cost="1.15",
        logs_uri=None,
    )
    session.add(r1)
    session.flush()
    ckpt1 = _checkpoint(loop, "c1", parent=base.id, run=r1.id, at=at(28.5))
    session.add(ckpt1)
    session.flush()
    c1.candidate_checkpoint_id = ckpt1.id
    r1e = _run(
        loop,
        c1,
        "eval",
        status="succeeded",
        dataset=d1,
        base=None,
        at=at(28.5),
        hours=1,
        cost="0.25",
        logs_uri="file:///etc/passwd",
    )
    session.add(r1e)
    session.flush()
    eval1 = [t for t in cycle1_tasks if t.split == "eval"]
    _evaluate(session, loop, c1, r1e, d1, base.id, eval1, 2, at(29.5))
    _evaluate(session, loop, c1, r1e, d1, ckpt1.id, eval1, 6, at(29.5))
    session.add(
        Promotion(
            loop_id=loop.id,
            cycle_id=c1.id,
            decision="promote",
            status="rolled_back",
            reason="candidate +57 points on eval (p=0.03)",
            statistics={
                "p_value": 0.03,
                "delivery": {
                    "candidate": {"verified": True, "note": VERIFIED_NOTE},
                    "rollback": {"verified": False, "note": "not verified: no probe set"},
                },
            },
            candidate_checkpoint_id=ckpt1.id,
            previous_checkpoint_id=base.id,
            decided_at=at(29.6),
            deployed_at=at(30),
            canary_ended_at=at(32),
            rolled_back_at=at(32),
        )
    )

    return ckpt1, r1e


def _promoted_cycle(scene: _Scene) -> tuple[Checkpoint, Run, Dataset]:
    """Cycle 2: triggered by the drift, promoted, holds."""
    session, loop, name = scene.session, scene.loop, scene.name
    base, tasks, artifacts_dir = scene.base, scene.tasks, scene.artifacts_dir
    start, at = scene.start, _Scene.clock(scene.start)
    d2 = _dataset(session, loop, "d2", tasks, at(34.5))
    c2 = Cycle(
        loop_id=loop.id,
        number=2,
        trigger="drift",
        trigger_detail={"failure_rate": 0.6},
        stage="account",
        outcome="promoted",
        workflow_id=f"loop/{name}",
        dataset_id=d2.id,
        champion_checkpoint_id=base.id,
        stage_timings=_timings(start, [34, 34.5, 34.6, 41, 43, 43.1, 44, 46, 46.1]),
        compute_seconds=8.4 * 3600,
        cost_usd=Decimal("2.10"),
        points_gained=58.3,
        gate_points=91.7,
        live_points=41.0,
        points_detail={
            "heldout": {"points": 58.3, "ci_low_points": 40.1, "ci_high_points": 72.4, "n": 40},
            "gate": {"points": 91.7, "ci_low_points": 75.0, "ci_high_points": 100.0, "n": 12},
            "live": {
                "points": 41.0,
                "ci_low_points": 22.5,
                "ci_high_points": 55.2,
                "n_before": 40,
                "successes_before": 16,
                "n_after": 60,
                "successes_after": 49,
            },
        },
        started_at=at(34),
        ended_at=at(46.1),
        estimate_usd=Decimal("2.00"),
        estimate={"phases": {"rollout": {"cost_usd": 1.0}, "evaluation": {"cost_usd": 0.6}}},
        cost_by_phase={
            "rollout": {"seconds": 9000.0, "compute_s": 18000.0, "cost_usd": 1.2},
            "update": {"seconds": 3000.0, "compute_s": 6000.0, "cost_usd": 0.3},
            "evaluation": {"seconds": 6000.0, "compute_s": 6000.0, "cost_usd": 0.6},
        },
    )
    session.add(c2)
    session.flush()
    train_log = write_log(
        ArtifactStore(artifacts_dir).logs_dir(name, f"{name}-c2-train") / "job.log",
        [f"step {i} loss={1 / (i + 1):.3f}" for i in range(400)],
    )
    r2 = _run(
        loop,
        c2,
        "train",
        status="succeeded",
        dataset=d2,
        base=base.id,
        at=at(34.6),
        hours=6.4,
        cost="1.60",
        logs_uri=train_log,
    )
    # where cycle 2's training went: 4 of its 6.4 hours rolling out, 2 updating
    r2.metrics = {
        **r2.metrics,
        "phases": {"rollout": {"seconds": 14400.0}, "update": {"seconds": 7200.0}},
    }
    session.add(r2)
    session.flush()
    ckpt2 = _checkpoint(loop, "c2", parent=base.id, run=r2.id, at=at(41))
    session.add(ckpt2)
    session.flush()
    c2.candidate_checkpoint_id = ckpt2.id
    r2e = _run(
        loop,
        c2,
        "eval",
        status="succeeded",
        dataset=d2,
        base=None,
        at=at(41),
        hours=2,
        cost="0.50",
        logs_uri=None,
    )
    session.add(r2e)
    session.flush()
    eval2 = [t for t in tasks if t.split == "eval"]
    _evaluate(session, loop, c2, r2e, d2, base.id, eval2, 3, at(43))
    _evaluate(session, loop, c2, r2e, d2, ckpt2.id, eval2, 10, at(43))
    session.add(
        Promotion(
            loop_id=loop.id,
            cycle_id=c2.id,
            decision="promote",
            status="held",
            reason="candidate +58 points on eval (p=0.004), no regression",
            statistics={
                "p_value": 0.004,
                "delivery": {"candidate": {"verified": True, "note": VERIFIED_NOTE}},
            },
            candidate_checkpoint_id=ckpt2.id,
            previous_checkpoint_id=base.id,
            decided_at=at(43.1),
            deployed_at=at(44),
            canary_ended_at=at(46),
        )
    )
    loop.champion_checkpoint_id = ckpt2.id

    return ckpt2, r2, d2


def _training_cycle(scene: _Scene, champion: Checkpoint) -> Run:
    """Cycle 3: training now, from cycle 2's champion."""
    session, loop, name = scene.session, scene.loop, scene.name
    tasks, artifacts_dir = scene.tasks, scene.artifacts_dir
    start, at = scene.start, _Scene.clock(scene.start)
    d3 = _dataset(session, loop, "d3", tasks, at(70.5))
    c3 = Cycle(
        loop_id=loop.id,
        number=3,
        trigger="min_new_tasks",
        stage="train",
        workflow_id=f"loop/{name}",
        dataset_id=d3.id,
        champion_checkpoint_id=champion.id,
        stage_timings=_timings(start, [70, 70.5, 70.6, None]),
        started_at=at(70),
        # estimated before its training started, from cycles 1 and 2
        estimate_usd=Decimal("1.90"),
        estimate={
            "phases": {
                "rollout": {"units": 512, "compute_s": 9000.0, "cost_usd": 0.9},
                "update": {"units": 40, "compute_s": 4000.0, "cost_usd": 0.4},
                "evaluation": {"units": 320, "compute_s": 6000.0, "cost_usd": 0.6},
            },
            "measured_cycles": 2,
            "left_usd": 21.2,
            "low_usd": 1.5,
            "high_usd": 2.4,
            "basis": "measured over 2 cycle(s)",
        },
    )
    session.add(c3)
    session.flush()
    live_log = write_log(
        ArtifactStore(artifacts_dir).logs_dir(name, f"{name}-c3-train") / "job.log",
        ["\x1b[32mINFO\x1b[0m starting GRPO", XSS_LOG_LINE, "step 13 loss=0.40"],
    )
    r3 = _run(
        loop,
        c3,
        "train",
        status="running",
        dataset=d3,
        base=champion.id,
        at=at(70.6),
        hours=None,
        cost="0.30",
        logs_uri=live_log,
    )
    session.add(r3)
    session.flush()

    return r3
