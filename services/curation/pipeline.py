"""One curation batch: uncurated traces in, tasks out, every trace stamped, in one transaction.

The caller opens the transaction and holds the loop's curation lock; :func:`curate_batch`
then

1. locks the loop's oldest uncurated traces (``FOR UPDATE SKIP LOCKED``),
2. selects: failures, a stable sample of successes, the rest skipped,
3. screens each body and runs the environment's adapter (rejections recorded with a reason),
4. redacts every string of the task (a task whose verifier or reference answer held a
   sensitive value is rejected: it could not be checked without it),
5. deduplicates: exact by content hash, near by MinHash-LSH against the batch and every
   stored task of the loop (persisted bands), folding duplicates into the kept task's
   weight and sources,
6. clusters and splits the new tasks,
7. writes tasks, sources, bands and weights, and stamps ``curated_at`` plus the verdict on
   every trace.

Because step 7 commits with the task rows, a crash anywhere rolls the whole batch back and a
retry curates the same traces once; a trace is never curated twice.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from services.curation import dedup
from services.curation.adapters import TraceAdapter, adapt, similarity_text
from services.curation.policy import CurationPolicy
from services.curation.redaction import Redactor
from services.curation.selection import (
    Outcome,
    classify,
    failure_signature,
    sampled,
    screen_trace,
)
from services.curation.similarity import (
    Signature,
    band_keys,
    content_hash,
    signature,
    signature_from_bytes,
    signature_to_bytes,
    verifier_key,
)
from services.curation.splits import ClusterSplit, Origin, SplitAssigner
from services.db.models import Loop
from services.db.queries import curation as q
from services.environments.base import Rejection, TaskSpec

logger = logging.getLogger(__name__)

# Newest stored tasks consulted per LSH bucket (see q.lsh_neighbours).
NEIGHBOURS_PER_BUCKET = 64
_HEARTBEAT_EVERY = 50


@dataclass(frozen=True)
class _Prepared:
    """A trace that yielded a redacted task, ready for deduplication."""

    trace_id: int
    origin: Origin
    task: TaskSpec
    key: str
    verifier: str
    signature: Signature
    redactions: dict[str, int]
    failure_signature: str | None


@dataclass
class BatchReport:
    """What one batch did; counters feed the activity result and the metrics."""

    traces_seen: int = 0
    tasks_created: int = 0
    duplicates: int = 0
    rejected: int = 0
    skipped: int = 0
    new_train_tasks: int = 0
    more: bool = False
    rejections: Counter[str] = field(default_factory=Counter)
    redactions: Counter[str] = field(default_factory=Counter)


def curate_batch(
    session: Session,
    *,
    loop: Loop,
    policy: CurationPolicy,
    adapter: TraceAdapter,
    limit: int,
    heartbeat: Callable[[], None] = lambda: None,
) -> BatchReport:
    """Curate up to ``limit`` uncurated traces of ``loop`` (see the module docstring)."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    traces = q.lock_uncurated_traces(session, loop_id=loop.id, limit=limit)
    report = BatchReport(traces_seen=len(traces), more=len(traces) == limit)
    if not traces:
        return report
    heartbeat()
    redactor = Redactor(policy.redact_patterns, high_entropy=policy.redact_high_entropy)
    verdicts: dict[int, q.Verdict] = {}
    prepared: list[_Prepared] = []
    for index, trace in enumerate(traces):
        if index % _HEARTBEAT_EVERY == 0:
            heartbeat()
        result = _prepare(trace, loop=loop, policy=policy, adapter=adapter, redactor=redactor)
        if isinstance(result, q.Verdict):
            verdicts[trace.id] = result
            if result.outcome == "rejected":
                report.rejected += 1
                report.rejections[result.detail.split(":", 1)[0]] += 1
            else:
                report.skipped += 1
        else:
            prepared.append(result)
    heartbeat()
    _store(
        session,
        loop=loop,
        policy=policy,
        prepared=prepared,
        verdicts=verdicts,
        report=report,
        heartbeat=heartbeat,
    )
    heartbeat()
    q.mark_traces_curated(session, verdicts=[verdicts[t.id] for t in traces])
    return report


def _prepare(
    trace: q.TraceRow,
    *,
    loop: Loop,
    policy: CurationPolicy,
    adapter: TraceAdapter,
    redactor: Redactor,
) -> _Prepared | q.Verdict:
    outcome = Outcome(trace.success, trace.score, trace.error_kind)
    verdict = classify(outcome, failure_score_threshold=policy.failure_score_threshold)
    if verdict == "unknown":
        return q.Verdict(trace.id, "skipped", "no outcome reported")
    if verdict == "success" and not sampled(loop.id, trace.external_id, policy.success_sample_rate):
        return q.Verdict(trace.id, "skipped", "success outside the regression sample")
    rejection = screen_trace(
        trace.body, size_bytes=trace.size_bytes, max_trace_bytes=policy.max_trace_bytes
    )
    task = rejection or adapt(adapter, trace.body)
    if isinstance(task, Rejection):
        return _rejected(trace.id, task, redactor)
    if task.environment != loop.environment:
        return _rejected(
            trace.id,
            Rejection("wrong_environment", f"adapter built a {task.environment!r} task"),
            redactor,
        )
    redacted = _redact_task(task, redactor)
    if isinstance(redacted, Rejection):
        return _rejected(trace.id, redacted, redactor)
    clean, counts = redacted
    signature_text = similarity_text(adapter, clean)
    origin: Origin = "failure" if verdict == "failure" else "success"
    return _Prepared(
        trace_id=trace.id,
        origin=origin,
        task=clean,
        key=content_hash(
            environment=clean.environment,
            prompt=clean.prompt,
            tools=clean.tools,
            verifier=clean.verifier,
            reference_answer=clean.reference_answer,
        ),
        verifier=verifier_key(clean.verifier),
        signature=signature(signature_text),
        redactions=counts,
        failure_signature=(
            redactor.redact_text(failure_signature(trace.body, trace.error_kind), Counter())
            if origin == "failure"
            else None
        ),
    )


def _rejected(trace_id: int, rejection: Rejection, redactor: Redactor) -> q.Verdict:
    message = redactor.redact_text(rejection.message, Counter())
    return q.Verdict(trace_id, "rejected", f"{rejection.reason}: {message}"[:1000])


def _redact_task(task: TaskSpec, redactor: Redactor) -> tuple[TaskSpec, dict[str, int]] | Rejection:
    """The task with sensitive values replaced, or a rejection if its answer held any."""
    checked: Counter[str] = Counter()
    verifier = redactor.redact_value(task.verifier, checked)
    reference = (
        redactor.redact_text(task.reference_answer, checked)
        if task.reference_answer is not None
        else None
    )
    if checked:
        kinds = ", ".join(sorted(checked))
        return Rejection(
            "sensitive_answer",
            f"the verifier or reference answer holds sensitive data ({kinds}); "
            "the task cannot be checked without it",
        )
    counts: Counter[str] = Counter()
    prompt = redactor.redact_text(task.prompt, counts)
    tools = redactor.redact_shared(task.tools, counts)
    metadata = redactor.redact_value(task.metadata, counts)
    if not counts:
        return task, {}
    clean = TaskSpec.create(
        environment=task.environment,
        prompt=prompt,
        tools=tools,
        verifier=verifier,
        reference_answer=reference,
        metadata=metadata,
    )
    return clean, dict(counts)


def _store(
    session: Session,
    *,
    loop: Loop,
    policy: CurationPolicy,
    prepared: list[_Prepared],
    verdicts: dict[int, q.Verdict],
    report: BatchReport,
    heartbeat: Callable[[], None],
) -> None:
    """Deduplicate, cluster, split and write the batch's tasks; fill in trace verdicts."""
    groups: dict[str, list[_Prepared]] = defaultdict(list)
    for item in prepared:
        groups[item.key].append(item)
    existing = q.tasks_by_content_hash(session, loop_id=loop.id, hashes=list(groups))
    increments: Counter[int] = Counter()
    sources: list[tuple[int, int, str]] = []
    for key, items in groups.items():
        if key in existing:
            task_id = existing[key].task_id
            increments[task_id] += len(items)
            for item in items:
                sources.append((task_id, item.trace_id, "duplicate"))
                verdicts[item.trace_id] = q.Verdict(
                    item.trace_id, "duplicate", f"exact duplicate of task {task_id}"
                )
            report.duplicates += len(items)
    fresh = {key: items for key, items in groups.items() if key not in existing}
    new_tasks = [
        dedup.NewTask(key, items[0].verifier, items[0].signature, weight=len(items))
        for key, items in fresh.items()
    ]
    neighbours = q.lsh_neighbours(
        session,
        loop_id=loop.id,
        bands=[band for task in new_tasks for band in band_keys(task.signature)],
        per_bucket=NEIGHBOURS_PER_BUCKET,
    )
    stored = [
        dedup.StoredTask(
            n.task_id,
            n.content_hash,
            verifier_key(n.verifier),
            signature_from_bytes(n.minhash),
            n.cluster_id,
        )
        for n in neighbours
    ]
    heartbeat()
    decisions = dedup.plan(
        new_tasks,
        stored,
        near_duplicate_threshold=policy.near_duplicate_threshold,
        cluster_threshold=policy.cluster_threshold,
    )
    kept = sorted(key for key, d in decisions.items() if d.kind == "new")
    weights = {key: len(fresh[key]) for key in kept}
    for key, decision in decisions.items():
        if decision.kind == "duplicate" and decision.target_key is not None:
            weights[decision.target_key] += len(fresh[key])
    rows = _task_rows(
        session,
        loop=loop,
        policy=policy,
        kept=kept,
        fresh=fresh,
        decisions=decisions,
        weights=weights,
    )
    heartbeat()
    ids = q.insert_tasks(session, rows=rows)
    report.tasks_created = len(kept)
    report.new_train_tasks = sum(1 for row in rows if row["split"] == "train")
    for row in rows:
        for kind, n in row["redactions"].items():
            report.redactions[kind] += n
    splits = {row["content_hash"]: row["split"] for row in rows}
    for key in kept:
        task_id = ids[key]
        first = _origin_item(fresh[key])
        rest = [item for item in fresh[key] if item is not first]
        sources.append((task_id, first.trace_id, "origin"))
        verdicts[first.trace_id] = q.Verdict(
            first.trace_id, "task", f"task {task_id} ({splits[key]})"
        )
        for item in rest:
            sources.append((task_id, item.trace_id, "duplicate"))
            verdicts[item.trace_id] = q.Verdict(
                item.trace_id, "duplicate", f"exact duplicate of task {task_id}"
            )
        report.duplicates += len(rest)
    for key, decision in decisions.items():
        if decision.kind != "duplicate":
            continue
        target = decision.target_task_id or ids[decision.target_key or ""]
        if decision.target_task_id is not None:
            increments[target] += len(fresh[key])
        for item in fresh[key]:
            sources.append((target, item.trace_id, "near_duplicate"))
            verdicts[item.trace_id] = q.Verdict(
                item.trace_id,
                "duplicate",
                f"near duplicate of task {target} (similarity {decision.similarity:.2f})",
            )
        report.duplicates += len(fresh[key])
    heartbeat()
    q.add_task_weights(session, increments=increments)
    q.insert_lsh_buckets(
        session,
        loop_id=loop.id,
        rows=[
            (band, bucket, ids[key])
            for key in kept
            for band, bucket in band_keys(fresh[key][0].signature)
        ],
    )
    q.insert_task_sources(session, rows=sources)


def _task_rows(
    session: Session,
    *,
    loop: Loop,
    policy: CurationPolicy,
    kept: list[str],
    fresh: Mapping[str, list[_Prepared]],
    decisions: Mapping[str, dedup.Decision],
    weights: Mapping[str, int],
) -> list[dict[str, Any]]:
    clusters = sorted({decisions[key].cluster_id for key in kept})
    stored_splits = q.cluster_splits(session, loop_id=loop.id, cluster_ids=clusters)
    assigner = SplitAssigner(
        cluster_splits={c: _cluster_split(s) for c, s in stored_splits.items()},
        heldout_count=q.heldout_count(session, loop_id=loop.id),
        heldout_max_tasks=policy.heldout_max_tasks,
        eval_fraction=policy.eval_fraction,
        heldout_fraction=policy.heldout_fraction,
    )
    rows: list[dict[str, Any]] = []
    for key in kept:
        first = _origin_item(fresh[key])
        origin = first.origin
        cluster = decisions[key].cluster_id
        rows.append(
            {
                "loop_id": loop.id,
                "content_hash": key,
                "environment": first.task.environment,
                "spec": first.task.to_dict(),
                "origin": origin,
                "cluster_id": cluster,
                "split": assigner.assign(cluster, origin),
                "weight": weights[key],
                "pinned": False,
                "failure_signature": first.failure_signature,
                "redactions": first.redactions,
                "minhash": signature_to_bytes(first.signature),
            }
        )
    return rows


def _origin_item(items: list[_Prepared]) -> _Prepared:
    """The trace a new task is credited to: the first failure, else the first success."""
    return next((i for i in items if i.origin == "failure"), items[0])


def _cluster_split(split: str) -> ClusterSplit:
    if split == "train":
        return "train"
    if split == "eval":
        return "eval"
    return "heldout"
