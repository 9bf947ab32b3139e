"""The per-trace half of a curation batch, on every core: screen, adapt, redact, hash, MinHash.

What a batch does to one trace depends on that trace alone (and the loop's policy and
adapter), so it can run anywhere and in any order; deduplication, clustering and the writes
depend on the whole batch and on what is stored, so they stay in the activity's process,
serial. :class:`PreparePool` splits a batch's traces into contiguous chunks, computes some
chunks in the calling process and the rest in worker processes, and concatenates the results
in trace order: the batch sees exactly the list a serial run would have built, which is why
a pool of any size decides exactly what one process does (tests/services/curation/
test_equivalence.py holds that to a recorded digest).

Profiling (docs/curation.md) put the per-trace work at about half of a batch's time before
this split; the other half is Postgres and the batch-wide steps. Bodies cross the process
boundary as the JSON text Postgres sends, decoded once in the worker; results come back
with the task spec already encoded for ``COPY``, so the activity's process neither decodes
nor encodes a body.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

from services.curation.adapters import TraceAdapter, adapt, similarity_text
from services.curation.policy import CurationPolicy
from services.curation.redaction import Redactor
from services.curation.replay import feedback_outcome
from services.curation.selection import (
    Outcome,
    classify,
    failure_signature,
    sampled,
    screen_trace,
)
from services.curation.similarity import (
    Signature,
    canonical_json,
    dedup_key,
    signature,
    verifier_key,
)
from services.curation.splits import Origin
from services.db.queries.traces import CurationOutcome, TraceRow, Verdict
from services.environments.base import Rejection, TaskSpec

logger = logging.getLogger(__name__)

# Loops whose next batch may be prefetched at once (each holds one batch's results).
MAX_LOOPS_AHEAD = 8

# Traces per chunk: small enough that the activity heartbeats often and chunks balance
# across processes, large enough that pickling a chunk costs little next to computing it.
CHUNK_SIZE = 128


@dataclass(frozen=True)
class Prepared:
    """A trace that yielded a redacted task, ready for deduplication.

    ``spec_json`` is the task's ``ratchet.task/v1`` object, encoded once where it was built.
    """

    trace_id: int
    origin: Origin
    environment: str
    spec_json: str
    key: str
    verifier: str
    signature: Signature
    redactions: dict[str, int]
    failure_signature: str | None


@dataclass(frozen=True)
class PrepareJob:
    """Everything the per-trace work needs: picklable, so it can travel to a worker."""

    loop_id: int
    environment: str
    policy: CurationPolicy
    adapter: TraceAdapter
    traces: Sequence[TraceRow]
    # What the batch knows of each trace beyond its body (services.curation.replay): given
    # to the adapter as the body's ``ratchet`` key.
    contexts: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)


def prepare_traces(job: PrepareJob) -> list[Prepared | Verdict]:
    """One result per trace of ``job``, in the same order: a task ready for dedup, or why not."""
    redactor = batch_redactor(job.policy)
    return [_prepare(trace, job=job, redactor=redactor) for trace in job.traces]


_REDACTORS: dict[tuple[Any, ...], Redactor] = {}


def batch_redactor(policy: CurationPolicy) -> Redactor:
    """One redactor per policy per process, so its caches stay warm from batch to batch."""
    key = (tuple((p.name, p.pattern) for p in policy.redact_patterns), policy.redact_high_entropy)
    redactor = _REDACTORS.get(key)
    if redactor is None:
        if len(_REDACTORS) >= 8:  # each caches up to 16k short strings (~10 MB)
            _REDACTORS.clear()
        redactor = Redactor(policy.redact_patterns, high_entropy=policy.redact_high_entropy)
        _REDACTORS[key] = redactor
    return redactor


def _prepare(trace: TraceRow, *, job: PrepareJob, redactor: Redactor) -> Prepared | Verdict:
    if trace.body_json is None:  # retention dropped its partition before curation saw it
        return Verdict(trace.id, CurationOutcome.PURGED, "body purged by retention")
    policy = job.policy
    context = job.contexts.get(trace.id)
    outcome = Outcome(trace.success, trace.score, trace.error_kind)
    said = feedback_outcome(context)
    if said is not None:  # the user's word after the fact outranks the runtime's
        outcome = Outcome(said, None, None if said else (trace.error_kind or "feedback"))
    verdict = classify(outcome, failure_score_threshold=policy.failure_score_threshold)
    if verdict == "unknown":
        return Verdict(trace.id, CurationOutcome.SKIPPED, "no outcome reported")
    if verdict == "success" and not sampled(
        job.loop_id, trace.external_id, policy.success_sample_rate
    ):
        return Verdict(trace.id, CurationOutcome.SKIPPED, "success outside the regression sample")
    body = json.loads(trace.body_json)
    if context is not None and isinstance(body, dict):
        body["ratchet"] = dict(context)
    rejection = screen_trace(
        body, size_bytes=trace.size_bytes, max_trace_bytes=policy.max_trace_bytes
    )
    task = rejection or adapt(job.adapter, body)
    if isinstance(task, Rejection):
        return rejected(trace.id, task, redactor)
    if task.environment != job.environment:
        return rejected(
            trace.id,
            Rejection("wrong_environment", f"adapter built a {task.environment!r} task"),
            redactor,
        )
    redacted = _redact_task(task, redactor)
    if isinstance(redacted, Rejection):
        return rejected(trace.id, redacted, redactor)
    clean, counts, tools_json = redacted
    origin: Origin = "failure" if verdict == "failure" else "success"
    return Prepared(
        trace_id=trace.id,
        origin=origin,
        environment=clean.environment,
        spec_json=_spec_json(clean, tools_json),
        key=dedup_key(clean, tools_json=tools_json),
        verifier=verifier_key(clean.verifier),
        signature=signature(similarity_text(job.adapter, clean)),
        redactions=counts,
        failure_signature=(
            redactor.redact_text(failure_signature(body, trace.error_kind), Counter())
            if origin == "failure"
            else None
        ),
    )


def rejected(trace_id: int, rejection: Rejection, redactor: Redactor) -> Verdict:
    """The verdict of a refused trace; the message is redacted, as everything stored is."""
    message = redactor.redact_text(rejection.message, Counter())
    return Verdict(trace_id, CurationOutcome.REJECTED, f"{rejection.reason}: {message}"[:1000])


def _spec_json(task: TaskSpec, tools_json: str) -> str:
    """``task.to_dict()`` as JSON for a ``jsonb`` column, reusing the tools' encoding."""
    spec = task.to_dict()
    del spec["tools"]
    head = json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
    return f'{head[:-1]},"tools":{tools_json}}}'


def _redact_task(
    task: TaskSpec, redactor: Redactor
) -> tuple[TaskSpec, dict[str, int], str] | Rejection:
    """The task with sensitive values replaced and its tools' canonical JSON, or a rejection
    if its answer held any."""
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
    tools_json = canonical_json(task.tools)
    tool_counts: Counter[str] = Counter()
    tools = redactor.redact_shared(task.tools, tool_counts, key=tools_json)
    if tool_counts:
        counts.update(tool_counts)
        tools_json = canonical_json(tools)
    metadata = redactor.redact_value(task.metadata, counts)
    if not counts:
        return task, {}, tools_json
    clean = TaskSpec.create(
        environment=task.environment,
        prompt=prompt,
        tools=tools,
        verifier=verifier,
        reference_answer=reference,
        metadata=metadata,
    )
    return clean, dict(counts), tools_json


def _watch_parent(parent: int, poll_s: float = 1.0) -> None:
    """Initializer of every worker process: exit when the process that started it is gone.

    A worker killed with ``kill -9`` cannot stop its pool, and a pool worker holds both ends
    of its task queue, so it would wait for work forever; this thread notices it has been
    re-parented and ends the process.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _ready(linger_s: float) -> int:
    """A worker's first task: its imports are done by the time it runs; it lingers so that
    each of the pool's processes gets one."""
    time.sleep(linger_s)
    return os.getpid()


@dataclass
class _Ahead:
    """Chunks of a loop's next batch, submitted while its current batch is being written."""

    context: tuple[Any, ...]
    rows: dict[int, tuple[TraceRow, Future[list[Prepared | Verdict]], int]]

    def cancel(self) -> None:
        for _, future, _ in self.rows.values():
            future.cancel()


def _context(job: PrepareJob) -> tuple[Any, ...] | None:
    """What a prepared result depends on besides the trace; None if the adapter cannot
    travel to another process (then everything runs here)."""
    try:
        adapter = pickle.dumps(job.adapter)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None
    contexts = json.dumps({str(k): v for k, v in job.contexts.items()}, sort_keys=True)
    return (job.loop_id, job.environment, job.policy, type(job.adapter), adapter, contexts)


class PreparePool:
    """Runs :func:`prepare_traces` on ``processes`` cores: this one plus ``processes - 1``
    worker processes (started on first use, or by :meth:`start`, with ``spawn``: the worker
    process runs threads, which ``fork`` would copy mid-flight).

    Two ways to use the other cores, both giving exactly the serial result:

    - :meth:`prepare` splits a batch into chunks, computes some here and the rest in the
      workers, and concatenates them in trace order;
    - :meth:`prefetch` hands a loop's *next* batch to the workers while the current one is
      being deduplicated and written (which needs this process and Postgres, not the
      workers). The next :meth:`prepare` of that loop takes those results for every trace
      whose row is still exactly the one prefetched, under the same loop, environment,
      policy and adapter, and computes any other trace afresh. A prepared result depends on
      nothing else, so taking it is the same as computing it again.

    With ``processes=1`` nothing is started and everything runs in the calling process.
    A worker that dies (killed for memory) fails the batch that was waiting on it; the next
    batch starts a new pool. A prefetched chunk that failed is simply computed here.
    """

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError("processes must be at least 1")
        self.processes = processes
        self._executor: ProcessPoolExecutor | None = None
        self._ahead: dict[int, _Ahead] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> PreparePool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> list[int]:
        """Start the worker processes now (they import curation's modules, about a second
        of CPU each) instead of in the first batch; returns their process ids."""
        if self.processes == 1:
            return []
        executor = self._pool()
        barrier = [executor.submit(_ready, 0.2) for _ in range(self.processes - 1)]
        return sorted({future.result() for future in barrier})

    def close(self) -> None:
        with self._lock:
            ahead, self._ahead = self._ahead, {}
            executor, self._executor = self._executor, None
        for item in ahead.values():
            item.cancel()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def prefetch(self, job: PrepareJob) -> None:
        """Start preparing ``job`` (a loop's likely next batch) on the worker processes."""
        context = _context(job)
        if self.processes == 1 or not job.traces or context is None:
            return
        executor = self._pool()
        rows: dict[int, tuple[TraceRow, Future[list[Prepared | Verdict]], int]] = {}
        for chunk in _chunks(job):
            future = executor.submit(prepare_traces, chunk)
            for position, trace in enumerate(chunk.traces):
                rows[trace.id] = (trace, future, position)
        with self._lock:
            replaced = self._ahead.pop(job.loop_id, None)
            self._ahead[job.loop_id] = _Ahead(context, rows)
            evicted = []
            while len(self._ahead) > MAX_LOOPS_AHEAD:
                evicted.append(self._ahead.pop(next(iter(self._ahead))))
        for item in [replaced, *evicted]:
            if item is not None:
                item.cancel()

    def prepare(
        self, job: PrepareJob, *, heartbeat: Callable[[], None] = lambda: None
    ) -> list[Prepared | Verdict]:
        """:func:`prepare_traces` of ``job``: prefetched results where they apply, the rest
        computed in chunks on every process."""
        with self._lock:
            ahead = self._ahead.pop(job.loop_id, None)
        hits: dict[int, tuple[Future[list[Prepared | Verdict]], int]] = {}
        if ahead is not None and ahead.context == _context(job):
            for trace in job.traces:
                entry = ahead.rows.get(trace.id)
                if entry is not None and entry[0] == trace:
                    hits[trace.id] = (entry[1], entry[2])
        misses = [trace for trace in job.traces if trace.id not in hits]
        fresh = self._compute(replace(job, traces=misses), heartbeat) if misses else []
        computed = {trace.id: result for trace, result in zip(misses, fresh, strict=True)}
        results: list[Prepared | Verdict] = []
        waited: set[int] = set()
        for trace in job.traces:
            if trace.id in computed:
                results.append(computed[trace.id])
                continue
            future, position = hits[trace.id]
            if id(future) not in waited:
                waited.add(id(future))
                heartbeat()
            results.append(self._prefetched(future, position, replace(job, traces=[trace])))
        if ahead is not None:
            ahead.cancel()
        return results

    def _prefetched(
        self, future: Future[list[Prepared | Verdict]], position: int, alone: PrepareJob
    ) -> Prepared | Verdict:
        try:
            return future.result()[position]
        except BrokenProcessPool:
            self.close()
        except Exception:  # the chunk failed in the worker: compute the trace here
            logger.warning("a prefetched curation chunk failed; computing it again", exc_info=True)
        return prepare_traces(alone)[0]

    def _compute(self, job: PrepareJob, heartbeat: Callable[[], None]) -> list[Prepared | Verdict]:
        chunks = _chunks(job)
        remote: dict[int, Future[list[Prepared | Verdict]]] = {}
        if self.processes > 1 and len(chunks) > 1 and _context(job) is not None:
            executor = self._pool()
            remote = {
                index: executor.submit(prepare_traces, chunk)
                for index, chunk in enumerate(chunks)
                if index % self.processes != 0
            }
        results: list[Prepared | Verdict] = []
        try:
            local: dict[int, list[Prepared | Verdict]] = {}
            for index, chunk in enumerate(chunks):
                if index not in remote:
                    heartbeat()
                    local[index] = prepare_traces(chunk)
            for index in range(len(chunks)):
                if index in local:
                    results.extend(local[index])
                else:
                    results.extend(remote[index].result())
                    heartbeat()
        except BrokenProcessPool:
            self.close()
            raise
        finally:
            for future in remote.values():
                future.cancel()
        return results

    def _pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ProcessPoolExecutor(
                    max_workers=self.processes - 1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_watch_parent,
                    initargs=(os.getpid(),),
                )
            return self._executor


def _chunks(job: PrepareJob) -> list[PrepareJob]:
    traces = list(job.traces)
    count = max(1, math.ceil(len(traces) / CHUNK_SIZE))
    return [
        replace(job, traces=traces[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]) for i in range(count)
    ]


_SHARED: dict[int, PreparePool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(processes: int) -> PreparePool:
    """The process-wide pool of ``processes``: every activity object built in one process
    (a worker, or a test session building many) shares one set of worker processes, which
    ``concurrent.futures`` stops when the process exits."""
    with _SHARED_LOCK:
        pool = _SHARED.get(processes)
        if pool is None:
            pool = _SHARED[processes] = PreparePool(processes)
        return pool
