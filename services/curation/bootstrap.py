"""Bootstrap's demonstrations: which of a loop's traces a first champion learns from.

A loop with no champion has a base model that answers ~0% and the traffic of the agent it
serves (often a large hosted model). ``ratchet loop bootstrap`` trains a LoRA adapter over
the base model on that agent's successful conversations (docs/loops.md, "A first champion
by bootstrap"); this module chooses them and counts every trace it saw.

Which traces, and why:

- **Successes only**, classified as curation classifies them
  (:func:`services.curation.selection.classify`; feedback posted after the fact outranks the
  runtime's outcome). Failures and traces without an outcome are counted, never used.
- **Of the train split only.** Curation puts every task in a cluster, and only failures give
  a cluster its split (successes become ``regression`` tasks, or ``heldout`` ones in a
  held-out cluster: docs/curation.md, "Splits"). So a success is used when its conversation's
  cluster is on the train side:

  - a success curation folded into a task (its own sampled task, or a duplicate of another):
    a regression, held-out or eval task judges the champion, so such a trace is left out
    (``regression_task``, ``heldout_task``, ``eval_task``); a success folded into a train task
    is that train task solved;
  - a success curation did not sample (most of them: ``success_sample_rate``) has no task,
    so its cluster is found as curation would find it, without writing anything: the same
    adapter, redaction, content hash and MinHash, then the stored task it duplicates or the
    stored cluster it joins (LSH at ``cluster_threshold``), else a cluster of its own;
  - the cluster's side is the stored one (any eval or held-out task in it puts the cluster
    across the line: ``eval_cluster``, ``heldout_cluster``), else the split its id hashes to
    (:func:`services.curation.splits.split_for_cluster`): the split the cluster's first
    failure will get. The frozen held-out set is drawn from all traffic by that same hash,
    so it never holds a conversation bootstrap trained on.

- **That replays**: the conversation must end in an answer, every call must name a listed
  tool and have its result in the trace, and stepping the agent's turns through the replay
  sandbox must give back the recorded results (:mod:`services.environments.replay.
  demonstrations`); otherwise the reason is counted.
- The newest ``limit`` of them (``training_profile.bootstrap.max_demonstrations``); two
  successes with the same task content (the same request and answer) count once.

Each chosen trace becomes a replay task (redacted as curation redacts, its conversation under
``metadata.replay.demonstration`` and its lineage under ``metadata.ratchet``), the line of a
task file the SFT job trains on. The :class:`BootstrapReport` (traces seen, successes used,
left out by reason) is what the api answers, the cycle row records and the loop page shows.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.curation import dedup
from services.curation.adapters import TraceAdapter, default_resolver
from services.curation.pipeline import NEIGHBOURS_PER_BUCKET
from services.curation.policy import CurationPolicy
from services.curation.selection import Outcome, classify
from services.curation.similarity import band_keys, signature_from_bytes, verifier_key
from services.curation.splits import split_for_cluster
from services.curation.workers import Prepared, PrepareJob, batch_redactor, prepare_traces
from services.db.models import Loop
from services.db.queries import bootstrap as q
from services.db.queries import tasks as task_queries
from services.db.queries.replay import Feedback, latest_feedback
from services.db.queries.traces import TraceRow, Verdict
from services.environments.base import TaskSpec, write_task_file
from services.environments.replay.demonstrations import demonstration_messages, replay_mismatch
from services.environments.replay.env import ENVIRONMENT_NAME as REPLAY
from services.environments.replay.env import ReplayEnvironment
from services.environments.replay.rewards import feedback_is_positive

# The newest traces a bootstrap looks at (metadata only; bodies are read for successes).
SCAN_TRACES = 50_000
# Successes prepared (adapted, hashed, clustered) at a time, newest first.
CHUNK = 500


class BootstrapRefused(Exception):
    """A bootstrap that cannot run on this loop as it is (the message says why)."""


@dataclass
class BootstrapReport:
    """Every trace a bootstrap looked at: how many, what they were, which it used and why
    it left the others out (reason code: count)."""

    traces: int = 0
    successes: int = 0
    failures: int = 0
    no_outcome: int = 0
    used: int = 0
    left_out: Counter[str] = field(default_factory=Counter)
    # True when the loop holds older traces than the newest SCAN_TRACES looked at.
    truncated: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "traces": self.traces,
            "successes": self.successes,
            "failures": self.failures,
            "no_outcome": self.no_outcome,
            "used": self.used,
            "left_out": dict(sorted(self.left_out.items(), key=lambda kv: (-kv[1], kv[0]))),
            "truncated": self.truncated,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> BootstrapReport:
        return cls(
            traces=int(raw.get("traces", 0)),
            successes=int(raw.get("successes", 0)),
            failures=int(raw.get("failures", 0)),
            no_outcome=int(raw.get("no_outcome", 0)),
            used=int(raw.get("used", 0)),
            left_out=Counter({str(k): int(v) for k, v in (raw.get("left_out") or {}).items()}),
            truncated=bool(raw.get("truncated", False)),
        )

    def summary(self) -> str:
        """One line a person reads: what was seen, used and left out, and why."""
        return summary(self.to_json())


def summary(report: Mapping[str, Any]) -> str:
    """:meth:`BootstrapReport.summary` of a stored report (``cycles.trigger_detail``)."""
    left = report.get("left_out") or {}
    reasons = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in left.items())
    older = " (older traces not scanned)" if report.get("truncated") else ""
    return (
        f"{report.get('traces', 0)} traces seen{older}: {report.get('successes', 0)} "
        f"successes, {report.get('failures', 0)} failures (never used), "
        f"{report.get('no_outcome', 0)} without an outcome; {report.get('used', 0)} successes "
        f"used; {sum(left.values())} left out" + (f" ({reasons})" if reasons else "")
    )


@dataclass
class BootstrapSelection:
    """The chosen demonstrations (task file lines, newest first) and the report."""

    tasks: list[TaskSpec]
    report: BootstrapReport

    def write(self, path: Path) -> int:
        """Write the task file the SFT job trains on; how many lines."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        count = write_task_file(tmp, self.tasks)
        tmp.replace(path)
        return count


def select_demonstrations(
    session: Session, *, loop: Loop, limit: int, scan: int = SCAN_TRACES
) -> BootstrapSelection:
    """The newest ``limit`` successful train-split traces of ``loop`` as demonstration
    tasks, and the report (see the module). Reads only."""
    if loop.environment != REPLAY:
        raise BootstrapRefused(
            f"loop {loop.name!r} runs the {loop.environment} environment; bootstrap learns from "
            "the recorded conversations of successful traces, which the replay environment keeps"
        )
    if limit < 1:
        raise ValueError("limit must be at least 1")
    policy = CurationPolicy.from_json(loop.curation_policy)
    run = _Run(session, loop, policy, BootstrapReport(), limit)
    rows = q.newest_traces(session=session, loop_id=loop.id, limit=scan)
    run.report.traces, run.report.truncated = len(rows), len(rows) == scan
    feedback = latest_feedback(session=session, trace_ids=[row.id for row in rows])
    successes = [row for row in rows if run.success(row, feedback.get(row.id))]
    links = q.task_links(session=session, trace_ids=[row.id for row in successes])
    candidates = [row for row in successes if run.may_train(links.get(row.id))]
    for chunk in _chunks(candidates, CHUNK):
        if len(run.tasks) >= limit:
            run.report.left_out["over_limit"] += len(chunk)
            continue
        run.take(chunk, links, feedback)
    run.report.used = len(run.tasks)
    return BootstrapSelection(run.tasks, run.report)


@dataclass
class _Run:
    """One selection in progress: what it reads with, what it has chosen and counted."""

    session: Session
    loop: Loop
    policy: CurationPolicy
    report: BootstrapReport
    limit: int
    tasks: list[TaskSpec] = field(default_factory=list)
    seen_ids: set[str] = field(default_factory=set)
    env: ReplayEnvironment = field(default_factory=ReplayEnvironment)

    def success(self, row: q.TraceOutcome, feedback: Feedback | None) -> bool:
        """Count ``row``; whether it is a success that could be used (curated, with a body)."""
        outcome = Outcome(row.success, row.score, row.error_kind)
        said = feedback_is_positive(feedback.to_dict()) if feedback is not None else None
        if said is not None:
            outcome = Outcome(said, None, None if said else (row.error_kind or "feedback"))
        verdict = classify(outcome, failure_score_threshold=self.policy.failure_score_threshold)
        if verdict == "failure":
            self.report.failures += 1
            return False
        if verdict == "unknown":
            self.report.no_outcome += 1
            return False
        self.report.successes += 1
        if not row.curated:
            self.report.left_out["not_curated"] += 1
            return False
        if row.purged:
            self.report.left_out["body_purged"] += 1
            return False
        return True

    def may_train(self, link: q.TaskLink | None) -> bool:
        """A success curation folded into a task is usable only if that task is a train one."""
        if link is None or link.split == "train":
            return True
        self.report.left_out[f"{link.split}_task"] += 1
        return False

    def take(
        self,
        chunk: Sequence[q.TraceOutcome],
        links: Mapping[int, q.TaskLink],
        feedback: Mapping[int, Feedback],
    ) -> None:
        """Prepare ``chunk`` as curation would, find each one's cluster and side, and keep
        the train side's demonstrations (newest first) until the limit."""
        bodies = q.trace_bodies(session=self.session, trace_ids=[row.id for row in chunk])
        prepared = self._prepare([bodies[row.id] for row in chunk], feedback)
        sides = _Sides(self.session, self.loop, self.policy).of(prepared, links)
        for row in chunk:
            item = prepared[row.id]
            if isinstance(item, Verdict):
                self.report.left_out[item.detail.split(":", 1)[0] or "rejected"] += 1
                continue
            side, cluster = sides[row.id]
            if side != "train":
                self.report.left_out[side] += 1
                continue
            if len(self.tasks) >= self.limit:
                self.report.left_out["over_limit"] += 1
                continue
            body_json = bodies[row.id].body_json
            assert body_json is not None  # a task is only ever prepared from a body
            self._keep(row, item, json.loads(body_json), cluster=cluster)

    def _prepare(
        self, traces: list[TraceRow], feedback: Mapping[int, Feedback]
    ) -> dict[int, Prepared | Verdict]:
        """Curation's per-trace work on every success (none is left to the sample)."""
        settings = self.policy.replay_settings()
        contexts = {
            trace.id: {
                "policy": settings,
                "feedback": feedback[trace.id].to_dict() if trace.id in feedback else None,
                "success_answer": None,
            }
            for trace in traces
        }
        adapter: TraceAdapter = default_resolver(self.loop.environment)
        job = PrepareJob(
            self.loop.id,
            self.loop.environment,
            replace(self.policy, success_sample_rate=1.0),
            adapter,
            traces,
            contexts,
        )
        results = prepare_traces(job)
        return {trace.id: result for trace, result in zip(traces, results, strict=True)}

    def _keep(self, row: q.TraceOutcome, item: Prepared, body: Any, *, cluster: str | None) -> None:
        """Add the trace's demonstration task, or count why it cannot be one."""
        turns = demonstration_messages(body)
        if not isinstance(turns, list):
            self.report.left_out[turns.reason] += 1
            return
        redacted = batch_redactor(self.policy).redact_value(turns, Counter())
        task = TaskSpec.from_json(item.spec_json)
        if task.task_id in self.seen_ids:
            self.report.left_out["duplicate"] += 1
            return
        replay = {**task.metadata.get("replay", {}), "demonstration": redacted}
        lineage = {
            "split": "train",
            "cluster_id": cluster,
            "source_traces": [row.id],
            "external_id": row.external_id,
            "bootstrap": True,
        }
        task = replace(task, metadata={**task.metadata, "replay": replay, "ratchet": lineage})
        mismatch = replay_mismatch(self.env, task)
        if mismatch is not None:
            self.report.left_out["unreplayable"] += 1
            return
        self.seen_ids.add(task.task_id)
        self.tasks.append(task)


@dataclass
class _Sides:
    """Where the prepared traces of a chunk stand against the train line (see the module)."""

    session: Session
    loop: Loop
    policy: CurationPolicy

    def of(
        self, prepared: Mapping[int, Prepared | Verdict], links: Mapping[int, q.TaskLink]
    ) -> dict[int, tuple[str, str | None]]:
        """Each prepared trace's side (``train``, or the reason code of the side it is on)
        and its cluster."""
        items = {tid: p for tid, p in prepared.items() if isinstance(p, Prepared)}
        sides: dict[int, tuple[str, str | None]] = {}
        clusters: dict[int, str] = {}
        for trace_id in items:
            link = links.get(trace_id)
            if link is not None:  # folded into a train task (may_train let only those by)
                clusters[trace_id] = link.cluster_id
        unlinked = {tid: p for tid, p in items.items() if tid not in clusters}
        for trace_id, found in self._stored_or_new(unlinked).items():
            if isinstance(found, q.TaskLink):
                if found.split != "train":
                    sides[trace_id] = (f"{found.split}_task", found.cluster_id)
                    continue
                clusters[trace_id] = found.cluster_id
            else:
                clusters[trace_id] = found
        stored = q.cluster_split_sets(
            session=self.session, loop_id=self.loop.id, cluster_ids=list(clusters.values())
        )
        for trace_id, cluster in clusters.items():
            sides[trace_id] = (self._side(cluster, stored.get(cluster, frozenset())), cluster)
        return sides

    def _stored_or_new(self, items: Mapping[int, Prepared]) -> dict[int, q.TaskLink | str]:
        """For each trace: the stored task it duplicates (exactly or nearly), else the
        cluster it would join or found, decided as curation's dedup plan decides."""
        by_key: dict[str, list[int]] = {}
        for trace_id, item in items.items():
            by_key.setdefault(item.key, []).append(trace_id)
        exact = task_queries.tasks_by_dedup_key(
            session=self.session, loop_id=self.loop.id, keys=list(by_key)
        )
        found: dict[int, q.TaskLink | str] = {}
        fresh: dict[str, Prepared] = {}
        for key, trace_ids in by_key.items():
            if key in exact:
                hit = exact[key]
                for trace_id in trace_ids:
                    found[trace_id] = q.TaskLink(hit.task_id, hit.split, hit.cluster_id)
            else:
                fresh[key] = items[trace_ids[0]]
        decisions = self._plan(fresh)
        targets = q.tasks_by_id(
            session=self.session,
            task_ids=[d.target_task_id for d in decisions.values() if d.target_task_id],
        )
        for key, decision in decisions.items():
            stored = targets.get(decision.target_task_id or 0)
            for trace_id in by_key[key]:
                found[trace_id] = stored if stored is not None else decision.cluster_id
        return found

    def _plan(self, fresh: Mapping[str, Prepared]) -> dict[str, dedup.Decision]:
        if not fresh:
            return {}
        new = [dedup.NewTask(key, p.verifier, p.signature) for key, p in fresh.items()]
        neighbours = task_queries.lsh_neighbours(
            session=self.session,
            loop_id=self.loop.id,
            bands=[band for task in new for band in band_keys(task.signature)],
            per_bucket=NEIGHBOURS_PER_BUCKET,
        )
        stored = [
            dedup.StoredTask(
                n.task_id,
                n.dedup_key,
                verifier_key(json.loads(n.verifier_json) or {}),
                signature_from_bytes(n.minhash),
                n.cluster_id,
            )
            for n in neighbours
        ]
        return dedup.plan(
            new,
            stored,
            near_duplicate_threshold=self.policy.near_duplicate_threshold,
            cluster_threshold=self.policy.cluster_threshold,
        )

    def _side(self, cluster: str, stored: frozenset[str]) -> str:
        """``train``, or the reason code of the side the cluster is on."""
        for split in ("heldout", "eval"):
            if split in stored:
                return f"{split}_cluster"
        if "train" in stored:
            return "train"
        hashed = split_for_cluster(
            cluster,
            eval_fraction=self.policy.eval_fraction,
            heldout_fraction=self.policy.heldout_fraction,
        )
        return "train" if hashed == "train" else f"{hashed}_cluster"


def _chunks(rows: Sequence[q.TraceOutcome], size: int) -> Iterator[Sequence[q.TraceOutcome]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


__all__ = [
    "BootstrapRefused",
    "BootstrapReport",
    "BootstrapSelection",
    "select_demonstrations",
    "summary",
]
