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

Steps 2-4 depend on one trace each and run in :mod:`services.curation.workers` (on a
process pool when one is given, which also prepares the loop's next batch while this one is
written); steps 5-7 depend on the whole batch and run here, serially. Each step's time is
reported per phase (``BatchReport.seconds``).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from sqlalchemy.orm import Session

from services.curation import dedup
from services.curation.adapters import TraceAdapter
from services.curation.policy import CurationPolicy
from services.curation.replay import batch_contexts
from services.curation.results import CurationCounts
from services.curation.similarity import (
    band_keys,
    signature_from_bytes,
    signature_to_bytes,
    verifier_key,
)
from services.curation.splits import ClusterSplit, SplitAssigner
from services.curation.workers import Prepared, PrepareJob, PreparePool, batch_redactor
from services.db.models import Loop
from services.db.queries import tasks as task_queries
from services.db.queries import traces as trace_queries

logger = logging.getLogger(__name__)

# Newest stored tasks consulted per LSH bucket (see task_queries.lsh_neighbours).
NEIGHBOURS_PER_BUCKET = 64

# The steps of a batch whose durations are reported (``BatchReport.seconds``): reading and
# locking traces, the per-trace work, the lookups of stored tasks, the batch-wide decisions,
# and the writes. Everything but ``prepare`` and ``dedup`` is time spent on Postgres.
PHASES = ("lock", "prepare", "lookup", "dedup", "write")
DATABASE_PHASES = frozenset({"lock", "lookup", "write"})

_SERIAL = PreparePool(1)


@dataclass
class BatchReport(CurationCounts):
    """What one batch did; counters feed the activity result and the metrics."""

    more: bool = False
    rejections: Counter[str] = field(default_factory=Counter)
    redactions: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - started


def curate_batch(
    session: Session,
    *,
    loop: Loop,
    policy: CurationPolicy,
    adapter: TraceAdapter,
    limit: int,
    heartbeat: Callable[[], None] = lambda: None,
    pool: PreparePool | None = None,
    only: Sequence[int] | None = None,
) -> BatchReport:
    """Curate up to ``limit`` uncurated traces of ``loop`` (see the module docstring), of
    ``only`` those when given (a failed batch curated again trace by trace).

    ``pool`` runs the per-trace work on several processes (see :mod:`.workers`); without
    one it runs here. The result is the same either way.
    """
    if limit < 1:
        raise ValueError("limit must be at least 1")
    report = BatchReport()
    with report.timed("lock"):
        traces = trace_queries.lock_uncurated_traces(
            session=session, loop_id=loop.id, limit=limit, only=only
        )
        # An uncurated trace has no task link; one left behind would fail the batch.
        trace_queries.unlink_traces(session=session, trace_ids=[t.id for t in traces])
    report.traces_seen = len(traces)
    report.more = len(traces) == limit
    if not traces:
        return report
    heartbeat()
    with report.timed("lookup"):
        contexts = batch_contexts(
            session,
            loop_id=loop.id,
            environment=loop.environment,
            policy=policy,
            traces=traces,
            redactor=batch_redactor(policy),
        )
    job = PrepareJob(loop.id, loop.environment, policy, adapter, traces, contexts)
    with report.timed("prepare"):
        results = (pool or _SERIAL).prepare(job, heartbeat=heartbeat)
    if pool is not None and pool.processes > 1 and report.more and not contexts:
        # The workers prepare the likely next batch while this one is deduplicated and
        # written here (see PreparePool.prefetch); the next batch checks every row. A batch
        # whose traces need their context (feedback, replay's store) reads it when it
        # locks them, so it cannot be prepared ahead.
        with report.timed("lock"):
            upcoming = trace_queries.peek_uncurated_traces(
                session=session, loop_id=loop.id, after_id=traces[-1].id, limit=limit
            )
        pool.prefetch(replace(job, traces=upcoming))
    verdicts, prepared = _split(results, report)
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
    with report.timed("write"):
        trace_queries.mark_traces_curated(
            session=session, verdicts=[verdicts[t.id] for t in traces]
        )
    return report


def _split(
    results: list[Prepared | trace_queries.Verdict], report: BatchReport
) -> tuple[dict[int, trace_queries.Verdict], list[Prepared]]:
    """The per-trace results as verdicts already reached (counted in ``report``) and the
    traces that yielded a task, ready for deduplication."""
    verdicts: dict[int, trace_queries.Verdict] = {}
    prepared: list[Prepared] = []
    for result in results:
        if isinstance(result, trace_queries.Verdict):
            verdicts[result.trace_id] = result
            if result.outcome == trace_queries.CurationOutcome.REJECTED:
                report.rejected += 1
                report.rejections[result.detail.split(":", 1)[0]] += 1
            else:
                report.skipped += 1
        else:
            prepared.append(result)
    return verdicts, prepared


def _store(
    session: Session,
    *,
    loop: Loop,
    policy: CurationPolicy,
    prepared: list[Prepared],
    verdicts: dict[int, trace_queries.Verdict],
    report: BatchReport,
    heartbeat: Callable[[], None],
) -> None:
    """Deduplicate, cluster, split and write the batch's tasks; fill in trace verdicts."""
    groups: dict[str, list[Prepared]] = defaultdict(list)
    for item in prepared:
        groups[item.key].append(item)
    with report.timed("lookup"):
        existing = task_queries.tasks_by_dedup_key(
            session=session, loop_id=loop.id, keys=list(groups)
        )
    links = _Links(verdicts, report)
    for key, items in groups.items():
        if key in existing:
            task_id = existing[key].task_id
            links.increments[task_id] += len(items)
            links.duplicates(task_id, items, "duplicate", f"exact duplicate of task {task_id}")
    fresh = {key: items for key, items in groups.items() if key not in existing}
    found = _near_duplicates(
        session, loop=loop, policy=policy, fresh=fresh, report=report, heartbeat=heartbeat
    )
    rows = _task_rows(
        session,
        loop=loop,
        policy=policy,
        kept=found.kept,
        fresh=fresh,
        decisions=found.decisions,
        weights=found.weights,
        report=report,
    )
    heartbeat()
    with report.timed("write"):
        ids = task_queries.insert_tasks(session=session, rows=rows)
    report.tasks_created = len(found.kept)
    report.new_train_tasks = sum(1 for row in rows if row.split == "train")
    for row in rows:
        for kind, n in row.redactions.items():
            report.redactions[kind] += n
    _link_new_tasks(links, found, fresh=fresh, ids=ids, rows=rows)
    heartbeat()
    with report.timed("write"):
        task_queries.add_task_weights(session=session, increments=links.increments)
        task_queries.insert_lsh_buckets(
            session=session,
            loop_id=loop.id,
            rows=[
                (band, bucket, ids[key]) for key in found.kept for band, bucket in found.bands[key]
            ],
        )
        task_queries.insert_task_sources(session=session, rows=links.sources)


@dataclass
class _Links:
    """What the batch's traces became: their task-source rows, each trace's verdict, and the
    weight added to tasks stored before this batch."""

    verdicts: dict[int, trace_queries.Verdict]
    report: BatchReport
    sources: list[tuple[int, int, str]] = field(default_factory=list)
    increments: Counter[int] = field(default_factory=Counter)

    def origin(self, task_id: int, item: Prepared, split: str) -> None:
        """``item``'s trace made task ``task_id``."""
        self.sources.append((task_id, item.trace_id, "origin"))
        self.verdicts[item.trace_id] = trace_queries.Verdict(
            item.trace_id, trace_queries.CurationOutcome.TASK, f"task {task_id} ({split})"
        )

    def duplicates(self, task_id: int, items: list[Prepared], kind: str, detail: str) -> None:
        """``items``' traces are duplicates (a source of ``kind``) of task ``task_id``."""
        for item in items:
            self.sources.append((task_id, item.trace_id, kind))
            self.verdicts[item.trace_id] = trace_queries.Verdict(
                item.trace_id, trace_queries.CurationOutcome.DUPLICATE, detail
            )
        self.report.duplicates += len(items)


@dataclass(frozen=True)
class _NearDuplicates:
    """The batch's new dedup keys against their stored neighbours: each key's LSH bands, its
    decision, the keys kept as new tasks and each kept task's weight."""

    bands: dict[str, list[tuple[int, bytes]]]
    decisions: dict[str, dedup.Decision]
    kept: list[str]
    weights: dict[str, int]


def _near_duplicates(
    session: Session,
    *,
    loop: Loop,
    policy: CurationPolicy,
    fresh: Mapping[str, list[Prepared]],
    report: BatchReport,
    heartbeat: Callable[[], None],
) -> _NearDuplicates:
    """Decide, for each key no stored task has, whether it is new, a near duplicate (of a
    stored task or of another new one) and in which cluster."""
    new_tasks = [
        dedup.NewTask(key, items[0].verifier, items[0].signature, weight=len(items))
        for key, items in fresh.items()
    ]
    bands = {task.key: band_keys(task.signature) for task in new_tasks}
    with report.timed("lookup"):
        neighbours = task_queries.lsh_neighbours(
            session=session,
            loop_id=loop.id,
            bands=[band for task_bands in bands.values() for band in task_bands],
            per_bucket=NEIGHBOURS_PER_BUCKET,
        )
    heartbeat()
    with report.timed("dedup"):
        stored = [
            dedup.StoredTask(
                n.task_id,
                n.dedup_key,
                _stored_verifier_key(n),
                signature_from_bytes(n.minhash),
                n.cluster_id,
            )
            for n in neighbours
        ]
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
    return _NearDuplicates(bands, decisions, kept, weights)


def _link_new_tasks(
    links: _Links,
    found: _NearDuplicates,
    *,
    fresh: Mapping[str, list[Prepared]],
    ids: Mapping[str, int],
    rows: list[task_queries.NewTaskRow],
) -> None:
    """Link the traces of the new tasks (origin and exact duplicates) and of the near
    duplicates (of a stored task, which gains their weight, or of a new one)."""
    splits = {row.dedup_key: row.split for row in rows}
    for key in found.kept:
        task_id = ids[key]
        first = _origin_item(fresh[key])
        links.origin(task_id, first, splits[key])
        rest = [item for item in fresh[key] if item is not first]
        links.duplicates(task_id, rest, "duplicate", f"exact duplicate of task {task_id}")
    for key, decision in found.decisions.items():
        if decision.kind != "duplicate":
            continue
        target = decision.target_task_id or ids[decision.target_key or ""]
        if decision.target_task_id is not None:
            links.increments[target] += len(fresh[key])
        links.duplicates(
            target,
            fresh[key],
            "near_duplicate",
            f"near duplicate of task {target} (similarity {decision.similarity:.2f})",
        )


_VERIFIER_KEYS: dict[str, str] = {}
_VERIFIER_KEYS_MAX = 65_536


def _stored_verifier_key(neighbour: task_queries.NeighbourRow) -> str:
    """The verifier key of a stored task, remembered by its content hash.

    The same popular neighbours come back batch after batch, and the content hash covers
    the verifier, so equal hashes have equal verifier keys (in any loop or database).
    """
    key = _VERIFIER_KEYS.get(neighbour.dedup_key)
    if key is None:
        if len(_VERIFIER_KEYS) >= _VERIFIER_KEYS_MAX:
            _VERIFIER_KEYS.clear()
        key = verifier_key(json.loads(neighbour.verifier_json) or {})
        _VERIFIER_KEYS[neighbour.dedup_key] = key
    return key


def _task_rows(
    session: Session,
    *,
    loop: Loop,
    policy: CurationPolicy,
    kept: list[str],
    fresh: Mapping[str, list[Prepared]],
    decisions: Mapping[str, dedup.Decision],
    weights: Mapping[str, int],
    report: BatchReport,
) -> list[task_queries.NewTaskRow]:
    clusters = sorted({decisions[key].cluster_id for key in kept})
    with report.timed("lookup"):
        stored_splits = task_queries.cluster_splits(
            session=session, loop_id=loop.id, cluster_ids=clusters
        )
        heldout = task_queries.heldout_count(session=session, loop_id=loop.id)
    assigner = SplitAssigner(
        cluster_splits={c: _cluster_split(s) for c, s in stored_splits.items()},
        heldout_count=heldout,
        heldout_max_tasks=policy.heldout_max_tasks,
        eval_fraction=policy.eval_fraction,
        heldout_fraction=policy.heldout_fraction,
    )
    rows: list[task_queries.NewTaskRow] = []
    for key in kept:
        first = _origin_item(fresh[key])
        origin = first.origin
        cluster = decisions[key].cluster_id
        rows.append(
            task_queries.NewTaskRow(
                loop_id=loop.id,
                dedup_key=key,
                environment=first.environment,
                spec_json=first.spec_json,
                origin=origin,
                cluster_id=cluster,
                split=assigner.assign(cluster, origin),
                weight=weights[key],
                failure_signature=first.failure_signature,
                redactions=first.redactions,
                minhash=signature_to_bytes(first.signature),
            )
        )
    return rows


def _origin_item(items: list[Prepared]) -> Prepared:
    """The trace a new task is credited to: the first failure, else the first success."""
    return next((i for i in items if i.origin == "failure"), items[0])


def _cluster_split(split: str) -> ClusterSplit:
    if split == "train":
        return "train"
    if split == "eval":
        return "eval"
    return "heldout"
