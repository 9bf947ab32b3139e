"""One curation batch on a real Postgres: selection, adapters, redaction, dedup, splits."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, text

from services.curation.pipeline import BatchReport, curate_batch
from services.curation.policy import CurationPolicy
from services.db.models import Loop, LshBucket, Task, TaskSource, Trace
from services.db.queries import tasks as task_queries
from services.db.queries import traces as trace_queries
from services.db.session import SessionFactory
from services.environments import get_environment
from services.environments.base import build_trace
from services.environments.toolcalc import ToolcalcEnvironment
from tests.services.curation.support import (
    QaAdapter,
    add_traces,
    make_loop,
    trace_body,
    traces_by_id,
)

WORDS = [
    *("order", "refund", "invoice", "password", "account", "login", "delivery", "address"),
    *("parcel", "broken", "missing", "late", "export", "report", "timeout", "plan", "premium"),
    *("cancel", "upgrade", "billing", "card", "charge", "twice", "email", "phone", "reset"),
    *("link", "expired", "warehouse", "courier", "tracking", "label", "customs", "return"),
    *("exchange", "size", "colour"),
]


def run_batch(
    session_factory: SessionFactory, loop_id: int, *, limit: int = 100, adapter: Any = None
) -> BatchReport:
    with session_factory.begin() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        return curate_batch(
            session,
            loop=loop,
            policy=CurationPolicy.from_json(loop.curation_policy),
            adapter=adapter or QaAdapter(),
            limit=limit,
        )


def tasks_of(session_factory: SessionFactory, loop_id: int) -> list[Task]:
    with session_factory() as session:
        return list(session.scalars(select(Task).where(Task.loop_id == loop_id).order_by(Task.id)))


def sources_of(session_factory: SessionFactory, task_id: int) -> list[tuple[int, str]]:
    with session_factory() as session:
        rows = session.execute(
            select(TaskSource.trace_id, TaskSource.relation)
            .where(TaskSource.task_id == task_id)
            .order_by(TaskSource.trace_id)
        ).all()
        return [(r[0], r[1]) for r in rows]


def test_failures_become_tasks_and_every_trace_is_stamped(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory, curation_policy={"success_sample_rate": 0.0})
    ids = add_traces(
        session_factory,
        loop_id,
        [
            trace_body("f1", "Where is my order 1?"),
            trace_body(
                "f2", "How do I reset my password?", error_kind=None, score=0.1, success=None
            ),
            trace_body("s1", "Thanks, all good", success=True, error_kind=None),
            trace_body("u1", "No outcome here", success=None, error_kind=None),
        ],
    )
    report = run_batch(session_factory, loop_id)
    assert (report.traces_seen, report.tasks_created, report.skipped) == (4, 2, 2)
    assert not report.more
    traces = traces_by_id(session_factory, ids)
    assert all(t.curated_at is not None for t in traces.values())
    assert [traces[i].curation_outcome for i in ids] == ["task", "task", "skipped", "skipped"]
    assert traces[ids[2]].curation_detail == "success outside the regression sample"
    tasks = tasks_of(session_factory, loop_id)
    assert [t.origin for t in tasks] == ["failure", "failure"]
    (first,) = [t for t in tasks if "order 1" in t.spec["prompt"]]
    assert first.spec["verifier"] == {"reward_id": "qa/exact", "params": {"answer": "42"}}
    assert first.failure_signature == "wrong_answer|search"
    assert sources_of(session_factory, first.id) == [(ids[0], "origin")]
    assert traces[ids[0]].curation_detail == f"task {first.id} ({first.split})"
    with session_factory() as session:
        assert session.scalar(select(func.count()).select_from(LshBucket)) == 2 * 16
    assert run_batch(session_factory, loop_id).traces_seen == 0


def test_exact_duplicates_raise_the_weight_of_the_kept_task(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory)
    first = add_traces(
        session_factory,
        loop_id,
        [trace_body("a", "Where is my order?"), trace_body("b", "Where   is my order?")],
    )
    run_batch(session_factory, loop_id)
    later = add_traces(session_factory, loop_id, [trace_body("c", "Where is my order? ")])
    report = run_batch(session_factory, loop_id)
    assert (report.tasks_created, report.duplicates) == (0, 1)
    (task,) = tasks_of(session_factory, loop_id)
    assert task.weight == 3
    assert sources_of(session_factory, task.id) == [
        (first[0], "origin"),
        (first[1], "duplicate"),
        (later[0], "duplicate"),
    ]
    detail = traces_by_id(session_factory, later)[later[0]].curation_detail
    assert detail == f"exact duplicate of task {task.id}"


def test_near_duplicates_match_earlier_batches_through_persisted_buckets(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(
        session_factory,
        curation_policy={"near_duplicate_threshold": 0.85, "cluster_threshold": 0.6},
    )
    question = "The export to CSV fails with a timeout when the report has many rows in it."
    add_traces(session_factory, loop_id, [trace_body("a", question)])
    run_batch(session_factory, loop_id)
    later = add_traces(
        session_factory,
        loop_id,
        [
            trace_body("b", question + " thanks"),
            trace_body("c", question + " Thanks a lot.", answer="other"),
        ],
    )
    report = run_batch(session_factory, loop_id)
    assert (report.tasks_created, report.duplicates) == (1, 1)
    kept, cousin = tasks_of(session_factory, loop_id)
    assert kept.weight == 2
    assert sources_of(session_factory, kept.id)[1] == (later[0], "near_duplicate")
    assert cousin.cluster_id == kept.cluster_id
    assert cousin.split == kept.split
    detail = traces_by_id(session_factory, later)[later[0]].curation_detail or ""
    assert detail.startswith(f"near duplicate of task {kept.id} (similarity ")


def test_bad_traces_are_rejected_with_a_reason_and_never_block_the_batch(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory, curation_policy={"max_trace_bytes": 50_000})
    bodies: list[Any] = [
        trace_body("no-answer", "What is up?", answer=None),
        trace_body("boom", "Explode please", metadata={"explode": True}),
        trace_body("empty", "   "),
        "just a string",
        {
            "schema": "ratchet.trace/v1",
            "messages": [{"role": "user", "content": "\x01\x02\x03"}],
            "outcome": {"success": False},
        },
        trace_body("calls", "Bad calls", metadata={})
        | {"messages": [{"role": "assistant", "tool_calls": "x"}]},
        trace_body("good", "A fine question"),
    ]
    ids = add_traces(session_factory, loop_id, bodies)
    ids += add_traces(session_factory, loop_id, [trace_body("huge", "Big one")], size=60_000)
    # Bodies that are not objects have no outcome columns: mark them failed so they are tried.
    with session_factory.begin() as session:
        session.execute(text("UPDATE traces SET success = false WHERE success IS NULL"))
    report = run_batch(session_factory, loop_id)
    assert report.tasks_created == 1
    assert report.rejected == 7
    assert report.rejections == Counter(
        {
            "no_answer": 1,
            "adapter_error": 1,
            "no_user_message": 1,
            "malformed_trace": 1,
            "binary_payload": 1,
            "unknown_tool_format": 1,
            "too_large": 1,
        }
    )
    traces = traces_by_id(session_factory, ids)
    details = {traces[i].external_id: traces[i].curation_detail for i in ids}
    assert details["boom"] == "adapter_error: RuntimeError: adapter bug"
    assert (details["huge"] or "").startswith("too_large: trace is 60000 bytes")
    assert all(t.curated_at is not None for t in traces.values())
    assert [t.curation_outcome for t in traces.values()].count("rejected") == 7


def test_sensitive_values_are_redacted_before_anything_is_stored(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(
        session_factory,
        curation_policy={"redact_patterns": [{"name": "ticket", "pattern": r"TCK-\d{4}"}]},
    )
    secrets = [
        "bob@example.com",
        "4111 1111 1111 1111",
        "sk-proj-abcdefghijklmnopqrstuv1234",
        "TCK-9981",
    ]
    question = "Refund " + " and ".join(secrets)
    ids = add_traces(
        session_factory,
        loop_id,
        [
            trace_body("pii", question, metadata={"note": "reach me at +1 (555) 123-4567"}),
            trace_body("leaky-answer", "What is my email?", answer="alice@example.com"),
        ],
    )
    report = run_batch(session_factory, loop_id)
    (task,) = tasks_of(session_factory, loop_id)
    stored = json.dumps(task.spec)
    for secret in [*secrets, "555) 123-4567"]:
        assert secret not in stored
    assert task.redactions == {"email": 1, "card": 1, "api_key": 1, "custom_ticket": 1, "phone": 1}
    assert report.redactions == Counter(task.redactions)
    leaky = traces_by_id(session_factory, ids)[ids[1]]
    assert leaky.curation_outcome == "rejected"
    assert (leaky.curation_detail or "").startswith("sensitive_answer:")
    assert "alice@example.com" not in (leaky.curation_detail or "")


def test_sampled_successes_become_regression_tasks(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory, curation_policy={"success_sample_rate": 1.0})
    add_traces(
        session_factory,
        loop_id,
        [trace_body("ok", "Worked fine", success=True, error_kind=None, score=1.0)],
    )
    run_batch(session_factory, loop_id)
    (task,) = tasks_of(session_factory, loop_id)
    assert (task.origin, task.split) == ("success", "regression")


def test_clusters_never_span_train_and_eval_in_the_table(session_factory: SessionFactory) -> None:
    loop_id = make_loop(
        session_factory,
        curation_policy={
            "eval_fraction": 0.3,
            "heldout_fraction": 0.2,
            "heldout_max_tasks": 5,
            "cluster_threshold": 0.6,
            "near_duplicate_threshold": 0.95,
        },
    )
    words = random.Random(5).choices(WORDS, k=40 * 10)
    bases = [" ".join(words[i * 10 : (i + 1) * 10]) for i in range(40)]
    bodies = [
        trace_body(f"t{i}-{v}", b + suffix, answer=f"{i}-{v}")
        for i, b in enumerate(bases)
        for v, suffix in enumerate(["", " today"])
    ]
    add_traces(session_factory, loop_id, bodies)
    while run_batch(session_factory, loop_id, limit=17).traces_seen:
        pass
    tasks = tasks_of(session_factory, loop_id)
    assert len(tasks) == 80
    by_cluster: dict[str, set[str]] = {}
    for task in tasks:
        by_cluster.setdefault(task.cluster_id, set()).add(task.split)
    assert len(by_cluster) < 80  # the " today" variants joined their base's cluster
    for splits in by_cluster.values():
        assert not ("train" in splits and splits & {"eval", "heldout"})
    assert sum(t.split == "heldout" for t in tasks) <= 5
    assert {"train", "eval"} <= {t.split for t in tasks}


def test_skip_locked_gives_concurrent_batches_disjoint_traces(
    session_factory: SessionFactory,
) -> None:
    loop_id = make_loop(session_factory)
    add_traces(session_factory, loop_id, [trace_body(f"t{i}", f"question {i}") for i in range(10)])
    with session_factory.begin() as holder:
        held = trace_queries.lock_uncurated_traces(session=holder, loop_id=loop_id, limit=4)
        with session_factory.begin() as other:
            got = trace_queries.lock_uncurated_traces(session=other, loop_id=loop_id, limit=10)
        assert {t.id for t in held}.isdisjoint({t.id for t in got})
        assert len(held) + len(got) == 10


def test_concurrent_workers_curate_each_trace_exactly_once(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory)
    ids = add_traces(
        session_factory,
        loop_id,
        [
            trace_body(
                f"t{i}", f"question number {i % 60} about order {i % 60}", answer=str(i % 60)
            )
            for i in range(150)
        ],
    )
    reports: list[BatchReport] = []

    def worker() -> None:
        while True:
            with session_factory.begin() as session:
                loop = session.get(Loop, loop_id)
                assert loop is not None
                while not task_queries.try_lock_loop_curation(session=session, loop_id=loop_id):
                    time.sleep(0.01)
                report = curate_batch(
                    session, loop=loop, policy=CurationPolicy(), adapter=QaAdapter(), limit=20
                )
            reports.append(report)
            if not report.traces_seen:
                return

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(r.traces_seen for r in reports) == 150
    with session_factory() as session:
        per_trace = session.execute(
            select(TaskSource.trace_id, func.count()).group_by(TaskSource.trace_id)
        ).all()
        weights = session.scalar(select(func.sum(Task.weight)).where(Task.loop_id == loop_id))
        tasks = session.scalar(select(func.count()).select_from(Task))
        uncurated = session.scalar(select(func.count()).where(Trace.curated_at.is_(None)))
    assert sorted(row[0] for row in per_trace) == sorted(ids)
    assert {row[1] for row in per_trace} == {1}
    assert (weights, tasks, uncurated) == (150, 60, 0)


def _toolcalc_traces(requests: Sequence[str], *, api: str = "v2") -> list[dict[str, Any]]:
    env = ToolcalcEnvironment()
    traces = []
    for index, request in enumerate(requests):
        task = env.make_task(request, api)
        episode = env.run_episode(task, lambda _: "ans 0", max_turns=2)
        trace = build_trace(task, episode, env.verify(task, episode), external_id=f"tc-{index}")
        traces.append(trace)
    return traces


def test_real_toolcalc_adapter(session_factory: SessionFactory) -> None:
    loop_id = make_loop(session_factory, environment="toolcalc")
    bodies = _toolcalc_traces(["12+345", "$pear*37", "12+345", "77*21"])
    bodies.append(
        bodies[0] | {"external_id": "bad", "messages": [{"role": "user", "content": "hi"}]}
    )
    ids = add_traces(session_factory, loop_id, bodies)
    report = run_batch(session_factory, loop_id, adapter=get_environment("toolcalc"))
    assert (report.tasks_created, report.duplicates, report.rejected) == (3, 1, 1)
    tasks = tasks_of(session_factory, loop_id)
    assert {t.spec["verifier"]["params"]["request"] for t in tasks} == {
        "12+345",
        "$pear*37",
        "77*21",
    }
    assert {t.spec["reference_answer"] for t in tasks} == {"357", "444", "1617"}
    # Only the user's request is compared, so distinct requests are not near duplicates.
    assert len({t.cluster_id for t in tasks}) == 3
    bad = traces_by_id(session_factory, ids)[ids[-1]]
    assert (bad.curation_detail or "").startswith("unverifiable_request:")
