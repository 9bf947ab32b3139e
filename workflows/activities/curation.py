"""Activities of curation: a batch of traces, a dataset snapshot, the drift signal, pending work,
and the difficulty probe's ends (its task file, its results, the recorded pass rates).

They are synchronous (SQLAlchemy) and run in the worker's thread pool. Each one is
idempotent, and its docstring says why. Configuration errors that no retry can fix (an
unknown loop, an invalid policy, an unknown environment) are raised as non-retryable
``ApplicationError`` so the workflow fails visibly instead of retrying forever; bad traces
never fail an activity, they are rejected one by one with a recorded reason.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from sqlalchemy.exc import (
    DisconnectionError,
    InterfaceError,
    OperationalError,
    StatementError,
)
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeoutError
from sqlalchemy.orm import Session
from temporalio import activity
from temporalio.exceptions import ApplicationError

from services.artifacts import ArtifactStore, path_to_uri, uri_to_path
from services.curation import probe as probes
from services.curation.adapters import AdapterResolver, TraceAdapter, default_resolver
from services.curation.drift import DriftPolicyError, read_drift
from services.curation.policy import CurationPolicy, CurationPolicyError
from services.curation.snapshot import SnapshotError, snapshot
from services.db.models import Loop
from services.db.queries import curation_failures as failures
from services.db.queries import tasks as task_queries
from services.db.queries import traces as trace_queries
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.evaluation.results import ResultsFileError, read_results
from services.logs import log_context
from services.metrics import (
    CURATION_PHASE_SECONDS,
    CURATION_REDACTIONS,
    CURATION_REJECTED,
    CURATION_TRACES,
    LOOP_FAILURE_RATE,
)
from workflows.activities.errors import fails_as
from workflows.payloads.curation import (
    CurateBatchInput,
    CurateBatchResult,
    DriftInput,
    DriftResult,
    PendingWorkInput,
    PendingWorkResult,
    SnapshotInput,
    SnapshotResult,
)
from workflows.payloads.probe import (
    ExportProbeTasksInput,
    ExportProbeTasksResult,
    ProbePassRatesInput,
    ProbePassRatesResult,
    RecordProbesInput,
    RecordProbesResult,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    # The pipeline pulls numpy, scipy and datasketch; workflow modules import this class
    # to call its activities by reference, so those load only where a batch really runs.
    from services.curation import pipeline
    from services.curation.workers import PreparePool

logger = logging.getLogger(__name__)

MAX_BATCH_SIZE = 10_000
# Failures of a trace curated alone before it is set aside: one can be bad luck (a worker
# restarting mid-batch), three in three batches is the trace.
MAX_CURATION_ATTEMPTS = 3

PayloadT = TypeVar("PayloadT", bound="DataclassInstance")


class CurationActivities:
    """Curation's activities, bound to a session factory, an artifact store and adapters.

    ``adapters`` resolves a loop's ``environment`` to its trace adapter (default: the
    environment registry); ``pool`` runs the per-trace work of a batch on several processes
    (``RATCHET_CURATION_PROCESSES``; default: this process alone); ``lock_poll_s`` is how
    often a batch retries the loop's curation lock while another batch of the same loop
    holds it.
    """

    def __init__(
        self,
        session_factory: SessionFactory,
        artifacts: ArtifactStore,
        *,
        adapters: AdapterResolver = default_resolver,
        pool: PreparePool | None = None,
        lock_poll_s: float = 0.2,
    ) -> None:
        self._sessions = session_factory
        self._artifacts = artifacts
        self._adapters = adapters
        self._pool = pool
        self._lock_poll_s = lock_poll_s

    @activity.defn(name="curate_batch")
    def curate_batch(self, input: CurateBatchInput) -> CurateBatchResult:
        """Curate up to ``batch_size`` uncurated traces of a loop.

        Idempotent: the traces are locked ``FOR UPDATE SKIP LOCKED`` and stamped
        ``curated_at`` in the same transaction that writes their tasks, so a retry after a
        crash finds them uncurated again (nothing was committed) and a retry after success
        finds them curated (nothing left to do). Each trace is curated exactly once.

        A batch that fails on something other than the database's availability is curated
        again one trace per transaction (:meth:`_one_by_one`), so one bad trace never stops
        the queue behind it.
        """
        if not 1 <= input.batch_size <= MAX_BATCH_SIZE:
            raise ApplicationError(
                f"batch_size must be between 1 and {MAX_BATCH_SIZE}, got {input.batch_size}",
                type="InvalidInput",
                non_retryable=True,
            )
        with log_context(loop=input.loop):
            try:
                report = self._batch(input.loop, limit=input.batch_size)
            except Exception as exc:
                if not _trace_may_be_at_fault(exc):
                    raise
                logger.warning(
                    "a curation batch of %s failed; curating it trace by trace: %s",
                    input.loop,
                    _short_error(exc),
                )
                report = self._one_by_one(input, exc)
        _record_metrics(input.loop, report)
        if report.traces_seen:
            logger.info(
                "curated %d traces of %s: %d tasks, %d duplicates, %d rejected, %d skipped",
                report.traces_seen,
                input.loop,
                report.tasks_created,
                report.duplicates,
                report.rejected,
                report.skipped,
            )
        return _payload(CurateBatchResult, report)

    @activity.defn(name="snapshot_dataset")
    def snapshot_dataset(self, input: SnapshotInput) -> SnapshotResult:
        """Freeze the loop's tasks into a dataset.

        Idempotent: a dataset is addressed by the hash of its content, files are written
        to a temporary directory and renamed into place, and the row is inserted with
        ``ON CONFLICT DO NOTHING`` after the files exist; the same content always returns
        the same dataset row and files.
        """
        with (
            log_context(loop=input.loop, cycle=input.cycle),
            fails_as("SnapshotFailed", SnapshotError, CurationPolicyError),
        ):
            result = snapshot(
                self._sessions, self._artifacts, loop_name=input.loop, cycle=input.cycle
            )
        return _payload(SnapshotResult, result, difficulty=dict(result.difficulty))

    @activity.defn(name="check_drift")
    def check_drift(self, input: DriftInput) -> DriftResult:
        """The served model's rolling failure rate. Read-only, so trivially idempotent."""
        with log_context(loop=input.loop), self._transaction() as session:
            loop = self._loop(session, input.loop)
            with fails_as("InvalidPolicy", DriftPolicyError, CurationPolicyError):
                reading = read_drift(session, loop=loop)
        LOOP_FAILURE_RATE.labels(input.loop).set(reading.failure_rate)
        return _payload(DriftResult, reading)

    @activity.defn(name="pending_work")
    def pending_work(self, input: PendingWorkInput) -> PendingWorkResult:
        """Curated train tasks not in any dataset yet, and uncurated traces. Read-only."""
        with self._transaction() as session:
            loop = self._loop(session, input.loop)
            policy = _policy(loop)
            return PendingWorkResult(
                new_train_tasks=task_queries.count_new_train_tasks(
                    session=session, loop_id=loop.id, difficulty_filter=policy.difficulty_filter
                ),
                uncurated_traces=trace_queries.count_uncurated_traces(
                    session=session, loop_id=loop.id
                ),
            )

    # Difficulty probe -----------------------------------------------------------------------

    @activity.defn(name="export_probe_tasks")
    def export_probe_tasks(self, input: ExportProbeTasksInput) -> ExportProbeTasksResult:
        """Write the loop's unprobed train tasks to the probe run's task file.

        The newest train tasks (not pinned) with no ``probe_pass_rate``, at most
        ``max_tasks`` and the policy's ``max_train_tasks``, go to
        ``<run dir>/probe-tasks.jsonl`` (``ratchet.task/v1``, ``metadata.ratchet`` lineage).
        No task to probe: no file, ``task_uri`` is None. Idempotent: the file is the run's
        input, written once (temporary file, then a link that never replaces); a retry, or a
        later call for the same run, returns the tasks that file holds.
        """
        with (
            log_context(loop=input.loop, run=input.run_id),
            fails_as("InvalidPolicy", CurationPolicyError),
            fails_as("ProbeFailed", probes.ProbeError),
        ):
            export = probes.export_unprobed(
                self._sessions,
                self._artifacts,
                loop_name=input.loop,
                run_id=input.run_id,
                max_tasks=input.max_tasks,
            )
        return ExportProbeTasksResult(
            task_uri=path_to_uri(export.path) if export.path is not None else None,
            count=len(export.task_ids),
            task_ids=export.task_ids,
        )

    @activity.defn(name="probe_pass_rates")
    def probe_pass_rates(self, input: ProbePassRatesInput) -> ProbePassRatesResult:
        """A finished probe job's ``results.jsonl`` as pass rates of the exported tasks.

        Rows name tasks by task id and are mapped to row ids as recorded evaluations
        are, among ``task_ids`` only; a row naming any other task, or malformed results, fail
        non-retryably (``BadProbeOutput``). Read-only, so trivially idempotent.
        """
        with (
            log_context(loop=input.loop),
            fails_as("BadProbeOutput", ResultsFileError, probes.ProbeError),
        ):
            rows = read_results(uri_to_path(input.output_uri))
            with self._transaction() as session:
                loop = self._loop(session, input.loop)
                rates = probes.pass_rates(
                    session, loop_id=loop.id, rows=rows, task_ids=input.task_ids
                )
        counts = rates.selection.counts()
        return ProbePassRatesResult(
            pass_rates=rates.pass_rates,
            too_easy=counts["too_easy"],
            too_hard=counts["too_hard"],
            kept=counts["kept"],
        )

    @activity.defn(name="record_probes")
    def record_probes(self, input: RecordProbesInput) -> RecordProbesResult:
        """Store probe pass rates on the loop's tasks (``tasks.probe_pass_rate``).

        Idempotent: it sets absolute values, so a retry writes the same rates again. Rates
        outside [0, 1] are refused (``InvalidInput``); ids of other loops' tasks are ignored.
        """
        bad = {task_id: rate for task_id, rate in input.pass_rates.items() if not 0 <= rate <= 1}
        if bad:
            task_id, rate = next(iter(bad.items()))
            raise ApplicationError(
                f"{len(bad)} pass rate(s) outside [0, 1], e.g. task {task_id}: {rate}",
                type="InvalidInput",
                non_retryable=True,
            )
        with log_context(loop=input.loop), self._transaction() as session:
            loop = self._loop(session, input.loop)
            updated = task_queries.record_probe_results(
                session=session, loop_id=loop.id, pass_rates=input.pass_rates
            )
        logger.info("recorded %d probe pass rates of %s", updated, input.loop)
        return RecordProbesResult(updated=updated)

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.curate_batch,
            self.snapshot_dataset,
            self.check_drift,
            self.pending_work,
            self.export_probe_tasks,
            self.probe_pass_rates,
            self.record_probes,
        ]

    # A failed batch, trace by trace -----------------------------------------------------------

    def _batch(
        self, loop_name: str, *, limit: int, only: list[int] | None = None
    ) -> pipeline.BatchReport:
        from services.curation import pipeline

        with self._transaction() as session:
            loop = self._loop(session, loop_name)
            policy = _policy(loop)
            adapter = self._adapter(loop)
            self._wait_for_lock(session, loop.id)
            return pipeline.curate_batch(
                session,
                loop=loop,
                policy=policy,
                adapter=adapter,
                limit=limit,
                heartbeat=activity.heartbeat,
                pool=self._pool,
                only=only,
            )

    def _one_by_one(self, input: CurateBatchInput, failure: Exception) -> pipeline.BatchReport:
        """Curate the traces of a batch that failed (the loop's oldest uncurated ones) one per
        transaction. A trace that fails alone has the failure counted on it and, at
        :data:`MAX_CURATION_ATTEMPTS`, is set aside (``rejected``, ``curation_failed``, the
        error in its detail), so the next batches no longer take it. When several traces
        were tried and every one failed alone, the fault is not a trace's (the code, the
        database): ``failure`` is raised and nothing is counted, so a fixed deploy resumes
        the queue whole."""
        from services.curation.pipeline import BatchReport

        with self._transaction() as session:
            loop = self._loop(session, input.loop)
            ids = failures.oldest_uncurated_ids(
                session=session, loop_id=loop.id, limit=input.batch_size
            )
        total = BatchReport(more=len(ids) == input.batch_size)
        failed: dict[int, Exception] = {}
        for trace_id in ids:
            activity.heartbeat()
            try:
                _merge(total, self._batch(input.loop, limit=1, only=[trace_id]))
            except Exception as exc:
                if not _trace_may_be_at_fault(exc):
                    raise
                failed[trace_id] = exc
        if len(ids) > 1 and len(failed) == len(ids):
            raise failure
        for trace_id, error in failed.items():
            _merge(total, self._count_failure(input.loop, trace_id, error))
        return total

    def _count_failure(self, loop: str, trace_id: int, exc: Exception) -> pipeline.BatchReport:
        from services.curation.pipeline import BatchReport

        error = _short_error(exc)
        with self._transaction() as session:
            set_aside = failures.record_curation_failure(
                session=session, trace_id=trace_id, error=error, max_attempts=MAX_CURATION_ATTEMPTS
            )
        logger.warning(
            "trace %d of %s failed curation alone%s: %s",
            trace_id,
            loop,
            " and is set aside" if set_aside else "",
            error,
        )
        report = BatchReport(traces_seen=1)
        if set_aside:
            report.rejected = 1
            report.rejections[failures.CURATION_FAILED] += 1
        return report

    # Helpers --------------------------------------------------------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    def _loop(self, session: Session, name: str) -> Loop:
        try:
            return require_loop(session=session, name=name)
        except NotFound as exc:
            raise ApplicationError(str(exc), type="NotFound", non_retryable=True) from None

    def _adapter(self, loop: Loop) -> TraceAdapter:
        with fails_as("UnknownEnvironment", ValueError, context=f"loop {loop.name!r}"):
            return self._adapters(loop.environment)

    def _wait_for_lock(self, session: Session, loop_id: int) -> None:
        """Wait (heartbeating) until no other batch of this loop is running."""
        while not task_queries.try_lock_loop_curation(session=session, loop_id=loop_id):
            activity.heartbeat()
            time.sleep(self._lock_poll_s)


def _trace_may_be_at_fault(exc: Exception) -> bool:
    """Whether a failed batch may owe its failure to one of its traces: not when the
    database was unreachable or the transaction was aborted for concurrency (a retry of the
    whole batch is right), nor for the activity's own refusals (bad configuration), nor
    when a worker process died (memory: the batch is retried with a new pool)."""
    transient = (
        ApplicationError,
        OperationalError,
        InterfaceError,
        DisconnectionError,
        SQLAlchemyTimeoutError,
        psycopg.OperationalError,  # the COPY writes use the driver's cursor directly
        psycopg.InterfaceError,
        BrokenProcessPool,
    )
    return not isinstance(exc, transient)


def _short_error(exc: Exception) -> str:
    """The error as a trace's detail keeps it: the first line of the driver's message, not
    the statement, its parameters or the row it was copying (which could hold trace
    content)."""
    cause = exc.orig if isinstance(exc, StatementError) and exc.orig is not None else exc
    lines = str(cause).splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"[:800]


def _merge(total: pipeline.BatchReport, report: pipeline.BatchReport) -> None:
    total.add(report)
    total.rejections.update(report.rejections)
    total.redactions.update(report.redactions)
    for phase, seconds in report.seconds.items():
        total.seconds[phase] = total.seconds.get(phase, 0.0) + seconds


def _policy(loop: Loop) -> CurationPolicy:
    with fails_as("InvalidPolicy", CurationPolicyError, context=f"loop {loop.name!r}"):
        return CurationPolicy.from_json(loop.curation_policy)


def _payload(payload: type[PayloadT], source: object, **values: Any) -> PayloadT:
    """The activity's result: each field of ``payload`` read from the attribute of the same
    name on the domain's result (``values`` given instead), so a field added to both travels
    without a third edit here."""
    return payload(
        **{
            name: values[name] if name in values else getattr(source, name)
            for name in (field.name for field in dataclasses.fields(payload))
        }
    )


def _record_metrics(loop: str, report: pipeline.BatchReport) -> None:
    """Count after commit, so a rolled-back attempt is never counted."""
    outcomes = {
        "task": report.tasks_created,
        "duplicate": report.duplicates,
        "rejected": report.rejected,
        "skipped": report.skipped,
    }
    for outcome, n in outcomes.items():
        if n:
            CURATION_TRACES.labels(loop, outcome).inc(n)
    for reason, n in report.rejections.items():
        CURATION_REJECTED.labels(loop, reason).inc(n)
    for kind, n in report.redactions.items():
        CURATION_REDACTIONS.labels(loop, kind).inc(n)
    for phase, seconds in report.seconds.items():
        CURATION_PHASE_SECONDS.labels(loop, phase).inc(seconds)
